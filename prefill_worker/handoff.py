"""The KV handoff, producer side (see splitserve.handoff for both sides and who owns what)."""

from __future__ import annotations

import concurrent.futures as cf
import logging
import queue
import time
from typing import TYPE_CHECKING

import grpc
import redis

from splitserve.engine.outputs import RequestOutput, placeholder_logprobs
from splitserve.handoff import layout as kv_layout
from splitserve.handoff.arena import ArenaFull
from splitserve.handoff.layout import KVExport, payload_nbytes
from splitserve.observability import tracing
from splitserve.service import convert, tls
from splitserve.service.errors import REDIS_UNREACHABLE, code_of
from splitserve.service.grpc_server import options
from splitserve.service.redis_state import Job
from splitserve_proto.v1 import worker_pb2 as w_pb
from splitserve_proto.v1 import worker_pb2_grpc

if TYPE_CHECKING:
    from splitserve.prefill_worker.worker import InFlight

log = logging.getLogger("splitserve.prefill")

HANDOFF_LEASE_S = 60.0

# The status a client gets when its KV handoff failed. No blocks on the decode side in time is
# overload; a decode worker gone is unavailable; anything else is ours (INTERNAL), not the client's.
HANDOFF_FAILURE_STATUS = {
    grpc.StatusCode.DEADLINE_EXCEEDED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}


def wants_it_whole(e: grpc.RpcError) -> bool:
    """A decode worker refused KV sent without its first tokens: it holds less of the prompt than
    expected, or it is of a release that reads only whole payloads (a rolling update)."""
    return e.code() == grpc.StatusCode.FAILED_PRECONDITION or (
        e.code() == grpc.StatusCode.INVALID_ARGUMENT and "handle.layout_version" in (e.details() or "")
    )


class HandoffSender:
    """The prefill worker's side of the KV handoff: the first token sent ahead, each ended prefill's KV
    written into a region of this worker's arena (or kept for the bytes), the decode worker's PutKV
    called with its handle, and the region freed once it answers. State: the worker's
    (PrefillWorker.__init__)."""

    def _hand_on(self, fl: InFlight, out: RequestOutput) -> None:
        """A prefill that has ended: its first token and KV go to its decode worker (a handoff on the
        peers' threads, submitted last), or its failure does."""
        if out.error:  # its format failed at the first token (Grammars.failure): the request fails
            fl.span.set_status(tracing.Status(tracing.StatusCode.ERROR, out.error))
            self._abandon(fl, {}, "failed")
            code = code_of(out.exception) if out.exception is not None else grpc.StatusCode.INTERNAL
            self.peers.submit(fl.job.decode_address, "handoff", self._give_up, fl.job, code, out.error)
            return
        fl.cached_tokens = out.num_cached_tokens
        fl.span.set_attribute("splitserve.prefix_cache.tokens", out.num_cached_tokens)
        fl.span.end(end_time=tracing.ns(fl.t_end))
        self.metrics.jobs.labels("prefilled").inc()
        fl.kv_span = tracing.tracer().start_span(
            "kv transfer",
            context=tracing.context_of(fl.job.traceparent),
            kind=tracing.SpanKind.CLIENT,
            start_time=tracing.ns(fl.t_end),
            attributes={"splitserve.request_id": out.request_id, "server.address": fl.job.decode_address},
        )
        if out.finish_reason == "prefilled":
            # The token goes out ahead of the KV: its copies (export, import) are off the TTFT path.
            # Waiting a moment for it keeps the export's copy from slowing its trip (measured: first
            # token part 2.9 -> 2.0 ms at light load); a busy decode worker costs at most 5 ms here.
            self._first_token(fl, out, wait_s=0.005)
            rid = out.request_id
            # Over shared memory, the region leaves out the KV the decode worker is expected to hold
            # (prefix affinity), and the engine keeps the whole until the handoff is over, should
            # the decode worker want it whole after all (_handoff). Bytes are cut from a whole copy.
            start = self._shm_start(fl.job, len(fl.job.token_ids))  # (the prompt's KV)
            off, view, start = self._region(rid, start)
            try:
                export = self.engine.export_kv(rid, view, start)
                if not start:
                    self.engine.release(rid)  # the KV now lives in the region
                self.peers.submit(fl.job.decode_address, "handoff", self._handoff, fl, export, off, view)
            except BaseException:  # not handed on: the region is this thread's to free (_output_failed)
                if view is not None:
                    view.release()
                if off is not None:
                    self.arena.free(off)
                raise
        else:  # the first token already finished it (eos, stop, max_tokens=1)
            job = fl.job
            seq_tokens = list(job.token_ids) + list(out.new_token_ids)
            logprobs = list(out.new_logprobs or [])
            if logprobs and job.resumed:  # (the tokens it came with)
                logprobs[:0] = placeholder_logprobs(job.token_ids[job.prompt_len :])
            export = KVExport(
                out.request_id,
                job.prompt_len,
                seq_tokens,
                job.params(),
                None,
                0,
                "",
                logprobs=logprobs,
                prompt_logprobs=out.prompt_logprobs or [],
                resumed=job.resumed,
                resumed_chars=job.resumed_chars,
            )
            self.peers.submit(
                job.decode_address,
                "handoff",
                self._handoff,
                fl,
                export,
                None,
                None,
                out.finish_reason or "error",
                out.new_text,
            )

    def _transport(self, job: Job) -> str:
        """How a job's KV goes to its decode worker (kv_transport; auto: shared memory on this host)."""
        if self.s.kv_transport != "auto":
            return self.s.kv_transport
        return "shm" if job.decode_host_id == self.host else "grpc"

    def _shm_start(self, job: Job, num_tokens: int) -> int:
        """The first token whose KV goes into the region, for a job whose KV goes over shared memory:
        the decode worker is expected to hold the ones before. 0 (the whole, and the engine's
        blocks freed at once) for bytes (cut in _handoff), or when keeping this KV in the engine
        would leave it short of blocks for a forward's worth of new prompts."""
        if not job.decode_cached_tokens or self._transport(job) != "shm":
            return 0
        pool = self.engine.cache.pool
        if not pool.can_allocate(pool.blocks_for(self.s.prefill_token_budget)):
            return 0
        return min(job.decode_cached_tokens, num_tokens - 1)

    def _release_kept(self) -> None:
        """Free the engine's copy of the KV of handoffs that are over (on the engine's thread)."""
        while True:
            try:
                rid = self.to_release.get_nowait()
            except queue.Empty:
                return
            self.engine.release(rid)

    def _first_token(self, fl: InFlight, out: RequestOutput, wait_s: float) -> None:
        """Send the first token to its decode worker, on the stream kept open to it (with a call of
        its own to a worker that has no FirstTokens); waits up to wait_s for it to leave."""
        job = fl.job
        req = w_pb.FirstTokenRequest(
            request_id=job.request_id,
            token_ids=out.new_token_ids,
            text=out.new_text,
            queue_ms=fl.queue_ms,
            prefill_ms=fl.prefill_ms,
            prefill_end_unix=fl.t_end,
            cached_tokens=fl.cached_tokens,
            logprobs=convert.logprobs_to_pb(out.new_logprobs),
            prompt_logprobs=convert.logprobs_to_pb(out.prompt_logprobs),
            prefill_worker=self.name,
            resumed_tokens=job.resumed,
            leg=job.leg,
        )
        peer = self.peers.get(job.decode_address)
        if self.token_streams.send(job.decode_address, peer.stub, req, wait_s):
            return
        fut = self.peers.submit(job.decode_address, "first-token", peer.stub.FirstToken, req, timeout=HANDOFF_LEASE_S)

        def done(f) -> None:  # a failure here is reported (and handled) by the KV handoff that follows
            if f.exception() is not None:
                log.debug("first token of %s not sent: %s", job.request_id, f.exception())

        fut.add_done_callback(done)
        cf.wait([fut], timeout=wait_s)

    def _handoff(
        self, fl: InFlight, export, off: int | None, view, finish_reason: str = "", text: str | None = None
    ) -> None:
        job = fl.job
        span = fl.kv_span
        transport = "none"
        kept = export.start > 0  # the engine keeps the KV for this handoff (on_output)
        try:  # (building the message too: a failure there held the job, its KV and its entry for good)
            seq = convert.sequence_to_pb(
                export,
                finish_reason=finish_reason,
                queue_ms=fl.queue_ms,
                prefill_ms=fl.prefill_ms,
                traceparent=tracing.traceparent_of(fl.kv_span),
            )
            if text is not None:
                seq.text = text
            seq.prefill_end_unix, seq.cached_tokens, seq.prefill_worker = fl.t_end, fl.cached_tokens, self.name
            seq.leg = job.leg
            stub = self._stub(job.decode_address)
            if finish_reason:
                stub.PutKV(w_pb.PutKVRequest(sequence=seq), timeout=30)
            else:
                transport = self._transport(job) if off is not None else "grpc"
                # Bytes leave out the KV the decode worker is expected to hold (prefix affinity); so
                # did the region (on_output).
                start = min(job.decode_cached_tokens, export.num_tokens - 1) if transport == "grpc" else export.start
                span.set_attribute("splitserve.kv.transport", transport)
                try:
                    nbytes = self._put(stub, seq, export, off, view, transport, start)
                except grpc.RpcError as e:
                    if not start or not wants_it_whole(e):
                        raise
                    log.info(
                        "%s: decode worker %s did not take the KV without its first %d tokens (%s); sending it whole",
                        job.request_id,
                        job.decode_worker,
                        start,
                        e.details(),
                    )
                    self.metrics.kv_resent.inc()
                    if export.start:  # the region holds a part: a new one, the whole, from the engine's KV
                        view.release()  # first: a handoff waiting for room must not hold any
                        self.arena.free(off)
                        off = view = None
                        off, view, _ = self._region(job.request_id)  # (read here: no step writes held blocks)
                        transport = transport if off is not None else "grpc"
                        export = self.engine.export_kv(job.request_id, view)
                    start = 0
                    nbytes = self._put(stub, seq, export, off, view, transport, start)
                secs = time.time() - fl.t_end
                span.set_attributes(
                    {
                        "splitserve.kv.bytes": nbytes,
                        "splitserve.kv.tokens": export.num_tokens,
                        "splitserve.kv.start_token": start,
                        "splitserve.kv.gbps": nbytes / max(secs, 1e-9) / 1e9,
                    }
                )
                self.metrics.kv_unsent.inc(start)
                self.metrics.kv_bytes.labels(transport).inc(nbytes)
                self.metrics.kv_seconds.labels(transport).observe(secs)
                self.metrics.kv_size.labels(transport).observe(nbytes)
            span.set_attribute("rpc.grpc.status_code", 0)
        except grpc.RpcError as e:
            span.set_attribute("rpc.grpc.status_code", e.code().value[0])
            if e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.CANCELLED):  # (or it is of a later leg there)
                log.info("request %s's stream ended before its KV arrived: %s", job.request_id, e.details())
            elif e.code() == grpc.StatusCode.ALREADY_EXISTS:
                # A job claimed from a prefill worker that died after (or as) its handoff went
                # through: the decode worker holds the KV, and the stream runs on.
                log.info(
                    "request %s: decode worker %s has its KV already (%s)",
                    job.request_id,
                    job.decode_worker,
                    e.details(),
                )
                try:
                    self._update(job, {"state": "decoding"})  # (back from the pickup's 'prefilling'; with its leg)
                except redis.RedisError as e2:
                    log.warning("could not record %s's state: %s", job.request_id, e2)
            else:
                log.warning(
                    "handoff of %s to %s failed: %s %s", job.request_id, job.decode_address, e.code(), e.details()
                )
                span.set_status(tracing.Status(tracing.StatusCode.ERROR, f"{e.code().name}: {e.details()}"[:300]))
                code = HANDOFF_FAILURE_STATUS.get(e.code(), grpc.StatusCode.INTERNAL)
                # Unreachable: the worker may be lost (killed), which its router sees too and resumes the
                # request on another, even if this failure is recorded first (resume.lua: 'lost_to').
                self._give_up(
                    job,
                    code,
                    f"KV handoff to decode worker {job.decode_worker} failed: {e.code().name}: {e.details()}",
                    lost_to=job.decode_worker if e.code() == grpc.StatusCode.UNAVAILABLE else "",
                )
        except Exception as e:  # noqa: BLE001 - never lose the worker
            log.exception("handoff of %s failed", job.request_id)
            span.set_status(tracing.Status(tracing.StatusCode.ERROR, repr(e)[:300]))
            self._give_up(
                job, grpc.StatusCode.INTERNAL, f"KV handoff to decode worker {job.decode_worker} failed: {e!r}"[:300]
            )
        finally:
            span.end()
            if view is not None:
                view.release()
            if off is not None:
                self.arena.free(off)
            if kept:
                self.to_release.put(job.request_id)
            self._ack(fl.stream, fl.entry_id)
            with self.lock:
                self.inflight.pop(job.request_id, None)
            try:  # (not waited for while Redis is away: recorded at the heartbeat that finds it back)
                self._unless_away()
                self._update(job, {"t_prefill_end": fl.t_end})
            except REDIS_UNREACHABLE as e:
                if self._unanswered(e):
                    log.warning(
                        "could not record the end of %s's prefill (again once Redis answers): %s", job.request_id, e
                    )
                with self.lock:
                    self.unrecorded.append((job, {"t_prefill_end": fl.t_end}))
            except redis.RedisError as e:
                log.warning("could not record the end of %s's prefill: %s", job.request_id, e)

    def _region(self, request_id: str, start: int = 0) -> tuple[int | None, memoryview, int]:
        """Room for a parked request's KV of tokens [start, n): (offset, view, start). A region of the
        arena, waited for while the decode side holds it full; or, bigger than the whole arena, a
        private buffer for its bytes, whole (offset None, start 0: bytes are cut in _handoff)."""
        nbytes = self.engine.kv_nbytes(request_id, start)
        try:
            off = self.arena.alloc(nbytes, timeout=None)
        except ArenaFull:
            return None, memoryview(bytearray(self.engine.kv_nbytes(request_id))), 0
        return off, self.arena.view(off, nbytes), start

    def _put(self, stub, seq: w_pb.SequenceState, export, off: int | None, view, transport: str, start: int) -> int:
        """Hand over the KV of tokens [start, n) (start: see KVHandle.start_token): a handle to the
        region (shm) or the bytes (grpc). Returns the bytes of KV the decode worker reads."""
        n = export.num_tokens
        nbytes = payload_nbytes(self.engine.model.shape, n, start)
        handle = w_pb.KVHandle(
            arena=self.arena.name if transport == "shm" else "",
            offset=off or 0,
            length=nbytes,
            num_tokens=n,
            layout_version=kv_layout.layout_version(start),
            dtype=export.dtype,
            fingerprint=export.fingerprint,
            producer=self.address,
            host_id=self.host,
            lease_deadline_unix=time.time() + HANDOFF_LEASE_S,
            transport=transport,
            start_token=start,
        )
        req = w_pb.PutKVRequest(sequence=seq, handle=handle)
        if transport == "shm":
            stub.PutKV(req, timeout=HANDOFF_LEASE_S + 5)
        else:
            pieces = [view] if not start else kv_layout.part(self.engine.model, view, n, start)
            stub.PutKVStream(self._chunks(req, pieces), timeout=HANDOFF_LEASE_S + 5)
        return nbytes

    def _chunks(self, req: w_pb.PutKVRequest, pieces: list):
        """The payload (its pieces, in order) in messages of kv_chunk_bytes, the first with the header."""
        step = self.s.kv_chunk_bytes
        header: w_pb.PutKVRequest | None = req
        parts: list = []
        size = 0
        for piece in pieces:
            piece = memoryview(piece)
            at = 0
            while at < len(piece):
                take = min(step - size, len(piece) - at)
                parts.append(piece[at : at + take])
                at += take
                size += take
                if size == step:
                    yield w_pb.KVChunk(header=header, data=b"".join(parts))
                    header, parts, size = None, [], 0
        if parts or header is not None:
            yield w_pb.KVChunk(header=header, data=b"".join(parts))

    def _stub(self, address: str) -> worker_pb2_grpc.DecodeWorkerStub:
        return self.peers.get(address).stub

    def _fail_stream(
        self,
        request_id: str,
        address: str,
        code: grpc.StatusCode,
        message: str,
        handoff_lost: bool = False,
        leg: int | None = None,
    ) -> None:
        """An address this worker has not dialled (one read from a malformed entry) gets a channel of
        its own, closed afterwards, so unreadable entries cannot grow the cached stubs."""
        channel = None
        try:
            if (peer := self.peers.cached(address)) is not None:
                stub = peer.stub
            else:
                channel = tls.channel(address, self.tls, options(self.s.keepalive_s))
                stub = worker_pb2_grpc.DecodeWorkerStub(channel)
            stub.Fail(
                w_pb.FailRequest(
                    request_id=request_id, code=code.value[0], message=message, handoff_lost=handoff_lost, leg=leg
                ),
                timeout=5,
            )
        except (grpc.RpcError, ValueError) as e:  # NOT_FOUND: the stream has ended; ValueError: a bad address
            log.info("could not end %s's decode stream with %s: %s", request_id, code.name, e)
        finally:
            if channel is not None:
                channel.close()
