"""The KV handoff, consumer side (see splitserve.handoff for both sides and who owns what)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import time
from typing import TYPE_CHECKING

import grpc
import redis

from splitserve.engine.errors import CapacityError, InvalidRequestError, KVPrefixMissing
from splitserve.engine.outputs import FINISH_EOS, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, RequestOutput
from splitserve.engine.params import check_vocab
from splitserve.handoff.arena import SHM_DIR
from splitserve.handoff.layout import HEADER_SIZE, LAYOUT_VERSIONS, layout_version, payload_nbytes
from splitserve.observability import tracing
from splitserve.service import aio, convert
from splitserve.service import redis_scripts as scripts
from splitserve.service.errors import (
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    Invalid,
    NotFound,
    code_of,
)
from splitserve.service.process import until_answered
from splitserve_proto.v1 import generation_pb2 as gen_pb
from splitserve_proto.v1 import worker_pb2 as w_pb

if TYPE_CHECKING:
    from splitserve.decode_worker.server import Slot

log = logging.getLogger(__name__)

SERVICE = w_pb.DESCRIPTOR.services_by_name["DecodeWorker"].full_name

# What a handoff's sequence may end with when its first token finished it at prefill
HANDOFF_FINISHES = (FINISH_LENGTH, FINISH_STOP, FINISH_EOS, FINISH_ERROR)


def other_leg(slot: Slot, sent: w_pb.SequenceState | w_pb.FirstTokenRequest | w_pb.FailRequest) -> bool:
    """A handoff, first token or failure of another leg of the request than its stream here is (both said)."""
    return slot.leg is not None and sent.HasField("leg") and sent.leg != slot.leg


class HandoffReceiver:
    """The decode worker's side of the KV handoff: first tokens relayed ahead of their KV, each handle
    checked field by field, its KV copied out of the producer's arena (or out of the bytes sent)
    into the engine's paged pool, and the sequence added to the running batch. State: the servicer's
    (DecodeServicer.__init__)."""

    async def FirstToken(self, request: w_pb.FirstTokenRequest, context):
        """The token prefill sampled, ahead of its KV: it goes to the client now."""
        self._check_first(request)
        self._relay_first(await self._stream(request.request_id), request, "call")
        return w_pb.FirstTokenResponse()

    async def FirstTokens(self, request_iterator, context):
        """FirstToken's messages over a stream a prefill worker keeps open. One that is bad or whose
        request has no stream here is dropped (and counted): its KV's handoff carries the token.
        This worker stopping ends the stream, OK, at once (its reading, in token_streams, is
        cancelled): open, it would hold the gRPC server's stop for its whole grace."""
        reading = asyncio.ensure_future(self._first_tokens(request_iterator))
        self.token_streams.add(reading)
        try:
            await reading
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # the call itself was cancelled (its peer went away)
                raise
        finally:
            self.token_streams.discard(reading)
        return w_pb.FirstTokenResponse()

    async def _first_tokens(self, request_iterator) -> None:
        async for request in request_iterator:
            try:
                self._check_first(request)
            except Invalid as e:
                self._drop_first(request, "invalid", e)
                continue
            slot = self.slots.get(request.request_id)
            if slot is not None:
                self._relay_first(slot, request, "stream")
            else:  # its stream may still be opening: wait for it off this stream
                self.background.start(self._relay_first_later(request))

    async def _relay_first_later(self, request: w_pb.FirstTokenRequest) -> None:
        try:
            slot = await self._stream(request.request_id)
        except NotFound as e:
            self._drop_first(request, "no_stream", e)
            return
        self._relay_first(slot, request, "stream")

    def _drop_first(self, request: w_pb.FirstTokenRequest, reason: str, e: Exception) -> None:
        self.metrics.first_tokens_dropped.labels(reason).inc()
        log.debug("first token of %r dropped: %s", request.request_id, e)

    @staticmethod
    def _check_first(request: w_pb.FirstTokenRequest) -> None:
        if not request.request_id:
            raise Invalid("request_id: must be set")
        if not request.token_ids:
            raise Invalid("token_ids: the first token must be given")

    def _relay_first(self, slot: Slot, request: w_pb.FirstTokenRequest, via: str) -> None:
        if slot.first_sent or slot.done:  # the KV got here first and its token went out already
            return
        if other_leg(slot, request):  # a job superseded when the request resumed (see _slot_for)
            self._drop_first(request, "other_leg", NotFound(f"leg {request.leg}, not the stream's {slot.leg}"))
            return
        slot.first_sent = True
        self.metrics.first_tokens.labels(via).inc()
        completion = request.resumed_tokens + len(request.token_ids)
        slot.sample_tokens[0] = completion
        slot.queue_ms, slot.prefill_ms = request.queue_ms, request.prefill_ms
        slot.first_token_at = request.prefill_end_unix or time.time()
        slot.cached_tokens, slot.prefill_worker = request.cached_tokens, request.prefill_worker
        slot.events.put_nowait(
            w_pb.DecodeEvent(
                token_ids=request.token_ids,
                text=request.text,
                completion_tokens=completion,
                timings=gen_pb.Timings(queue_ms=request.queue_ms, prefill_ms=request.prefill_ms),
                first_token_unix=slot.first_token_at,
                cached_tokens=slot.cached_tokens,
                logprobs=request.logprobs,
                prompt_logprobs=request.prompt_logprobs,
                prefill_worker=slot.prefill_worker,
            )
        )

    def _put_span(self, method: str, seq: w_pb.SequenceState) -> tracing.rpc_span:
        full = f"{SERVICE}/{method}"
        return tracing.rpc_span(
            full,
            parent=tracing.context_of(seq.traceparent),
            attributes=tracing.rpc_attributes(full) | {"splitserve.request_id": seq.request_id},
        )

    def _count_refusal(self, e: BaseException) -> None:
        self.metrics.handoffs_refused.labels(code_of(e).name).inc()

    async def PutKV(self, request: w_pb.PutKVRequest, context):
        with self._put_span("PutKV", request.sequence) as ps:
            try:
                slot = await self._slot_for(request.sequence)
                if request.sequence.finish_reason and not request.HasField("handle"):
                    return await self._finished_at_prefill(slot, request.sequence)
                h = request.handle
                self._check_handle(request.sequence, h, transport="shm")
                await self._check_arena(h.arena)
                payload = self.reader.region(h.arena, h.offset, h.length)
                return await self._adopt(slot, request.sequence, h, payload, ps)
            except Exception as e:
                self._count_refusal(e)
                raise

    async def PutKVStream(self, request_iterator, context):
        first = await anext(request_iterator, None)
        if first is None or not first.HasField("header"):
            self._count_refusal(Invalid(""))
            raise Invalid("header: the first chunk must carry the handle and sequence")
        req = first.header
        with self._put_span("PutKVStream", req.sequence) as ps:
            try:
                return await self._put_stream(req, first, request_iterator, ps)
            except Exception as e:
                self._count_refusal(e)
                raise

    async def _put_stream(
        self, req: w_pb.PutKVRequest, first: w_pb.KVChunk, request_iterator, ps: tracing.rpc_span
    ) -> w_pb.PutKVResponse:
        slot = await self._slot_for(req.sequence)
        if req.sequence.finish_reason and not req.HasField("handle"):
            return await self._finished_at_prefill(slot, req.sequence)
        h = req.handle
        self._check_handle(req.sequence, h, transport="grpc")
        buf = bytearray(h.length)
        got = 0
        chunk = first
        while True:
            data = chunk.data
            if got + len(data) > h.length:
                raise Invalid(f"handle.length: received more than {h.length} bytes")
            buf[got : got + len(data)] = data
            got += len(data)
            chunk = await anext(request_iterator, None)
            if chunk is None:
                break
        if got != h.length:
            raise Invalid(f"handle.length: {h.length} bytes announced, {got} received")
        return await self._adopt(slot, req.sequence, h, memoryview(buf), ps)

    async def _slot_for(self, seq: w_pb.SequenceState) -> Slot:
        slot = await self._stream(seq.request_id)
        if slot.done:
            raise NotFound(f"request {seq.request_id!r} has ended here (cancelled)")
        if other_leg(slot, seq):  # a job superseded as the request resumed, prefilled all the same, and a later
            # leg of the request back on this worker: that job's KV is not this stream's
            raise NotFound(
                f"sequence.leg: request {seq.request_id!r} is of leg {slot.leg} here, not {seq.leg} "
                "(superseded: its decode worker was lost)"
            )
        if slot.imported or slot.prefill_start:
            raise AlreadyExists(f"request {seq.request_id!r} already has its KV here (or is prefilled here)")
        if slot.prompt_tokens and seq.prompt_len != slot.prompt_tokens:  # another request's KV, or a bad producer
            raise Invalid(
                f"sequence.prompt_len: {seq.prompt_len} tokens, but request {seq.request_id!r} has a "
                f"{slot.prompt_tokens}-token prompt"
            )
        if seq.finish_reason and seq.finish_reason not in HANDOFF_FINISHES:
            raise Invalid(f"sequence.finish_reason: {seq.finish_reason!r} is not one of {', '.join(HANDOFF_FINISHES)}")
        if not 0 < seq.prompt_len < len(seq.token_ids):
            raise Invalid(
                f"sequence.prompt_len: {seq.prompt_len} of {len(seq.token_ids)} tokens (the prompt is at "
                "least one, and at least one token follows it)"
            )
        sampled = len(seq.token_ids) - seq.prompt_len
        if seq.resumed_tokens > sampled:
            raise Invalid(f"sequence.resumed_tokens: {seq.resumed_tokens} of {sampled} sampled tokens")
        if seq.sampling.HasField("logprobs") and len(seq.logprobs) != sampled:
            raise Invalid(f"sequence.logprobs: {len(seq.logprobs)} given for {sampled} sampled tokens")
        if seq.sampling.HasField("prompt_logprobs") and len(seq.prompt_logprobs) != seq.prompt_len - 1:
            raise Invalid(
                f"sequence.prompt_logprobs: {len(seq.prompt_logprobs)} given for a {seq.prompt_len}-token "
                "prompt (one per token after the first)"
            )
        return slot

    def _check_handle(self, seq: w_pb.SequenceState, h: w_pb.KVHandle, transport: str) -> None:
        """Every field against this worker's model before a byte is read."""
        if h.transport != transport:
            raise Invalid(f"handle.transport: {h.transport!r} sent to the {transport} endpoint")
        if h.layout_version not in LAYOUT_VERSIONS:
            raise Invalid(
                f"handle.layout_version: {h.layout_version} is not supported (this worker reads "
                f"{', '.join(map(str, LAYOUT_VERSIONS))})"
            )
        if h.dtype != self.engine.model.shape.kv_dtype:
            raise Invalid(f"handle.dtype: {h.dtype!r} is not this worker's {self.engine.model.shape.kv_dtype!r}")
        if h.fingerprint != self.engine.fingerprint:
            raise Invalid(
                f"handle.fingerprint: {h.fingerprint!r} is not this worker's model ({self.engine.fingerprint})"
            )
        if h.num_tokens < 1 or h.num_tokens != len(seq.token_ids) - 1:
            raise Invalid(
                f"handle.num_tokens: {h.num_tokens} does not match the sequence ({len(seq.token_ids)} tokens)"
            )
        if h.start_token >= h.num_tokens:
            raise Invalid(f"handle.start_token: {h.start_token} leaves none of the {h.num_tokens} tokens of KV")
        if h.layout_version != layout_version(h.start_token):
            raise Invalid(
                f"handle.start_token: {h.start_token} in layout version {h.layout_version} (a payload without "
                f"its first tokens is version {layout_version(1)}, a whole one {layout_version(0)})"
            )
        need = payload_nbytes(self.engine.model.shape, h.num_tokens, h.start_token)
        if h.length != need:
            raise Invalid(f"handle.length: {h.length} bytes, tokens {h.start_token}..{h.num_tokens} of KV are {need}")
        if h.lease_deadline_unix and h.lease_deadline_unix < time.time():
            raise Invalid("handle.lease_deadline_unix: the lease has expired")
        if transport == "shm" and h.host_id != self.host:
            raise Invalid(f"handle.host_id: {h.host_id!r} is another host; send the bytes with PutKVStream")

    async def _finished_at_prefill(self, slot: Slot, seq: w_pb.SequenceState) -> w_pb.PutKVResponse:
        check_vocab("sequence.token_ids", seq.token_ids, self.engine.model.shape.vocab_size)
        n = len(seq.token_ids) - seq.prompt_len  # its completion's tokens, the client has seq.resumed_tokens
        out = list(seq.token_ids[seq.prompt_len + seq.resumed_tokens :])
        skip = seq.sampling.skip_special_tokens if seq.sampling.HasField("skip_special_tokens") else True
        if seq.HasField("text"):
            text = seq.text
        else:  # (a prefill worker of a release without it)
            text = self.engine.tokenizer.decode(out, skip) if self.engine.tokenizer else ""
        slot.imported = True
        slot.queue_ms, slot.prefill_ms, slot.cached_tokens = seq.queue_ms, seq.prefill_ms, seq.cached_tokens
        slot.prefill_worker = seq.prefill_worker
        slot.kv_done = time.time()
        slot.first_token_at = seq.prefill_end_unix
        if seq.prefill_end_unix:
            slot.transfer_ms = (slot.kv_done - seq.prefill_end_unix) * 1000
        logprobs = (
            convert.logprobs_from_pb(seq.logprobs[seq.resumed_tokens :]) if seq.sampling.HasField("logprobs") else None
        )
        prompt = convert.logprobs_from_pb(seq.prompt_logprobs) if seq.sampling.HasField("prompt_logprobs") else None
        self._on_output(
            slot,
            RequestOutput(
                seq.request_id,
                out,
                text,
                True,
                seq.finish_reason,
                seq.prompt_len,
                n,
                new_logprobs=logprobs,
                prompt_logprobs=prompt,
            ),
        )
        return w_pb.PutKVResponse()

    async def _adopt(
        self, slot: Slot, seq: w_pb.SequenceState, h: w_pb.KVHandle, payload, ps: tracing.rpc_span
    ) -> w_pb.PutKVResponse:
        export = convert.export_from_pb(seq, h)
        slot.samples_left = export.params.n
        await self._compile_format(export.params)
        t0 = time.perf_counter()
        waits = 0
        deadline = h.lease_deadline_unix or (time.time() + 60)
        slot.held = []
        cancelled = False  # the call, while its import ran: its KV is kept all the same (aio.outlast_cancel)
        try:
            # Backpressure: wait for blocks rather than refuse. Waiting handoffs take freed blocks
            # in priority order, then in arrival order; one tries only when none waits ahead of it
            # (so a big KV at the head is not starved by smaller ones behind it).
            rank = (slot.priority, next(self._arrivals))
            try:
                while True:
                    if not any(r < rank for r in self.adopt_waiting):
                        try:
                            # An import submitted runs to its end in the engine's thread, even if
                            # this call is cancelled meanwhile (its producer killed): the engine
                            # then held a sequence this worker did not know it had, and the job's
                            # next prefill (claimed by another prefill worker) failed the stream,
                            # "already in this engine". Its KV, all read, is kept as any other.
                            (first, shared), cancelled = await aio.outlast_cancel(
                                self.runner.submit(lambda e: self._import(e, export, payload, slot.priority))
                            )
                            break
                        except CapacityError:
                            pass
                        except KVPrefixMissing as e:  # the producer sends it whole
                            raise FailedPrecondition(f"handle.start_token: {e}") from None
                        except InvalidRequestError as e:  # the request can never run here (max_tokens too big)
                            self._end_with_error(slot, grpc.StatusCode.INVALID_ARGUMENT, str(e))
                            raise
                    if time.time() > deadline:
                        raise DeadlineExceeded("no free KV blocks before the handle's lease ran out")
                    if slot.done or self.slots.get(seq.request_id) is not slot:
                        raise NotFound(f"request {seq.request_id!r} was cancelled while waiting for KV blocks")
                    self.adopt_waiting.add(rank)
                    waits += 1
                    self.capacity.clear()
                    try:
                        await aio.wait_for(self.capacity.wait(), timeout=0.05)
                    except TimeoutError:
                        pass
            finally:
                if rank in self.adopt_waiting:
                    self.adopt_waiting.discard(rank)
                    self.capacity.set()  # the next in line may try now
            if slot.done or self.slots.get(seq.request_id) is not slot:  # cancelled while the KV was copied in
                self.runner.submit_nowait(lambda e: e.abort_request(seq.request_id))
                raise NotFound(f"request {seq.request_id!r} was cancelled during the handoff")
            slot.imported = True
            adopt_s = time.perf_counter() - t0
            slot.kv_done = time.time()
            # The handoff as the request sees it: from the end of prefill (export, PutKV, import).
            slot.transfer_ms = (slot.kv_done - seq.prefill_end_unix) * 1000 if seq.prefill_end_unix else adopt_s * 1000
            slot.queue_ms, slot.prefill_ms, slot.cached_tokens = seq.queue_ms, seq.prefill_ms, seq.cached_tokens
            slot.prefill_worker = seq.prefill_worker
            slot.first_token_at = seq.prefill_end_unix
            self.metrics.adopt_seconds.labels(h.transport).observe(adopt_s)
            self.metrics.kv_bytes.labels(h.transport).inc(h.length)
            self.metrics.kv_shared_tokens.inc(shared)
            ps.span.set_attributes(
                {
                    "splitserve.kv.bytes": h.length,
                    "splitserve.kv.transport": h.transport,
                    "splitserve.kv.tokens": h.num_tokens,
                    "splitserve.kv.block_waits": waits,
                    "splitserve.kv.adopt_ms": adopt_s * 1000,
                    "splitserve.kv.start_token": h.start_token,
                    "splitserve.kv.shared_tokens": shared,
                }
            )
            self._start_decode_span(slot)
            if first is not None and not slot.first_sent:  # FirstToken did not beat the KV here: send it now
                self._on_output(slot, first)
            elif first is not None and first.finished:  # its first token, sent already, ended sample 0 (n > 1)
                self._on_output(
                    slot,
                    dataclasses.replace(
                        first,
                        new_token_ids=[],
                        new_text="",
                        prompt_logprobs=None,
                        new_logprobs=[] if first.new_logprobs is not None else None,
                    ),
                )
        finally:  # a step's outputs that came before the import's own go out after it
            held, slot.held = slot.held, None
            for out in held:
                self._on_output(slot, out)
        # Bookkeeping off the handoff's path: the producer frees its region as soon as we answer.
        # While Redis does not answer, written once it does (GetRequest's timestamps, transport, bytes).
        # With its leg: a worker taken for lost, that adopts it late, must not write over the next leg's.
        adopted = functools.partial(
            self.scripts.run,
            scripts.update(
                self.keys,
                request_id=seq.request_id,
                fields={
                    "state": "decoding",
                    "t_kv_done": time.time(),
                    "decode_worker": self.name,
                    "kv_transport": h.transport,
                    "kv_bytes": h.length,
                },
                leg=slot.leg,
            ),
        )
        self.background.start(
            until_answered(
                adopted, f"{seq.request_id}'s KV adoption", self.s.heartbeat_s, self.s.request_ttl_s, at_once=True
            )
        )
        if cancelled:
            log.info("request %s: its KV handoff was cancelled as its import ran; adopted all the same", seq.request_id)
            raise asyncio.CancelledError()
        # The body holds tokens [start, num_tokens); those the prefix cache held are not read.
        per_token = (h.length - HEADER_SIZE) // max(1, h.num_tokens - h.start_token)
        copied = max(0, h.num_tokens - max(shared, h.start_token)) * per_token
        return w_pb.PutKVResponse(transfer_ms=adopt_s * 1000, copied_bytes=copied, shared_tokens=shared)

    @staticmethod
    def _import(engine, export, payload, priority: int) -> tuple:
        """Engine thread: adopt the KV; (its first output, the tokens whose KV was cached here already)."""
        first = engine.import_kv(export, payload, priority)
        seq = engine.seqs.get(export.request_id)  # (gone if its first token ended it: sampling.n > 1)
        return first, seq.num_shared_on_import if seq is not None else engine.last_shared_on_import

    async def _check_arena(self, name: str) -> None:
        """Only the arena of a prefill worker registered on this host is mapped (its name is
        random: known to those who read the registry), while its segment lasts. One not seen yet
        is looked for once more (a worker registered since the last read), and among the arenas of
        workers draining on this host (out of the registry, still handing over)."""
        if name not in self.local_arenas:
            await self.warm_arenas()
        if name not in self.local_arenas and name.isprintable():  # out of the registry: draining, on this host?
            host = await self.redis.get(self.keys.draining_arena(name))
            if host is not None and host.decode(errors="replace") == self.host:
                self.local_arenas.add(name)
        if name not in self.local_arenas:
            raise Invalid(f"handle.arena: {name!r} is not the arena of a prefill worker registered on this host")

    async def warm_arenas(self) -> None:
        """Map the arenas of prefill workers on this host before their first handoff, and unmap
        those of prefill workers that have gone; local_arenas: the names registered."""
        registered: set[str] = set()
        for name in await asyncio.to_thread(self.reader.drop_stale):
            self.warmed.discard(name)
            log.info("unmapped arena %s: its prefill worker has gone", name)
        async for key in self.redis.scan_iter(match=self.keys.worker_pattern("prefill"), count=100):
            try:
                arena, host = await self.redis.hmget(key, "arena", "host_id")
            except redis.ResponseError:  # a key of another type: no entry a worker wrote
                continue
            # (any bytes: a name that is not UTF-8 is no arena's, and warm refuses it)
            arena, host = (v.decode(errors="replace") if v else "" for v in (arena, host))
            if arena and host == self.host:
                registered.add(arena)
            if arena and host == self.host and arena not in self.warmed:
                if await asyncio.to_thread(self.reader.warm, arena):
                    self.warmed.add(arena)
        # A name stays allowed while its segment lasts: a draining prefill worker has left the
        # registry but still hands over the KV it holds.
        gone = {n for n in self.local_arenas if not os.path.exists(os.path.join(SHM_DIR, n))}
        self.local_arenas = (self.local_arenas - gone) | registered
