"""The KV byte layout that the prefill -> decode handoff carries.

Producer (prefill worker): ``LLMEngine.export_kv`` writes one sequence's KV into a
buffer it owns (a region of its shared-memory arena, or a bytearray for the gRPC
path) and keeps its blocks until ``release``; the buffer's owner frees the region
after the consumer has answered.
Consumer (decode worker): ``LLMEngine.import_kv`` checks the header against its own
model (``check``) before it reads a byte of the body, then copies the body into its
paged pool (``load``). It never keeps a reference to the producer's buffer.

Layout: a 64-byte little-endian header, then [layers, 2 (k, v), tokens, kv_heads, head_dim], C
order, in the engine's KV dtype (float32, bfloat16 or float16: the header's dtype code and the
handle's dtype name say which; a worker refuses KV of a dtype other than its own). Version 1
holds the KV of every token. Version 2 adds a start field to the header, and its body holds the
KV of tokens [start, num_tokens) only: the consumer already
holds the first start in its prefix cache (``part`` cuts such a payload out of a whole one).
A whole payload is written as version 1, so workers of the release before version 2 still
read it (a rolling update).
"""

from __future__ import annotations

import struct
import warnings
from dataclasses import dataclass, field

import torch

from splitserve.engine.errors import KVImportError
from splitserve.engine.params import SamplingParams

MAGIC = b"SSKV"
LAYOUT_VERSION = 1  # a whole payload
LAYOUT_VERSION_START = 2  # one without its first tokens' KV
LAYOUT_VERSIONS = (LAYOUT_VERSION, LAYOUT_VERSION_START)
DTYPE_CODES = {"float32": 1, "bfloat16": 2, "float16": 3}
# magic, version, dtype, layers, kv_heads, head_dim, tokens, fingerprint, start
_HEADER = struct.Struct("<4sHHIIII32sI")
HEADER_SIZE = 64


@dataclass
class KVExport:
    """Everything the consumer needs besides the bytes: the sequence and the KV's shape."""

    request_id: str
    prompt_len: int
    token_ids: list[int]  # prompt + generated so far; KV covers all but the last
    params: SamplingParams
    generator_state: bytes | None
    num_tokens: int
    fingerprint: str
    layout_version: int = LAYOUT_VERSION
    dtype: str = "float32"
    nbytes: int = 0
    cache_salt: str = ""  # its prefix cache root (Sequence.cache_salt)
    start: int = 0  # the body holds the KV of tokens [start, num_tokens)
    logprobs: list = field(default_factory=list)  # TokenLogprob of the tokens sampled so far (params.logprobs set)
    prompt_logprobs: list = field(default_factory=list)  # TokenLogprob of its prompt (params.prompt_logprobs set)
    # params.n > 1: the first sample's finish reason when its first token ended it (the KV still
    # travels: the other samples are made from it); "" otherwise
    finish_reason: str = ""
    # A request resumed after its decode worker was lost: the last `resumed` of its sampled tokens
    # before this one (and the first `resumed_chars` characters of their text) its client has
    # already; they are not sent again
    resumed: int = 0
    resumed_chars: int = 0


def payload_nbytes(shape, num_tokens: int, start: int = 0) -> int:
    """shape: a ModelShape (its kv_dtype sizes the elements)."""
    per_token = shape.num_kv_heads * shape.head_dim * shape.kv_itemsize
    return HEADER_SIZE + shape.num_layers * 2 * (num_tokens - start) * per_token


def _header(model, n: int, start: int) -> bytes:
    shape = model.shape
    return _HEADER.pack(
        MAGIC,
        layout_version(start),
        DTYPE_CODES[shape.kv_dtype],
        shape.num_layers,
        shape.num_kv_heads,
        shape.head_dim,
        n,
        model.fingerprint.encode(),
        start,
    )


def layout_version(start: int) -> int:
    return LAYOUT_VERSION_START if start else LAYOUT_VERSION


def _body(buf, shape, n: int) -> torch.Tensor:
    count = shape.num_layers * 2 * n * shape.num_kv_heads * shape.head_dim
    with warnings.catch_warnings():  # read-only buffers are only ever read
        warnings.simplefilter("ignore", UserWarning)
        t = torch.frombuffer(buf, dtype=getattr(torch, shape.kv_dtype), count=count, offset=HEADER_SIZE)
    return t.view(shape.num_layers, 2, n, shape.num_kv_heads, shape.head_dim)


def export(model, kv: torch.Tensor, slots: torch.Tensor, seq, dest=None, start: int = 0) -> KVExport:
    """slots: those of tokens [start, num_tokens)."""
    shape, count = model.shape, int(slots.numel())
    n = start + count
    nbytes = payload_nbytes(shape, n, start)
    if dest is None:
        dest = memoryview(bytearray(nbytes))
    if len(dest) < nbytes:
        raise ValueError(f"destination holds {len(dest)} bytes, KV needs {nbytes}")
    header = _header(model, n, start)
    dest[: len(header)] = header
    if kv.device.type == "cpu":
        torch.index_select(kv, 2, slots, out=_body(dest, shape, count))
    else:
        _body(dest, shape, count).copy_(kv.index_select(2, slots.to(kv.device)))
    state = seq.generator.get_state().numpy().tobytes() if seq.generator is not None else None
    return KVExport(
        request_id=seq.request_id,
        prompt_len=seq.prompt_len,
        token_ids=list(seq.token_ids),
        params=seq.params,
        generator_state=state,
        num_tokens=n,
        fingerprint=model.fingerprint,
        nbytes=nbytes,
        dtype=shape.kv_dtype,
        cache_salt=seq.cache_salt,
        start=start,
        layout_version=layout_version(start),
        logprobs=list(seq.logprobs),
        resumed=seq.resumed,
        resumed_chars=seq.resumed_chars,
        prompt_logprobs=list(seq.prompt_logprobs),
        finish_reason=seq.first_finish or "",
    )


def part(model, payload, num_tokens: int, start: int) -> list:
    """The pieces, in order, of a payload of tokens [start, num_tokens) cut out of a whole one
    (start 0) without copying it: a header, then for each layer's K and V the run of its
    tokens from start on (a token's KV is not outermost, so the run is not one piece)."""
    shape = model.shape
    per_token = shape.num_kv_heads * shape.head_dim * shape.kv_itemsize
    run = num_tokens * per_token
    pieces: list = [_header(model, num_tokens, start), bytes(HEADER_SIZE - _HEADER.size)]
    for i in range(shape.num_layers * 2):
        at = HEADER_SIZE + i * run
        pieces.append(payload[at + start * per_token : at + run])
    return pieces


def check(model, export: KVExport, payload) -> None:
    """Refuse KV that does not belong to this model or does not match its own header."""
    shape = model.shape
    if export.layout_version not in LAYOUT_VERSIONS:
        raise KVImportError(
            "handle.layout_version", f"KV layout version {export.layout_version} is not one of {LAYOUT_VERSIONS}"
        )
    if export.layout_version != layout_version(export.start):
        raise KVImportError(
            "handle.layout_version",
            f"KV layout version {export.layout_version} with start "
            f"{export.start}: a whole payload is version {LAYOUT_VERSION}, one without its first "
            f"tokens {LAYOUT_VERSION_START}",
        )
    if export.dtype != shape.kv_dtype:
        raise KVImportError("handle.dtype", f"KV dtype {export.dtype!r} is not this model's {shape.kv_dtype!r}")
    if export.fingerprint != model.fingerprint:
        raise KVImportError(
            "handle.fingerprint",
            f"KV fingerprint {export.fingerprint!r} does not match this model ({model.fingerprint})",
        )
    if export.num_tokens < 1:
        raise KVImportError("handle.num_tokens", f"KV token count must be >= 1, got {export.num_tokens}")
    if not 0 <= export.start < export.num_tokens:
        raise KVImportError("handle.start_token", f"KV start {export.start} is outside [0, {export.num_tokens})")
    need = payload_nbytes(shape, export.num_tokens, export.start)
    if len(payload) < need:
        raise KVImportError(
            "handle.length",
            f"KV payload is {len(payload)} bytes, tokens {export.start}..{export.num_tokens} need {need}",
        )
    magic, version, dtype, layers, heads, dim, n, fp, start = _HEADER.unpack_from(bytes(payload[: _HEADER.size]))
    if magic != MAGIC or version != export.layout_version or dtype != DTYPE_CODES[shape.kv_dtype]:
        raise KVImportError(
            "handle", f"the KV payload's header is not a splitserve v{export.layout_version} {shape.kv_dtype} layout"
        )
    if version == LAYOUT_VERSION:  # no start field (its bytes may hold anything)
        start = 0
    if (layers, heads, dim) != (shape.num_layers, shape.num_kv_heads, shape.head_dim):
        raise KVImportError("handle", f"the KV payload's shape {(layers, heads, dim)} does not match this model")
    if n != export.num_tokens or start != export.start or fp.decode(errors="replace") != model.fingerprint:
        raise KVImportError(
            "handle", "the KV payload's header disagrees with the handle (tokens, start or fingerprint)"
        )


def load(model, kv: torch.Tensor, slots: torch.Tensor, payload, count: int, skip: int = 0) -> None:
    """Copy a payload's KV into slots: the body holds count tokens; the first skip are left out."""
    body = _body(payload, model.shape, count)[:, :, skip:]
    kv.index_copy_(2, slots.to(kv.device), body.to(kv.device))
