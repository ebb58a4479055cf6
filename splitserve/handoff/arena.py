"""The prefill worker's shared-memory arena and the decode worker's read-only view of it.

Producer (prefill worker): ``Arena`` creates /dev/shm/<name>, hands out regions
(first fit, 64-byte aligned), and frees a region once the consumer's ``PutKV`` has
returned: the producer owns every byte, always. ``Arena.close`` unlinks the segment;
``splitserve up`` also removes any segment of its own prefix a killed worker left.
Consumer (decode worker): ``ArenaReader`` maps a segment read-only and returns a
bounds-checked memoryview of one region; it refuses names outside the configured
prefix and ranges outside the segment.
"""

from __future__ import annotations

import contextlib
import glob
import mmap
import os
import re
import secrets
import threading

SHM_DIR = "/dev/shm"
_ALIGN = 64
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class ArenaFull(Exception):
    pass


class Arena:
    def __init__(self, base: str, size: int):
        """Creates /dev/shm/<base>-<16 random hex digits>, mode 0600: only this user's processes
        may map it, and only those that read its name from the registry know it. A segment of an
        earlier incarnation of this worker (the same base), killed before it could unlink its
        own, is removed first."""
        for old in glob.glob(os.path.join(SHM_DIR, glob.escape(base) + "-" + "[0-9a-f]" * 16)):
            with contextlib.suppress(OSError):
                os.unlink(old)
        self.name = f"{base}-{secrets.token_hex(8)}"
        self.size = size
        self.path = os.path.join(SHM_DIR, self.name)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            # NOTE: MAP_POPULATE faults every page in now, not during a handoff's copy.
            self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED | _POPULATE, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._free: list[tuple[int, int]] = [(0, size)]  # (offset, length), sorted by offset
        self._used: dict[int, int] = {}
        self._lock = threading.Condition()

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._used.values())

    def alloc(self, nbytes: int, timeout: float | None = None) -> int:
        """Offset of a free region of nbytes; waits up to timeout for one (backpressure)."""
        need = -(-nbytes // _ALIGN) * _ALIGN
        if need > self.size:
            raise ArenaFull(f"{nbytes} bytes can never fit in arena {self.name} ({self.size} bytes)")
        with self._lock:
            ok = self._lock.wait_for(lambda: self._fit(need) is not None, timeout=timeout)
            if not ok:
                raise ArenaFull(f"arena {self.name} has no {nbytes} free bytes")
            i = self._fit(need)
            off, length = self._free[i]
            if length == need:
                self._free.pop(i)
            else:
                self._free[i] = (off + need, length - need)
            self._used[off] = need
            return off

    def _fit(self, need: int) -> int | None:
        return next((i for i, (_, length) in enumerate(self._free) if length >= need), None)

    def free(self, offset: int) -> None:
        with self._lock:
            length = self._used.pop(offset)
            self._free.append((offset, length))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for off, ln in self._free:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + ln)
                else:
                    merged.append((off, ln))
            self._free = merged
            self._lock.notify_all()

    def view(self, offset: int, nbytes: int) -> memoryview:
        return memoryview(self.mm)[offset : offset + nbytes]

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:  # a view is still alive; the unlink below still frees the name
            pass
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class BadHandle(ValueError):
    """The handle does not name a readable region; the message says which field."""


class ArenaReader:
    def __init__(self, prefix: str):
        self.prefix = prefix
        self._maps: dict[str, tuple[int, mmap.mmap]] = {}  # name -> (inode, map)
        self._lock = threading.Lock()

    def region(self, name: str, offset: int, length: int) -> memoryview:
        mm = self._map(name)
        with self._lock:  # drop_stale() cannot close the map before the view holds it
            if mm.closed:
                raise BadHandle(f"handle.arena {name!r} is gone (its prefill worker stopped)")
            if offset < 0 or length <= 0 or offset + length > len(mm):
                raise BadHandle(
                    f"handle.offset/length [{offset}, {offset + length}) is outside arena {name!r} ({len(mm)} bytes)"
                )
            return memoryview(mm)[offset : offset + length]

    def drop_stale(self) -> list[str]:
        """Unmap the arenas whose segment is gone or was replaced (a prefill worker that stopped
        or restarted): a mapping keeps an unlinked segment's memory alive. One still read by a
        handoff stays until the next call. Returns the names unmapped."""
        dropped = []
        with self._lock:
            for name, (ino, mm) in list(self._maps.items()):
                try:
                    st = os.stat(os.path.join(SHM_DIR, name))
                    if st.st_ino == ino and st.st_size == len(mm):
                        continue
                except FileNotFoundError:
                    pass
                try:
                    mm.close()
                except BufferError:  # a view of it is alive: a handoff is reading it
                    continue
                del self._maps[name]
                dropped.append(name)
        return dropped

    @property
    def mapped(self) -> list[str]:
        with self._lock:
            return list(self._maps)

    def warm(self, name: str) -> bool:
        """Map an arena ahead of its first handoff (mapping and populating it costs tens of ms)."""
        try:
            self._map(name)
            return True
        except BadHandle:
            return False

    def _map(self, name: str) -> mmap.mmap:
        if not name.startswith(self.prefix) or not _NAME.match(name):
            raise BadHandle(f"handle.arena {name!r} is not a splitserve arena (prefix {self.prefix!r})")
        path = os.path.join(SHM_DIR, name)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise BadHandle(f"handle.arena {name!r} does not exist on this host") from None
        with self._lock:
            cached = self._maps.get(name)
            if cached is None or cached[0] != st.st_ino or len(cached[1]) != st.st_size:
                if st.st_size == 0:
                    raise BadHandle(f"handle.arena {name!r} is empty")
                fd = os.open(path, os.O_RDONLY)
                try:
                    mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED | _POPULATE, mmap.PROT_READ)
                finally:
                    os.close(fd)
                self._maps[name] = (st.st_ino, mm)
                cached = self._maps[name]
        return cached[1]

    def close(self) -> None:
        with self._lock:
            for _, mm in self._maps.values():
                try:
                    mm.close()
                except BufferError:
                    pass
            self._maps.clear()
