"""The model's own tokenizer: encoding, chat template, and incremental detokenization.

Loaded from the folder's files with the ``tokenizers`` library (tokenizer.json, the special
tokens of tokenizer_config.json, the chat template) in ~0.1 s; ``transformers``' AutoTokenizer
costs ~3 s of imports in every process that starts. The chat template is rendered by
``transformers``' own renderer (its sandbox and filters), whose module imports in ~0.7 s
without ``torch``. Encoding and decoding are the same calls ``transformers``' fast tokenizers
make (tests compare them on the real model).
"""

from __future__ import annotations

import functools
import json
import os
import re
import secrets

from tokenizers import Tokenizer as _RustTokenizer
from tokenizers.decoders import DecodeStream

from splitserve.engine.errors import InvalidRequestError, ModelLoadError

# How many tokens before the output's start are decoded with it, so the first
# output token gets its leading space right with SentencePiece-style tokenizers.
_CONTEXT_TOKENS = 5


CHAT_ROLES = ("system", "user", "assistant")
# The named special tokens a chat template sees (transformers' special_tokens_map).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


# Texts on which a tokenizer read from the files must agree with transformers' (differs_from_transformers).
_PROBES = (
    "Hello world",
    " leading space",
    "  two  spaces ",
    "\n\nnew lines\n",
    "tab\there",
    "naïve café 日本語 🎉",
    "x = 1234567.89;",
    "don't I'll we're",
    "UPPER lower MiXeD",
    "\u00a0\u2009odd\u200bspaces",
)


def load_tokenizer(folder: str, from_files: bool = True) -> Tokenizer | None:
    """The folder's tokenizer, or None for a folder of weights alone. from_files=False: the one
    transformers builds (for a model whose files alone tokenize otherwise, which
    differs_from_transformers finds once, when its config is first resolved)."""
    has_json = os.path.isfile(os.path.join(folder, "tokenizer.json"))
    if not has_json and not os.path.isfile(os.path.join(folder, "tokenizer.model")):
        return None
    if not has_json or not from_files:  # SentencePiece alone (transformers converts it), or files it reads otherwise
        return _from_transformers(folder)
    try:
        rust = _RustTokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        config = _read_json(os.path.join(folder, "tokenizer_config.json")) or {}
        template = _chat_template(folder, config)
    except Exception as e:  # noqa: BLE001 - tokenizers and json raise many types
        raise ModelLoadError(f"cannot load tokenizer in {folder}: {e}") from None
    specials = {k: _content(config[k]) for k in SPECIAL_TOKENS if config.get(k)}
    return Tokenizer(rust, chat_template=template, special_tokens=specials)


def _from_transformers(folder: str) -> Tokenizer:
    try:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(folder)
        return Tokenizer(
            hf.backend_tokenizer, chat_template=getattr(hf, "chat_template", None), special_tokens=hf.special_tokens_map
        )
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"cannot load tokenizer in {folder}: {e}") from None


def differs_from_transformers(folder: str) -> str | None:
    """What a tokenizer read from the folder's files does otherwise than transformers' AutoTokenizer
    (which may rebuild parts of it from tokenizer_config.json), or None when they agree on the
    probes: encoding and decoding texts, each special token amid text, the chat template, the
    special tokens and EOS."""
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return None
    ours = load_tokenizer(folder)
    try:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(folder)
    except Exception:  # noqa: BLE001 - transformers cannot read it: the files are all there is
        return None
    specials = {t.content for t in ours.rust.get_added_tokens_decoder().values() if t.special}
    for text in [*_PROBES, *(f"a{t} b" for t in sorted(specials))]:
        ids = hf.encode(text, add_special_tokens=False)
        if ours.encode(text) != ids:
            return f"encoding {text!r}: {ours.encode(text)} against {ids}"
        if ours.decode(ids) != hf.decode(ids, skip_special_tokens=True):
            return f"decoding {ids}"
    if ours.chat_template != (getattr(hf, "chat_template", None) or None):
        return "the chat template"
    if ours.special_tokens != hf.special_tokens_map or ours.eos_token_ids != _eos_of(hf):
        return f"the special tokens: {ours.special_tokens} against {hf.special_tokens_map}"
    return None


def _eos_of(hf) -> frozenset[int]:
    return frozenset(() if hf.eos_token_id is None else (hf.eos_token_id,))


def _read_json(path: str):
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _content(token) -> str:
    """A special token as tokenizer_config.json gives it: a string, or an AddedToken's fields."""
    return token["content"] if isinstance(token, dict) else str(token)


def _chat_template(folder: str, config: dict) -> str | None:
    """chat_template.jinja (how transformers saves it now), else tokenizer_config.json's or
    chat_template.json's; of named templates, the one named default."""
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template") or (_read_json(os.path.join(folder, "chat_template.json")) or {}).get(
        "chat_template"
    )
    if isinstance(template, list):
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template or None


class Tokenizer:
    def __init__(self, rust, *, chat_template: str | None = None, special_tokens: dict[str, str] | None = None):
        rust.no_truncation()  # transformers' encode does not truncate either; the context is checked by us
        rust.no_padding()
        self.rust = rust
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        eos = self.special_tokens.get("eos_token")
        eos_id = rust.token_to_id(eos) if eos else None
        self.eos_token_ids = frozenset(() if eos_id is None else (eos_id,))
        self.streams = True  # off when this tokenizers release cannot stream with context
        self._token_texts: dict[int, str] = {}  # token_text's, at most the vocabulary's

    @functools.cached_property
    def max_token_chars(self) -> int | None:
        """The most characters of text one token can stand for, or None when that is not known.
        A token's string in the vocabulary is as long as the text it covers (byte-level: one
        character per byte, so at least as long), unless a normalizer rewrites the text first: then
        nothing is claimed, nor when an added token takes in the spaces around it (lstrip, rstrip).
        So a text of n characters is at least n / this many tokens."""
        if self.rust.normalizer is not None:
            return None
        if any(t.lstrip or t.rstrip for t in self.rust.get_added_tokens_decoder().values()):
            return None
        return max(map(len, self.rust.get_vocab(with_added_tokens=True)), default=0) or None

    def encode(self, text: str) -> list[int]:
        # NOTE: special tokens in the text (<|im_start|> ...) are recognised, no BOS is added:
        # that is how the model's chat template and the bench workloads tokenize.
        return self.rust.encode(text, add_special_tokens=False).ids

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        if not self.chat_template:
            raise InvalidRequestError("messages", "this model has no chat template; send prompt instead")
        for i, m in enumerate(messages):
            if not m.get("role"):
                raise InvalidRequestError(f"messages[{i}].role", "must be set")
            if m["role"] not in CHAT_ROLES:
                raise InvalidRequestError(
                    f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}, got {m['role']!r}"
                )
        from jinja2.exceptions import TemplateError
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            rendered, _ = render_jinja_template(
                conversations=[messages],
                chat_template=self.chat_template,
                add_generation_prompt=True,
                **self.special_tokens,
            )
        except TemplateError as e:  # the template's raise_exception: what it says of this chat
            raise InvalidRequestError("messages", f"the model's chat template refused it: {e}") from None
        return rendered[0]

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
        contents = [m.get("content") or "" for m in messages]
        if not any(name in c for c in contents for name in self._added_tokens):  # substring scans: ~20x a regex's speed
            return self.encode(text)
        marks = [f"\ue000{secrets.token_hex(8)}.{i}\ue001" for i in range(len(messages))]
        shape = self.apply_chat_template([{**m, "content": k} for m, k in zip(messages, marks)])
        pieces = re.split("(" + "|".join(map(re.escape, marks)) + ")", shape)
        content = dict(zip(marks, contents))
        found = pieces[1::2]
        if sorted(found) != sorted(marks) or "".join(content.get(p, p) for p in pieces) != text:
            return self.encode(text)
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if piece:
                ids += (
                    self._literal.encode(content[piece], add_special_tokens=False).ids if i % 2 else self.encode(piece)
                )
        return ids

    @functools.cached_property
    def _added_tokens(self) -> tuple[str, ...]:
        """The text of every added token (the specials among them)."""
        return tuple(sorted({t.content for t in self.rust.get_added_tokens_decoder().values() if t.content}))

    @functools.cached_property
    def _literal(self):
        """A copy of the tokenizer that reads added tokens' text as plain text."""
        literal = _RustTokenizer.from_str(self.rust.to_str())
        literal.encode_special_tokens = True
        return literal

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.rust.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text decoded alone, special tokens included (a log probability's token):
        U+FFFD where it holds only part of a character's bytes. Kept once decoded."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.rust.decode([token_id], skip_special_tokens=False)
        return text

    def detokenizer(self, prompt_ids: list[int], skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas with no broken UTF-8.

    Decodes the window [prefix, end) against [prefix, read) and hands out the
    difference once it does not end in a replacement character (an incomplete
    multi-byte sequence). With a fast tokenizer, its ``DecodeStream`` hands out the
    same deltas in one call per token (~7x less time than two decodes), and the
    window is only kept for ``flush``.
    """

    def __init__(self, tok: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tok = tok
        self.skip = skip_special_tokens
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix = 0
        self.read = len(self.ids)
        self.stream = None
        if tok.streams:
            try:
                self.stream = DecodeStream(ids=list(self.ids), skip_special_tokens=skip_special_tokens)
            except TypeError:  # a tokenizers release whose streams take no context: windows from now on
                tok.streams = False

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        if self.stream is not None:
            delta = self.stream.step(self.tok.rust, token_id)
        else:
            prefix_text = self.tok.decode(self.ids[self.prefix : self.read], self.skip)
            full = self.tok.decode(self.ids[self.prefix :], self.skip)
            ready = len(full) > len(prefix_text) and not full.endswith("\ufffd")
            delta = full[len(prefix_text) :] if ready else None
        if delta is None:
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return delta

    def flush(self) -> str:
        """At the end: whatever is still held back, incomplete bytes included."""
        prefix_text = self.tok.decode(self.ids[self.prefix : self.read], self.skip)
        full = self.tok.decode(self.ids[self.prefix :], self.skip)
        self.prefix = self.read = len(self.ids)
        return full[len(prefix_text) :]
