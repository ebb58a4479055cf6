"""Static and dynamic batching, run the way such systems really run them.

A batch is a rectangle: prompts left-padded to the longest, one contiguous KV
tensor per batch, every row computed at every step until the longest member
ends. Nobody joins a running batch. ``dynamic`` starts a batch when
``max_batch_size`` requests wait or the oldest has waited ``max_wait_ms``;
``static`` always runs ``static_batch_size`` rows, padding missing ones with
empty rows, and waits the same way for them to fill. The padding is counted in
``StepStats.padding_tokens``. These exist so that continuous batching is
measured against them, not quoted.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import torch

from splitserve.engine.cuda_graphs import GraphCaptureError, PaddedDecodeGraphs
from splitserve.engine.errors import StepFailed, in_halves
from splitserve.engine.outputs import StepStats
from splitserve.engine.sequence import Sequence, Status

_PAD = 0
log = logging.getLogger(__name__)


class PaddedBatcher:
    def __init__(self, model, config, cuda_graphs: bool = False):
        self.model = model
        self.graphs = PaddedDecodeGraphs(model) if cuda_graphs else None  # decode steps replayed on CUDA
        self.policy = config.policy
        self.rows_max = config.static_batch_size if config.policy == "static" else config.max_batch_size
        self.max_wait_s = config.max_wait_ms / 1000.0
        self.waiting: deque[Sequence] = deque()
        self.rows: list[Sequence | None] = []  # the running batch; None = padding row
        self.active: list[bool] = []
        self.pad: list[int] = []  # left padding of each row
        self.kv: torch.Tensor | None = None  # [layers, 2, B, Hkv, >= max_len, D]
        self.max_len = 0  # cache positions the batch can need: longest prompt + most new tokens
        self.cur = 0  # cache positions filled
        self.last_stats = StepStats(policy=self.policy)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def num_running(self) -> int:
        return sum(self.active)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def finish(self, seq: Sequence) -> None:
        if seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        for i, r in enumerate(self.rows):
            if r is seq:
                self.active[i] = False  # the row stays in the batch as padding
        seq.status = Status.FINISHED

    def _ready(self) -> bool:
        if not self.waiting:
            return False
        return len(self.waiting) >= self.rows_max or time.monotonic() - self.waiting[0].arrival >= self.max_wait_s

    def step(self, engine) -> list:
        self.last_stats = StepStats(policy=self.policy)
        if not self.rows:
            if not self._ready():
                if self.waiting:  # the policy's cost: wait for the batch to fill
                    time.sleep(min(0.001, self.max_wait_s))
                return []
            return self._prefill(engine)
        return self._decode(engine)

    def _prefill(self, engine) -> list:
        n = min(len(self.waiting), self.rows_max)
        seqs = [self.waiting.popleft() for _ in range(n)]
        B = self.rows_max if self.policy == "static" else n
        self.rows = seqs + [None] * (B - n)
        self.active = [True] * n + [False] * (B - n)
        lens = [len(s.token_ids) for s in seqs] + [1] * (B - n)
        L = max(lens)
        self.pad = [L - n_ for n_ in lens]
        max_new = max(s.params.max_tokens - s.num_output for s in seqs)
        shape = self.model.shape
        self.max_len = L + max_new
        if self.graphs is not None:
            self.kv = self.graphs.kv_for(B, self.max_len)
        else:
            self.kv = torch.empty(
                shape.num_layers,
                2,
                B,
                shape.num_kv_heads,
                self.max_len,
                shape.head_dim,
                dtype=self.model.dtype,
                device=self.model.device,
            )
        ids = torch.full((B, L), _PAD, dtype=torch.int64)
        for i, s in enumerate(seqs):
            ids[i, self.pad[i] :] = torch.tensor(s.token_ids)
            s.status = Status.RUNNING
        pad = torch.tensor(self.pad).view(B, 1)
        positions = (torch.arange(L).view(1, L) - pad).clamp(min=0)
        q = torch.arange(L).view(1, L, 1)
        k = torch.arange(L).view(1, 1, L)
        mask = ((k <= q) & (k >= pad.view(B, 1, 1))) | (k == q)  # a pad query sees itself (no NaN)
        self.cur = 0
        stats = self.last_stats
        stats.num_prefill_tokens = sum(lens[:n])
        return self._eager(engine, ids, positions, mask.unsqueeze(1), B * L - sum(lens[:n]))

    def _decode(self, engine) -> list:
        B = len(self.rows)
        # (a row that has ended is fed padding: its last token may be what failed its forward, _alone)
        ids = [r.token_ids[-1] if r is not None and act else _PAD for r, act in zip(self.rows, self.active)]
        positions = [max(self.cur - p, 0) for p in self.pad]
        self.last_stats.num_decode_tokens = sum(self.active)
        padding = B - sum(self.active)
        if self.graphs is not None:
            self.last_stats.graphed = True
            replay = lambda: self.graphs.run(self.kv, ids, positions, self.pad, self.cur)  # noqa: E731
            try:
                return self._forward(engine, replay, 1, padding)
            except GraphCaptureError as e:  # raised before the step changed anything: go on eagerly
                engine.drop_graphs(e)
                self.last_stats.graphed = False
        keys = torch.arange(self.cur + 1).view(1, -1)
        mask = (keys >= torch.tensor(self.pad).view(B, 1)).view(B, 1, 1, -1)  # [B, 1, 1, cur + 1]
        return self._eager(engine, torch.tensor(ids).view(B, 1), torch.tensor(positions).view(B, 1), mask, padding)

    def _eager(self, engine, ids, positions, mask, padding: int) -> list:
        dev, kv, cur = self.model.device, self.kv, self.cur
        ids, positions, mask = ids.to(dev), positions.to(dev), mask.to(dev)

        def rows(a: int, b: int) -> torch.Tensor:  # rows [a, b) alone (their KV: a view of the batch's)
            return self.model.forward_padded(ids[a:b], positions[a:b], mask[a:b], kv[:, :, a:b], cur)

        return self._forward(engine, lambda: rows(0, len(self.rows)), ids.shape[1], padding, rows)

    def _forward(self, engine, run, width: int, padding: int, rows=None) -> list:
        """run() the forward of width new positions per row, then sample and update the rows.
        rows(a, b): the forward of rows [a, b) alone, to find the rows that fail one (in_halves);
        without it (a captured decode step), a forward that raises fails the step."""
        stats = self.last_stats
        t = time.perf_counter()
        failed: list[Sequence] = []
        try:
            logits = run()
        except Exception as e:  # noqa: BLE001 - one sequence's fault must not end its batch's
            if rows is None:
                raise
            log.warning(
                "a %s batch's forward of %d rows failed (%s: %s); running it again in parts to find the "
                "rows that fail it",
                self.policy,
                len(self.rows),
                type(e).__name__,
                e,
            )
            parts = in_halves(
                0,
                len(self.rows),
                e,
                lambda a, b: (b - a, rows(a, b)),
                lambda got: got,
                lambda i, error: self._alone(engine, i, error, failed),
            )
            known = next((p for _, p in parts if p is not None), None)  # (None: every row failed; none is live)
            logits = (
                None
                if known is None
                else torch.cat([p if p is not None else known.new_zeros(n, known.shape[1]) for n, p in parts])
            )
        stats.forward_time_s = time.perf_counter() - t
        self.cur += width
        stats.num_seqs, stats.num_tokens, stats.padding_tokens = len(self.rows), len(self.rows) * width, padding
        stats.request_ids = [r.request_id for r, a in zip(self.rows, self.active) if a]
        live = [i for i, a in enumerate(self.active) if a]
        t = time.perf_counter()
        taken, unsampled = engine.sample_rows(logits[live], [self.rows[i] for i in live]) if live else ([], [])
        failed += unsampled
        stats.sample_time_s = time.perf_counter() - t
        outputs = [out for seq in failed if (out := engine._output(seq)) is not None]
        stats.finished += [seq.request_id for seq in failed]
        for seq, tok, lp in taken:
            seq.num_computed = len(seq.token_ids)
            engine.take(seq, tok, lp)
            out = engine._output(seq)
            if out is not None:
                outputs.append(out)
            if seq.status is Status.FINISHED:
                stats.finished.append(seq.request_id)
        if not any(self.active) or self.cur >= self.max_len:
            self.rows, self.active, self.pad, self.kv = [], [], [], None
        return outputs

    def _alone(self, engine, i: int, error: Exception, failed: list) -> tuple[int, None]:
        """Row i failed the forward alone (in_halves: the others' logits are what the batch would
        have given them, as a row's forward reads only its own row and KV). A sequence's row ends
        "error" (StepFailed; into `failed`) and stays, inactive: padding from now on. (1 row, no
        logits)."""
        seq = self.rows[i]
        if seq is not None and self.active[i]:
            log.error(
                "request %s fails its %s batch's forward alone: it ends with an error",
                seq.parent or seq.request_id,
                self.policy,
                exc_info=error,
            )
            engine._fail(seq, StepFailed(error))
            failed.append(seq)
        return 1, None
