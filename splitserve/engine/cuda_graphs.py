"""CUDA graphs for engine steps: a few launches instead of hundreds.

A step of a small model is launch-bound on a GPU: eager, the host issues ~25
kernels per layer and takes longer to issue them than the GPU takes to run them.
Steps are captured once per shape and replayed.

- ``DecodeGraphs``: a continuous-batching step where every scheduled sequence
  has one new token (no prefill in it), over the paged cache: one graph.
- ``PaddedDecodeGraphs``: a decode step of a static/dynamic batch (the same
  rectangle every step), so that the policies are compared on the same kernels.
- ``PiecewiseGraphs``: every other continuous step (prefill chunks, mixed steps).
  Attention depends on each sequence's lengths and runs eagerly; the stretches
  between attentions are one graph each.

Shapes are fixed per graph. Batches are padded to the next size in a short list,
contexts to the next power of two (in KV blocks for the paged cache, masked), token
counts to the next token bucket. Padding rows and tokens of the paged steps write
their K/V into a spare block that the pool never hands out, and read only that block.
Each step copies its variable inputs into static device buffers. The graph derives
everything else on the device: the slots written, the slots read and the mask.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from splitserve.engine.attention import RaggedBatch


class GraphCaptureError(RuntimeError):
    """A step could not be captured (this device or torch build); the engine goes on eagerly."""


def batch_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8, up to max_rows (always included)."""
    sizes = [b for b in (1, 2, 4) if b < max_rows] + list(range(8, max_rows, 8))
    return sizes + [max_rows]


def bucket(sizes: list[int], n: int) -> int | None:
    return next((b for b in sizes if b >= n), None)


def pow2_at_least(n: int, floor: int) -> int:
    b = floor
    while b < n:
        b *= 2
    return b


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor | None  # the static int64 input buffer, on the device
    output: torch.Tensor | dict  # logits [rows, V] (or a piece's tensors), overwritten by every replay


class _Captured:
    """Graphs keyed by shape, captured on first use into one shared memory pool.

    Sharing the pool is safe because replays never overlap: each one's logits are
    read (sampled) before the next replay. capture=False runs the same step bodies
    eagerly instead (on any device), which is how the CPU tests check their math.
    """

    def __init__(self, device: torch.device, capture: bool = True):
        self.device = device
        self.capture = capture
        self.pool = None
        self.graphs: dict[tuple, _Graph] = {}
        self.capture_s = 0.0  # time spent capturing, all graphs together

    def run(
        self,
        key: tuple,
        host: torch.Tensor,
        safe: Callable[[], torch.Tensor],
        fn: Callable[[torch.Tensor], torch.Tensor],
        rows: int,
    ) -> torch.Tensor:
        """fn's first rows of output on the inputs host, replayed from the graph for key.

        A new key is captured first, from fn on safe(): inputs that touch nothing in use.
        """
        if not self.capture:
            return fn(host.to(self.device))[:rows]
        entry = self.graphs.get(key) or self._capture(key, safe(), fn)
        entry.inputs.copy_(host)
        entry.graph.replay()
        return entry.output[:rows]

    def capture_piece(self, key: tuple, fn: Callable[[], dict]) -> _Graph:
        """Capture fn(), whose inputs are tensors it already holds; output is its dict of tensors."""
        return self._capture(key, None, lambda _: fn())

    def _capture(self, key: tuple, inputs: torch.Tensor | None, fn: Callable) -> _Graph:
        try:
            return self._capture_on_device(key, inputs, fn)
        except Exception as e:  # anything torch raises here means: no graphs on this device
            raise GraphCaptureError(f"CUDA graph capture of a step shaped {key} failed: {e}") from e

    def _capture_on_device(self, key: tuple, inputs: torch.Tensor | None, fn: Callable) -> _Graph:
        t = time.perf_counter()
        with torch.cuda.device(self.device):
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the capture (lazy inits, autotuning)
                fn(inputs)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                output = fn(inputs)
        entry = self.graphs[key] = _Graph(graph, inputs, output)
        self.capture_s += time.perf_counter() - t
        return entry


class DecodeGraphs:
    """Pure decode steps of the continuous engine over the paged cache."""

    def __init__(self, model, cache, max_num_seqs: int, capture: bool = True):
        self.model = model
        self.kv = cache.kv
        self.block_size = cache.block_size
        self.spare_block = cache.spare_block
        assert self.spare_block is not None, "the paged cache needs a spare block for padding rows"
        self.sizes = batch_buckets(max_num_seqs)
        self.captured = _Captured(self.kv.device, capture)

    def covers(self, scheduled) -> bool:
        """Whether a step is a pure decode step (one new token per sequence, each sampled)."""
        return (
            bool(scheduled)
            and len(scheduled) <= self.sizes[-1]
            and all(s.num_tokens == 1 and s.samples for s in scheduled)
        )

    def run(self, seqs) -> torch.Tensor:
        """Logits [len(seqs), V] of one decode step for seqs (each with one uncomputed token)."""
        rows = bucket(self.sizes, len(seqs))
        longest = max(s.num_computed for s in seqs) + 1
        nb = pow2_at_least(-(-longest // self.block_size), 8)
        ids, pos, tables = [], [], []
        for s in seqs:
            ids.append(s.token_ids[s.num_computed])
            pos.append(s.num_computed)
            bt = s.block_table[:nb]
            tables.extend(bt)
            tables.extend([self.spare_block] * (nb - len(bt)))
        pad = rows - len(seqs)
        host = torch.tensor(
            ids + [0] * pad + pos + [0] * pad + tables + [self.spare_block] * (pad * nb), dtype=torch.int64
        )
        return self.captured.run(
            (rows, nb), host, lambda: self._safe_inputs(rows, nb), lambda buf: self._forward(buf, rows, nb), len(seqs)
        )

    def _safe_inputs(self, rows: int, nb: int) -> torch.Tensor:
        """Every row a padding row: position 0 of the spare block (what capture runs on)."""
        buf = torch.zeros(rows * (2 + nb), dtype=torch.int64, device=self.kv.device)
        buf[2 * rows :] = self.spare_block
        return buf

    def _forward(self, buf: torch.Tensor, rows: int, nb: int) -> torch.Tensor:
        bs = self.block_size
        ids, pos, tables = buf[:rows], buf[rows : 2 * rows], buf[2 * rows :].view(rows, nb)
        written = tables.gather(1, (pos // bs).unsqueeze(1)).squeeze(1) * bs + pos % bs
        if self.model.fused is not None:  # attention reads through the block tables: no slot list, no mask
            reads = dict(dec_tables=tables, dec_lens=pos + 1, block_size=bs)
        else:
            offsets = torch.arange(bs, device=buf.device)
            read = (tables.unsqueeze(-1) * bs + offsets).view(rows, nb * bs)
            mask = (torch.arange(nb * bs, device=buf.device) <= pos.unsqueeze(1)).view(rows, 1, 1, nb * bs)
            reads = dict(dec_slots=read, dec_mask=mask)
        every = torch.arange(rows, device=buf.device)
        batch = RaggedBatch(
            input_ids=ids,
            positions=pos,
            slot_mapping=written,
            logits_rows=every,
            seqs=[],
            ctx_slots=None,
            dec_rows=every,
            **reads,
        )
        return self.model.forward(batch, self.kv)


class PaddedDecodeGraphs:
    """Decode steps of a static/dynamic batch: [B, 1] tokens against the batch's own KV tensor.

    The batcher takes its KV tensor from ``kv_for``, which keeps one per (rows, length
    bucket) and hands it out again to later batches of that shape, so the address the
    graph holds stays valid. The least recently used shapes are dropped with their graphs.
    """

    MAX_SHAPES = 8

    def __init__(self, model, capture: bool = True):
        self.model = model
        self.captured = _Captured(model.device, capture)
        self.kv_buffers: dict[tuple[int, int], torch.Tensor] = {}  # in use order, oldest first

    def kv_for(self, rows: int, length: int) -> torch.Tensor:
        """A KV tensor [layers, 2, rows, Hkv, L, D] with L >= length (a power of two, >= 128)."""
        key = (rows, pow2_at_least(length, 128))
        kv = self.kv_buffers.pop(key, None)
        if kv is None:
            if len(self.kv_buffers) >= self.MAX_SHAPES:
                oldest = next(iter(self.kv_buffers))
                del self.kv_buffers[oldest]
                self.captured.graphs.pop(oldest, None)
            s = self.model.shape
            dims = (s.num_layers, 2, rows, s.num_kv_heads, key[1], s.head_dim)
            kv = torch.zeros(dims, dtype=self.model.dtype, device=self.model.device)
        self.kv_buffers[key] = kv
        return kv

    def run(self, kv: torch.Tensor, ids: list[int], positions: list[int], pad: list[int], cur: int) -> torch.Tensor:
        """Logits [B, V]: row b's token ids[b] at positions[b], its K/V written at cache
        position cur, attending to cache positions [pad[b], cur]. kv comes from kv_for."""
        rows, L = kv.shape[2], kv.shape[4]
        assert self.kv_buffers.get((rows, L)) is kv, "kv must come from kv_for"
        host = torch.tensor(ids + positions + pad + [cur], dtype=torch.int64)
        return self.captured.run(
            (rows, L), host, lambda: self._safe_inputs(rows, L), lambda buf: self._forward(buf, kv, rows), rows
        )

    def _safe_inputs(self, rows: int, L: int) -> torch.Tensor:
        """Every row writes the buffer's last position, which is this step's write position
        or a later one: either way it is written again before anything reads it."""
        buf = torch.zeros(3 * rows + 1, dtype=torch.int64, device=self.model.device)
        buf[-1] = L - 1
        return buf

    def _forward(self, buf: torch.Tensor, kv: torch.Tensor, rows: int) -> torch.Tensor:
        ids, pos, pad, cur = buf[:rows], buf[rows : 2 * rows], buf[2 * rows : 3 * rows], buf[3 * rows :]
        keys = torch.arange(kv.shape[4], device=buf.device).view(1, -1)
        mask = (keys >= pad.view(rows, 1)) & (keys <= cur)
        return self.model.forward_padded(ids.view(rows, 1), pos.view(rows, 1), mask.view(rows, 1, 1, -1), kv, cur)


def token_buckets(max_tokens: int) -> list[int]:
    """16, 32, 64, ... (powers of two) below max_tokens, then max_tokens."""
    sizes, b = [], 16
    while b < max_tokens:
        sizes.append(b)
        b *= 2
    return sizes + [max_tokens]


class _Pieces:
    """One token bucket's graphs: piece 0 is the embedding and layer 0 up to attention,
    piece i (1 <= i < L) is layer i-1 after attention and layer i up to it, piece L is
    the last layer after attention and the final norm. Attention runs eagerly between them."""

    def __init__(self, tokens: int, width: int, device: torch.device, spare_slot: int, dtype: torch.dtype):
        self.tokens = tokens
        self.inputs = torch.zeros(3 * tokens, dtype=torch.int64, device=device)  # ids, positions, slots
        self.inputs[2 * tokens :] = spare_slot  # capture runs with every token written to the spare block
        self.attn = torch.zeros(tokens, width, dtype=dtype, device=device)  # attention output, read by the next piece
        self.state: dict[str, torch.Tensor] = {}  # x, cos, sin as the next piece's body reads them

    def views(self):
        t = self.tokens
        return self.inputs[:t], self.inputs[t : 2 * t], self.inputs[2 * t :]


class PiecewiseGraphs:
    """Steps that are not pure decode (prefill chunks, mixed steps) of the continuous engine.

    Their attention depends on each sequence's lengths, so it stays eager; everything else
    (norms, projections, rotary, the KV writes, the MLP) is captured per token bucket, in
    one graph per stretch between two attentions. A step of T tokens runs in the bucket
    of T: padding tokens sit at position 0 and write the spare block.
    """

    def __init__(self, model, cache, max_tokens: int, capture: bool = True):
        self.model = model
        self.kv = cache.kv
        assert cache.spare_block is not None, "the paged cache needs a spare block for padding tokens"
        self.spare_slot = cache.spare_block * cache.block_size
        self.sizes = token_buckets(max_tokens)
        self.captured = _Captured(self.kv.device, capture)
        self.buckets: dict[int, _Pieces] = {}

    def covers(self, num_tokens: int) -> bool:
        return num_tokens <= self.sizes[-1]

    def run(self, batch: RaggedBatch) -> torch.Tensor:
        """Logits for batch.logits_rows (or their normed hidden states), as model.forward(batch, kv) gives them."""
        T = batch.num_tokens
        b = self._bucket(bucket(self.sizes, T))
        ids, pos, slots = b.views()
        ids[:T].copy_(batch.input_ids)
        ids[T:].zero_()
        pos[:T].copy_(batch.positions)
        pos[T:].zero_()
        slots[:T].copy_(batch.slot_mapping)
        slots[T:].fill_(self.spare_slot)
        m = self.model
        out = {}
        for li in range(len(m.layers) + 1):
            if li:  # layer li - 1's attention, on the q, k, v of the piece before
                q, k, v = out["q"][:T], out["k"][:T], out["v"][:T]
                batch.attention(
                    q, k, v, self.kv[li - 1, 0], self.kv[li - 1, 1], m.scaling, None, b.attn[:T], fused=m.fused
                )
            out = self._piece(b, li)
        h = out["h"][batch.logits_rows]  # after the final norm
        return h if batch.hidden_out else m.lm_head_of(h)

    def _bucket(self, tokens: int) -> _Pieces:
        b = self.buckets.get(tokens)
        if b is None:
            m = self.model
            b = self.buckets[tokens] = _Pieces(
                tokens, m.shape.num_heads * m.shape.head_dim, self.kv.device, self.spare_slot, m.dtype
            )
            if self.captured.capture:  # every piece now, in order: each reads the one before
                for li in range(len(m.layers) + 1):
                    entry = self.captured.capture_piece((tokens, li), lambda li=li: self._body(b, li))
                    b.state.update(entry.output)
                    entry.graph.replay()  # real values (of the padding inputs) for the next warm-up to read
        return b

    def _piece(self, b: _Pieces, li: int) -> dict[str, torch.Tensor]:
        """Run piece li; its outputs (a captured piece's are the same tensors at every replay)."""
        if self.captured.capture:
            entry = self.captured.graphs[(b.tokens, li)]
            entry.graph.replay()
            return entry.output
        out = self._body(b, li)
        b.state.update(out)
        return out

    def _body(self, b: _Pieces, li: int) -> dict[str, torch.Tensor]:
        m, L = self.model, len(self.model.layers)
        ids, pos, slots = b.views()
        if li == 0:
            x = m.embed[ids]
            cos, sin = m.rope(pos)
            out: dict[str, torch.Tensor] = {"cos": cos, "sin": sin}
        else:
            x = m.attn_out(li - 1, b.state["x"], b.attn)
            cos, sin = b.state["cos"], b.state["sin"]
            out = {}
        if li == L:
            out["h"] = m.rms_norm(x, m.norm)
            return out
        out["x"] = x
        out["q"], out["k"], out["v"] = m.attn_in(li, x, cos, sin, self.kv, slots)
        return out
