"""Per-request sampling parameters and their checks (no torch: the router imports them)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from splitserve.engine.errors import InvalidRequestError
from splitserve.engine.structured import StructuredOutput

_MAX_SEED = 2**63 - 1
# Every stop string is looked for after every token, and the longest one's length of text is held
# back from the stream: without bounds, one request's stops slowed every request in its batch
# (350,000 stop strings in a 3.5 MB message: TPOT 14 -> 77 ms for its neighbours, stalls of 0.46 s).
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGPROBS = 20  # most likely tokens a request may ask for at each position (vLLM's default bound)
MAX_PRESENCE_FREQUENCY = 2.0  # presence_penalty and frequency_penalty lie in [-2, 2] (OpenAI's and vLLM's bounds)
MAX_REPETITION = 10.0  # repetition_penalty in (0, 10]: past that a seen token is all but banned
MAX_LOGIT_BIAS = 100.0  # a logit_bias value lies in [-100, 100] (OpenAI's bound)
MAX_LOGIT_BIAS_ENTRIES = 1024  # as many as stop_token_ids: each is applied at every step of the request
MAX_N = 16  # samples of one request (each its own decode row and KV after the prompt's shared blocks)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # the stop string that ended the text is kept at its end
    skip_special_tokens: bool = True  # False: special tokens' text is in the output text
    n: int = 1  # samples of the prompt, each generated on its own (sample i seeded seed + i)
    logprobs: int | None = None  # None: none; k: each token's log probability and the k most likely
    prompt_logprobs: int | None = None  # the same for each prompt token after the first
    presence_penalty: float = 0.0  # subtracted from the logit of a token in the output so far
    frequency_penalty: float = 0.0  # ... once for each time it is there
    repetition_penalty: float = (
        1.0  # divides a positive logit (multiplies a negative one) of a token in prompt or output
    )
    min_p: float = 0.0  # drawn only: tokens at least min_p times as likely as the most likely (after top_k, top_p)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), sorted by id
    structured_output: StructuredOutput | None = None  # the output held to a format (structured.py)

    def __post_init__(self) -> None:
        _check_types(self)
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))  # (integers: _check_types)
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((t, float(v)) for t, v in bias)))
        if self.max_tokens < 1:
            raise InvalidRequestError("sampling.max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError("sampling.temperature", f"must be a finite number >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise InvalidRequestError("sampling.top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError("sampling.top_k", f"must be >= 0, got {self.top_k}")
        if not (1 <= self.n <= MAX_N):
            raise InvalidRequestError("sampling.n", f"must be in [1, {MAX_N}], got {self.n}")
        if self.min_tokens < 0:
            raise InvalidRequestError("sampling.min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                "sampling.min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if self.seed is not None and not (0 <= self.seed <= _MAX_SEED):
            raise InvalidRequestError("sampling.seed", f"must be in [0, 2^63), got {self.seed}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (0 <= value <= MAX_LOGPROBS):
                raise InvalidRequestError(f"sampling.{name}", f"must be in [0, {MAX_LOGPROBS}], got {value}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -MAX_PRESENCE_FREQUENCY <= value <= MAX_PRESENCE_FREQUENCY):
                raise InvalidRequestError(
                    f"sampling.{name}",
                    f"must be in [-{MAX_PRESENCE_FREQUENCY:g}, {MAX_PRESENCE_FREQUENCY:g}], got {value}",
                )
        if not (math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty <= MAX_REPETITION):
            raise InvalidRequestError(
                "sampling.repetition_penalty", f"must be in (0, {MAX_REPETITION:g}], got {self.repetition_penalty}"
            )
        if not (math.isfinite(self.min_p) and 0 <= self.min_p <= 1):
            raise InvalidRequestError("sampling.min_p", f"must be in [0, 1], got {self.min_p}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidRequestError(
                "sampling.logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(self.logit_bias)}"
            )
        bad = next(
            (
                (t, v)
                for t, v in self.logit_bias
                if t < 0 or not (math.isfinite(v) and -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS)
            ),
            None,
        )
        if bad is not None:
            raise InvalidRequestError(
                "sampling.logit_bias",
                f"token {bad[0]}: ids are >= 0 and biases in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bad[1]}",
            )
        check_stop_counts(len(self.stop), len(self.stop_token_ids))
        if any(not s for s in self.stop):
            raise InvalidRequestError("sampling.stop", "stop strings must be non-empty")
        long = next((i for i, s in enumerate(self.stop) if len(s) > MAX_STOP_CHARS), None)
        if long is not None:
            raise InvalidRequestError(
                f"sampling.stop[{long}]", f"must be at most {MAX_STOP_CHARS} characters, got {len(self.stop[long])}"
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("sampling.stop_token_ids", "token ids must be >= 0")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise InvalidRequestError("sampling.structured_output", "must be a StructuredOutput")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether any penalty on tokens seen before is on."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


_INTS = ("max_tokens", "top_k", "min_tokens", "n")
_OPTIONAL_INTS = ("seed", "logprobs", "prompt_logprobs")
_REALS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
_BOOLS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens")


def _check_types(p: SamplingParams) -> None:
    """Raise InvalidRequestError naming the field whose value is of the wrong type. A router builds
    them from a protobuf, whose types are right; a job read from Redis (a router of another release,
    or a bug) holds JSON, where a top_k of 1.5 failed the sampler and an ignore_eos of "yes" the
    handoff. (A bool is not a number here, though Python's is an int.)"""
    for name in _INTS + _OPTIONAL_INTS:  # (as the protobuf carries them: int64; a top_k of 10^30 failed a handoff)
        v = getattr(p, name)
        if not (type(v) is int and -(2**63) <= v < 2**63) and not (v is None and name in _OPTIONAL_INTS):
            raise InvalidRequestError(f"sampling.{name}", f"must be a 64-bit integer, got {_shown(v)}")
    for name in _REALS:
        if type(v := getattr(p, name)) not in (int, float):
            raise InvalidRequestError(f"sampling.{name}", f"must be a number, got {_shown(v)}")
    for name in _BOOLS:
        if type(v := getattr(p, name)) is not bool:
            raise InvalidRequestError(f"sampling.{name}", f"must be true or false, got {_shown(v)}")
    if not isinstance(p.stop, (list, tuple)) or not all(isinstance(x, str) for x in p.stop):
        raise InvalidRequestError("sampling.stop", f"must be a list of strings, got {_shown(p.stop)}")
    if not isinstance(p.stop_token_ids, (list, tuple)) or not all(type(t) is int for t in p.stop_token_ids):
        raise InvalidRequestError(
            "sampling.stop_token_ids", f"must be a list of integers, got {_shown(p.stop_token_ids)}"
        )
    bias = p.logit_bias.items() if isinstance(p.logit_bias, dict) else p.logit_bias
    if not isinstance(bias, (list, tuple, type({}.items()))) or not all(
        isinstance(e, (list, tuple)) and len(e) == 2 and type(e[0]) is int and type(e[1]) in (int, float) for e in bias
    ):
        raise InvalidRequestError(
            "sampling.logit_bias", f"must be (token id, number) pairs, got {_shown(p.logit_bias)}"
        )


def _shown(v: object) -> str:
    s = repr(v)
    return s if len(s) <= 60 else f"{s[:50]}... ({len(s)} characters)"


def check_stop_counts(stop: int, stop_token_ids: int) -> None:
    """Raise InvalidRequestError if a request has more stop strings or stop token ids than allowed
    (callers holding the protobuf count them before copying the lists)."""
    if stop > MAX_STOP_STRINGS:
        raise InvalidRequestError("sampling.stop", f"at most {MAX_STOP_STRINGS} stop strings, got {stop}")
    if stop_token_ids > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(
            "sampling.stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} token ids, got {stop_token_ids}"
        )


def check_vocab(field: str, token_ids, vocab: int) -> None:
    """Raise InvalidRequestError naming `field` if a token id is outside the vocabulary."""
    if (bad := next((t for t in token_ids if not 0 <= t < vocab), None)) is not None:
        raise InvalidRequestError(field, f"token id {bad} is outside the vocabulary [0, {vocab})")


def check_context(prompt_len: int, params: SamplingParams, context: int, input_field: str = "prompt") -> None:
    """Raise InvalidRequestError if prompt + max_tokens exceed the context: naming the input when it
    alone leaves no room for even one token, else sampling.max_tokens."""
    if prompt_len >= context:
        raise InvalidRequestError(
            input_field, f"is {prompt_len} tokens; the context length is {context}, prompt and completion together"
        )
    total = prompt_len + params.max_tokens
    if total > context:
        raise InvalidRequestError(
            "sampling.max_tokens",
            f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds the context length "
            f"{context}",
        )
