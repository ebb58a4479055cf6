"""This router's lease in Redis and its drain: renewing the lease, reaping the requests of routers past
theirs, recording running requests' progress, cutting streams off as a drain runs out, and the
writes that wait for Redis."""

from __future__ import annotations

import time

import grpc
import redis.exceptions

from splitserve.router.requests import Active, log
from splitserve.service import redis_scripts as scripts
from splitserve.service.errors import (
    REDIS_UNREACHABLE,
)
from splitserve.service.process import settled, until_answered
from splitserve.service.redis_state import (
    CALL_TIMEOUT_S,
)


class LeaseAndDrain:
    """RouterServicer's lease part: this router's lease in Redis, the reaping of lost routers'
    requests, running requests' progress, and the drain's cut. State: the servicer's."""

    async def keep_alive(self) -> None:
        """Renew this router's lease in the routers set (by Redis's clock, so routers on hosts whose
        clocks differ agree) and its request set's TTL."""
        try:
            sec, usec = await self.redis.time()
            self.clock = (sec + usec / 1e6, time.monotonic())
            async with self.redis.pipeline(transaction=False) as p:
                p.zadd(self.keys.routers, {self.id: self.clock[0] + self.lease_s})
                p.expire(self.keys.router_requests(self.id), self.s.request_ttl_s)
                await p.execute()
        except BaseException as e:
            self.renewing_since = None
            self.redis_away = self.redis_away or isinstance(e, REDIS_UNREACHABLE)
            raise
        self.redis_away = False
        t = time.monotonic()
        if self.renewing_since is None or t - self.last_renewal > 2 * self.s.heartbeat_s:
            self.renewing_since = t  # renewals stalled (Redis did not answer?): so may the others' have
        self.last_renewal = t

    def redis_now(self) -> float:
        if not self.clock[1]:  # before the first renewal
            return time.time()
        return self.clock[0] + time.monotonic() - self.clock[1]

    async def reap(self, router_id: str | None = None) -> int:
        """Mark failed the requests that have not ended of every router past its lease, or (forced) of
        router_id: this router's own id at start (left by an earlier life under the same id) and at
        stop. Returns how many were marked."""
        if router_id is None:
            # Only after a whole lease of timely renewals, the last one just now: when Redis answers
            # again after an outage or a stall (or this router's loop was held up), every router's
            # lease may have run out, and the others must get the time to renew theirs.
            t = time.monotonic()
            if (
                self.renewing_since is None
                or t - self.renewing_since < self.lease_s
                or t - self.last_renewal > self.s.heartbeat_s
            ):
                return 0
            dead = [
                x.decode()
                for x in await self.redis.zrangebyscore(self.keys.routers, "-inf", self.redis_now())
                if x.decode() != self.id
            ]
        else:
            dead = [router_id]
        n = 0
        for rt in dead:
            members = await self.redis.smembers(self.keys.router_requests(rt))
            marked = await self.scripts.run(
                scripts.reap(
                    self.keys,
                    router_id=rt,
                    request_ids=[m.decode() for m in members],
                    now=self.redis_now(),
                    finished_ttl_s=self.s.finished_ttl_s,
                    force=bool(router_id),
                )
            )
            if marked and rt != self.id:
                log.warning("router %s went away: %d of its requests marked failed", rt, marked)
                self.metrics.reaped.inc(int(marked))
            elif marked:
                log.warning("%d requests left by this router's id (%s) marked failed", marked, rt)
            n += int(marked)
        return n

    async def record_progress(self) -> None:
        """Write, for the requests this router streams whose count moved since, their completion
        tokens so far and their first token's time (progress.lua): GetRequest, on any router, shows a
        running request's progress at most half a heartbeat late. One call for them all, off their
        streams' path; their ends write the last count (_mark)."""
        moved = [(rid, a, a.sent) for rid, a in self.active.items() if a.first_token and a.sent != a.recorded]
        if not moved:
            return
        await self.scripts.run(
            scripts.progress(self.keys, running=[(rid, sent, a.first_token) for rid, a, sent in moved])
        )
        for _, a, sent in moved:
            a.recorded = sent

    def cut_off(self, why: str) -> None:
        """End every request this router holds with UNAVAILABLE and `why` (it is stopping), and those
        still in admission as they come out of it (_cut_if_stopping)."""
        self.cut = why
        for rid, a in list(self.active.items()):
            self._cut(rid, a, why)

    @staticmethod
    def _cut(rid: str, a: Active, why: str) -> None:
        """Its current call is cancelled even if it has ended already (lost, aborted): one cut as it
        resumed on another decode worker has a new call since (_resume)."""
        if not (a.lost or a.aborted):
            a.lost, a.lost_code = why, grpc.StatusCode.UNAVAILABLE
            log.warning("request %s: %s", rid, why)
        a.call.cancel()

    def _cut_if_stopping(self, rid: str, a: Active) -> None:
        """A request admitted after its router's drain ran out (its decode worker accepted it late: a
        padded batch running, a stopped worker) is cut off at once, as those running then were: it
        ran on until gRPC's grace ended it, "Cancelling all calls", recorded cancelled. So is one
        that resumed on another decode worker meanwhile (_resume): the cut cancelled the call to
        the worker it lost, not the new one."""
        if self.cut:
            self._cut(rid, a, self.cut)

    def _check_redis(self) -> None:
        """While this router's last lease renewal got no answer, a call that needs Redis is refused at
        once, UNAVAILABLE naming Redis: it would wait CALL_TIMEOUT_S for its own timeout, to the same
        end. (Renewals go on every half heartbeat: the first one answered ends this.)"""
        if self.redis_away:
            raise redis.exceptions.ConnectionError(
                f"it did not answer this router's last call within {CALL_TIMEOUT_S:g} s (asked again every "
                f"{self.s.heartbeat_s / 2:g} s)"
            )

    async def _write(self, call, what: str, away: bool = False) -> None:
        """A Redis write (call) that the request's path does not wait for while Redis is away (`away`,
        or this router's last renewal got no answer): then, or when this call gets none, it is done
        in the background once Redis answers (until_answered). A cancel of the request's task does
        not cut it off (settled)."""
        if not (away or self.redis_away):
            try:
                await settled(call())
                return
            except REDIS_UNREACHABLE as e:
                self.redis_away = True
                log.warning("could not record %s (again once Redis answers): %s", what, e)
        self.background.start(until_answered(call, what, self.s.heartbeat_s, self.s.request_ttl_s))
