"""Admission's fast path and refusals, the queue counts of requests their decode worker prefills, and
the requests that wait in the queue: taken back while no prefill worker is registered, ended when
Redis lost them."""

from __future__ import annotations

import asyncio
import functools
import time

import grpc

from splitserve.observability import tracing
from splitserve.router.requests import LOST_GRACE_HEARTBEATS, Active, Recorded, log
from splitserve.service import convert
from splitserve.service import redis_scripts as scripts
from splitserve.service.errors import (
    Refused,
    code_of,
    status_code,
)
from splitserve.service.redis_state import LOCAL_FIELD, QUEUE_FIELDS, queue_counts
from splitserve_proto.v1 import worker_pb2 as w_pb

# the local view (Admission._surely_full): counts under LOCAL_REFRESH_S old refuse at once; older ones,
# up to LOCAL_VIEW_S, are read again before they refuse; older still are not used
LOCAL_VIEW_S = 1.0
LOCAL_REFRESH_S = 0.05


class Admission:
    """RouterServicer's admission part: the fast refusal, the queue counts of requests their decode
    worker prefills, and the queued requests taken back or found lost. State: the servicer's."""

    def _queue_may_be_full(self, tokens: int) -> bool:
        """False when this router saw the queue under half its refusal bound in the last 10 seconds.

        The admission script decides either way; this only spares light load the read that
        lets a flood be refused before a decode stream is opened.
        """
        q, t, when = self.queue_seen
        if time.monotonic() - when > 10.0:
            return True
        frac = self.s.admit_fraction / 2
        return q + 1 > self.s.max_queue_requests * frac or t + tokens > self.s.max_queue_tokens * frac

    async def _surely_full(self, r) -> Refused | None:
        """The local view, before the request is validated, tokenized or placed: the queue counts this
        router saw last, plus the requests it is admitting now (validated, their admission script not
        answered: _admitting). Counts under LOCAL_REFRESH_S old that leave no room refuse at once,
        with no Redis call and behind no admission; older ones (under LOCAL_VIEW_S) that leave no room
        are read again first, one read shared by every request that waits for it. The admission
        script still decides for every request let through; with no recent counts (light load) the
        request takes the full path. A text prompt's tokens are not known yet: it is held to the
        requests bound here, and to both in the script."""
        if not self.s.local_refusal:
            return None
        tokens = len(r.request.token_ids.ids) if r.request.HasField("token_ids") else 0
        for _ in range(2):
            q, t, when = self.queue_seen
            age = time.monotonic() - when
            if age > LOCAL_VIEW_S:
                break
            q, t = q + self.admitting[0], t + self.admitting[1]
            if q + 1 <= int(self.s.max_queue_requests * r.frac) and (
                not tokens or t + tokens <= int(self.s.max_queue_tokens * r.frac)
            ):
                break
            if age <= LOCAL_REFRESH_S:
                self.metrics.local_refusals.inc()
                return self._refusal(q, t, r.frac)
            await self._read_view()
        return None

    def _admitting(self, r) -> None:
        """The request, validated, joins the router's admitting count until its admission answers:
        the local view counts it. (A request the view lets through but that fails validation never
        counts: it would take a place it does not use.)"""
        r.admitting = r.work
        self.admitting[0] += 1
        self.admitting[1] += r.work

    async def _read_view(self) -> None:
        """The queue counts read again for the local view: one read at a time, shared by its waiters."""
        if self.view_read is None or self.view_read.done():
            self.view_read = asyncio.ensure_future(self._view_counts())
        await asyncio.shield(self.view_read)

    async def _view_counts(self) -> None:
        try:
            await self._read_counts()
        except Exception as e:  # noqa: BLE001 - the view goes stale, and requests take the full path
            log.debug("the local view's read failed: %s", e)

    async def _read_counts(self) -> tuple[int, int]:
        """The queue's counts (requests, tokens) read from Redis, and kept as the latest seen."""
        *counts, local = await self.redis.hmget(self.keys.admission, *QUEUE_FIELDS, LOCAL_FIELD)
        q, t = queue_counts(counts)
        self.queue_seen, self.local_seen = (q, t, time.monotonic()), int(local or 0)
        return q, t

    def _admission_answered(self, r) -> None:
        """The request leaves the router's admitting count (its admission answered, or it ended first)."""
        if r.admitting is not None:
            self.admitting[0] -= 1
            self.admitting[1] -= r.admitting
            r.admitting = None

    def _without_prefill_workers(self) -> bool:
        """No prefill worker is registered, and local_prefill_without_prefill_workers is on (the
        registry read counts them only then; never colocated)."""
        return self.prefill_workers == 0

    def _prefill_locally(self, tokens: int, cached: int = 0) -> bool:
        """Whether the chosen decode worker prefills this prompt itself rather than a prefill worker:
        always when colocated; disaggregated (conditional disaggregation), when no prefill worker
        is registered (local_prefill_without_prefill_workers: all died, or hang), when what it
        must compute is short (local_prefill_max_tokens: the prompt's tokens less the `cached`
        ones it is expected to hold already) or when prefill workers are behind (more than
        local_prefill_queue_tokens queued for them at the last admission this router saw)."""
        if self.colocated:
            return True
        if self._without_prefill_workers():
            return True
        if tokens - cached <= self.s.local_prefill_max_tokens:
            return True
        backlog = self.queue_seen[1] - self.local_seen
        return 0 < self.s.local_prefill_queue_tokens < backlog and time.monotonic() - self.queue_seen[2] <= 10.0

    def _refusal(self, q: int, t: int, frac: float) -> Refused:
        hint = self.s.retry_after_ms
        return Refused(
            f"queue is full ({q} requests, {t} tokens queued; refusing from {frac:.0%} of "
            f"{self.s.max_queue_requests} requests / {self.s.max_queue_tokens} tokens); retry after {hint} ms",
            metadata=(("retry-after-ms", str(hint)), ("grpc-retry-pushback-ms", str(hint))),
            reason="QUEUE_FULL",
        )

    def _tenant_refusal(self, tenant, q: int, t: int) -> Refused:
        """A tenant over its own quota (its q requests and t tokens queued): others go on being admitted."""
        hint = self.s.retry_after_ms
        self.metrics.tenant_refused.labels(tenant.name).inc()
        return Refused(
            f"tenant {tenant.name!r} is over its quota ({q} requests, {t} tokens queued; its max_queued_requests "
            f"{tenant.max_queued_requests or 'none'}, max_queued_tokens {tenant.max_queued_tokens or 'none'}); "
            f"retry after {hint} ms",
            metadata=(("retry-after-ms", str(hint)), ("grpc-retry-pushback-ms", str(hint))),
            reason="TENANT_QUOTA",
        )

    @staticmethod
    def _end_admission(adm, e: BaseException) -> None:
        if isinstance(e, Recorded):  # not admitted: answered with its recorded result
            adm.set_attribute("splitserve.replayed", True)
            adm.end()
            return
        code = code_of(e)
        adm.set_attribute("rpc.grpc.status_code", code.value[0])
        if code != grpc.StatusCode.CANCELLED:
            adm.set_status(tracing.Status(tracing.StatusCode.ERROR, f"{code.name}: {e}"[:300]))
        adm.end()

    async def take_back(self, rid: str, a: Active) -> None:
        """Take a request that waits in the prefill queue back for its decode worker to prefill, on
        the Decode stream it has open there: no prefill worker is registered (all died, or hang),
        and without this it would wait for one to return, or for its deadline. A prefill worker
        that has picked it up keeps it (the script takes back only a request still queued), and one
        that pulls its job later skips it. It then counts as one its decode worker prefills."""
        took = await self.scripts.run(
            scripts.take_back(self.keys, request_id=rid, prompt_tokens=len(a.ids), now=time.time())
        )
        if not int(took):
            return
        if self.active.get(rid) is not a:  # it ended meanwhile, its counts not returned: they go back now
            await self._dequeue(rid, len(a.ids))
            return
        a.local = a.queued = True  # returned at its first token, or its end
        self.metrics.taken_back.inc()
        log.warning("request %s: no prefill worker is registered; its decode worker at %s prefills it", rid, a.address)
        self.background.start(self._prefill_at_decode_worker(rid, a))

    async def _prefill_at_decode_worker(self, rid: str, a: Active) -> None:
        req = w_pb.PrefillHereRequest(
            request_id=rid,
            prompt_token_ids=a.ids,
            priority=a.priority,
            sampling=convert.sampling_to_pb(a.params),
            cache_salt=a.cache_salt,
            queue_ms=(time.time() - a.t_admitted) * 1000,
        )
        try:
            await self.stub(a.address).PrefillHere(req, timeout=10.0)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND or self.active.get(rid) is not a:
                return  # its stream has ended (the client went, or its worker): nothing waits for it
            if e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED):
                a.lost_code = e.code()
            a.lost = f"no prefill worker is registered, and its decode worker could not prefill it: {e.details()}"
            log.warning("request %s: %s", rid, a.lost)
            a.call.cancel()

    async def _dequeue(self, rid: str, prompt_tokens: int) -> None:
        """Return the queue counts of a request its decode worker prefills (dequeue.lua: once). While
        Redis is away, in the background, until it answers (the request goes on meanwhile)."""
        await self._write(
            functools.partial(
                self.scripts.run, scripts.dequeue(self.keys, request_id=rid, prompt_tokens=prompt_tokens)
            ),
            f"{rid}'s queue counts",
        )

    async def check_waiting(self) -> None:
        """End the streams still waiting for a first token whose request Redis no longer holds (it
        restarted empty: the job is gone, no prefill worker will run it) or that were reaped (this
        router missed its lease, so prefill skips them), UNAVAILABLE, and those a prefill worker
        failed, with the status it recorded (it tells the decode worker, which ends the stream,
        but that worker may be out of its reach): their clients hear now, not at their deadlines.
        A hash gone for less than LOST_GRACE_HEARTBEATS is waited for: a prefill worker already
        running the request puts it back. One its decode worker prefills (colocated, or conditional
        disaggregation) is held there, not in Redis: not checked.
        While no prefill worker is registered (local_prefill_without_prefill_workers), those still
        queued are taken back for their decode workers to prefill (take_back)."""
        waiting = [
            (rid, a) for rid, a in self.active.items() if not (a.first or a.aborted or a.lost or a.moved or a.local)
        ]
        if not waiting:
            return
        async with self.redis.pipeline(transaction=False) as p:
            for rid, _ in waiting:
                p.hmget(
                    self.keys.req(rid),
                    "t_admitted",
                    "reaped",
                    "router",
                    "state",
                    "error",
                    "code",
                    "lost_to",
                    "decode_worker",
                )
            rows = await p.execute()
        now = time.monotonic()
        restored = []
        take_back = self._without_prefill_workers()
        for (rid, a), (admitted, reaped, router, state, error, code, lost_to, worker) in zip(waiting, rows):
            if a.first or self.active.get(rid) is not a:
                continue
            if take_back and state == b"queued" and not (a.resumes or a.carried):
                await self.take_back(rid, a)
            if admitted is None:
                a.missing_since = a.missing_since or now
                if now - a.missing_since < LOST_GRACE_HEARTBEATS * self.s.heartbeat_s:
                    continue  # a prefill worker holding it puts its hash back at its next heartbeat
                a.lost = "the queue state store (Redis) no longer holds this request (it restarted empty?); retry"
            elif reaped:
                a.lost = f"this router ({self.id}) missed its lease in Redis and its requests were failed; retry"
            elif state == b"failed" and lost_to and lost_to == worker and a.resumes < self.s.decode_resumes:
                # Its prefill worker could not reach its decode worker (stopped, killed): this router's
                # own stream to it is dropped as well (keepalive), and the request resumes on another
                # (resume.lua lets it). Failed now, it would not. Past that, the stream still up (the
                # worker went on after the prefill worker gave up, or only the prefill workers are cut
                # off from it), the handoff will never come: this router cuts the stream itself and
                # the request resumes all the same (_events).
                a.lost_seen = a.lost_seen or now
                if now - a.lost_seen < 2 * self.s.keepalive_s + self.s.heartbeat_s:
                    continue
                a.moved = (error or b"its KV handoff failed").decode(errors="replace")
                log.warning("request %s: %s; this router's stream there is up: resuming it on another", rid, a.moved)
                a.call.cancel()
                continue
            elif state == b"failed":
                a.lost = (error or b"a worker failed this request").decode(errors="replace")
                got = status_code(int(code)) if code and code.isdigit() else None
                a.lost_code = got if got not in (None, grpc.StatusCode.OK) else grpc.StatusCode.UNAVAILABLE
            else:
                a.missing_since = 0.0
                if router is None:  # put back by its prefill worker: this router holds it again
                    restored.append(rid)
                continue
            log.warning("request %s: %s", rid, a.lost)
            a.call.cancel()
        if restored:  # so that they are reaped if this router dies
            async with self.redis.pipeline(transaction=False) as p:
                for rid in restored:
                    p.hset(self.keys.req(rid), "router", self.id)
                p.sadd(self.keys.router_requests(self.id), *restored)
                p.expire(self.keys.router_requests(self.id), self.s.request_ttl_s)
                await p.execute()
            if ended := [rid for rid in restored if rid not in self.active]:  # ended meanwhile (_mark removed it)
                await self.redis.srem(self.keys.router_requests(self.id), *ended)
