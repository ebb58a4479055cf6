"""Continuous (iteration-level) batching over the paged KV cache.

The scheduler decides, the model executes: ``schedule()`` returns a plain
``SchedulerOutput`` (which sequences, how many tokens each, who was preempted).
Every sequence is "tokens computed so far" against "tokens known": a decode is
one pending token, a prefill is many, a long prefill is cut into chunks by the
token budget. Running sequences go first (decode never waits behind a long
prompt); waiting ones join while budget, sequence slots and KV blocks last.

Priority (lower is more urgent) orders both queues: running sequences are kept
sorted by (priority, arrival), and waiting ones are served by priority, then
arrival. A paused sequence (its reader is behind: LLMEngine.pause_request) keeps
its place and its KV but computes nothing; it is the first preempted when blocks
or sequence slots run short. Otherwise, when blocks run out, the last running
sequence in that order is preempted (blocks freed, recomputed later): the least urgent, newest first, so
the most urgent, oldest one always makes progress and nothing deadlocks. A
waiting sequence that finds no blocks or no sequence slot preempts running ones
of a strictly less urgent priority to get in; it never preempts its own class.
Some waiting sequences hold blocks (an import, a request's later samples): before
a running one preempts itself, those behind it in line give theirs up, and so do
they, last in line first, when nothing else could run.

With the prefix cache (kv_cache.BlockPool), a waiting sequence that holds no blocks
starts with the cached blocks of its longest cached prefix and computes the rest; a
preempted one often finds its own first blocks there. Blocks fill the cache as their
KV is computed (``cache_computed``).
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
    num_cached_tokens: int = 0  # tokens of the sequences admitted found in the prefix cache, recomputes included
    num_queried_tokens: int = 0  # tokens of the sequences admitted that were looked up in the prefix cache

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
        self._preempted: list[Sequence] = []  # by make_room since the last step: reported with it

    def add(self, seq: Sequence) -> None:
        """Queue seq behind every waiting one of its priority or a more urgent (lower) one."""
        if not self.waiting or self.waiting[-1].priority <= seq.priority:
            self.waiting.append(seq)
            return
        i = next(i for i, w in enumerate(self.waiting) if w.priority > seq.priority)
        self.waiting.insert(i, seq)

    def _requeue(self, seq: Sequence) -> None:
        """A preempted seq goes back ahead of every waiting one of its priority (it came first)."""
        i = next((i for i, w in enumerate(self.waiting) if w.priority >= seq.priority), len(self.waiting))
        self.waiting.insert(i, seq)

    def make_room(self, blocks: int, priority: int) -> bool:
        """Free blocks for a sequence of this priority arriving with its KV (an import), preempting
        running ones of a strictly less urgent priority, and taking the blocks of waiting ones
        of such a priority, last in line first. True if they fit now; when they cannot, however
        many go, none goes.

        Blocks that waiting sequences of the same or a more urgent priority need to recompute
        (preempted ones) are not the import's to take: otherwise a stream of imports could
        keep a preempted sequence out for good."""
        reserved = sum(
            self._blocks_needed(w, w.num_pending) for w in self.waiting if w.priority <= priority and not w.block_table
        )

        def fits() -> bool:
            return self.pool.num_free - reserved >= blocks

        if fits():
            return True
        victims = sorted(
            (s for s in (*self.running, *self.waiting) if s.priority > priority and s.block_table),
            key=lambda s: (s.priority, s.order),
            reverse=True,
        )
        # (preempting them all for blocks that still would not do only throws their work away:
        # two running ones preempted in turn for an import that never fit never finished)
        if self.pool.num_free + self.pool.freed_by([s.block_table for s in victims]) - reserved < blocks:
            return False
        for victim in victims:
            if fits():
                break
            if victim.status is Status.RUNNING:
                self._preempt(victim)
            else:
                self._drop_kv(victim)
            self._preempted.append(victim)
        return fits()

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(preempted=self._preempted)
        self._preempted = []
        before = len(out.preempted)
        budget = self.max_num_batched_tokens
        self._sort_running()  # the victims are at the end
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.paused:  # its reader is behind: it keeps its place and its KV, and computes nothing
                i += 1
                continue
            n = min(seq.num_pending, budget)
            if not self._grow(seq, n, out):
                break  # seq preempted itself: it was the last in line
            out.scheduled.append(Scheduled(seq, n))
            budget -= n
            i += 1
        if len(out.preempted) > before:
            return out  # memory is tight: let the running ones drain first
        self._admit(out, budget)
        # Nothing could run: the blocks are held by waiting sequences that each need one more (an
        # import whose KV ends at a block's end, a request's later sample that computes the rest
        # of its prompt), and they would wait for one another forever. They give theirs up, last
        # in line first, until one can run.
        while not out.scheduled and (holder := self._holder_behind()) is not None:
            self._drop_kv(holder)
            out.preempted.append(holder)
            self._admit(out, budget)
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        """Let waiting sequences join, in line, while the budget, sequence slots and blocks last."""
        blocked = False  # the first in line found no room: only sequences holding their KV pass it
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs and not self._can_preempt_for(seq.priority):
                break
            if any(seq is v for v in out.preempted) or blocked and not seq.block_table or seq.paused:
                continue  # made room this step / would take blocks the first in line waits for / paused
            looked = not seq.block_table and self.pool.prefix_caching  # its tokens are queried in the cache
            took = not seq.block_table and self._take_cached(seq, out)
            need = self._blocks_needed(seq, min(seq.num_pending, budget))
            while len(self.running) >= self.max_num_seqs or not self.pool.can_allocate(need):
                if (paused := self._paused_victim()) is not None:  # a paused one makes room first
                    self._preempt(paused)
                    out.preempted.append(paused)
                elif self._can_preempt_for(seq.priority):
                    budget += self._unschedule(self.running[-1], out)  # a less urgent one makes room
                else:
                    break
                need = self._blocks_needed(seq, min(seq.num_pending, budget))
            if len(self.running) >= self.max_num_seqs:
                if took:
                    self._drop_cached(seq, out)
                break
            if not self.pool.can_allocate(need):
                if took:
                    self._drop_cached(seq, out)
                # An imported sequence waiting behind this one already holds its KV: letting it
                # run (it needs a block at most) is how blocks come back; holding it back can
                # leave nothing running and the first in line waiting forever.
                blocked = True
                continue
            n = min(seq.num_pending, budget)
            self.waiting.remove(seq)
            seq.block_table.extend(self.pool.allocate(need))
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.scheduled.append(Scheduled(seq, n))
            if looked:
                out.num_queried_tokens += len(seq.token_ids)
            budget -= n

    def _take_cached(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Give seq (holding no blocks) the cached blocks of its longest cached prefix: their KV
        counts as computed. At least its last token is left to compute (its logits give the
        next token), and the prompt tokens whose log probabilities it asked for and lacks
        (Sequence.max_cached). True if it took any."""
        blocks, entry = self.pool.lookup(seq.token_ids, seq.max_cached, seq.cache_root)
        if not blocks:
            return False
        self.pool.take(blocks)
        seq.block_table.extend(blocks)
        seq.num_computed = len(blocks) * self.pool.block_size
        seq.num_cache_blocks, seq.cache_entry = len(blocks), entry
        out.num_cached_tokens += seq.num_computed
        if seq.num_preemptions == 0:  # a recompute's hits are not the request's prompt tokens served
            seq.num_cached_tokens = min(seq.num_computed, seq.prompt_len)
        return True

    def _drop_cached(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Undo _take_cached for a seq that could not be admitted after all."""
        out.num_cached_tokens -= seq.num_computed
        seq.num_cached_tokens = 0
        self.pool.free(seq.block_table)
        seq.num_computed = seq.num_cache_blocks = 0
        seq.cache_entry = seq.cache_root

    def cache_computed(self, seq: Sequence) -> None:
        """File seq's blocks that have filled with computed KV since the last call in the
        prefix cache (after each step that computed for it, and after an import)."""
        full = seq.num_computed // self.pool.block_size
        if full > seq.num_cache_blocks:
            seq.cache_entry = self.pool.register(
                seq.token_ids, seq.block_table, seq.num_cache_blocks, full, seq.cache_entry
            )
            seq.num_cache_blocks = full

    def _sort_running(self) -> None:
        """Most urgent, oldest first: the last in line is the one to preempt."""
        self.running.sort(key=lambda s: (s.priority, s.order))

    def _can_preempt_for(self, priority: int) -> bool:
        """Whether the last running sequence in line is less urgent than this priority."""
        return bool(self.running) and self.running[-1].priority > priority

    def _blocks_needed(self, seq: Sequence, n: int) -> int:
        """Blocks seq must still get to hold the KV of n more tokens."""
        return self.pool.blocks_for(seq.num_computed + n) - len(seq.block_table)

    def _grow(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Give seq blocks for n more tokens, preempting the last in line; False if seq itself went.

        Before seq preempts itself, the waiting sequences behind it in line that hold blocks give
        them up, last in line first (imports, and a request's later samples, wait holding theirs):
        otherwise, with blocks they hold, seq could never get all it needs, take a chunk of its
        prompt at every step and preempt itself at the next, and they could never get in."""
        need = self._blocks_needed(seq, n)
        while not self.pool.can_allocate(need):
            victim = self._paused_victim() or self.running[-1]  # a paused one goes first
            if victim is seq and (holder := self._holder_behind(seq)) is not None:
                victim = holder
                self._drop_kv(holder)
            else:
                self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        seq.block_table.extend(self.pool.allocate(need))
        return True

    def _paused_victim(self) -> Sequence | None:
        """The last in line of the running sequences that are paused (their readers are behind), or
        None: when blocks or sequence slots run short they go first, whatever their priority, since
        they would hold them for as long as their readers read nothing."""
        return next((s for s in reversed(self.running) if s.paused), None)

    def _holder_behind(self, seq: Sequence | None = None) -> Sequence | None:
        """The last in line of the waiting sequences that hold blocks (behind seq, if given), or None."""
        key = (seq.priority, seq.order) if seq is not None else None
        return max(
            (w for w in self.waiting if w.block_table and (key is None or (w.priority, w.order) > key)),
            key=lambda w: (w.priority, w.order),
            default=None,
        )

    def _unschedule(self, seq: Sequence, out: SchedulerOutput) -> int:
        """Preempt a running seq that this step already scheduled; returns the budget it held."""
        held = next((s.num_tokens for s in out.scheduled if s.seq is seq), 0)
        out.scheduled = [s for s in out.scheduled if s.seq is not seq]
        self._preempt(seq)
        out.preempted.append(seq)
        return held

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._drop_kv(seq)
        seq.status = Status.WAITING
        self._requeue(seq)

    def _drop_kv(self, seq: Sequence) -> None:
        """seq's blocks go back; it computes its KV again when it runs (a preemption)."""
        self.pool.free(seq.block_table)
        seq.num_computed = seq.num_cache_blocks = 0
        seq.cache_entry = seq.cache_root
        seq.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or cancelled sequence and free its blocks at once."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.pool.free(seq.block_table)
        seq.status = Status.FINISHED
