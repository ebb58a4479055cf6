"""Continuous (iteration-level) batching over the paged KV cache.

The scheduler decides, the model executes: ``schedule()`` returns a plain
``SchedulerOutput`` (which sequences, how many tokens each, who was preempted).
Every sequence is "tokens computed so far" against "tokens known": a decode is
one pending token, a prefill is many, a long prefill is cut into chunks by the
token budget. Running sequences go first (decode never waits behind a long
prompt); waiting ones join while budget, sequence slots and KV blocks last.
When blocks run out, the newest running sequence is preempted (blocks freed,
recomputed later); the oldest always makes progress, so nothing deadlocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from splitserve.engine.kv_cache import BlockPool
from splitserve.engine.sequence import Sequence, Status


@dataclass
class Scheduled:
    seq: Sequence
    num_tokens: int  # tokens computed for it this step, starting at seq.num_computed

    @property
    def samples(self) -> bool:
        return self.seq.num_computed + self.num_tokens == len(self.seq.token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[Scheduled] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class ContinuousScheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int):
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        """Queue seq behind every waiting one of its priority or a more urgent (lower) one."""
        if not self.waiting or self.waiting[-1].priority <= seq.priority:
            self.waiting.append(seq)
            return
        i = next(i for i, w in enumerate(self.waiting) if w.priority > seq.priority)
        self.waiting.insert(i, seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_pending, budget)
            if not self._grow(seq, n, out):
                break  # seq preempted itself: it was the newest
            out.scheduled.append(Scheduled(seq, n))
            budget -= n
            i += 1
        if out.preempted:
            return out  # memory is tight: let the running ones drain first
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_pending, budget)
            need = self.pool.blocks_for(seq.num_computed + n) - len(seq.block_table)
            if not self.pool.can_allocate(need):
                break
            self.waiting.popleft()
            seq.block_table.extend(self.pool.allocate(need))
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.scheduled.append(Scheduled(seq, n))
            budget -= n
        return out

    def _grow(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Give seq blocks for n more tokens, preempting the newest others; False if seq itself went."""
        need = self.pool.blocks_for(seq.num_computed + n) - len(seq.block_table)
        while not self.pool.can_allocate(need):
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        seq.block_table.extend(self.pool.allocate(need))
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.free(seq.block_table)
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or cancelled sequence and free its blocks at once."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.pool.free(seq.block_table)
        seq.status = Status.FINISHED
