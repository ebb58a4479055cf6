"""Attention over a ragged batch: no padding between sequences, none to the longest KV.

Each sequence in the batch has ``q_len`` new tokens at the end of ``ctx_len`` tokens of
context. A first prefill chunk (``q_len == ctx_len``) attends to its own fresh K/V;
every other sequence reads its context from the paged cache through one gather per
layer (the slot list is the same for every layer, so it is built once per step).

Without the C kernel (the torch backend, and every CUDA device) the single-token
decodes are done together: one gather of their contexts padded to the longest and
one masked SDPA call per layer, so a step's kernel launches do not grow with the
number of running sequences.
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
    # torch backend: single-token decodes, batched (not in ``seqs``)
    dec_rows: torch.Tensor | None = None  # [S] int64, their rows of the batch
    dec_slots: torch.Tensor | None = None  # [S, longest ctx] int64, each one's context slots, padded with 0
    dec_mask: torch.Tensor | None = None  # [S, 1, 1, longest ctx] bool, False on the padding
    # fused kernels (CUDA): the same decodes read through their block tables instead
    dec_tables: torch.Tensor | None = None  # [S, blocks] int64, each one's block table, padded
    dec_lens: torch.Tensor | None = None  # [S] int64, each one's context length with its new token
    block_size: int = 0
    # The forward returns the logits rows' final hidden states (normed) instead of their logits:
    # the caller makes logits of them a slice at a time (prompt log probabilities' many rows).
    hidden_out: bool = False

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def attention(self, q, k, v, k_cache, v_cache, scale: float, kernel=None, out=None, fused=None) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; caches: [slots, Hkv, D] -> [T, Hq*D] (into out if given).

        With ``kernel`` (native.PagedAttention), every cache-reading sequence is done in one
        call straight from the paged cache; fresh prefills still use torch's SDPA. With
        ``fused`` (fused.FusedOps) and dec_tables, the batched decodes are read the same way.
        """
        T, Hq, D = q.shape
        if out is None:
            out = torch.empty(T, Hq * D, dtype=q.dtype, device=q.device)
        if self.dec_tables is not None:
            every = self.dec_rows.shape[0] == T  # a pure decode step: the rows are the whole batch, in order
            qd = q if every else q.index_select(0, self.dec_rows)
            o = fused.paged_decode(
                qd, k_cache, v_cache, self.dec_tables, self.dec_lens, self.block_size, scale, out if every else None
            )
            if not every:
                out.index_copy_(0, self.dec_rows, o)
        elif self.dec_rows is not None:
            S, L = self.dec_slots.shape
            Hkv = k_cache.shape[1]
            kd = k_cache.index_select(0, self.dec_slots.view(-1)).view(S, L, Hkv, D).transpose(1, 2)
            vd = v_cache.index_select(0, self.dec_slots.view(-1)).view(S, L, Hkv, D).transpose(1, 2)
            every = S == T  # a pure decode step: the rows are the whole batch, in order
            o = sdpa_decode(q if every else q.index_select(0, self.dec_rows), kd, vd, self.dec_mask, scale)
            if every:
                out.copy_(o)
            else:
                out.index_copy_(0, self.dec_rows, o)
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
                o = sdpa_gqa(qi, ki, vi, None, s.q_len > 1, scale)
            else:
                c, d = s.ctx_off, s.ctx_off + s.ctx_len
                ki, vi = K[:, c:d].unsqueeze(0), V[:, c:d].unsqueeze(0)  # [1, Hkv, ctx, D]
                o = sdpa_gqa(qi, ki, vi, s.mask, False, scale)
            out[a:b] = o[0].transpose(0, 1).reshape(s.q_len, Hq * D)
        return out


def sdpa_decode(q, k, v, mask, scale: float) -> torch.Tensor:
    """One new token per sequence. q: [S, Hq, D]; k, v: [S, Hkv, L, D]; mask: [S, 1, 1, L] -> [S, Hq*D].

    GQA without repeating K/V: a KV head's query heads are its "query positions" (head h
    reads KV head h // G), so SDPA runs its plain kernel, not the math fallback.
    """
    S, Hq, D = q.shape
    Hkv = k.shape[1]
    o = F.scaled_dot_product_attention(q.reshape(S, Hkv, Hq // Hkv, D), k, v, attn_mask=mask, scale=scale)
    return o.reshape(S, Hq * D)


def sdpa_gqa(q, k, v, mask, causal: bool, scale: float) -> torch.Tensor:
    """SDPA with fewer K/V heads than query heads. q: [1, Hq, n, D]; k, v: [1, Hkv, m, D].

    On the CPU, torch's own GQA path (the results the tests pin). Elsewhere K/V are
    repeated first: with ``enable_gqa`` CUDA falls back to the math kernel (~10 launches).
    """
    if q.device.type == "cpu":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    B, Hkv, m, D = k.shape
    G = q.shape[1] // Hkv
    if G > 1:
        k = k.unsqueeze(2).expand(B, Hkv, G, m, D).reshape(B, Hkv * G, m, D)
        v = v.unsqueeze(2).expand(B, Hkv, G, m, D).reshape(B, Hkv * G, m, D)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)


def chunk_mask(q_len: int, ctx_len: int) -> torch.Tensor | None:
    """Causal mask for q_len new tokens at the end of ctx_len tokens; None when q_len == 1."""
    if q_len == 1:
        return None
    rows = torch.arange(ctx_len - q_len, ctx_len).unsqueeze(1)
    return torch.arange(ctx_len).unsqueeze(0) <= rows
