"""The relay: one request from admission to its end, its decode stream's events turned into the
client's messages, and the end recorded in Redis and in the request's span."""

from __future__ import annotations

import asyncio
import sys
import time

import grpc

from splitserve.observability import tracing
from splitserve.router.placement import Placement, Placements
from splitserve.router.requests import (
    NAME_TOKENS_INLINE,
    STATUS_WAIT_S,
    Active,
    RelayState,
    Result,
    UpstreamError,
    aborted_first,
    cancel_once_ended,
    fingerprint,
    log,
    message_to_text,
    name_tokens,
)
from splitserve.service import convert
from splitserve.service import redis_scripts as scripts
from splitserve.service.errors import (
    REDIS_UNREACHABLE,
    AlreadyExists,
    PermissionDenied,
    Unavailable,
    fit_details,
    status_code,
)
from splitserve.service.process import settled
from splitserve.service.redis_state import (
    Job,
    WorkerInfo,
    priority_class,
    sampling_to_dict,
)
from splitserve.service.tenants import salted, scoped
from splitserve_proto.v1 import generation_pb2 as gen_pb
from splitserve_proto.v1 import worker_pb2 as w_pb


class Relay:
    """RouterServicer's relay part: one request from admission to its end, its decode stream's
    events turned into the client's messages. State: the servicer's."""

    async def _events(self, request: gen_pb.GenerateRequest, context, rs: tracing.rpc_span, tenant=None):
        """Yields (rid, the request_id its client knows, prompt_tokens, DecodeEvent) for every decode
        event of the request; rid differs from the client's for a new attempt (_attempt).

        The request's path, one step each: validate and place it (_plan), open its decode stream
        (_open_decode), admit it in Redis (_admit), then relay the stream's events (_next_event,
        _take_event) until the last, going on on another decode worker when its own is lost; record
        how it ended (_record_end, _rpc_error_end) and give back what it held (_release)."""
        r = RelayState(request, rs, time.time(), tenant=tenant)
        r.adm = tracing.tracer().start_span("admission", context=rs.ctx)
        try:
            await self._plan(r, context)
            self._open_decode(r)
        except BaseException as e:
            self._admission_answered(r)
            self._end_admission(r.adm, e)
            raise
        failed_with = None  # the exception the request ends with (the decode span in use ends with it)
        try:
            try:
                await self._admit(r)
                try:
                    while True:
                        ev = await self._next_event(r, context)
                        if ev is None:  # its decode worker was lost: it goes on on another
                            continue
                        last = await self._take_event(r, ev)
                        yield r.rid, r.public_id, len(r.ids), ev
                        if last:
                            self._record_generated(r)
                            break
                except asyncio.CancelledError:
                    if r.active.lost:
                        r.state = "failed"
                        raise UpstreamError(r.active.lost, r.active.lost_code) from None
                    r.state = "cancelled"
                    if not r.active.aborted:
                        raise
                    r.final = r.cancelled_event()
                    yield r.rid, r.public_id, len(r.ids), r.final
                except GeneratorExit:
                    # The client cancelled while its handler was writing a message, not reading one:
                    # the handler's task is cancelled outside this generator, which is then closed.
                    r.state = "cancelled"
                    raise
                await self._record_end(r)
            except grpc.aio.AioRpcError as e:
                aborted = self._rpc_error_end(r, e)  # raises, unless its client aborted it
                yield r.rid, r.public_id, len(r.ids), aborted
                await self._mark(r.rid, r.state, first_token=r.first_token)
                return
            finally:
                await self._release(r, sys.exc_info()[1])
        except BaseException as e:
            failed_with = e
            raise
        finally:  # (a `with r.dec`, but r.dec is another span once the request resumes elsewhere)
            if r.dec is not None:
                r.dec.__exit__(type(failed_with) if failed_with is not None else None, failed_with, None)

    async def _plan(self, r: RelayState, context) -> None:
        """Validates the request, refuses it early when the queue is surely full, and places it: its
        decode worker, and whether its prompt is prefilled there (local) or by a prefill worker
        (directed to one, for prefix affinity, or to any)."""
        request = r.request
        if r.tenant is not None and request.priority < r.tenant.best_priority:
            raise PermissionDenied(
                f"priority: tenant {r.tenant.name!r} may ask for {r.tenant.best_priority} at most urgent "
                f"(best_priority in the tokens file), got {request.priority}",
                reason="PRIORITY_NOT_ALLOWED",
            )
        # have: what its client has already (resume_from: a stream sent again to go on), prefilled
        # after the prompt (sampling.n > 1: each sample not finished, by its decode worker,
        # Sent.unfinished); the queue counts them with it
        # High priority (< 0) may use the headroom above admit_fraction, up to the bound itself.
        r.frac = 1.0 if priority_class(request.priority) == "high" else self.s.admit_fraction
        refused = await self._surely_full(r)  # the local view: a burst's refusals wait behind nothing
        if refused is not None:
            raise refused
        r.rid, r.ids, r.params, r.have = await self._validate(request)
        if r.tenant is not None:  # its prefix-cache entries apart from every other tenant's
            request.cache_salt = salted(r.tenant, request.cache_salt)
        params, have = r.params, r.have
        self._check_redis()
        r.carried, r.carried_chars = (have.tokens[0], have.chars[0]) if params.n == 1 else ([], 0)
        r.samples = have.unfinished(params.n)
        r.resumed = have.count()
        r.work = len(r.ids) + have.carried(params.n)
        self._admitting(r)
        r.public_id, was_on = r.rid, ""
        r.rid = scoped(r.tenant, r.rid)  # a tenant's ids are its own
        if request.request_id:  # client-chosen: it may exist (see _attempt)
            r.rid, r.attempt, was_on = await self._attempt(r.rid, fingerprint(request), have)
        attributes = self._genai_attributes(request, r.rid, r.ids, params, r.resumed)
        r.rs.span.set_attributes(attributes | {"gen_ai.response.id": r.public_id})
        if self._queue_may_be_full(r.work):  # fast path: no decode stream opened for a refusal
            q, t = await self._read_counts()
            if q + 1 > int(self.s.max_queue_requests * r.frac) or t + r.work > int(self.s.max_queue_tokens * r.frac):
                raise self._refusal(q, t, r.frac)
        r.remaining = context.time_remaining()
        r.deadline = r.t_recv + r.remaining if r.remaining is not None else 0.0
        if not any(self._reachable(w) for w in self.workers):
            # None registered, or none connected: a worker that has just (re)started may be
            # registered by now, and is placed at once (not after the next periodic read).
            await self.refresh_since(time.monotonic())
            if not self.workers:
                await self._await_registration(r.deadline)
        if self.affinity or self.prefill_affinity:
            r.hashes = self.prefixes.prompt_chain(r.ids, request.cache_salt)
        r.worker, r.placed, expect_cached = self.pick(
            len(r.ids) + params.n * params.max_tokens, r.hashes if self.affinity else None, prefer=was_on
        )
        if params.prompt_logprobs is not None:  # its prompt is computed whole wherever it goes
            expect_cached = 0
        r.expect_cached = expect_cached
        # A stream sent again to go on (its router was lost) goes back to the decode worker that
        # was running it, which holds the KV of its prompt and of the tokens sent in its prefix
        # cache, and prefills only the rest itself: a prefill worker would compute the tokens
        # sent again, behind the other re-sends, and hand all of its KV over.
        going_on = bool(r.carried) and r.worker.worker_id == was_on and self.s.prefix_caching
        r.local = bool(r.samples) or going_on or self._prefill_locally(r.work, expect_cached)
        r.directed = [] if r.local else self._prefill_worker_for(r.hashes, request.priority)
        r.adm.set_attributes(
            {"splitserve.prefill.local": r.local, "splitserve.prefix.expected_cached_tokens": expect_cached}
        )

    def _open_decode(self, r: RelayState) -> None:
        """Opens the request's Decode stream on its decode worker, under a span of its own. A local
        prefill sends the prompt (and what its client has) with it."""
        r.dec = tracing.rpc_span(
            "splitserve.v1.DecodeWorker/Decode",
            kind=tracing.SpanKind.CLIENT,
            parent=r.rs.ctx,
            attributes=tracing.rpc_attributes("splitserve.v1.DecodeWorker/Decode")
            | {"server.address": r.worker.address, "splitserve.decode_worker": r.worker.worker_id},
        )
        request = r.request
        dreq = w_pb.DecodeRequest(
            request_id=r.rid, prompt_tokens=len(r.ids), deadline_unix=r.deadline, priority=request.priority, leg=0
        )
        if r.local:  # the decode worker prefills it itself; the queue counts it until its first token
            dreq.prompt_token_ids.extend(r.ids + r.carried)
            dreq.sampling.CopyFrom(convert.sampling_to_pb(r.params))
            dreq.cache_salt = request.cache_salt
            dreq.resumed_tokens, dreq.resumed_chars = len(r.carried), r.carried_chars
            if r.samples:
                dreq.resumed_samples.extend(w_pb.ResumedSample(index=i, token_ids=t, chars=c) for i, t, c in r.samples)
        try:
            peer = self.peers.get(r.worker.address)
            peer.run = peer.run or r.worker.epoch  # the run a new channel was opened for (_reconnect_restarted)
            r.call = peer.stub.Decode(dreq, timeout=r.remaining, metadata=tracing.inject(r.dec.ctx))
        except BaseException:
            self.placements.ended(r.worker.worker_id, r.placed)
            raise
        r.sent_by = {i: len(t) for i, t in r.have.tokens.items()}
        r.sent = sum(r.sent_by.values())
        if request.request_id and r.params.n * r.params.max_tokens <= self.s.replay_max_tokens:
            # kept for a replay (_attempt), each sample's: a resumed attempt's after the tokens its
            # client had
            have = r.have
            r.results = {
                i: Result(len(have.tokens.get(i, ())), have.chars.get(i, 0), i in have.finished)
                for i in range(r.params.n)
            }

    async def _admit(self, r: RelayState) -> None:
        """Admits the request in Redis (admit.lua: the queue's bounds, the request hash, its job
        queued unless prefilled locally) and registers it as active. A local prefill is admitted
        once its decode worker accepted the stream; a queued job's stream is awaited after, while
        the prefill runs."""
        request, local = r.request, r.local
        try:
            if local:  # the worker starts on the prompt at once: admit once it accepted (or was lost)
                r.unaccepted = await self._accepted(r.call, r.worker, r.placed)
            r.t_admitted = time.time()
            # Disaggregated, the job is queued while the stream opens: a prefill takes longer
            # than the stream does, and the decode worker holds a handoff that comes first.
            # Settled: cut off by a cancel while Redis runs it (a slow or stopped Redis), an
            # admission would be done there but not here, and its counts never returned.
            got = await settled(
                self.scripts.run(
                    scripts.admit(
                        self.keys,
                        request_id=r.rid,
                        job_json=self._job(r).to_json(),
                        priority=request.priority,
                        tokens=r.work,
                        max_requests=self.s.max_queue_requests,
                        max_tokens=self.s.max_queue_tokens,
                        fraction=r.frac,
                        ttl_s=self.s.request_ttl_s,
                        queue=not local,
                        router_id=self.id,
                        attempt=r.attempt,
                        directed_to=r.directed[0] if r.directed else "",
                        directed_bound=self.s.prefill_affinity_jobs,
                        supersede=bool(r.resumed),
                        tenant_quotas=(
                            (r.tenant.max_queued_requests, r.tenant.max_queued_tokens) if r.tenant else (0, 0)
                        ),
                    )
                )
            )
            self._admission_answered(r)
            ok, q, t, lt = (int(x) for x in got[:4])
            if len(got) > 4 and int(got[4]):
                self.metrics.prefill_directed.inc()
                r.adm.set_attributes(
                    {
                        "splitserve.prefill.sent_to": r.directed[0],
                        "splitserve.prefix.expected_prefill_cached_tokens": r.directed[1],
                    }
                )
            r.queued = local and ok == 1
            self.queue_seen, self.local_seen = (q, t, time.monotonic()), lt
            r.adm.set_attributes(
                {"splitserve.queue.requests": q, "splitserve.queue.tokens": t, "splitserve.admitted": ok == 1}
            )
            if ok != 1:
                r.state = ""
                if ok == -1:
                    raise AlreadyExists(f"request_id {r.public_id!r} already exists (see GetRequest)")
                if ok == -2:
                    raise aborted_first(r.public_id)
                if ok == -3:
                    raise self._tenant_refusal(r.tenant, q, t)
                raise self._refusal(q, t, r.frac)
            if not local:  # refused now: the job is marked failed (finally), so no worker runs it
                r.unaccepted = await self._accepted(r.call, r.worker, r.placed)
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError) and r.state:
                r.state = "cancelled"
            self._end_admission(r.adm, e)
            raise
        r.adm.end()
        self._activate(r)

    def _activate(self, r: RelayState) -> None:
        """The admitted request becomes active: counted, and seen by the router's other tasks."""
        request, local = r.request, r.local
        m, params = self.metrics, r.params
        m.prompt_tokens.inc(len(r.ids))
        if local:
            m.local_prefills.inc()
        if params.structured_output is not None:
            m.structured.labels(params.structured_output.kind).inc()
        r.active = self.active[r.rid] = Active(
            r.call,
            r.worker.address,
            r.ids,
            params,
            request.priority,
            request.cache_salt,
            local,
            r.queued,
            r.t_admitted,
            carried=r.resumed,
            sent=r.sent,
        )
        self._cut_if_stopping(r.rid, r.active)
        r.queued = False  # the active request's now (active.queued): a take-back sets it too

    def _job(self, r: RelayState) -> Job:
        """The request's prefill job, as the admission queues it (or records it, prefilled locally)."""
        request = r.request
        return Job(
            request_id=r.rid,
            token_ids=r.ids + r.carried,
            sampling=sampling_to_dict(r.params),
            decode_worker=r.worker.worker_id,
            decode_address=r.worker.address,
            decode_epoch=r.worker.epoch,
            decode_host_id=r.worker.host_id,
            deadline_unix=r.deadline,
            traceparent=tracing.traceparent_of(r.rs.span),
            t_received=r.t_recv,
            t_admitted=r.t_admitted,
            priority=request.priority,
            cache_salt=request.cache_salt,
            decode_cached_tokens=r.expect_cached,
            resumed=len(r.carried),
            resumed_chars=r.carried_chars,
        )

    async def _next_event(self, r: RelayState, context):
        """The decode stream's next event, or None once the request has gone on on another decode
        worker because its own was lost (_resume). A loss it may not resume from raises."""
        active = r.active
        try:
            if r.unaccepted is not None:
                ev, r.unaccepted = r.unaccepted, None
                if isinstance(ev, grpc.aio.AioRpcError):
                    raise ev
            else:
                ev = await r.call.read()
            if ev is grpc.aio.EOF:
                lost = "decode stream ended without a finish"
            else:
                lost = ev.error if ev.error and ev.worker_stopping else ""
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            ev, lost = e, f"{e.code().name}: {e.details()}"
        except asyncio.CancelledError:  # the call, cut by check_waiting; or this task, cancelled
            if not active.moved or active.aborted or asyncio.current_task().cancelling():
                raise
            ev, lost = None, active.moved
        if lost and active.resumes < self.s.decode_resumes and not (active.lost or active.aborted):
            await self._go_on_elsewhere(r, ev, lost, context)
            return None
        if ev is None:  # (moved, and it may not resume after all)
            raise UpstreamError(lost, grpc.StatusCode.UNAVAILABLE)
        if isinstance(ev, grpc.aio.AioRpcError):
            raise ev
        if ev is grpc.aio.EOF:
            raise Unavailable("decode stream ended without a finish")
        return ev

    async def _go_on_elsewhere(self, r: RelayState, ev, lost: str, context) -> None:
        """Its decode worker was lost: the request goes on on another (_resume), with a new stream
        and span."""
        active, rid = r.active, r.rid
        if active.queued:  # prefilled there: its queue counts go back now (a new leg counts anew)
            active.queued = False
            await self._dequeue(rid, r.work)
        self.placements.ended(
            r.worker.worker_id, r.placed, getattr(ev, "close_seq", 0) or r.close_seq, len(r.ids) + r.sent
        )
        r.close_seq, r.placed = 0, None
        r.dec.__exit__(Unavailable, Unavailable(lost), None)
        r.dec = None
        r.call.cancel()
        old = r.worker
        active.moved, active.lost_seen = "", 0.0
        r.call, r.worker, r.placed, r.dec = await self._resume(
            rid, active, old, lost, r.have, r.deadline, context, r.rs
        )
        log.warning(
            "request %s: decode worker %s lost (%s); resumed on %s after %d tokens",
            rid,
            old.worker_id,
            lost,
            r.worker.worker_id,
            active.carried,
        )

    async def _take_event(self, r: RelayState, ev: w_pb.DecodeEvent) -> bool:
        """Takes in one decode event before its client gets it: a worker's error raises; the first
        token records the prompt's prefix for affinity and the TTFT parts, and gives back the queue
        counts of a local prefill; samples' counts and the replay's record follow. True for the
        request's last event."""
        active, params, rid = r.active, r.params, r.rid
        r.close_seq = ev.close_seq or r.close_seq
        if ev.error:
            code = status_code(ev.error_code) if ev.error_code else None
            r.failure = ev.error if code else f"decode failed: {ev.error}"
            raise UpstreamError(r.failure, code)
        if (ev.logprobs or ev.prompt_logprobs) and self.front.tokenizer is not None:
            await self._name_tokens(ev)
        if ev.token_ids and not active.first:
            self._check_first_token(r, ev)
        if ev.token_ids or ev.finish_reason:
            active.first = True
        if ev.token_ids and not r.first_token:
            r.first_token = active.first_token = time.time()
        if ev.token_ids:
            now, last = time.monotonic(), r.token_at.get(ev.index)
            if last is not None:  # the gap since the sample's last tokens, a token at a time
                for _ in ev.token_ids:
                    self.metrics.inter_token.observe((now - last) / len(ev.token_ids))
            r.token_at[ev.index] = now
        if active.queued and (ev.token_ids or ev.finish_reason):
            active.queued = False
            await self._dequeue(rid, r.work)
        if ev.first_token_unix and rid not in self.first_parts:  # (a resumed leg's: not the first)
            ev.timings.admission_ms = (r.t_admitted - r.t_recv) * 1000
            ev.timings.first_token_ms = (time.time() - ev.first_token_unix) * 1000
            self.first_parts[rid] = ev.timings
        if ev.completion_tokens:
            r.sent_by[ev.index] = ev.completion_tokens
            r.sent = active.sent = sum(r.sent_by.values())
        r.cached = ev.cached_tokens or r.cached
        last = bool(ev.finish_reason) and not ev.more
        if last:
            r.final = ev
            if params.n > 1:  # recorded with every sample's tokens
                r.final = w_pb.DecodeEvent(
                    finish_reason=ev.finish_reason, completion_tokens=r.sent, cached_tokens=ev.cached_tokens
                )
        if r.results is not None:
            r.results[ev.index].add(ev)
            if last and ev.finish_reason != "cancelled":
                # Recorded before the client has the last message, so that a re-send
                # following it finds the request finished (its replay), not running.
                with tracing.tracer().start_span("finish", context=r.rs.ctx):
                    await self._mark(rid, "finished", r.final, results=r.results, first_token=r.first_token)
                r.marked = True
        r.have.add(ev)
        return last

    def _check_first_token(self, r: RelayState, ev: w_pb.DecodeEvent) -> None:
        """The request's first token: the prompt's KV is at the worker now, or on its way, and in the
        prefix cache of the prefill worker that computed it (recorded for affinity). Prompt log
        probabilities must have come whole."""
        if self.affinity or self.prefill_affinity:
            full = self.prefixes.chain(r.ids, r.request.cache_salt, r.hashes)
            if self.affinity:
                self._record(r.worker, full)
            if self.prefill_affinity and ev.prefill_worker:  # (a prefill worker's run is "")
                self._record(WorkerInfo(ev.prefill_worker, "prefill", "", ""), full, self.prefill_prefixes)
        if r.params.prompt_logprobs is not None and not r.active.carried and len(ev.prompt_logprobs) != len(r.ids) - 1:
            raise UpstreamError(
                f"prompt log probabilities: {len(ev.prompt_logprobs)} came for a "
                f"{len(r.ids)}-token prompt (a worker of a release without them?)",
                grpc.StatusCode.INTERNAL,
            )

    def _record_generated(self, r: RelayState) -> None:
        """After the last event: the KV of the prompt and all but the last token is cached at its
        decode worker, for the next turn's affinity."""
        if self.affinity and r.have.tokens[0]:
            self._record(r.worker, self.prefixes.chain(r.ids + r.have.tokens[0][:-1], r.request.cache_salt, r.hashes))

    async def _record_end(self, r: RelayState) -> None:
        """Records how the request ended, unless its last event was recorded already (a replay's)."""
        r.state = "cancelled" if r.final.finish_reason == "cancelled" else "finished"
        if not r.marked:
            with tracing.tracer().start_span("finish", context=r.rs.ctx):
                await self._mark(r.rid, r.state, r.final, first_token=r.first_token)

    def _rpc_error_end(self, r: RelayState, e: grpc.aio.AioRpcError) -> w_pb.DecodeEvent:
        """The decode stream failed with e: raises what the client gets, naming the decode worker;
        or, for a request its client aborted, gives the cancelled event to send it."""
        active = r.active
        if e.code() == grpc.StatusCode.CANCELLED and active is not None and active.lost:
            r.state = "failed"
            raise UpstreamError(active.lost, active.lost_code) from None
        if e.code() == grpc.StatusCode.CANCELLED and active is not None and active.aborted:
            r.state = "cancelled"
            return r.cancelled_event()
        r.state = "cancelled" if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else "failed"
        if e.code() == grpc.StatusCode.UNAVAILABLE:  # say which worker, not just "Socket closed"
            raise Unavailable(
                f"decode worker {r.worker.worker_id} at {r.worker.address} went away ({e.details()}); retry"
            ) from e
        raise e

    async def _release(self, r: RelayState, exc: BaseException | None) -> None:
        """Gives back what the request held, however it ended (exc: the exception it ends with, if
        any): its placement, its active record, its decode call, its queue counts; and records a
        cancelled or failed end."""
        self._admission_answered(r)
        rid, active = r.rid, r.active
        if r.placed is not None:
            self.placements.ended(r.worker.worker_id, r.placed, r.close_seq, len(r.ids) + r.sent)
        if active is not None and self.active.get(rid) is active:  # not another request's (a reused id's)
            del self.active[rid]
            self.first_parts.pop(rid, None)
        if r.state == "finished" and not r.call.done():
            # Its status follows its last event: cancelled now, the call would race the worker's
            # sending it, which gRPC there logs as the servicer's error.
            self.background.start(cancel_once_ended(r.call, STATUS_WAIT_S))
        else:
            r.call.cancel()
        if r.queued or (active is not None and active.queued):
            await self._dequeue(rid, r.work)
        if r.state in ("cancelled", "failed"):
            why = r.failure or (active.lost if active is not None else "")
            if not why and r.state == "failed" and isinstance(exc, Unavailable):
                why = str(exc)  # its decode worker went away, or it could not resume
            # Redis not answering: recording it would keep the client waiting as long again.
            away = isinstance(exc, REDIS_UNREACHABLE)
            await self._mark(rid, r.state, error=why, away=away, first_token=r.first_token)

    @staticmethod
    async def _accepted(call, worker: WorkerInfo, placed: Placement):
        """Waits for the decode worker to accept the stream: None once it has. A worker lost as the
        stream opens (killed, its registry entry not yet lapsed, or draining) gives what came
        instead, gRPC's UNAVAILABLE error or the stream's end, for the caller to resume the request
        on another (the read loop of _events) or to raise (_raise_unaccepted)."""
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            return e
        if first is grpc.aio.EOF:
            return first
        if not first.accepted:
            raise Unavailable(f"decode worker {worker.worker_id} did not accept the request")
        Placements.accepted(placed, first.epoch, first.open_seq)
        return None

    @staticmethod
    def _raise_unaccepted(lost, worker: WorkerInfo) -> None:
        if isinstance(lost, BaseException):
            raise lost
        if lost is not None:
            raise Unavailable(f"decode worker {worker.worker_id} did not accept the request")

    async def _name_tokens(self, ev: w_pb.DecodeEvent) -> None:
        """Set the text of each token in the event's log probabilities (~1 us a token and 0.4 us
        for each of the most likely with it, measured; a long prompt's on a thread, so the loop
        gets its turns meanwhile)."""
        n = len(ev.prompt_logprobs) + len(ev.logprobs)
        if n > NAME_TOKENS_INLINE:
            await asyncio.to_thread(name_tokens, self.front.tokenizer, ev.logprobs, ev.prompt_logprobs)
        else:
            name_tokens(self.front.tokenizer, ev.logprobs, ev.prompt_logprobs)

    async def _mark(
        self,
        rid: str,
        state: str,
        final=None,
        error: str = "",
        results: dict[int, Result] | None = None,
        away: bool = False,
        first_token: float = 0.0,
    ) -> None:
        """Record how a request ended (with its last decode event, if any, and what it sent of each
        sample, for a replay); the hash then expires sooner. While Redis is away (`away`: the
        request failed for it), in the background until it answers: the caller does not wait."""
        key = self.keys.req(rid)
        mapping = {"state": state, "t_finished": time.time()}
        if first_token:
            mapping["t_first_token"] = first_token
        if final is not None:
            mapping.update(
                completion_tokens=final.completion_tokens,
                finish_reason=final.finish_reason,
                cached_tokens=final.cached_tokens,
            )
        if results is not None and len(results) > 1:  # every sample's, as text (below)
            mapping["result_samples"] = message_to_text(
                gen_pb.GenerateResponse(choices=[r.message(i) for i, r in sorted(results.items())])
            )
            mapping["result_starts"] = ",".join(
                f"{r.start}:{r.start_chars}:{int(r.before)}" for _, r in sorted(results.items())
            )
        elif results is not None:
            # As text: the hash is read whole and decoded (GetRequest).
            result = results[0]
            mapping.update(result_tokens=",".join(map(str, result.tokens)), result_text="".join(result.texts))
            if result.start:
                mapping.update(result_start=result.start, result_start_chars=result.start_chars)
            if result.logprobs or result.prompt_logprobs:
                mapping["result_logprobs"] = message_to_text(
                    gen_pb.GenerateResponse(logprobs=result.logprobs, prompt_logprobs=result.prompt_logprobs)
                )
        if error:
            mapping["error"] = fit_details(error)  # (a worker of another release may send it whole)

        async def record():
            async with self.redis.pipeline(transaction=False) as p:
                p.hset(key, mapping=mapping)
                p.expire(key, self.s.finished_ttl_s)
                p.srem(self.keys.router_requests(self.id), rid)
                await p.execute()

        try:
            await self._write(record, f"the end of {rid}", away)
        except Exception:  # noqa: BLE001 - bookkeeping must not hide the real outcome
            log.exception("could not record the end of %s", rid)
