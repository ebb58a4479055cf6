"""Attention over a ragged batch: no padding between sequences, none to the longest KV.

Each sequence in the batch has ``q_len`` new tokens at the end of ``ctx_len`` tokens of
context. A first prefill chunk (``q_len == ctx_len``) attends to its own fresh K/V;
every other sequence reads its context from the paged cache through one gather per
layer (the slot list is the same for every layer, so it is built once per step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttnSeq:
    q_start: int
    q_len: int
    ctx_len: int
    ctx_off: int  # offset into RaggedBatch.ctx_slots; -1 = fresh prefill, no cache read
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, for a later prefill chunk


@dataclass
class RaggedBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, where each new token's K/V is written
    logits_rows: torch.Tensor  # [S] int64, rows of the batch whose next token is sampled
    seqs: list[AttnSeq]
    ctx_slots: torch.Tensor | None  # [sum ctx_len of cache-reading seqs] int64
    ctx_info: torch.Tensor | None = None  # [cache-reading seqs, 4] int64: q_start, q_len, ctx_len, ctx_off

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def attention(self, q, k, v, k_cache, v_cache, scale: float, kernel=None) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; caches: [slots, Hkv, D] -> [T, Hq*D].

        With ``kernel`` (native.PagedAttention), every cache-reading sequence is done in one
        call straight from the paged cache; fresh prefills still use torch's SDPA.
        """
        T, Hq, D = q.shape
        out = torch.empty(T, Hq * D, dtype=q.dtype)
        if self.ctx_slots is not None:
            if kernel is not None:
                kernel(q, k_cache, v_cache, self.ctx_info, self.ctx_slots, scale, out)
            else:
                K = k_cache.index_select(0, self.ctx_slots).transpose(0, 1)  # [Hkv, N, D]
                V = v_cache.index_select(0, self.ctx_slots).transpose(0, 1)
        for s in self.seqs:
            if kernel is not None and s.ctx_off >= 0:
                continue
            a, b = s.q_start, s.q_start + s.q_len
            qi = q[a:b].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
            if s.ctx_off < 0:
                ki = k[a:b].transpose(0, 1).unsqueeze(0)  # [1, Hkv, q_len, D]
                vi = v[a:b].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=s.q_len > 1, scale=scale, enable_gqa=True)
            else:
                c, d = s.ctx_off, s.ctx_off + s.ctx_len
                ki, vi = K[:, c:d].unsqueeze(0), V[:, c:d].unsqueeze(0)  # [1, Hkv, ctx, D]
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=s.mask, scale=scale, enable_gqa=True)
            out[a:b] = o[0].transpose(0, 1).reshape(s.q_len, Hq * D)
        return out


def chunk_mask(q_len: int, ctx_len: int) -> torch.Tensor | None:
    """Causal mask for q_len new tokens at the end of ctx_len tokens; None when q_len == 1."""
    if q_len == 1:
        return None
    rows = torch.arange(ctx_len - q_len, ctx_len).unsqueeze(1)
    return torch.arange(ctx_len).unsqueeze(0) <= rows
