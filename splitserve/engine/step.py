"""The engine's step: schedule, run the forward over the scheduled sequences (a ragged batch,
or the padded policies' rectangle), sample, and advance each sequence; a step that fails is
retried in halves so that only the sequences at fault end."""

from __future__ import annotations

import logging
import time

import torch

from splitserve.engine.attention import AttnSeq, RaggedBatch, chunk_mask
from splitserve.engine.cuda_graphs import GraphCaptureError
from splitserve.engine.errors import (
    StepFailed,
    in_halves,
)
from splitserve.engine.outputs import (
    RequestOutput,
    StepStats,
)
from splitserve.engine.sampling import (
    sample_with_logprobs,
    token_logprobs,
)
from splitserve.engine.scheduler import SchedulerOutput
from splitserve.engine.sequence import Sequence, Status
from splitserve.engine.tokens import Before

log = logging.getLogger(__name__)

_PROMPT_ROWS_AT_ONCE = 256  # logits made at once: ~50 MB of float32 rows for SmolLM2's 49152-token vocabulary


class Stepping:
    """LLMEngine's step (schedule -> execute -> update). State: the engine's."""

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        if self.core_share is not None:
            self.core_share.tick()
        if self.padded is not None:
            outputs = self.padded.step(self)
            self.last_stats = self.padded.last_stats
        else:
            sched = self.scheduler.schedule()
            stats = StepStats(
                policy="continuous",
                num_preempted=len(sched.preempted),
                preempted=[s.parent or s.request_id for s in sched.preempted],
                num_cached_tokens=sched.num_cached_tokens,
                num_queried_tokens=sched.num_queried_tokens,
            )
            outputs = self._run(sched, stats) if sched.scheduled else []
            self.last_stats = stats
        s = self.last_stats
        s.num_running, s.num_waiting = self.num_running, self.num_waiting
        s.kv_blocks_used, s.kv_blocks_free = self.cache.pool.num_used, self.cache.pool.num_free
        s.step_time_s = time.perf_counter() - t0
        if self.core_share is not None and not self.has_unfinished():
            self.core_share.idle()
        return outputs

    def _run(self, sched: SchedulerOutput, stats: StepStats) -> list[RequestOutput]:
        before = Before([s.seq for s in sched.scheduled if s.samples])
        try:
            computed = self._compute(sched, stats)
        except Exception as e:  # noqa: BLE001 - one sequence's fault must not end its batch's
            if len(sched.scheduled) > 1:
                log.warning(
                    "an engine step of %d sequences failed (%s: %s); running it again in parts to find "
                    "the sequences that fail it",
                    len(sched.scheduled),
                    type(e).__name__,
                    e,
                )
            return self._isolate(sched.scheduled, stats, before, e)
        return self._advance(sched, *computed, stats)

    def _isolate(self, scheduled: list, stats: StepStats, before: Before, error: Exception) -> list[RequestOutput]:
        """The step of `scheduled` raised `error`: it is run again in halves (in_halves), each run
        undoing first what a failed one did (before.restore), down to the sequences that raise
        alone. Those end "error" (StepFailed); the others go on as if nothing had failed (the KV a
        failed run wrote is written again by the next)."""

        def run(a: int, b: int) -> tuple:
            before.restore([s.seq for s in scheduled[a:b]])
            sub = SchedulerOutput(scheduled[a:b])
            return sub, self._compute(sub, stats)

        def alone(i: int, e: Exception) -> list[RequestOutput]:
            seq = scheduled[i].seq
            before.restore([seq])
            log.error(
                "request %s fails an engine step alone: it ends with an error", seq.parent or seq.request_id, exc_info=e
            )
            self._fail(seq, StepFailed(e))
            out = self._output(seq)
            return [out] if out is not None else []

        parts = in_halves(0, len(scheduled), error, run, lambda got: self._advance(got[0], *got[1], stats), alone)
        return [out for outs in parts for out in outs]

    def _compute(self, sched: SchedulerOutput, stats: StepStats) -> tuple[list, list[int], list]:
        """The forward and sampling of a step: (the scheduled that sample, their tokens, their log
        probabilities). Changes nothing but the KV of the positions computed, the generators of the
        rows that sample (Before) and the prompt log probabilities of the rows that want them."""
        prompt_rows = _prompt_rows(sched)
        whole = not prompt_rows and self.graphs is not None and self.graphs.covers(sched.scheduled)
        batch = None if whole else self._build_batch(sched, prompt_rows)
        stats.graphed = whole or (self.pieces is not None and self.pieces.covers(batch.num_tokens))
        events = _device_events(self.device)
        t = time.perf_counter()
        try:
            if whole:
                logits = self.graphs.run([s.seq for s in sched.scheduled])
            elif stats.graphed:
                logits = self.pieces.run(batch)
        except GraphCaptureError as e:  # captures write nothing the step needs: run it eagerly instead
            self.drop_graphs(e)
            stats.graphed = False
            batch = batch or self._build_batch(sched, prompt_rows)
        if not stats.graphed:
            logits = self.model.forward(batch, self.cache.kv)
        if events:
            events[1].record()
        stats.forward_time_s += time.perf_counter() - t
        samplers = [s for s in sched.scheduled if s.samples]
        t = time.perf_counter()
        if prompt_rows:  # hidden states: the samplers' rows, then theirs
            _add_prompt_logprobs(prompt_rows, logits[len(samplers) :], self.model.lm_head_of)
            logits = self.model.lm_head_of(logits[: len(samplers)])
        tokens, logprobs = sample_with_logprobs(logits, [self._sample_row(s.seq) for s in samplers])
        stats.sample_time_s += time.perf_counter() - t
        if events:  # done when sampling read the logits back; a step that sampled nothing waits here
            events[1].synchronize()
            stats.device_time_s += events[0].elapsed_time(events[1]) / 1000
        return samplers, tokens, logprobs

    def _advance(
        self, sched: SchedulerOutput, samplers: list, tokens: list[int], logprobs: list, stats: StepStats
    ) -> list[RequestOutput]:
        """After _compute: the positions computed count, and each sampled token is taken. A
        sequence whose token fails to be taken ends "error" (StepFailed); the others go on."""
        stats.num_seqs += len(sched.scheduled)
        stats.request_ids += [s.seq.request_id for s in sched.scheduled]
        stats.num_tokens += sched.num_tokens
        for s in sched.scheduled:
            if s.seq.num_computed == len(s.seq.token_ids) - 1 and s.num_tokens == 1:
                stats.num_decode_tokens += 1
            else:
                stats.num_prefill_tokens += s.num_tokens
            s.seq.num_computed += s.num_tokens
            self.scheduler.cache_computed(s.seq)
        outputs = []
        for s, tok, lp in zip(samplers, tokens, logprobs):
            self.take(s.seq, tok, lp)
            out = self._output(s.seq)
            if out is not None:
                outputs.append(out)
            if s.seq.status is Status.FINISHED:
                stats.finished.append(s.seq.request_id)
        return outputs

    def _build_batch(
        self, sched: SchedulerOutput, prompt_rows: list[tuple[Sequence, int, int, int]] = ()
    ) -> RaggedBatch:
        """prompt_rows (_prompt_rows): rows whose logits are wanted after the samplers'."""
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slot_mapping: list[torch.Tensor] = []
        ctx_slots: list[torch.Tensor] = []
        ctx_info: list[tuple[int, int, int, int]] = []
        dec_rows: list[int] = []  # torch backend: single-token decodes, batched
        dec_slots: list[torch.Tensor] = []
        logits_rows: list[int] = []
        seqs: list[AttnSeq] = []
        kernel = self.model.attn_kernel is not None
        fused = self.model.fused is not None  # fused kernels: decodes read through their block tables
        dec_tables: list[list[int]] = []
        dev = self.device
        ctx_off = 0
        for s in sched.scheduled:
            seq, n = s.seq, s.num_tokens
            start, end = seq.num_computed, seq.num_computed + n
            q_start = len(ids)
            ids.extend(seq.token_ids[start:end])
            positions.append(torch.arange(start, end))
            if start == 0 and not self.config.batch_invariant:  # (invariant: through the kernel, as any chunk)
                slot_mapping.append(self.cache.slots(seq.block_table, 0, end))
                seqs.append(AttnSeq(q_start, n, end, -1, None))
            else:
                slots = self.cache.slots(seq.block_table, 0, end)
                slot_mapping.append(slots[start:])
                if n == 1 and not kernel:
                    dec_rows.append(q_start)
                    if fused:
                        dec_tables.append(seq.block_table)
                    else:
                        dec_slots.append(slots)
                else:
                    ctx_slots.append(slots)
                    mask = None if kernel else chunk_mask(n, end).to(dev)
                    seqs.append(AttnSeq(q_start, n, end, ctx_off, mask))
                    ctx_info.append((q_start, n, end, ctx_off))
                    ctx_off += end
            if s.samples:
                logits_rows.append(len(ids) - 1)
        for _, _, n, row in prompt_rows:
            logits_rows.extend(range(row, row + n))
        batch = RaggedBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64).to(dev),
            positions=torch.cat(positions).to(dev),
            slot_mapping=torch.cat(slot_mapping).to(dev),
            logits_rows=torch.tensor(logits_rows, dtype=torch.int64).to(dev),
            seqs=seqs,
            ctx_slots=torch.cat(ctx_slots).to(dev) if ctx_slots else None,
            ctx_info=torch.tensor(ctx_info, dtype=torch.int64) if ctx_info else None,
            hidden_out=bool(prompt_rows),
        )
        if dec_rows:
            batch.dec_rows = torch.tensor(dec_rows, dtype=torch.int64).to(dev)
        if dec_tables:
            blocks = max(len(t) for t in dec_tables)
            batch.dec_tables = torch.tensor([t + [0] * (blocks - len(t)) for t in dec_tables], dtype=torch.int64).to(
                dev
            )
            batch.dec_lens = batch.positions.index_select(0, batch.dec_rows) + 1
            batch.block_size = self.cache.block_size
        elif dec_rows:
            lens = torch.tensor([len(t) for t in dec_slots])
            padded = torch.nn.utils.rnn.pad_sequence(dec_slots, batch_first=True)  # [S, longest], 0-padded
            batch.dec_slots = padded.to(dev)
            batch.dec_mask = (torch.arange(padded.shape[1]) < lens.unsqueeze(1)).view(len(dec_rows), 1, 1, -1).to(dev)
        return batch


def _device_events(device: torch.device) -> tuple | None:
    """On CUDA, a pair of timing events, the first recorded now on the current stream (the
    forward's; the second is recorded after it): StepStats.device_time_s."""
    if device.type != "cuda":
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    return start, end


def _prompt_rows(sched: SchedulerOutput) -> list[tuple[Sequence, int, int, int]]:
    """(sequence, first position, count, its batch row) of the prompt positions computed this step
    whose logits give prompt log probabilities the sequence asked for and lacks: position p's give
    prompt token p + 1's. The last prompt position's are the first token's (sampled as usual)."""
    rows = []
    row = 0
    for s in sched.scheduled:
        seq = s.seq
        if seq.wants_prompt_logprobs:
            # A recompute (after preemption) starts below what it has; the prefix cache never
            # skips past it (Sequence.max_cached), so the positions it lacks are all here.
            a = max(seq.num_computed, len(seq.prompt_logprobs))
            b = min(seq.num_computed + s.num_tokens, seq.prompt_len - 1)
            if b > a:
                rows.append((seq, a, b - a, row + a - seq.num_computed))
        row += s.num_tokens
    return rows


def _add_prompt_logprobs(rows: list[tuple[Sequence, int, int, int]], hidden: torch.Tensor, lm_head) -> None:
    """hidden: the normed final hidden states of rows' positions, in order (lm_head makes their
    logits, a slice at a time: a chunk's 2048 rows at once would be 400 MB). Each sequence's
    prompt log probabilities grow by its positions' next prompt tokens (and the k most likely,
    k its request's)."""
    targets: list[tuple[Sequence, int]] = []
    for seq, first, n, _ in rows:
        if first != len(seq.prompt_logprobs):
            raise RuntimeError(
                f"{seq.request_id}: prompt log probabilities from {first}, but it holds {len(seq.prompt_logprobs)}"
            )
        targets.extend((seq, p + 1) for p in range(first, first + n))
    for i in range(0, len(targets), _PROMPT_ROWS_AT_ONCE):
        part = targets[i : i + _PROMPT_ROWS_AT_ONCE]
        dist = torch.log_softmax(lm_head(hidden[i : i + len(part)]).float(), dim=-1)
        found = token_logprobs(
            dist, [seq.token_ids[at] for seq, at in part], [seq.params.prompt_logprobs for seq, _ in part]
        )
        for (seq, _), lp in zip(part, found):
            seq.prompt_logprobs.append(lp)
