"""The KV byte layout that the prefill -> decode handoff carries.

Producer (prefill worker): ``LLMEngine.export_kv`` writes one sequence's KV into a
buffer it owns (a region of its shared-memory arena, or a bytearray for the gRPC
path) and keeps its blocks until ``release``; the buffer's owner frees the region
after the consumer has answered.
Consumer (decode worker): ``LLMEngine.import_kv`` checks the header against its own
model (``check``) before it reads a byte of the body, then copies the body into its
paged pool (``load``). It never keeps a reference to the producer's buffer.

Layout, version 1: a 64-byte little-endian header, then fp32 [layers, 2 (k, v), tokens,
kv_heads, head_dim], C order.
"""

from __future__ import annotations

import struct
import warnings
from dataclasses import dataclass

import torch

from splitserve.engine.errors import KVImportError
from splitserve.engine.params import SamplingParams

MAGIC = b"SSKV"
LAYOUT_VERSION = 1
DTYPE_F32 = 1
DTYPE_NAMES = {DTYPE_F32: "float32"}
_HEADER = struct.Struct("<4sHHIIII32s")  # magic, version, dtype, layers, kv_heads, head_dim, tokens, fingerprint
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


def payload_nbytes(shape, num_tokens: int) -> int:
    return HEADER_SIZE + shape.num_layers * 2 * num_tokens * shape.num_kv_heads * shape.head_dim * 4


def _body(buf, shape, n: int) -> torch.Tensor:
    count = shape.num_layers * 2 * n * shape.num_kv_heads * shape.head_dim
    with warnings.catch_warnings():  # read-only buffers are only ever read
        warnings.simplefilter("ignore", UserWarning)
        t = torch.frombuffer(buf, dtype=torch.float32, count=count, offset=HEADER_SIZE)
    return t.view(shape.num_layers, 2, n, shape.num_kv_heads, shape.head_dim)


def export(model, kv: torch.Tensor, slots: torch.Tensor, seq, dest=None) -> KVExport:
    shape, n = model.shape, int(slots.numel())
    nbytes = payload_nbytes(shape, n)
    if dest is None:
        dest = memoryview(bytearray(nbytes))
    if len(dest) < nbytes:
        raise ValueError(f"destination holds {len(dest)} bytes, KV needs {nbytes}")
    header = _HEADER.pack(
        MAGIC, LAYOUT_VERSION, DTYPE_F32, shape.num_layers, shape.num_kv_heads, shape.head_dim, n,
        model.fingerprint.encode(),
    )
    dest[: len(header)] = header
    if kv.device.type == "cpu":
        torch.index_select(kv, 2, slots, out=_body(dest, shape, n))
    else:
        _body(dest, shape, n).copy_(kv.index_select(2, slots.to(kv.device)))
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
        cache_salt=seq.cache_salt,
    )


def check(model, export: KVExport, payload) -> None:
    """Refuse KV that does not belong to this model or does not match its own header."""
    shape = model.shape
    if export.layout_version != LAYOUT_VERSION:
        raise KVImportError(f"KV layout version {export.layout_version} is not {LAYOUT_VERSION}")
    if export.dtype != "float32":
        raise KVImportError(f"KV dtype {export.dtype!r} is not 'float32'")
    if export.fingerprint != model.fingerprint:
        raise KVImportError(f"KV fingerprint {export.fingerprint!r} does not match this model ({model.fingerprint})")
    if export.num_tokens < 1:
        raise KVImportError(f"KV token count must be >= 1, got {export.num_tokens}")
    need = payload_nbytes(shape, export.num_tokens)
    if len(payload) < need:
        raise KVImportError(f"KV payload is {len(payload)} bytes, {export.num_tokens} tokens need {need}")
    magic, version, dtype, layers, heads, dim, n, fp = _HEADER.unpack_from(bytes(payload[: _HEADER.size]))
    if magic != MAGIC or version != LAYOUT_VERSION or dtype != DTYPE_F32:
        raise KVImportError("KV payload header is not a splitserve v1 float32 layout")
    if (layers, heads, dim) != (shape.num_layers, shape.num_kv_heads, shape.head_dim):
        raise KVImportError(f"KV payload shape {(layers, heads, dim)} does not match this model")
    if n != export.num_tokens or fp.decode(errors="replace") != model.fingerprint:
        raise KVImportError("KV payload header disagrees with the handle (tokens or fingerprint)")


def load(model, kv: torch.Tensor, slots: torch.Tensor, payload, n: int) -> None:
    kv.index_copy_(2, slots.to(kv.device), _body(payload, model.shape, n).to(kv.device))
