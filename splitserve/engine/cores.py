"""CoreShare: engines in processes on one host divide its cores among those that are busy.

A local stack runs a prefill and a decode worker on the same cores. With every
engine using every core, the two OpenMP teams oversubscribe them: a thread waits at a
barrier for a peer the kernel has descheduled to run the other process. Measured on 2
cores, a prefill loop and a 32-sequence decode loop side by side: with 2 threads each,
320 prompt tok/s and 149 decode tok/s; with 1 thread each, 324 and 188. A fixed split
loses instead when one role has nothing to do and its core sits idle, so the split
follows the work: an engine runs ``base // (1 + other busy engines)`` threads (at least 1),
and all of them when it is alone. Loading counts as computing: two workers that load
side by side, each on every core, were ready after 11.3 s on 2 cores (11.7 CPU-s each),
against 6 s with one thread each.

The board is a small file every engine of the host opens. Each engine holds one slot
(an open-file-description lock on the slot's bytes, which the kernel drops when the
process dies) and stamps it with the monotonic clock while it computes: while it
loads, at every step and between layers, at most every ``CHECK_S``; 0 when it goes
idle. Another engine counts a slot as busy while its stamp is younger than ``FRESH_S``,
so the stamp of an engine that died mid-forward stops counting on its own.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import struct
import time
from collections.abc import Callable

SLOTS = 64
_SLOT = struct.Struct("d")
SIZE = SLOTS * _SLOT.size
CHECK_S = 0.05  # between layers, look at the board at most this often
FRESH_S = 2.0  # a stamp older than this is an engine that stopped computing (or died)
_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)  # Linux value; per open file, not per process
_FLOCK = struct.Struct("hhqqi4x")  # struct flock on Linux x86-64 / aarch64: type, whence, start, len, pid


class CoreShare:
    def __init__(self, path: str, base_threads: int, apply: Callable[[int], None]):
        self.base = max(1, base_threads)
        self.apply = apply
        self.threads = self.base
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise ValueError(f"core_share {path!r}: {e.strerror}") from None
        try:
            if os.fstat(fd).st_size < SIZE:
                os.ftruncate(fd, SIZE)
            self.slot = _claim(fd)
            self.mm = mmap.mmap(fd, SIZE)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd  # the slot's lock lives as long as this descriptor
        self._offset = self.slot * _SLOT.size
        self._checked = 0.0
        _SLOT.pack_into(self.mm, self._offset, 0.0)

    def tick(self, force: bool = False) -> None:
        """Mark this engine busy and fit its threads to the engines busy beside it."""
        now = time.monotonic()
        if not force and now - self._checked < CHECK_S:
            return
        self._checked = now
        _SLOT.pack_into(self.mm, self._offset, now)
        n = max(1, self.base // self.busy_engines(now))  # this engine's own stamp counts: at least 1
        if n != self.threads:
            self.threads = n
            self.apply(n)

    def idle(self) -> None:
        """Nothing to compute: the others may take this engine's cores."""
        if self._checked:
            _SLOT.pack_into(self.mm, self._offset, 0.0)
            self._checked = 0.0

    def busy_engines(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        return sum(1 for (t,) in _SLOT.iter_unpack(self.mm) if now - t < FRESH_S)

    def close(self) -> None:
        if self._fd < 0:
            return
        _SLOT.pack_into(self.mm, self._offset, 0.0)
        self.mm.close()
        os.close(self._fd)
        self._fd = -1


def _claim(fd: int) -> int:
    for slot in range(SLOTS):
        lock = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, slot * _SLOT.size, _SLOT.size, 0)
        try:
            fcntl.fcntl(fd, _OFD_SETLK, lock)
            return slot
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):  # not "held by another engine"
                raise ValueError(
                    f"core share board: cannot lock a slot ({e.strerror}); "
                    f"put the board on a local filesystem or turn core sharing off"
                ) from None
    raise ValueError(f"core share board: all {SLOTS} slots are held")
