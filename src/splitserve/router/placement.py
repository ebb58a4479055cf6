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

Other routers' streams are as the entry says. A stream that ended without the worker's last
event (cancelled here, or its worker went away) is left to the entry: the worker closes it on
its own, and a later entry says so.
"""
from __future__ import annotations

from splitserve.service.redis_state import WorkerInfo


class Placement:
    """One stream this router opened at a decode worker."""

    __slots__ = ("epoch", "open_seq", "close_seq", "ended")

    def __init__(self) -> None:
        self.epoch = ""  # the run of the worker that accepted it ("": not accepted yet)
        self.open_seq = 0
        self.close_seq = 0
        self.ended = False


class Placements:
    def __init__(self) -> None:
        self.at: dict[str, set[Placement]] = {}  # worker id -> the streams that may still correct its entry

    def place(self, worker_id: str) -> Placement:
        p = Placement()
        self.at.setdefault(worker_id, set()).add(p)
        return p

    @staticmethod
    def accepted(p: Placement, epoch: str, open_seq: int) -> None:
        p.epoch, p.open_seq = epoch, open_seq

    def ended(self, worker_id: str, p: Placement, close_seq: int = 0) -> None:
        """The stream is over; `close_seq` from its last event, 0 when that event never came."""
        p.ended, p.close_seq = True, close_seq
        if not close_seq or not p.open_seq:
            self._drop(worker_id, p)

    def load(self, w: WorkerInfo) -> int:
        """Open streams at `w` now, as far as this router can tell."""
        if not w.epoch:  # a worker that does not count its streams: its engine's counts
            return w.running + w.waiting + w.pending
        n = w.opened - w.closed
        for p in self.at.get(w.worker_id, ()):
            if p.epoch != w.epoch or p.open_seq > w.opened:
                n += not p.ended  # not in the entry: not accepted yet, by another run, or after it was written
            elif p.ended and p.close_seq > w.closed:
                n -= 1
        return max(n, 0)

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
