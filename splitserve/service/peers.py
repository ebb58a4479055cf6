"""Connections to decode workers, by address, that do not outlive their use.

A router and a prefill worker each keep one channel per decode worker they talk to. Decode
workers come and go (a pod rescheduled gets a new address), so a channel that nothing has used
for ``idle_s`` and that the owner does not name in ``keep`` (a registered worker, one with a call
open) is dropped: a long-running process would otherwise hold a channel, its reconnection
attempts and its keepalive timers for every decode worker that ever lived.

Each peer also has its own thread pools (``pools``: name -> size, threads started on demand),
so calls that block on one peer (it hangs, until keepalive drops it) hold that peer's threads
only, and work for the other peers goes on.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from splitserve_proto.v1 import worker_pb2_grpc

log = logging.getLogger(__name__)

IDLE_S = 300.0
RUNS_KEPT = 8  # earlier runs remembered per address


@dataclass
class Peer:
    address: str
    channel: object  # grpc.Channel or grpc.aio.Channel: the owner closes it once pruned
    stub: worker_pb2_grpc.DecodeWorkerStub
    last_used: float
    pools: dict[str, cf.ThreadPoolExecutor] = field(default_factory=dict)
    run: str = ""  # the run (epoch) of the worker at address this channel was opened for (see follow)
    earlier: tuple[str, ...] = ()  # the runs at address before it, latest last: their processes are gone


class Peers:
    def __init__(
        self, open_channel: Callable[[str], object], idle_s: float = IDLE_S, pools: dict[str, int] | None = None
    ):
        self._open = open_channel
        self.idle_s = idle_s
        self._sizes = dict(pools or {})
        self._peers: dict[str, Peer] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._peers)

    def __contains__(self, address: str) -> bool:
        return address in self._peers

    def get(self, address: str) -> Peer:
        """The peer at address, its channel opened on first use; marks it used now."""
        with self._lock:
            peer = self._peers.get(address)
            if peer is None:
                channel = self._open(address)
                peer = self._peers[address] = Peer(address, channel, worker_pb2_grpc.DecodeWorkerStub(channel), 0.0)
            peer.last_used = time.monotonic()
            return peer

    def follow(self, address: str, run: str) -> Peer | None:
        """Note that the worker at address is in run (its epoch, new at each start). A channel
        opened for an earlier run is replaced: the process it reached is gone, and while its
        reconnection backs off (up to gRPC's maximum backoff) every call on it fails at once, where
        a new channel connects now. Returns the replaced peer, its pools shut down, for the owner
        to close once the calls in hand have ended. A run seen before the current one (a request
        placed there before the restart), or none, changes nothing."""
        if not run:
            return None
        with self._lock:
            old = self._peers.get(address)
            if old is not None and not old.run:  # opened before any run was known: taken as this one's
                old.run = run
            if old is not None and (old.run == run or run in old.earlier):
                return None
            channel = self._open(address)
            self._peers[address] = Peer(
                address,
                channel,
                worker_pb2_grpc.DecodeWorkerStub(channel),
                time.monotonic(),
                run=run,
                earlier=(*old.earlier, old.run)[-RUNS_KEPT:] if old else (),
            )
        if old is not None:
            _shut_down(old)
        return old

    def cached(self, address: str) -> Peer | None:
        """The peer at address if a channel to it is open; opens nothing."""
        with self._lock:
            return self._peers.get(address)

    def submit(self, address: str, pool: str, fn: Callable, *args, **kw) -> cf.Future:
        """Run fn(*args, **kw) on the named pool of the peer at address (calls to that peer)."""
        peer = self.get(address)  # just used: not pruned before the call starts (idle_s > 0)
        return self._pool(peer, pool).submit(fn, *args, **kw)

    def _pool(self, peer: Peer, name: str) -> cf.ThreadPoolExecutor:
        with self._lock:
            ex = peer.pools.get(name)
            if ex is None:
                ex = peer.pools[name] = cf.ThreadPoolExecutor(
                    self._sizes[name], thread_name_prefix=f"{name}-{peer.address}"
                )
            return ex

    def prune(self, keep: set[str]) -> list[Peer]:
        """Drop the peers unused for idle_s and not in keep; returns them, their pools shut down,
        for the owner to close their channels (closing an aio channel is awaited)."""
        now = time.monotonic()
        with self._lock:
            gone = [p for a, p in self._peers.items() if a not in keep and now - p.last_used >= self.idle_s]
            for p in gone:
                del self._peers[p.address]
        for p in gone:
            _shut_down(p)
            log.info("closing the channel to %s (unused for %.0f s)", p.address, now - p.last_used)
        return gone

    def drop(self, address: str) -> Peer | None:
        """Forget the peer at address (the next get opens a new channel); returns it, its pools shut
        down, for the owner to close, or None if there was none."""
        with self._lock:
            peer = self._peers.pop(address, None)
        if peer is not None:
            _shut_down(peer)
        return peer

    def clear(self, wait: bool = False) -> list[Peer]:
        """Drop every peer, shutting down its pools (wait: after what they hold has run);
        returns them for the owner to close."""
        with self._lock:
            peers = list(self._peers.values())
        for p in peers:  # first, while calls in hand may still use their peer's channel
            for ex in list(p.pools.values()):
                ex.shutdown(wait=wait)
        with self._lock:
            gone, self._peers = list(self._peers.values()), {}
        for p in gone:  # and any pool opened meanwhile
            _shut_down(p)
        return gone


def _shut_down(peer: Peer) -> None:
    """Stop the peer's pools taking calls (those queued still run)."""
    for ex in list(peer.pools.values()):
        ex.shutdown(wait=False)
