"""The relay: one request from admission to its end, its decode stream's events turned into the
client's messages, and the end recorded in Redis and in the request's span."""

from __future__ import annotations

import asyncio
import sys
import time

import grpc

from splitserve.engine.params import SamplingParams
from splitserve.observability import tracing
from splitserve.router.placement import Placement, Placements
from splitserve.router.requests import (
    NAME_TOKENS_INLINE,
    STATUS_WAIT_S,
    Active,
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
    Unavailable,
    fit_details,
    status_code,
)
from splitserve.service.process import settled
from splitserve.service.redis_state import (
    LOCAL_FIELD,
    QUEUE_FIELDS,
    Job,
    WorkerInfo,
    priority_class,
    queue_counts,
    sampling_to_dict,
)
from splitserve_proto.v1 import generation_pb2 as gen_pb
from splitserve_proto.v1 import worker_pb2 as w_pb


class Relay:
    """RouterServicer's relay part: one request from admission to its end, its decode stream's
    events turned into the client's messages. State: the servicer's."""

    async def _events(self, request: gen_pb.GenerateRequest, context, rs: tracing.rpc_span):
        """Yields (rid, the request_id its client knows, prompt_tokens, DecodeEvent) for every decode
        event of the request; rid differs from the client's for a new attempt (_attempt)."""
        t_recv = time.time()
        m = self.metrics
        adm = tracing.tracer().start_span("admission", context=rs.ctx)
        try:
            # have: what its client has already (resume_from: a stream sent again to go on), prefilled
            # after the prompt (sampling.n > 1: each sample not finished, by its decode worker,
            # Sent.unfinished); the queue counts them with it
            rid, ids, params, have = await self._validate(request)
            self._check_redis()
            carried, carried_chars = (have.tokens[0], have.chars[0]) if params.n == 1 else ([], 0)
            samples = have.unfinished(params.n)
            resumed = have.count()
            work = len(ids) + have.carried(params.n)
            public_id, attempt, was_on = rid, None, ""
            if request.request_id:  # client-chosen: it may exist (see _attempt)
                rid, attempt, was_on = await self._attempt(rid, fingerprint(request), have)
            rs.span.set_attributes(self._genai_attributes(request, rid, ids, params, resumed))
            # High priority (< 0) may use the headroom above admit_fraction, up to the bound itself.
            frac = 1.0 if priority_class(request.priority) == "high" else self.s.admit_fraction
            if self._queue_may_be_full(work):  # fast path: no decode stream opened for a refusal
                *counts, local = await self.redis.hmget(self.keys.admission, *QUEUE_FIELDS, LOCAL_FIELD)
                q, t = queue_counts(counts)
                self.queue_seen, self.local_seen = (q, t, time.monotonic()), int(local or 0)
                if q + 1 > int(self.s.max_queue_requests * frac) or t + work > int(self.s.max_queue_tokens * frac):
                    raise self._refusal(q, t, frac)
            remaining = context.time_remaining()
            deadline = t_recv + remaining if remaining is not None else 0.0
            if not any(self._reachable(w) for w in self.workers):
                # None registered, or none connected: a worker that has just (re)started may be
                # registered by now, and is placed at once (not after the next periodic read).
                await self.refresh_since(time.monotonic())
                if not self.workers:
                    await self._await_registration(deadline)
            hashes = (
                self.prefixes.prompt_chain(ids, request.cache_salt) if self.affinity or self.prefill_affinity else None
            )
            worker, placed, expect_cached = self.pick(
                len(ids) + params.n * params.max_tokens, hashes if self.affinity else None, prefer=was_on
            )
            if params.prompt_logprobs is not None:  # its prompt is computed whole wherever it goes
                expect_cached = 0
            # A stream sent again to go on (its router was lost) goes back to the decode worker that
            # was running it, which holds the KV of its prompt and of the tokens sent in its prefix
            # cache, and prefills only the rest itself: a prefill worker would compute the tokens
            # sent again, behind the other re-sends, and hand all of its KV over.
            going_on = bool(carried) and worker.worker_id == was_on and self.s.prefix_caching
            local = bool(samples) or going_on or self._prefill_locally(work, expect_cached)
            directed = [] if local else self._prefill_worker_for(hashes, request.priority)
            adm.set_attributes(
                {"splitserve.prefill.local": local, "splitserve.prefix.expected_cached_tokens": expect_cached}
            )
        except BaseException as e:
            self._end_admission(adm, e)
            raise
        close_seq = 0  # from the stream's last event
        dec = tracing.rpc_span(
            "splitserve.v1.DecodeWorker/Decode",
            kind=tracing.SpanKind.CLIENT,
            parent=rs.ctx,
            attributes=tracing.rpc_attributes("splitserve.v1.DecodeWorker/Decode")
            | {"server.address": worker.address, "splitserve.decode_worker": worker.worker_id},
        )
        dreq = w_pb.DecodeRequest(
            request_id=rid, prompt_tokens=len(ids), deadline_unix=deadline, priority=request.priority, leg=0
        )
        if local:  # the decode worker prefills it itself; the queue counts it until its first token
            dreq.prompt_token_ids.extend(ids + carried)
            dreq.sampling.CopyFrom(convert.sampling_to_pb(params))
            dreq.cache_salt = request.cache_salt
            dreq.resumed_tokens, dreq.resumed_chars = len(carried), carried_chars
            if samples:
                dreq.resumed_samples.extend(w_pb.ResumedSample(index=i, token_ids=t, chars=c) for i, t, c in samples)
        try:
            peer = self.peers.get(worker.address)
            peer.run = peer.run or worker.epoch  # the run a new channel was opened for (_reconnect_restarted)
            call = peer.stub.Decode(dreq, timeout=remaining, metadata=tracing.inject(dec.ctx))
        except BaseException:
            self.placements.ended(worker.worker_id, placed)
            raise
        state = "failed"
        failure = ""  # the decode worker's message, when its stream ends with an error
        queued = False
        active = None
        sent_by = {i: len(t) for i, t in have.tokens.items()}  # a sample's index -> its completion tokens so far
        sent = sum(sent_by.values())  # completion tokens streamed so far (of all samples)
        cached = 0  # prompt tokens found in a prefix cache, as the first token's event said
        # kept for a replay (_attempt), each sample's: a resumed attempt's after the tokens its client had
        results = (
            {i: Result(len(have.tokens.get(i, ())), have.chars.get(i, 0), i in have.finished) for i in range(params.n)}
            if request.request_id and params.n * params.max_tokens <= self.s.replay_max_tokens
            else None
        )
        marked = False  # the end recorded (_mark) already
        first_token = 0.0  # unix time its first token came here: recorded with its end (GetRequest)
        failed_with = None  # the exception the request ends with (the decode span in use ends with it)
        # The worker lost as the stream opened (_accepted): the request is admitted all the same, and
        # resumes on another at once, as if it was lost later.
        unaccepted = None
        try:
            try:
                try:
                    if local:  # the worker starts on the prompt at once: admit once it accepted (or was lost)
                        unaccepted = await self._accepted(call, worker, placed)
                    t_admitted = time.time()
                    job = Job(
                        request_id=rid,
                        token_ids=ids + carried,
                        sampling=sampling_to_dict(params),
                        decode_worker=worker.worker_id,
                        decode_address=worker.address,
                        decode_epoch=worker.epoch,
                        decode_host_id=worker.host_id,
                        deadline_unix=deadline,
                        traceparent=tracing.traceparent_of(rs.span),
                        t_received=t_recv,
                        t_admitted=t_admitted,
                        priority=request.priority,
                        cache_salt=request.cache_salt,
                        decode_cached_tokens=expect_cached,
                        resumed=len(carried),
                        resumed_chars=carried_chars,
                    )
                    # Disaggregated, the job is queued while the stream opens: a prefill takes longer
                    # than the stream does, and the decode worker holds a handoff that comes first.
                    # Settled: cut off by a cancel while Redis runs it (a slow or stopped Redis), an
                    # admission would be done there but not here, and its counts never returned.
                    got = await settled(
                        self.scripts.run(
                            scripts.admit(
                                self.keys,
                                request_id=rid,
                                job_json=job.to_json(),
                                priority=request.priority,
                                tokens=work,
                                max_requests=self.s.max_queue_requests,
                                max_tokens=self.s.max_queue_tokens,
                                fraction=frac,
                                ttl_s=self.s.request_ttl_s,
                                queue=not local,
                                router_id=self.id,
                                attempt=attempt,
                                directed_to=directed[0] if directed else "",
                                directed_bound=self.s.prefill_affinity_jobs,
                                supersede=bool(resumed),
                            )
                        )
                    )
                    ok, q, t, lt = (int(x) for x in got[:4])
                    if len(got) > 4 and int(got[4]):
                        self.metrics.prefill_directed.inc()
                        adm.set_attributes(
                            {
                                "splitserve.prefill.sent_to": directed[0],
                                "splitserve.prefix.expected_prefill_cached_tokens": directed[1],
                            }
                        )
                    queued = local and ok == 1
                    self.queue_seen, self.local_seen = (q, t, time.monotonic()), lt
                    adm.set_attributes(
                        {"splitserve.queue.requests": q, "splitserve.queue.tokens": t, "splitserve.admitted": ok == 1}
                    )
                    if ok == -1:
                        state = ""
                        raise AlreadyExists(f"request_id {public_id!r} already exists (see GetRequest)")
                    if ok == -2:
                        state = ""
                        raise aborted_first(public_id)
                    if ok == 0:
                        state = ""
                        raise self._refusal(q, t, frac)
                    if not local:  # refused now: the job is marked failed (finally), so no worker runs it
                        unaccepted = await self._accepted(call, worker, placed)
                except BaseException as e:
                    if isinstance(e, asyncio.CancelledError) and state:
                        state = "cancelled"
                    self._end_admission(adm, e)
                    raise
                adm.end()
                m.prompt_tokens.inc(len(ids))
                if local:
                    m.local_prefills.inc()
                if params.structured_output is not None:
                    m.structured.labels(params.structured_output.kind).inc()
                active = self.active[rid] = Active(
                    call,
                    worker.address,
                    ids,
                    params,
                    request.priority,
                    request.cache_salt,
                    local,
                    queued,
                    t_admitted,
                    carried=resumed,
                    sent=sent,
                )
                self._cut_if_stopping(rid, active)
                queued = False  # the active request's now (active.queued): a take-back sets it too
                final = None
                try:
                    while True:
                        try:
                            if unaccepted is not None:
                                ev, unaccepted = unaccepted, None
                                if isinstance(ev, grpc.aio.AioRpcError):
                                    raise ev
                            else:
                                ev = await call.read()
                            lost = (
                                "decode stream ended without a finish"
                                if ev is grpc.aio.EOF
                                else ev.error
                                if ev.error and ev.worker_stopping
                                else ""
                            )
                        except grpc.aio.AioRpcError as e:
                            if e.code() != grpc.StatusCode.UNAVAILABLE:
                                raise
                            ev, lost = e, f"{e.code().name}: {e.details()}"
                        except asyncio.CancelledError:  # the call, cut by check_waiting; or this task, cancelled
                            if not active.moved or active.aborted or asyncio.current_task().cancelling():
                                raise
                            ev, lost = None, active.moved
                        if lost and active.resumes < self.s.decode_resumes and not (active.lost or active.aborted):
                            # Its decode worker was lost: it goes on on another (_resume).
                            if active.queued:  # prefilled there: its queue counts go back now (a new leg counts anew)
                                active.queued = False
                                await self._dequeue(rid, work)
                            self.placements.ended(
                                worker.worker_id, placed, getattr(ev, "close_seq", 0) or close_seq, len(ids) + sent
                            )
                            close_seq, placed = 0, None
                            dec.__exit__(Unavailable, Unavailable(lost), None)
                            dec = None
                            call.cancel()
                            old = worker
                            active.moved, active.lost_seen = "", 0.0
                            call, worker, placed, dec = await self._resume(
                                rid, active, old, lost, have, deadline, context, rs
                            )
                            log.warning(
                                "request %s: decode worker %s lost (%s); resumed on %s after %d tokens",
                                rid,
                                old.worker_id,
                                lost,
                                worker.worker_id,
                                active.carried,
                            )
                            continue
                        if ev is None:  # (moved, and it may not resume after all)
                            raise UpstreamError(lost, grpc.StatusCode.UNAVAILABLE)
                        if isinstance(ev, grpc.aio.AioRpcError):
                            raise ev
                        if ev is grpc.aio.EOF:
                            raise Unavailable("decode stream ended without a finish")
                        close_seq = ev.close_seq or close_seq
                        if ev.error:
                            code = status_code(ev.error_code) if ev.error_code else None
                            failure = ev.error if code else f"decode failed: {ev.error}"
                            raise UpstreamError(failure, code)
                        if (ev.logprobs or ev.prompt_logprobs) and self.front.tokenizer is not None:
                            await self._name_tokens(ev)
                        if ev.token_ids and not active.first and (self.affinity or self.prefill_affinity):
                            # a first token: the prompt's KV is at the worker now, or on its way; and
                            # in the prefix cache of the prefill worker that computed it
                            full = self.prefixes.chain(ids, request.cache_salt, hashes)
                            if self.affinity:
                                self._record(worker, full)
                            if self.prefill_affinity and ev.prefill_worker:  # (a prefill worker's run is "")
                                self._record(
                                    WorkerInfo(ev.prefill_worker, "prefill", "", ""), full, self.prefill_prefixes
                                )
                        if (
                            ev.token_ids
                            and not active.first
                            and params.prompt_logprobs is not None
                            and not active.carried
                            and len(ev.prompt_logprobs) != len(ids) - 1
                        ):
                            raise UpstreamError(
                                f"prompt log probabilities: {len(ev.prompt_logprobs)} came for a "
                                f"{len(ids)}-token prompt (a worker of a release without them?)",
                                grpc.StatusCode.INTERNAL,
                            )
                        if ev.token_ids or ev.finish_reason:
                            active.first = True
                        if ev.token_ids and not first_token:
                            first_token = active.first_token = time.time()
                        if active.queued and (ev.token_ids or ev.finish_reason):
                            active.queued = False
                            await self._dequeue(rid, work)
                        if ev.first_token_unix and rid not in self.first_parts:  # (a resumed leg's: not the first)
                            ev.timings.admission_ms = (t_admitted - t_recv) * 1000
                            ev.timings.first_token_ms = (time.time() - ev.first_token_unix) * 1000
                            self.first_parts[rid] = ev.timings
                        if ev.completion_tokens:
                            sent_by[ev.index] = ev.completion_tokens
                            sent = active.sent = sum(sent_by.values())
                        cached = ev.cached_tokens or cached
                        last = ev.finish_reason and not ev.more
                        if last:
                            final = ev
                            if params.n > 1:  # recorded with every sample's tokens
                                final = w_pb.DecodeEvent(
                                    finish_reason=ev.finish_reason,
                                    completion_tokens=sent,
                                    cached_tokens=ev.cached_tokens,
                                )
                        if results is not None:
                            results[ev.index].add(ev)
                            if last and ev.finish_reason != "cancelled":
                                # Recorded before the client has the last message, so that a re-send
                                # following it finds the request finished (its replay), not running.
                                with tracing.tracer().start_span("finish", context=rs.ctx):
                                    await self._mark(rid, "finished", final, results=results, first_token=first_token)
                                marked = True
                        have.add(ev)
                        yield rid, public_id, len(ids), ev
                        if last:
                            if self.affinity and have.tokens[0]:  # the KV of all but the last token is cached there
                                self._record(
                                    worker, self.prefixes.chain(ids + have.tokens[0][:-1], request.cache_salt, hashes)
                                )
                            break
                except asyncio.CancelledError:
                    if active.lost:
                        state = "failed"
                        raise UpstreamError(active.lost, active.lost_code) from None
                    if not active.aborted:
                        state = "cancelled"
                        raise
                    state = "cancelled"
                    final = w_pb.DecodeEvent(finish_reason="cancelled", completion_tokens=sent, cached_tokens=cached)
                    yield rid, public_id, len(ids), final
                except GeneratorExit:
                    # The client cancelled while its handler was writing a message, not reading one:
                    # the handler's task is cancelled outside this generator, which is then closed.
                    state = "cancelled"
                    raise
                state = "cancelled" if final.finish_reason == "cancelled" else "finished"
                if not marked:
                    with tracing.tracer().start_span("finish", context=rs.ctx):
                        await self._mark(rid, state, final, first_token=first_token)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.CANCELLED and active is not None and active.lost:
                    state = "failed"
                    raise UpstreamError(active.lost, active.lost_code) from None
                if e.code() == grpc.StatusCode.CANCELLED and active is not None and active.aborted:
                    state = "cancelled"
                    yield (
                        rid,
                        public_id,
                        len(ids),
                        w_pb.DecodeEvent(finish_reason="cancelled", completion_tokens=sent, cached_tokens=cached),
                    )
                    await self._mark(rid, state, first_token=first_token)
                    return
                state = "cancelled" if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else "failed"
                if e.code() == grpc.StatusCode.UNAVAILABLE:  # say which worker, not just "Socket closed"
                    raise Unavailable(
                        f"decode worker {worker.worker_id} at {worker.address} went away ({e.details()}); retry"
                    ) from e
                raise
            finally:
                if placed is not None:
                    self.placements.ended(worker.worker_id, placed, close_seq, len(ids) + sent)
                if active is not None and self.active.get(rid) is active:  # not another request's (a reused id's)
                    del self.active[rid]
                    self.first_parts.pop(rid, None)
                if state == "finished" and not call.done():
                    # Its status follows its last event: cancelled now, the call would race the worker's
                    # sending it, which gRPC there logged as the servicer's error (a soak: 1 of ~7000).
                    self.background.start(cancel_once_ended(call, STATUS_WAIT_S))
                else:
                    call.cancel()
                if queued or (active is not None and active.queued):
                    await self._dequeue(rid, work)
                if state in ("cancelled", "failed"):
                    why = failure or (active.lost if active is not None else "")
                    if not why and state == "failed" and isinstance(sys.exc_info()[1], Unavailable):
                        why = str(sys.exc_info()[1])  # its decode worker went away, or it could not resume
                    # Redis not answering: recording it would keep the client waiting as long again.
                    await self._mark(
                        rid,
                        state,
                        error=why,
                        away=isinstance(sys.exc_info()[1], REDIS_UNREACHABLE),
                        first_token=first_token,
                    )
        except BaseException as e:
            failed_with = e
            raise
        finally:  # (a `with dec`, but dec is another span once the request resumes elsewhere)
            if dec is not None:
                dec.__exit__(type(failed_with) if failed_with is not None else None, failed_with, None)

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

    def _timings(self, rid: str, t0: float, t_first: float | None, ev) -> gen_pb.Timings:
        now = time.perf_counter()
        tm = gen_pb.Timings()
        first = self.first_parts.get(rid)
        if first is not None:
            tm.CopyFrom(first)
            if ev is not None and ev.timings.kv_transfer_ms:  # the KV may land after the first token went out
                tm.kv_transfer_ms = ev.timings.kv_transfer_ms
        elif ev is not None and ev.HasField("timings"):
            tm.CopyFrom(ev.timings)
        tm.e2e_ms = (now - t0) * 1000
        if t_first is not None:
            tm.ttft_ms = (t_first - t0) * 1000
            tm.decode_ms = (now - t_first) * 1000
        return tm

    def _finish(
        self,
        rs: tracing.rpc_span,
        resp: gen_pb.GenerateResponse,
        rid: str,
        n_prompt: int,
        ev,
        t0: float,
        t_first: float | None,
        ended: list,
        n: int,
    ) -> None:
        """A sample's last message: its finish reason, usage and timings. ended: the finish events of
        the request's samples so far, this one's last; the last sample's (or a cancellation) records
        the request on the span and in the metrics. n: its samples (TPOT is its longest one's steps)."""
        resp.finish_reason = ev.finish_reason
        resp.usage.CopyFrom(
            gen_pb.Usage(prompt_tokens=n_prompt, completion_tokens=ev.completion_tokens, cached_tokens=ev.cached_tokens)
        )
        resp.timings.CopyFrom(self._timings(rid, t0, t_first, ev))
        if ev.more:
            return
        t = resp.timings
        out = sum(e.completion_tokens for e in ended) if ev.finish_reason != "cancelled" else ev.completion_tokens
        rs.span.set_attributes(
            {
                "gen_ai.usage.output_tokens": out,
                "gen_ai.usage.cache_read.input_tokens": resp.usage.cached_tokens,
                "gen_ai.response.finish_reasons": [e.finish_reason for e in ended],
                "splitserve.ttft_ms": t.ttft_ms,
                "splitserve.e2e_ms": t.e2e_ms,
            }
        )
        if resp.finish_reason == "cancelled":
            self.metrics.cancelled.labels("abort").inc()
        self.metrics.prompt_tokens_cached.inc(resp.usage.cached_tokens)
        longest = max(e.completion_tokens for e in ended) if ev.finish_reason != "cancelled" else 0
        self.metrics.observe_finished(t, resp.finish_reason, out, longest if n > 1 else None)

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

    def _genai_attributes(self, request, rid: str, ids: list[int], params: SamplingParams, resumed: int) -> dict:
        kind = request.WhichOneof("input")
        attrs = {
            "splitserve.request_id": rid,
            "gen_ai.operation.name": "chat" if kind == "messages" else "text_completion",
            "gen_ai.system": "splitserve",
            "gen_ai.request.model": self.front.name,
            "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.usage.input_tokens": len(ids),
        }
        if params.top_k:
            attrs["gen_ai.request.top_k"] = params.top_k
        if params.seed is not None:
            attrs["gen_ai.request.seed"] = params.seed
        if params.presence_penalty:
            attrs["gen_ai.request.presence_penalty"] = params.presence_penalty
        if params.frequency_penalty:
            attrs["gen_ai.request.frequency_penalty"] = params.frequency_penalty
        if params.repetition_penalty != 1.0:
            attrs["splitserve.request.repetition_penalty"] = params.repetition_penalty
        if params.logprobs is not None:
            attrs["splitserve.request.logprobs"] = params.logprobs
        if params.prompt_logprobs is not None:
            attrs["splitserve.request.prompt_logprobs"] = params.prompt_logprobs
        if params.structured_output is not None:
            attrs["splitserve.request.structured_output"] = params.structured_output.kind
        if params.n > 1:
            attrs["gen_ai.request.choice.count"] = params.n
        if request.priority:
            attrs["splitserve.priority"] = request.priority
        if resumed:  # a stream sent again to go on (resume_from): the tokens its client had
            attrs["splitserve.resume_from.tokens"] = resumed
        return attrs
