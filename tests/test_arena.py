"""The decode worker's view of prefill arenas (handoff/arena.py), on real shared memory."""

from __future__ import annotations

import os
import re
import stat
import uuid

import pytest

from splitserve.handoff.arena import SHM_DIR, Arena, ArenaReader, BadHandle


@pytest.fixture
def prefix():
    p = f"splitserve-test-{uuid.uuid4().hex[:8]}-"
    yield p
    for name in os.listdir(SHM_DIR):
        if name.startswith(p):
            os.unlink(os.path.join(SHM_DIR, name))


def test_an_arena_is_private_and_named_by_chance(prefix):
    """Mode 0600 and a random suffix: another user cannot map it, and only a process that reads
    its name from the registry knows it. A worker restarted under the same id (killed, its
    segment left behind) removes its predecessor's segment and makes one under a new name."""
    base = f"{prefix}prefill-0"
    first = Arena(base, 1 << 16)
    assert re.fullmatch(re.escape(base) + "-[0-9a-f]{16}", first.name), first.name
    assert stat.S_IMODE(os.stat(first.path).st_mode) == 0o600
    again = Arena(base, 1 << 16)  # the first one never closed: killed
    try:
        assert again.name != first.name and not os.path.exists(first.path) and os.path.exists(again.path)
    finally:
        again.close()
        first.mm.close()


def test_arenas_that_go_or_are_replaced_are_unmapped(prefix):
    arena = Arena(f"{prefix}prefill-1", 1 << 20)
    name = arena.name
    reader = ArenaReader(prefix)
    arena.mm[64:68] = b"abcd"
    view = reader.region(name, 64, 4)
    assert bytes(view) == b"abcd" and reader.mapped == [name]
    assert reader.drop_stale() == []  # still there: kept

    arena.close()  # its prefill worker stopped: the segment is unlinked
    assert reader.drop_stale() == [] and reader.mapped == [name]  # a handoff still reads it
    view.release()
    assert reader.drop_stale() == [name] and reader.mapped == []  # its memory can now go
    with pytest.raises(BadHandle, match="does not exist"):
        reader.region(name, 64, 4)

    # a segment replaced under the same name (by hand: a worker's own names are new at each start)
    fd = os.open(arena.path, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, 1 << 20)
    try:
        with reader.region(name, 0, 2) as v:
            assert len(v) == 2
        assert reader.drop_stale() == []
        os.unlink(arena.path)
        os.ftruncate(fd2 := os.open(arena.path, os.O_CREAT | os.O_RDWR, 0o600), 2 << 20)
        os.close(fd2)
        assert reader.drop_stale() == [name]
        assert len(reader.region(name, (2 << 20) - 8, 8)) == 8  # the new one is mapped on use
    finally:
        os.close(fd)
        reader.close()
