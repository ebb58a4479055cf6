"""A decode worker's load as one router sees it: the worker's registry entry, corrected by the
streams this router has seen open and close there since that entry was written.

An entry is written once a heartbeat, so it can be a heartbeat old when it is read. Right after a
busy spell it still shows the streams that have just ended, and a burst placed by it alone piles
onto the worker that was idle a heartbeat ago. The entry carries the worker's stream counts
(`opened`, `closed`, and the `epoch` they count in) and each stream's events carry its numbers
in those counts, so the router knows exactly which of its own streams the entry counts:

- a stream the worker has not accepted yet, or accepted after the entry was written
  (`open_seq > opened`), is open and not in the entry: +1;
- a stream in the entry (`open_seq <= opened`) that closed after it was written
  (`close_seq > closed`): -1.

The same streams correct the entry's free KV (`free_kv_tokens`), which the router checks
against a request's prompt + max_tokens: a stream not in the entry takes its own prompt +
max_tokens off it; a stream that closed after the entry was written gives back its prompt and
the tokens it generated (what it held when it closed; block rounding aside). That is an
estimate, and only a preference: a worker short of KV is picked last, never refused.

Other routers' streams are as the entry says. A stream that ended without the worker's last
event (cancelled here, or its worker went away) is left to the entry: the worker closes it on
its own, and a later entry says so.
"""

from __future__ import annotations

from splitserve.service.redis_state import WorkerInfo


class Placement:
    """One stream this router opened at a decode worker."""

    __slots__ = ("epoch", "open_seq", "close_seq", "ended", "tokens")

    def __init__(self, tokens: int = 0) -> None:
        self.epoch = ""  # the run of the worker that accepted it ("": not accepted yet)
        self.open_seq = 0
        self.close_seq = 0
        self.ended = False
        self.tokens = tokens  # KV it may take: prompt + max_tokens; once ended, prompt + generated


class Placements:
    def __init__(self) -> None:
        self.at: dict[str, set[Placement]] = {}  # worker id -> the streams that may still correct its entry

    def place(self, worker_id: str, tokens: int = 0) -> Placement:
        p = Placement(tokens)
        self.at.setdefault(worker_id, set()).add(p)
        return p

    @staticmethod
    def accepted(p: Placement, epoch: str, open_seq: int) -> None:
        p.epoch, p.open_seq = epoch, open_seq

    def ended(self, worker_id: str, p: Placement, close_seq: int = 0, held: int | None = None) -> None:
        """The stream is over; `close_seq` from its last event, 0 when that event never came;
        `held`: the tokens it held at the end (prompt + generated)."""
        p.ended, p.close_seq = True, close_seq
        if held is not None:
            p.tokens = held
        if not close_seq or not p.open_seq:
            self._drop(worker_id, p)

    def load(self, w: WorkerInfo) -> int:
        """Open streams at `w` now, as far as this router can tell."""
        if not w.epoch:  # a worker that does not count its streams: its engine's counts
            return w.running + w.waiting + w.pending
        opened, closed = self._since(w)
        return max(w.opened - w.closed + len(opened) - len(closed), 0)

    def free_kv(self, w: WorkerInfo) -> int:
        """Free KV tokens at `w` now, as far as this router can tell (an estimate)."""
        if not w.epoch:
            return w.free_kv_tokens
        opened, closed = self._since(w)
        return w.free_kv_tokens - sum(p.tokens for p in opened) + sum(p.tokens for p in closed)

    def _since(self, w: WorkerInfo) -> tuple[list[Placement], list[Placement]]:
        """This router's streams at `w` that opened and are not in its entry, and those in its
        entry that have closed since it was written."""
        opened, closed = [], []
        for p in self.at.get(w.worker_id, ()):
            if p.epoch != w.epoch or p.open_seq > w.opened:
                if not p.ended:  # not in the entry: not accepted yet, by another run, or after it was written
                    opened.append(p)
            elif p.ended and p.close_seq > w.closed:
                closed.append(p)
        return opened, closed

    def prune(self, workers: list[WorkerInfo]) -> None:
        """Forget the ended streams that no entry of `workers` (a fresh registry read) counts."""
        entries = {w.worker_id: w for w in workers}
        for wid, ps in list(self.at.items()):
            w = entries.get(wid)
            for p in [p for p in ps if p.ended]:
                if w is None or p.epoch != w.epoch or p.close_seq <= w.closed:
                    ps.discard(p)
            if not ps:
                del self.at[wid]

    def _drop(self, worker_id: str, p: Placement) -> None:
        ps = self.at.get(worker_id)
        if ps is not None:
            ps.discard(p)
            if not ps:
                del self.at[worker_id]
