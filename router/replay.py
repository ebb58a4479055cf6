"""Idempotency, replay and resume: a client-chosen request_id's attempts, a finished request's recorded
result, and a request resumed on another decode worker after its own was lost."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from splitserve.observability import tracing
from splitserve.router.requests import ATTEMPT_SEP, Active, Recorded, Sent, aborted_first, log, message_from_text
from splitserve.service import convert
from splitserve.service import redis_scripts as scripts
from splitserve.service.errors import (
    AlreadyExists,
    ServiceError,
    Unavailable,
)
from splitserve.service.redis_state import (
    FINAL_STATES,
    MAY_RUN_AGAIN,
    Job,
    WorkerInfo,
    sampling_to_dict,
)
from splitserve.service.tenants import unscoped
from splitserve_proto.v1 import generation_pb2 as gen_pb
from splitserve_proto.v1 import worker_pb2 as w_pb


class Replay:
    """RouterServicer's replay part: a client-chosen request_id's attempts, a finished request's
    recorded result, and a request resumed after its decode worker was lost. State: the servicer's."""

    async def _attempt(self, rid: str, fp: str, have: Sent) -> tuple[str, scripts.Attempt, str]:
        """The id a request with a client-chosen request_id runs under, what admission checks of it
        (scripts.Attempt; fp: its fingerprint), and, for one sent again to go on (below), the decode worker
        its latest attempt ran on ("" otherwise). A new id runs under itself. The id of a request that
        finished answers with its recorded result (raises Recorded). One whose latest attempt ended
        unfinished (it failed, or its client went away or its deadline passed) may be sent again
        (a client's retry, gRPC's own included): it runs as a new attempt under its own id
        (request_id#n), so nothing left of the earlier one (a job still queued, a late handoff) can
        touch it. Any other that exists is refused ALREADY_EXISTS (a request never runs twice, nor
        again after an Abort, nor under the id of a different request), and one that an Abort came
        before is refused CANCELLED. have: what its client has, sent again to go on (resume_from)
        after it lost its stream with its router: then a latest attempt still running is superseded
        by the new one (admit.lua), not waited for (a dead router's would run on until reaped), and
        the replay of one that finished is only what the client does not have."""
        supersede = have.count() > 0
        first = self.keys.req(rid)
        state, early, aborted, attempts, current, fp_first, was_on = await self.redis.hmget(
            first, "state", "early", "aborted", "attempts", "current", "fingerprint", "decode_worker"
        )
        if state is None:
            return rid, scripts.Attempt(seen=0, fingerprint=fp), ""
        if early == b"1":
            raise aborted_first(unscoped(rid))
        if fp_first is not None and fp_first.decode() != fp:
            raise AlreadyExists(
                f"request_id {unscoped(rid)!r} belongs to a different request (its input, sampling or priority "
                "differ); send this one with a new request_id"
            )
        latest = current.decode() if current else rid
        if latest != rid:
            state, aborted, was_on = await self.redis.hmget(self.keys.req(latest), "state", "aborted", "decode_worker")
        if state == b"finished":
            if (recorded := await self._recorded(rid, latest, have)) is not None:
                raise Recorded(recorded)
            raise AlreadyExists(
                f"request_id {unscoped(rid)!r} already exists and finished, and its result was not kept (only "
                f"one of at most replay_max_tokens = {self.s.replay_max_tokens} tokens, n x "
                "max_tokens, is); see GetRequest"
            )
        if aborted:
            raise AlreadyExists(
                f"request_id {unscoped(rid)!r} was aborted (see GetRequest); send it with a new request_id"
            )
        if (
            state is not None
            and state.decode() not in MAY_RUN_AGAIN
            and not (supersede and state.decode() not in FINAL_STATES)
        ):  # None: the latest's hash expired
            raise AlreadyExists(
                f"request_id {unscoped(rid)!r} already exists and is {state.decode()} (see GetRequest); the same "
                "request may be sent again once it has ended"
            )
        n = int(attempts or 1)
        return (
            f"{rid}{ATTEMPT_SEP}{n + 1}",
            scripts.Attempt(seen=n, fingerprint=fp, first_id=rid, latest_id=latest),
            (was_on or b"").decode() if supersede else "",
        )

    async def _recorded(self, rid: str, attempt: str, have: Sent) -> list[gen_pb.GenerateResponse] | None:
        """The result a finished attempt left in its hash (_mark), as its replay: a message for each
        sample, after the tokens its client has of it (have, resume_from: the last message did not
        reach it), none for a sample it has whole (finished); None if the attempt left none."""
        (
            tokens,
            text,
            reason,
            n_prompt,
            n_out,
            n_cached,
            logprobs,
            start,
            start_chars,
            samples,
            starts,
        ) = await self.redis.hmget(
            self.keys.req(attempt),
            "result_tokens",
            "result_text",
            "finish_reason",
            "prompt_tokens",
            "completion_tokens",
            "cached_tokens",
            "result_logprobs",
            "result_start",
            "result_start_chars",
            "result_samples",
            "result_starts",
        )
        if samples is not None:  # n > 1: each sample's, and where it started (_mark)
            kept = message_from_text(samples).choices
            begun = [tuple(int(x) for x in s.split(":")) for s in starts.decode().split(",")]
        elif tokens is None:
            return None
        else:
            kept = [
                gen_pb.GenerateResponse(
                    token_ids=[int(t) for t in tokens.split(b",") if t],
                    text=(text or b"").decode(),
                    finish_reason=(reason or b"").decode(),
                    usage=gen_pb.Usage(completion_tokens=int(n_out or 0)),
                )
            ]
            if logprobs:
                kept[0].MergeFrom(message_from_text(logprobs))  # (only log probabilities)
            begun = [(int(start or 0), int(start_chars or 0), 0)]
        out = []
        for sample, (first, first_chars, before) in zip(kept, begun):
            i = sample.index
            if before and i not in have.finished:
                raise AlreadyExists(
                    f"request_id {unscoped(rid)!r} already exists and finished; sample {i} had finished before "
                    "its last attempt, which went on from resume_from: only what came after was kept, "
                    "for a re-send whose resume_from.samples holds that sample finished"
                )
            if i in have.finished:
                continue
            resp = self._replay_of(rid, sample, first, first_chars, have.tokens.get(i, []), have.chars.get(i, 0))
            resp.usage.prompt_tokens, resp.usage.cached_tokens = int(n_prompt or 0), int(n_cached or 0)
            out.append(resp)
        return out

    @staticmethod
    def _replay_of(
        rid: str, kept: gen_pb.GenerateResponse, start: int, start_chars: int, carried: list[int], chars: int
    ) -> gen_pb.GenerateResponse:
        """A sample's kept result (its tokens after the `start` its attempt went on from) as the
        replay to a client that has `carried` tokens (`chars` characters) of it: what comes after."""
        if len(carried) < start:
            raise AlreadyExists(
                f"request_id {unscoped(rid)!r} already exists and finished, going on from {start} tokens its "
                "client had (resume_from): only what came after them was kept, for a re-send whose "
                "resume_from holds at least those"
            )
        skip, skip_chars = len(carried) - start, chars - start_chars
        if carried[start:] != list(kept.token_ids[:skip]) or not 0 <= skip_chars <= len(kept.text):
            raise AlreadyExists(
                f"request_id {unscoped(rid)!r} already exists and finished with other tokens than "
                "resume_from's (or fewer characters than its text_chars)"
            )
        resp = gen_pb.GenerateResponse(
            request_id=rid,
            index=kept.index,
            token_ids=kept.token_ids[skip:],
            text=kept.text[skip_chars:],
            finish_reason=kept.finish_reason,
            replayed=True,
            usage=kept.usage,
            logprobs=kept.logprobs[skip:],
        )
        if not carried:  # they came with the first token
            resp.prompt_logprobs.extend(kept.prompt_logprobs)
        return resp

    async def _latest(self, rid: str) -> str:
        """The id of a request_id's latest attempt."""
        current = await self.redis.hget(self.keys.req(rid), "current")
        return current.decode() if current else rid

    async def _resume(
        self,
        rid: str,
        a: Active,
        lost: WorkerInfo,
        why: str,
        have: Sent,
        deadline: float,
        context,
        rs: tracing.rpc_span,
    ) -> tuple:
        """Resume a request whose decode worker was lost (killed, unreachable, or stopped past its
        drain time) on another: its prompt and the tokens its client has (`have`, with the
        characters of their text; none yet, if it was lost before its first token) are prefilled
        again, by a prefill worker or by the new decode worker (as _prefill_locally says), which goes on from
        there and sends only what is new. A request of sampling.n > 1 samples, once any has tokens:
        the new decode worker prefills each sample not finished (Sent.unfinished, resume_samples),
        each going on from its own tokens. This is a new leg (resume.lua): a job of an earlier one,
        still queued or prefilling for the lost worker, is superseded. Greedy or seeded, the stream
        is the one it would have been (the engine skips the draws of the tokens carried). Returns
        (the new Decode call, its worker, its placement, its span)."""
        ids, params = a.ids, a.params
        generated, chars, samples = have.tokens[0], have.chars[0], have.unfinished(params.n)
        if generated:  # its prompt log probabilities went with its first token
            params = dataclasses.replace(params, prompt_logprobs=None)
        tokens = ids + generated
        carried = have.carried(params.n)
        try:
            worker, placed, _ = self.pick(len(ids) + params.n * params.max_tokens, exclude=lost.worker_id)
        except ServiceError as e:
            raise Unavailable(
                f"decode worker {lost.worker_id} was lost ({why}), and the request could not resume on another: {e}"
            ) from None
        local = bool(samples) or self._prefill_locally(len(tokens))
        a.resumes += 1
        log.info("request %s: decode worker %s lost (%s); resuming on %s", rid, lost.worker_id, why, worker.worker_id)
        rs.span.add_event(
            "resumed",
            {
                "splitserve.decode_worker.lost": lost.worker_id,
                "splitserve.decode_worker": worker.worker_id,
                "splitserve.lost.reason": why[:300],
                "splitserve.resumed_tokens": carried,
                "splitserve.prefill.local": local,
            }
            | ({"splitserve.resumed_samples": len(samples)} if samples else {}),
        )
        dec = tracing.rpc_span(
            "splitserve.v1.DecodeWorker/Decode",
            kind=tracing.SpanKind.CLIENT,
            parent=rs.ctx,
            attributes=tracing.rpc_attributes("splitserve.v1.DecodeWorker/Decode")
            | {
                "server.address": worker.address,
                "splitserve.decode_worker": worker.worker_id,
                "splitserve.resumed_tokens": carried,
            },
        )
        dreq = w_pb.DecodeRequest(
            request_id=rid, prompt_tokens=len(ids), deadline_unix=deadline, priority=a.priority, leg=a.resumes
        )
        if samples:
            dreq.prompt_token_ids.extend(ids)
            dreq.resumed_samples.extend(w_pb.ResumedSample(index=i, token_ids=t, chars=c) for i, t, c in samples)
        elif local:
            dreq.prompt_token_ids.extend(tokens)
            dreq.resumed_tokens, dreq.resumed_chars = len(generated), chars
        if local:
            dreq.sampling.CopyFrom(convert.sampling_to_pb(params))
            dreq.cache_salt = a.cache_salt
        call = None
        try:
            peer = self.peers.get(worker.address)
            peer.run = peer.run or worker.epoch
            call = peer.stub.Decode(dreq, timeout=context.time_remaining(), metadata=tracing.inject(dec.ctx))
            if local:
                self._raise_unaccepted(await self._accepted(call, worker, placed), worker)
            now = time.time()
            job = Job(
                request_id=rid,
                token_ids=tokens,
                sampling=sampling_to_dict(params),
                decode_worker=worker.worker_id,
                decode_address=worker.address,
                decode_epoch=worker.epoch,
                decode_host_id=worker.host_id,
                deadline_unix=deadline,
                traceparent=tracing.traceparent_of(rs.span),
                t_received=now,
                t_admitted=now,
                priority=a.priority,
                cache_salt=a.cache_salt,
                resumed=len(generated),
                resumed_chars=chars,
                leg=a.resumes,
            )
            ok, q, t = (
                int(x)
                for x in await self.scripts.run(
                    scripts.resume(
                        self.keys,
                        request_id=rid,
                        job_json=job.to_json(),
                        priority=a.priority,
                        tokens=len(tokens),
                        max_requests=self.s.max_queue_requests,
                        max_tokens=self.s.max_queue_tokens,
                        ttl_s=self.s.request_ttl_s,
                        queue=not local,
                        lost_worker=lost.worker_id,
                    )
                )
            )
            if ok == -2 and not a.aborted and await self.redis.hget(self.keys.req(rid), "aborted") == b"1":
                # An Abort through another router, whose Cancel could not reach the lost worker: it is
                # answered as this router's own, not as a request that has ended.
                a.aborted = True
            if ok == -2 and a.aborted:
                raise asyncio.CancelledError()  # (answered as the Abort's: _events)
            if ok != 1:
                raise Unavailable(
                    f"decode worker {lost.worker_id} was lost ({why}), and the request could not resume "
                    "on another: "
                    + ("it has ended (see GetRequest)" if ok == -2 else f"the queue is full ({q} requests, {t} tokens)")
                )
            if not local:
                self._raise_unaccepted(await self._accepted(call, worker, placed), worker)
        except BaseException as e:
            if call is not None:
                call.cancel()
            self.placements.ended(worker.worker_id, placed)
            dec.__exit__(type(e), e, None)
            raise
        self.metrics.resumed.inc()
        a.call, a.address, a.local, a.first, a.carried = call, worker.address, local, False, carried
        if a.aborted:  # an Abort that came meanwhile cancelled the lost worker's call, not this one
            call.cancel()
        self._cut_if_stopping(rid, a)
        return call, worker, placed, dec

    def _replayed(
        self, rs: tracing.rpc_span, responses: list[gen_pb.GenerateResponse], t0: float
    ) -> list[gen_pb.GenerateResponse]:
        """A finished request's recorded result, sent again (a message a sample): on the span and in
        the metrics as such."""
        for resp in responses:
            resp.timings.e2e_ms = (time.perf_counter() - t0) * 1000
            resp.request_id = unscoped(resp.request_id)  # (a tenant's, as its client knows it)
        rs.span.set_attributes(
            {
                "splitserve.replayed": True,
                "gen_ai.response.finish_reasons": [r.finish_reason for r in responses],
                "gen_ai.usage.output_tokens": sum(r.usage.completion_tokens for r in responses),
            }
        )
        self.metrics.replayed.inc()
        return responses
