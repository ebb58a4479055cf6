"""The model's own tokenizer: encoding, chat template, and incremental detokenization."""

from __future__ import annotations

import functools
import re
import secrets

from splitserve.engine.errors import InvalidRequestError

try:
    from tokenizers import Tokenizer as _RustTokenizer
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - tokenizers comes with transformers
    _RustTokenizer = DecodeStream = None

# How many tokens before the output's start are decoded with it, so the first
# output token gets its leading space right with SentencePiece-style tokenizers.
_CONTEXT_TOKENS = 5


CHAT_ROLES = ("system", "user", "assistant")


class Tokenizer:
    def __init__(self, hf_tokenizer):
        self.hf = hf_tokenizer
        self.eos_token_ids = frozenset(
            t for t in (getattr(hf_tokenizer, "eos_token_id", None),) if t is not None
        )
        rust = getattr(hf_tokenizer, "_tokenizer", None)  # a fast tokenizer's own: streams in one call a token
        self.rust = rust if _RustTokenizer is not None and isinstance(rust, _RustTokenizer) else None

    @functools.cached_property
    def max_token_chars(self) -> int | None:
        """The most characters of text one token can stand for, or None when that is not known.
        A token's string in the vocabulary is as long as the text it covers (byte-level: one
        character per byte, so at least as long), unless a normalizer rewrites the text first: then
        nothing is claimed, nor when an added token takes in the spaces around it (lstrip, rstrip).
        So a text of n characters is at least n / this many tokens."""
        if self.rust is None or self.rust.normalizer is not None:
            return None
        added = getattr(self.hf, "added_tokens_decoder", {}).values()
        if any(getattr(t, "lstrip", False) or getattr(t, "rstrip", False) for t in added):
            return None
        try:
            return max(map(len, self.hf.get_vocab())) or None
        except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary to list: no bound
            return None

    def encode(self, text: str) -> list[int]:
        # NOTE: special tokens in the text (<|im_start|> ...) are recognised, no BOS is added:
        # that is how the model's chat template and the bench workloads tokenize.
        return self.hf.encode(text, add_special_tokens=False)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        if not getattr(self.hf, "chat_template", None):
            raise InvalidRequestError("messages", "this model has no chat template; send prompt instead")
        for i, m in enumerate(messages):
            if not m.get("role"):
                raise InvalidRequestError(f"messages[{i}].role", "must be set")
            if m["role"] not in CHAT_ROLES:
                raise InvalidRequestError(f"messages[{i}].role",
                                          f"must be one of {', '.join(CHAT_ROLES)}, got {m['role']!r}")
        return self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """A chat's prompt ids: the template's own text with its special tokens, and each message's
        content as text, so a user cannot write a role boundary (`<|im_end|>`, `<|im_start|>system`)
        into the prompt. Content holding no added token's text tokenizes as the whole rendered
        prompt does (the common case, unchanged). Otherwise the template is rendered with a marker
        for each content, and the pieces between the markers are tokenized with special tokens
        recognised, the contents without. A template that changes a content on its way into the
        prompt (trims it, say), so that the markers do not give back the prompt, keeps the plain
        tokenization."""
        text = self.apply_chat_template(messages)
        added = self._added_tokens
        if added is None or not any(added.search(m.get("content") or "") for m in messages):
            return self.encode(text)
        marks = [f"\ue000{secrets.token_hex(8)}.{i}\ue001" for i in range(len(messages))]
        shape = self.apply_chat_template([{**m, "content": k} for m, k in zip(messages, marks)])
        pieces = re.split("(" + "|".join(map(re.escape, marks)) + ")", shape)
        content = dict(zip(marks, (m.get("content") or "" for m in messages)))
        found = pieces[1::2]
        if sorted(found) != sorted(marks) or "".join(content.get(p, p) for p in pieces) != text:
            return self.encode(text)
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if piece:
                ids += self._encode_literal(content[piece]) if i % 2 else self.encode(piece)
        return ids

    @functools.cached_property
    def _added_tokens(self) -> "re.Pattern | None":
        """Matches the text of any added token (the specials among them), longest first."""
        names = sorted({t.content for t in getattr(self.hf, "added_tokens_decoder", {}).values() if t.content},
                       key=len, reverse=True)
        return re.compile("|".join(map(re.escape, names))) if names else None

    @functools.cached_property
    def _literal(self):
        """A copy of the fast tokenizer that reads added tokens' text as plain text."""
        if self.rust is None:
            return None
        literal = _RustTokenizer.from_str(self.rust.to_str())
        literal.encode_special_tokens = True
        return literal

    def _encode_literal(self, text: str) -> list[int]:
        if self._literal is not None:
            return self._literal.encode(text, add_special_tokens=False).ids
        return self.hf.encode(text, add_special_tokens=False, split_special_tokens=True)

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    def detokenizer(self, prompt_ids: list[int]) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, prompt_ids)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas with no broken UTF-8.

    Decodes the window [prefix, end) against [prefix, read) and hands out the
    difference once it does not end in a replacement character (an incomplete
    multi-byte sequence). With a fast tokenizer, its ``DecodeStream`` hands out the
    same deltas in one call per token (~7x less time than two decodes), and the
    window is only kept for ``flush``.
    """

    def __init__(self, tok: Tokenizer, prompt_ids: list[int]):
        self.tok = tok
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix = 0
        self.read = len(self.ids)
        self.stream = None
        if tok.rust is not None:
            try:
                self.stream = DecodeStream(ids=list(self.ids), skip_special_tokens=True)
            except TypeError:  # a tokenizers release whose streams take no context: windows from now on
                tok.rust = None

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        if self.stream is not None:
            delta = self.stream.step(self.tok.rust, token_id)
        else:
            prefix_text = self.tok.decode(self.ids[self.prefix : self.read])
            full = self.tok.decode(self.ids[self.prefix :])
            ready = len(full) > len(prefix_text) and not full.endswith("\ufffd")
            delta = full[len(prefix_text) :] if ready else None
        if delta is None:
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return delta

    def flush(self) -> str:
        """At the end: whatever is still held back, incomplete bytes included."""
        prefix_text = self.tok.decode(self.ids[self.prefix : self.read])
        full = self.tok.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return full[len(prefix_text) :]
