"""The decode worker's view of prefill arenas (handoff/arena.py), on real shared memory."""

from __future__ import annotations

import os
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


def test_arenas_that_go_or_are_replaced_are_unmapped(prefix):
    name = f"{prefix}prefill-1"
    arena = Arena(name, 1 << 20)
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

    again = Arena(name, 1 << 20)  # restarted under the same name: a new segment
    try:
        again.mm[0:2] = b"hi"
        with reader.region(name, 0, 2) as v:
            assert bytes(v) == b"hi"
        assert reader.drop_stale() == []
        again.close()
        Arena(name, 2 << 20)  # replaced by a bigger one, never unlinked here
        assert reader.drop_stale() == [name]
        assert len(reader.region(name, (2 << 20) - 8, 8)) == 8  # the new one is mapped on use
    finally:
        reader.close()
