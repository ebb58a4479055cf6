"""Routers tell one another what they record of the decode workers' prefix caches
(prefix_index.py), so that a chat's next turn that reaches another router behind the same
address still goes where its KV is.

Each router appends what it records (the decode worker, its run, the chain of block hashes)
to one capped Redis stream, ``{prefix}:prefix-records``, and follows that stream, applying the
other routers' entries to its own record. Placement still reads only the router's own record:
no Redis round trip at admission. An entry reaches the other routers a few milliseconds after
the first token or the end that it records: the writer sends whatever has gathered in one
pipeline, and each reader waits on a blocking XREAD. An entry for a run of a worker the reader
does not know (restarted since, or not yet read from the registry) is dropped.

It stays a guess, as the record is. An entry lost (Redis unreachable, a reader so far behind
that the stream was trimmed past it) costs a placement by load; the worker looks prompts up by
their exact tokens.
"""

from __future__ import annotations

import asyncio
import logging
import struct

from splitserve.router.prefix_index import PrefixIndex

log = logging.getLogger(__name__)

STREAM_MAXLEN = 4096  # entries kept (about; trimmed lazily): ~1 KB each for a 1000-token prompt
STREAM_TTL_S = 3600  # renewed by every write: the stream goes once no router has written for this long
READ_COUNT = 256  # entries per XREAD
READ_BLOCK_MS = 1000  # under the clients' socket timeout (5 s)
MAX_PENDING = 4096  # entries waiting for the writer; past it the oldest are dropped (Redis is down)


def pack(hashes: list[int]) -> bytes:
    return struct.pack(f"<{len(hashes)}q", *hashes)


def unpack(raw: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(raw) // 8}q", raw[: len(raw) // 8 * 8]))


class SharedRecord:
    def __init__(self, r, key: str, router_id: str, index: PrefixIndex | list[PrefixIndex], metrics=None):
        """index: the record the entries apply to; a list of them (the decode workers' and the
        prefill workers'): each entry to the one that knows its worker's run."""
        self.r = r
        self.key = key
        self.id = router_id
        self.indexes = index if isinstance(index, list) else [index]
        self.metrics = metrics
        self.pending: list[tuple[str, str, list[int]]] = []
        self.wake = asyncio.Event()
        self.running = False  # publish() keeps entries only while the writer runs
        self.reading = asyncio.Event()  # set once the reader has found the stream's tail: it misses nothing after

    def publish(self, worker_id: str, epoch: str, hashes: list[int]) -> None:
        """Tell the other routers that worker_id (in its run `epoch`) holds the blocks of this chain."""
        if not self.running or not hashes:
            return
        self.pending.append((worker_id, epoch, hashes))
        if len(self.pending) > MAX_PENDING:
            del self.pending[: len(self.pending) - MAX_PENDING]
        self.wake.set()

    def apply(self, fields: dict) -> bool:
        """An entry of the stream (its fields, as bytes): recorded here if another router wrote it
        for a run of a worker this router knows. True if it was."""
        # (any bytes: an entry another release, or a hand, wrote; one not UTF-8 names no worker here)
        if fields.get(b"r", b"").decode(errors="replace") == self.id:
            return False
        worker_id, epoch = (fields.get(name, b"").decode(errors="replace") for name in (b"w", b"e"))
        index = next((i for i in self.indexes if worker_id and i.epochs.get(worker_id) == epoch), None)
        if index is None:
            return False
        index.record(worker_id, unpack(fields.get(b"h", b"")))
        if self.metrics is not None:
            self.metrics.prefix_records_applied.inc()
        return True

    async def run(self) -> None:
        """Write this router's entries and read the others', until cancelled."""
        self.running = True
        try:
            await asyncio.gather(self._write(), self._read())
        finally:
            self.running = False
            self.pending.clear()

    async def _write(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            batch, self.pending = self.pending, []
            try:
                async with self.r.pipeline(transaction=False) as p:
                    for worker_id, epoch, hashes in batch:
                        p.xadd(
                            self.key,
                            {"r": self.id, "w": worker_id, "e": epoch, "h": pack(hashes)},
                            maxlen=STREAM_MAXLEN,
                            approximate=True,
                        )
                    p.expire(self.key, STREAM_TTL_S)
                    await p.execute()
            except Exception as e:  # noqa: BLE001 - lost entries cost placements, not requests
                log.warning("could not share %d prefix records: %s", len(batch), e)
                await asyncio.sleep(1.0)

    async def _tail(self) -> bytes | str:
        """The id of the stream's last entry: entries after it are read ("0-0" if it is empty)."""
        last = await self.r.xrevrange(self.key, count=1)
        return last[0][0] if last else "0-0"

    async def _read(self) -> None:
        last = None
        while True:
            try:
                if last is None:
                    last = await self._tail()
                    self.reading.set()
                got = await self.r.xread({self.key: last}, count=READ_COUNT, block=READ_BLOCK_MS)
            except Exception as e:  # noqa: BLE001 - Redis away: try again, from its tail then
                log.warning("could not read the shared prefix records: %s", e)
                last = None
                await asyncio.sleep(1.0)
                continue
            for _stream, entries in got.items() if isinstance(got, dict) else got or ():  # RESP3, RESP2
                for entry_id, fields in entries:
                    last = entry_id
                    try:
                        self.apply(fields)
                    except Exception:  # noqa: BLE001 - one entry must not end the reading of the others
                        log.exception("prefix record %s left out", entry_id)
