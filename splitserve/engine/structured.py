"""Structured output: a request's output held to a format (a JSON Schema, any JSON object, a
regular expression, one of given strings, or a Lark grammar).

llguidance compiles the format against the model's tokenizer into a matcher, which gives, before
each token, the set of tokens the format allows next (a bit mask over the vocabulary); the
sampler draws only among them (sampling.constrain). Whoever samples a token holds the sequence's
matcher: a prefill worker builds one for the first token, and a decode worker builds its own from
the same format and feeds it the tokens the sequence came with. The format travels as the request
gave it (sampling.structured_output), so every process compiles the same grammar.

No torch here: the router checks a request's format before admitting it.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from splitserve.engine.errors import InvalidRequestError

KINDS = ("json_schema", "json_object", "regex", "choice", "lark")
MAX_FORMAT_CHARS = 65536  # a format's text (a choice's strings together): compiled in every process it reaches
MAX_CHOICES = 1024
# A JSON Schema nested deeper (objects and lists) is refused before it is parsed: Python's parser
# gives up near 1000 levels, and llguidance's compiler near 100 (a schema of `items` 200 deep).
MAX_SCHEMA_DEPTH = 64
_CACHED_FORMATS = 64  # compiled matchers kept per process, the least recently used going first
# The time a format's mask may take, which every step of its row's batch waits for: a regex
# a{60000} took 22 ms a step (a third of a 32-row decode step here), and none of llguidance's limits
# bounds it; the formats of the tests and a 5000-way Lark choice take 0.02-0.6 ms. Masks are timed in
# CPU time (waits for the GIL or the cores not counted). Admission times the first mask (the lesser
# of two tries). Some formats are cheap at first and costly later ([0-9]{3}a{40000}: 0.0 ms for
# three tokens, then 7 ms each), so an engine times every mask too, and ends a sequence whose masks
# took more than this in MASK_STRIKES of its last MASK_WINDOW steps (a lone spike is forgiven).
MAX_MASK_MS = 5.0
MASK_WINDOW = 5
MASK_STRIKES = 3
_ERROR_CHARS = 600  # of llguidance's message, in an InvalidRequestError


def _first_line(matcher) -> str:
    """A matcher's error as a request's message: llguidance's first line (the rest is the parser's
    state, its statistics and the grammar), cut to _ERROR_CHARS."""
    return matcher.get_error().strip().split("\n", 1)[0][:_ERROR_CHARS]


# Whitespace between JSON's tokens: a line break and an indentation, or spaces alone; llguidance's
# default (any run of whitespace) let a model write whitespace until max_tokens, which a tiny
# random one did every time. A schema's own "x-guidance" options override it.
_JSON_OPTIONS = {"whitespace_pattern": r"(?:\r?\n)?[ \t]{0,64}"}
# Rust regex's meta characters (regex-syntax): escaped, a choice's strings match only themselves.
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


@dataclass(frozen=True)
class StructuredOutput:
    kind: str  # one of KINDS
    value: str | tuple[str, ...] = ""  # the schema's JSON text, the regex, the Lark grammar; the choice's strings
    disable_any_whitespace: bool = False  # JSON kinds: none between JSON's tokens

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(
                "sampling.structured_output", f"unknown format {self.kind!r}; one of {', '.join(KINDS)}"
            )
        if self.kind == "choice":
            object.__setattr__(self, "value", tuple(self.value))
            if not self.value:
                raise InvalidRequestError(self.field, "needs at least one string")
            if len(self.value) > MAX_CHOICES:
                raise InvalidRequestError(self.field, f"at most {MAX_CHOICES} strings, got {len(self.value)}")
            if any(not s for s in self.value):
                raise InvalidRequestError(self.field, "strings must be non-empty")
        elif not isinstance(self.value, str):
            raise InvalidRequestError(self.field, f"must be a string, got {type(self.value).__name__}")
        elif self.kind != "json_object" and not self.value:
            raise InvalidRequestError(self.field, "must not be empty")
        if self.disable_any_whitespace and not self.kind.startswith("json"):
            raise InvalidRequestError(
                "sampling.structured_output.disable_any_whitespace",
                f"applies to json_schema and json_object, not {self.kind}",
            )
        chars = sum(map(len, self.value)) if self.kind == "choice" else len(self.value)
        if chars > MAX_FORMAT_CHARS:
            raise InvalidRequestError(self.field, f"at most {MAX_FORMAT_CHARS} characters, got {chars}")

    @property
    def field(self) -> str:
        """The request field that holds it, for errors."""
        return f"sampling.structured_output.{self.kind}"

    def _json_options(self) -> dict:
        return {"whitespace_flexible": False} if self.disable_any_whitespace else _JSON_OPTIONS

    def grammar(self) -> str:
        """llguidance's grammar for it (raises InvalidRequestError for a schema that is not JSON)."""
        from llguidance import LLMatcher

        if self.kind == "json_schema":
            if (depth := json_depth(self.value)) > MAX_SCHEMA_DEPTH:
                raise InvalidRequestError(self.field, f"nested {depth} levels deep; at most {MAX_SCHEMA_DEPTH}")
            try:
                schema = json.loads(self.value)
            except ValueError as e:
                raise InvalidRequestError(self.field, f"is not JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequestError(
                    self.field, f"a JSON Schema is an object or a boolean, got {type(schema).__name__}"
                )
            try:
                return LLMatcher.grammar_from_json_schema(json.dumps(schema), self._json_options())
            except ValueError as e:  # a schema llguidance cannot compile
                raise InvalidRequestError(self.field, str(e)[:_ERROR_CHARS]) from None
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema('{"type": "object"}', self._json_options())
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.value)
        if self.kind == "choice":
            return LLMatcher.grammar_from_regex("|".join(map(_literal, self.value)))
        return LLMatcher.grammar_from_lark(self.value)


def json_depth(text: str) -> int:
    """How deep a JSON text's objects and lists nest (strings skipped), without parsing it."""
    depth = deepest = 0
    for c in _BRACKETS.findall(_STRINGS.sub("", text)):
        if c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(r"[\[\]{}]")


def _mask_ms(matcher) -> float:
    """The CPU time of the matcher's next mask, in ms (llguidance makes it on the calling thread)."""
    t = time.thread_time_ns()
    matcher.compute_bitmask()
    return (time.thread_time_ns() - t) / 1e6


def _literal(text: str) -> str:
    """A regex matching text alone."""
    return "(?:" + "".join("\\" + c if c in _REGEX_META else c for c in text) + ")"


class Grammars:
    """One model's compiled formats: llguidance's view of the tokenizer (built at the first format,
    ~0.2 s for SmolLM2's) and the matchers of the formats seen last, each copied for a sequence.
    Thread-safe: a worker checks requests on its event loop while its engine steps elsewhere."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, max_mask_ms: float = MAX_MASK_MS):
        self._tokenizer = tokenizer
        self.max_mask_ms = max_mask_ms
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._lltok = None
        self._compiled: OrderedDict[StructuredOutput, object] = OrderedDict()  # format -> matcher in its first state
        self._lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def check(self, fmt: StructuredOutput) -> None:
        """Raise InvalidRequestError naming the field if the format does not compile."""
        self._compile(fmt)

    def matcher(self, fmt: StructuredOutput, tokens: list[int] = ()):
        """A fresh matcher of the format, fed tokens already generated (InvalidRequestError if the
        format does not compile; ValueError, "do not follow …", if the tokens do not follow it). A
        matcher that errs later (past one of llguidance's limits), or whose masks turn too costly,
        fails its request (failure())."""
        m = self._compile(fmt).deep_copy()
        if tokens and not m.consume_tokens(list(tokens)):
            raise ValueError(f"do not follow {fmt.field}: {_first_line(m)}")
        return m

    def failure(self, fmt: StructuredOutput, matcher, mask_ms) -> InvalidRequestError | None:
        """Why a sequence held to fmt cannot go on, or None: its matcher erred (one of llguidance's
        limits, met past the first token), or its masks (mask_ms: the CPU milliseconds of its last
        masks, newest last) took more than max_mask_ms in MASK_STRIKES of its last MASK_WINDOW."""
        if matcher.is_error():
            return InvalidRequestError(fmt.field, f"failed while generating: {_first_line(matcher)}")
        if mask_ms and sum(ms > self.max_mask_ms for ms in mask_ms) >= MASK_STRIKES:
            took = ", ".join(f"{ms:.1f}" for ms in mask_ms)
            return InvalidRequestError(
                fmt.field,
                f"too costly while generating: its last token masks took {took} ms "
                f"(at most {self.max_mask_ms:g}), which every step of its batch "
                f"waits for",
            )
        return None

    def _compile(self, fmt: StructuredOutput):
        with self._lock:
            hit = self._compiled.get(fmt)
            if hit is not None:
                self._compiled.move_to_end(fmt)
        if hit is None:  # (a format that does not compile is not kept: compiling it again costs ~1 ms)
            hit = self._build(fmt)
            with self._lock:
                self._compiled[fmt] = hit
                while len(self._compiled) > _CACHED_FORMATS:
                    self._compiled.popitem(last=False)
        return hit

    def _build(self, fmt: StructuredOutput):
        """The format's matcher in its first state (InvalidRequestError if it does not compile, or
        its first mask takes more than MAX_MASK_MS)."""
        from llguidance import LLMatcher

        m = LLMatcher(self._llguidance_tokenizer(), fmt.grammar(), log_level=0)  # drops the GIL while it compiles
        if not m.is_error():
            ms = min(_mask_ms(m), _mask_ms(m.deep_copy()))
            if ms > self.max_mask_ms:
                raise InvalidRequestError(
                    fmt.field,
                    f"too costly: a token mask takes {ms:.1f} ms (at most "
                    f"{self.max_mask_ms:g}), which every step of its batch waits for",
                )
        if m.is_error():
            raise InvalidRequestError(fmt.field, m.get_error()[:_ERROR_CHARS])
        return m

    def _llguidance_tokenizer(self):
        with self._lock:
            if self._lltok is None:
                from llguidance import LLTokenizer

                self._lltok = LLTokenizer(self._tokenizer.rust.to_str(), n_vocab=self._vocab_size, eos_token=self._eos)
            return self._lltok
