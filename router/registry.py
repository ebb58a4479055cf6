"""The worker registry as the router reads it, and placement: which decode worker (and which prefill
worker's own stream) a request goes to, and the channels to the decode workers."""

from __future__ import annotations

import asyncio
import time

import grpc
import redis.exceptions

from splitserve.engine.errors import InvalidRequestError
from splitserve.router.placement import Placement
from splitserve.router.prefix_index import PrefixIndex
from splitserve.router.requests import LAPSE_GRACE_HEARTBEATS, REGISTER_WAIT_HEARTBEATS, log
from splitserve.service import grpc_server
from splitserve.service.errors import (
    Unavailable,
)
from splitserve.service.redis_state import (
    WorkerInfo,
    priority_class,
)
from splitserve_proto.v1 import worker_pb2_grpc


class WorkerRegistry:
    """RouterServicer's placement part: the worker registry as this router reads it, the choice of
    decode worker (and prefill stream) for a request, and the channels to the workers. State: the servicer's."""

    async def refresh_workers(self) -> None:
        started = time.monotonic()
        found = await self._registry("decode")
        count = not self.colocated and self.s.local_prefill_without_prefill_workers
        if self.prefill_affinity or count:
            prefill = await self._registry("prefill")
            if count:  # (else None: not counted, never "none registered")
                self.prefill_workers = len(prefill)
            if self.prefill_affinity:
                self.prefill_prefixes.workers(prefill)
        if found:
            self.lapsed.clear()
        else:
            found = self._kept_lapsed()
        self.workers = found
        self.read_from = max(self.read_from, started)
        self.placements.prune(found)
        self.prefixes.workers(found)
        await self._reconnect_restarted(found)

    def _kept_lapsed(self) -> list[WorkerInfo]:
        """With no decode worker registered: the workers this router placed on at its last read
        whose entries have lapsed since, while its channel to them is up and carries streams, for
        LAPSE_GRACE_HEARTBEATS. A lease lapses when a heartbeat is late (Redis slow, the worker's
        process held); failing the requests admitted meanwhile with "no decode worker is
        registered" would lose work that the worker can still do. One that is truly gone drops its
        connection and is not kept; one that drained and left stops taking streams, which then
        fail as they would have."""
        now = time.monotonic()
        holding = {a.address for a in self.active.values()}
        kept = []
        for w in self.workers:
            peer = self.peers.cached(w.address)
            if w.address not in holding or peer is None:
                continue
            if peer.channel.get_state() != grpc.ChannelConnectivity.READY:
                continue
            since = self.lapsed.setdefault(w.worker_id, now)
            if since == now:
                self.metrics.lease_lapses.inc()
                log.warning(
                    "decode worker %s's registry entry lapsed while it holds streams from here and its "
                    "channel is up: still placing requests on it, for up to %g s",
                    w.worker_id,
                    LAPSE_GRACE_HEARTBEATS * self.s.heartbeat_s,
                )
            if now - since < LAPSE_GRACE_HEARTBEATS * self.s.heartbeat_s:
                kept.append(w)
        self.lapsed = {w.worker_id: self.lapsed[w.worker_id] for w in kept}
        return kept

    async def _registry(self, role: str) -> list[WorkerInfo]:
        """The registry's entries of role's workers. One that is not an entry a worker writes (of
        another release, or a hand's; WorkerInfo.from_mapping) is left out, and told once: it must
        not fail the read of the registry, and with it each request's placement and the router's
        reaping and checks, which follow the read."""
        found = []
        async for key in self.redis.scan_iter(match=self.keys.worker_pattern(role), count=100):
            try:
                m = await self.redis.hgetall(key)
                if m:
                    found.append(WorkerInfo.from_mapping(m))
            except (ValueError, redis.ResponseError) as e:  # (ResponseError: a key of another type)
                if key not in self.unreadable:
                    log.warning("registry entry %s left out: %s", key.decode(errors="replace"), e)
                    if len(self.unreadable) >= 1024:  # (told again, after a thousand others)
                        self.unreadable.clear()
                    self.unreadable.add(key)
        return found

    async def _reconnect_restarted(self, found: list[WorkerInfo]) -> None:
        """A decode worker that registers a new run (restarted) at an address whose channel failed
        to connect gets a new channel, which connects at once: the old one retries on gRPC's
        backoff (up to 2 s apart), and until then every request placed there fails UNAVAILABLE.
        A channel connected, or connecting, may carry streams to the new run: it stays."""
        for w in found:
            peer = self.peers.cached(w.address)
            if peer is None or not w.epoch or peer.run == w.epoch:
                continue
            if peer.run and peer.channel.get_state() == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                log.info("decode worker %s at %s restarted: connecting to it anew", w.worker_id, w.address)
                self.peers.drop(w.address)
                await peer.channel.close()
            else:  # a channel connected (or connecting) to the new run, or one opened before any
                peer.run = w.epoch

    async def refresh_since(self, t: float) -> None:
        """Make sure the registry has been read since monotonic time t: one read, one at a time,
        serves every caller that came before it began."""
        async with self.refreshing:
            if self.read_from < t:
                await self.refresh_workers()

    async def _await_registration(self, deadline: float) -> None:
        """With no decode worker registered, wait up to REGISTER_WAIT_HEARTBEATS (and the request's
        deadline, unix time; 0: none) for one to register. A Redis stall longer than a worker's lease
        lapses every entry at once, and a worker writes its entry again up to a heartbeat after Redis
        answers, and a request in that gap waits for it. None comes within the wait: the request
        fails UNAVAILABLE, "no decode worker is registered"."""
        until = time.monotonic() + REGISTER_WAIT_HEARTBEATS * self.s.heartbeat_s
        if deadline:
            until = min(until, time.monotonic() + deadline - time.time())
        while not self.workers and time.monotonic() < until:
            await asyncio.sleep(min(self.s.heartbeat_s / 4, max(0.0, until - time.monotonic())))
            await self.refresh_since(time.monotonic())

    def pick(
        self, need_tokens: int, hashes: list[int] | None = None, exclude: str = "", prefer: str = ""
    ) -> tuple[WorkerInfo, Placement, int]:
        """The decode worker for a request of need_tokens (prompt + max_tokens) whose prompt has the
        block hashes `hashes` (PrefixIndex.prompt_chain), its placement, and the prompt tokens it
        is expected to find in its prefix cache. The least loaded worker, unless one expected to
        hold more of the prompt has at most prefix_affinity_slack more requests open; the worker
        `prefer` (the one a stream sent again to go on was running on) whenever it can take it.
        Never the worker `exclude` (one a request was lost on)."""
        workers = [w for w in self.workers if w.worker_id != exclude]
        if not workers:
            raise Unavailable(
                "no decode worker is registered"
                + (f" but {exclude}, which was lost" if exclude else "")
                + "; retry shortly"
            )
        largest = max(w.kv_capacity_tokens for w in workers)
        if largest < need_tokens and all(w.kv_capacity_tokens for w in workers):  # 0: an older worker, unknown
            raise InvalidRequestError(
                "sampling.max_tokens",
                f"prompt + max_tokens (× sampling.n) = {need_tokens} "
                f"tokens can never fit "
                f"in a decode worker's KV cache (the largest holds {largest})",
            )

        def load(w: WorkerInfo) -> tuple:
            return (self.placements.free_kv(w) < need_tokens, self.placements.load(w))

        # A worker this router cannot connect to (killed, its registry entry not yet lapsed) gets
        # nothing while another can take the request; if none can, the request fails naming it.
        candidates = [w for w in workers if self._reachable(w)] or workers
        loads = {c.worker_id: load(c) for c in candidates}
        w = min(candidates, key=lambda c: loads[c.worker_id])
        w = next((c for c in candidates if c.worker_id == prefer and not loads[c.worker_id][0]), w)
        cached = 0
        if w.worker_id == prefer:
            cached = self.prefixes.cached_tokens(w.worker_id, hashes) if hashes and self.affinity else 0
        elif hashes and self.affinity:
            held = {c.worker_id: self.prefixes.cached_tokens(c.worker_id, hashes) for c in candidates}
            cached = held[w.worker_id]
            short, least = loads[w.worker_id]
            best = max(candidates, key=lambda c: (held[c.worker_id], -loads[c.worker_id][1]))
            short_b, load_b = loads[best.worker_id]
            if held[best.worker_id] > cached and short_b <= short and load_b <= least + self.s.prefix_affinity_slack:
                w, cached = best, held[best.worker_id]
                self.metrics.prefix_placements.inc()  # may be a refused admission's: a placement all the same
        return w, self.placements.place(w.worker_id, need_tokens), cached

    def _prefill_worker_for(self, hashes: list[int] | None, priority: int) -> list:
        """Prefill affinity: [the prefill worker expected to hold more of this prompt in its prefix cache
        than any other, those tokens], or [] (none does: every worker may take it, as one of several
        that hold a shared system prompt; fewer than two prefill workers registered, as this router
        last read: with one, its own stream would only reorder its jobs; or not normal priority: high
        and low go to their class's stream, read by every worker in its turn). Whether the job goes
        to it is admit.lua's to say: while that worker is registered and fewer than
        prefill_affinity_jobs of its jobs wait."""
        if (
            not (self.prefill_affinity and hashes)
            or priority_class(priority) != "normal"
            or len(self.prefill_prefixes.epochs) < 2
        ):
            return []
        held = sorted(
            ((self.prefill_prefixes.cached_tokens(w, hashes), w) for w in self.prefill_prefixes.blocks), reverse=True
        )
        if not held or held[0][0] == 0 or (len(held) > 1 and held[1][0] == held[0][0]):
            return []
        return [held[0][1], held[0][0]]

    def _reachable(self, w: WorkerInfo) -> bool:
        """False while this router's channel to w is in TRANSIENT_FAILURE: its last connection
        attempt failed, and gRPC keeps it so (retrying in the background) until one succeeds."""
        peer = self.peers.cached(w.address)
        return peer is None or peer.channel.get_state() != grpc.ChannelConnectivity.TRANSIENT_FAILURE

    def _open_channel(self, address: str) -> grpc.aio.Channel:
        # a decode stream's events wait in the worker, not here, while this router's client reads none
        channel = grpc_server.channel(address, self.s.keepalive_s, self.tls, self.s.stream_buffer_bytes)
        self.background.start(self._watch(channel))
        return channel

    @staticmethod
    async def _watch(channel: grpc.aio.Channel) -> None:
        """Reconnect a channel as soon as its connection drops: a worker that was killed then shows
        as TRANSIENT_FAILURE within a moment (connection refused), not at the next request placed
        there, and one that comes back (same address) is connected before it is picked."""
        state = channel.get_state()
        try:
            while state != grpc.ChannelConnectivity.SHUTDOWN:
                if state == grpc.ChannelConnectivity.IDLE:
                    state = channel.get_state(try_to_connect=True)
                await channel.wait_for_state_change(state)
                state = channel.get_state()
        except (asyncio.CancelledError, RuntimeError, ValueError):  # the channel or the loop closed
            return

    def stub(self, address: str) -> worker_pb2_grpc.DecodeWorkerStub:
        return self.peers.get(address).stub

    async def close_idle_channels(self) -> None:
        """Close the channels to decode workers that have left the registry and carry no stream."""
        keep = {w.address for w in self.workers} | {a.address for a in self.active.values()}
        for peer in self.peers.prune(keep):
            await peer.channel.close()

    def _record(self, worker: WorkerInfo, hashes: list[int], index: PrefixIndex | None = None) -> None:
        """worker holds the KV of these blocks now: in this router's record (`index`: the decode
        workers', or the prefill workers'), and the others'."""
        (self.prefixes if index is None else index).record(worker.worker_id, hashes)
        self.shared.publish(worker.worker_id, worker.epoch, hashes)
