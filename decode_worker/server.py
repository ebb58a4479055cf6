"""The DecodeWorker service.

Per request: the router opens ``Decode`` (a slot waits for the KV), a prefill worker
sends the token it sampled with ``FirstToken`` (relayed at once; or as a message on the
``FirstTokens`` stream it keeps open to this worker) and then calls
``PutKV`` with a handle (or ``PutKVStream`` with the bytes), the KV is validated
and copied into the paged pool on the engine thread, and tokens flow back on the
``Decode`` stream. A cancelled ``Decode`` aborts the sequence and frees its blocks;
a ``PutKV`` for a request whose stream has ended (or never opens) is NOT_FOUND, so the
producer frees its region. The router queues the prefill job while ``Decode`` opens, so a
handoff that comes before its stream waits for it (``STREAM_WAIT_S``). ``Cancel`` comes
from a router whose ``Abort`` found the request's stream held by another router: the
stream ends with finish_reason "cancelled" and the KV is freed here.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field

import grpc
import redis
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2

from splitserve.engine.engine import LLMEngine
from splitserve.engine.errors import CapacityError, InvalidRequestError, KVPrefixMissing
from splitserve.engine.kv_transfer import LAYOUT_VERSIONS, layout_version, payload_nbytes
from splitserve.engine.outputs import FINISH_EOS, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, RequestOutput
from splitserve.engine.params import check_vocab
from splitserve.observability import tracing
from splitserve.observability.metrics import DecodeMetrics
from splitserve.service import aio, convert, grpc_server
from splitserve.service import redis_scripts as scripts
from splitserve.service.arena import ArenaReader
from splitserve.service.errors import (
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    Invalid,
    NotFound,
    Unavailable,
    code_of,
    fit_details,
    status_code,
)
from splitserve.service.process import Background, until_answered
from splitserve.service.redis_scripts import Scripts
from splitserve.service.redis_state import Keys, WorkerInfo, connect
from splitserve.service.runner import EngineRunner
from splitserve.service.settings import Settings, host_id
from splitserve.service.watchdog import StepWatch
from splitserve_proto.v1 import generation_pb2 as gen_pb
from splitserve_proto.v1 import worker_pb2 as w_pb
from splitserve_proto.v1 import worker_pb2_grpc

log = logging.getLogger(__name__)
SERVICE = w_pb.DESCRIPTOR.services_by_name["DecodeWorker"].full_name
# The router queues a request's prefill job while its Decode stream is still opening, so a
# handoff (FirstToken, PutKV, Fail) may arrive before the stream: it waits this long for it.
STREAM_WAIT_S = 2.0
ENDED_KEEP = 4096  # request ids whose stream ended here, remembered so their late handoffs are refused at once
# A Cancel can come before its stream too (Abort right after admission): a stream that opens
# this soon after it ends cancelled at once.
CANCEL_KEEP_S = 10.0
# What a handoff's sequence may end with when its first token finished it at prefill
HANDOFF_FINISHES = (FINISH_LENGTH, FINISH_STOP, FINISH_EOS, FINISH_ERROR)


def _remember(ids: collections.OrderedDict, rid: str, value) -> None:
    """Record a request id as the newest entry, forgetting the oldest past ENDED_KEEP."""
    ids[rid] = value
    ids.move_to_end(rid)
    if len(ids) > ENDED_KEEP:
        ids.popitem(last=False)


@dataclass
class Slot:
    request_id: str
    deadline: float
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    imported: bool = False
    done: bool = False
    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    transfer_ms: float = 0.0
    kv_done: float = 0.0  # unix time the KV was adopted
    first_token_at: float = 0.0  # unix time the first token was sampled (0: unknown, use kv_done)
    prefill_start: float = 0.0  # prefilled here: when this worker's engine took the prompt
    first_sent: bool = False
    open_seq: int = 0  # its number among the streams this worker opened
    close_seq: int = 0  # ... and closed (0: still open)
    sample_tokens: dict = field(default_factory=dict)  # a sample's index (sampling.n) -> its tokens sent so far
    samples_left: int = 1  # samples not finished (sampling.n, once the request's sampling is here)
    # While its KV is adopted: the engine's outputs of it that came before the import's own (a step's,
    # delivered before _adopt resumed), sent after that one
    held: list | None = None
    priority: int = 0  # lower first: orders the handoffs waiting for KV blocks here
    prompt_tokens: int = 0  # as the router counted them (0: not said): a handoff's prompt must match
    leg: int | None = None  # DecodeRequest.leg (None: not said): a handoff, first token or failure must be of it
    cached_tokens: int = 0  # of them, found in the prefix cache of the engine that prefilled it
    prefill_worker: str = ""  # the prefill worker that prefilled it ("": this worker)
    trace: tracing.rpc_span | None = None  # the Decode server span
    decode_span: object = None  # KV adopted -> finished
    # For that span: times its sequences were preempted here (their KV freed, to be recomputed), and
    # the longest time between two of its outputs (a stall its client saw)
    preemptions: int = 0
    last_output: float = 0.0  # monotonic
    max_gap_s: float = 0.0

    @property
    def completion_tokens(self) -> int:
        """Sent so far, of all its samples."""
        return sum(self.sample_tokens.values())


def _other_leg(slot: Slot, sent: w_pb.SequenceState | w_pb.FirstTokenRequest | w_pb.FailRequest) -> bool:
    """A handoff, first token or failure of another leg of the request than its stream here is (both said)."""
    return slot.leg is not None and sent.HasField("leg") and sent.leg != slot.leg


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(
        self,
        settings: Settings,
        runner: EngineRunner,
        r: aioredis.Redis,
        keys: Keys,
        name: str,
        metrics: DecodeMetrics | None = None,
    ):
        self.s = settings
        self.metrics = metrics or DecodeMetrics()
        self.metrics.streams.set_function(lambda: len(self.slots))
        self.metrics.handoffs_waiting.set_function(lambda: len(self.adopt_waiting))
        self.runner = runner
        self.engine: LLMEngine = runner.engine
        self.redis = r
        self.keys = keys
        self.scripts = Scripts(r)
        self.name = name
        self.host = host_id()
        self.reader = ArenaReader(settings.shm_prefix)
        self.warmed: set[str] = set()
        self.slots: dict[str, Slot] = {}
        self.arrivals: dict[str, asyncio.Future] = {}  # request id -> its stream, for handoffs that came first
        self.ended: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.cancelled: collections.OrderedDict[str, float] = (
            collections.OrderedDict()
        )  # rid -> when, before its stream
        self.capacity = asyncio.Event()  # set after steps that may have freed blocks
        self.background = Background()
        self.token_streams: set[asyncio.Task] = set()  # FirstTokens readings: they last as long as their peer
        self.adopt_waiting: set[tuple[int, int]] = set()  # (priority, arrival) of handoffs waiting for blocks
        self._arrivals = itertools.count()
        self.draining = False
        # Streams opened and closed, reported with each heartbeat: a router corrects that entry by
        # the streams it has seen open and close since (their numbers come on their events).
        self.epoch = uuid.uuid4().hex[:12]
        self.opened = 0
        self.closed = 0

    # -- Decode -------------------------------------------------------------------------

    async def Decode(self, request: w_pb.DecodeRequest, context):
        rid = request.request_id
        if not rid:
            raise Invalid("request_id: must be set")
        if self.draining:
            self._ended(rid)
            raise Unavailable("decode worker is draining")
        if rid in self.slots:
            raise AlreadyExists(f"request {rid!r} already has a decode stream here")
        slot = Slot(
            rid,
            request.deadline_unix,
            priority=request.priority,
            prompt_tokens=max(0, request.prompt_tokens),
            leg=request.leg if request.HasField("leg") else None,
        )
        self.ended.pop(rid, None)
        early = self.cancelled.pop(rid, None)
        full = f"{SERVICE}/Decode"
        with tracing.rpc_span(
            full,
            parent=tracing.extract(context.invocation_metadata()),
            attributes=tracing.rpc_attributes(full)
            | {"splitserve.request_id": rid, "splitserve.decode_worker": self.name},
        ) as rs:
            slot.trace = rs
            self.slots[rid] = slot
            self.opened += 1
            slot.open_seq = self.opened
            self.runner.sinks[rid] = lambda out, slot=slot: self._from_engine(slot, out)
            if (waiting := self.arrivals.pop(rid, None)) is not None and not waiting.done():
                waiting.set_result(slot)
            try:
                if early is not None and time.monotonic() - early < CANCEL_KEEP_S:
                    self._cancel(slot)  # aborted before its stream opened: it ends at once
                elif request.prompt_token_ids:
                    await self._prefill_here(slot, request)
                yield w_pb.DecodeEvent(accepted=True, open_seq=slot.open_seq, epoch=self.epoch)
                while True:
                    ev = await slot.events.get()
                    if ev.finish_reason and not ev.more or ev.error:
                        ev.close_seq = self._close(slot)
                        slot.done = True
                        yield ev
                        return
                    yield ev
            finally:
                self._close(slot)
                self.slots.pop(rid, None)
                self.runner.sinks.pop(rid, None)
                self._ended(rid)
                if slot.imported and not slot.done:  # the router went away: stop decoding, free the KV
                    self.runner.submit_nowait(lambda e: e.abort_request(rid))
                    self.metrics.aborted.inc()
                    self._end_decode_span(slot, "cancelled", None)

    def _close(self, slot: Slot) -> int:
        if not slot.close_seq:
            self.closed += 1
            slot.close_seq = self.closed
        return slot.close_seq

    # -- Cancel -------------------------------------------------------------------------

    async def Cancel(self, request: w_pb.CancelRequest, context):
        """Abort, from a router that does not hold this request's stream: end it here."""
        rid = request.request_id
        if not rid:
            raise Invalid("request_id: must be set")
        slot = self.slots.get(rid)
        if slot is not None:
            return w_pb.CancelResponse(found=self._cancel(slot))
        if rid not in self.ended and not self.draining:  # its stream may still be opening
            _remember(self.cancelled, rid, time.monotonic())
        return w_pb.CancelResponse(found=False)

    def _cancel(self, slot: Slot) -> bool:
        """End a stream with finish_reason "cancelled" and free its KV; False if it has ended."""
        imported = slot.imported
        if not self._end_stream(
            slot, "cancelled", w_pb.DecodeEvent(finish_reason="cancelled", completion_tokens=slot.completion_tokens)
        ):
            return False
        if imported:
            self.metrics.aborted.inc()
        return True

    def _end_stream(self, slot: Slot, finish_reason: str, last: w_pb.DecodeEvent) -> bool:
        """End a stream with its `last` event, the engine told to drop it (its KV freed) and its decode
        span ended; False if it has ended already."""
        if slot.done:
            return False
        slot.done = True  # a handoff still on its way is refused (NOT_FOUND): its producer frees the region
        if slot.imported:
            rid = slot.request_id
            self.runner.submit_nowait(lambda e: e.abort_request(rid))
        self._end_decode_span(slot, finish_reason, None)
        slot.events.put_nowait(last)
        return True

    async def PrefillHere(self, request: w_pb.PrefillHereRequest, context):
        """A request whose stream is open here, taken back from the prefill queue by its router (no
        prefill worker is registered): this engine prefills it, as if it had come so."""
        rid = request.request_id
        if not rid:
            raise Invalid("request_id: must be set")
        if not request.prompt_token_ids:
            raise Invalid("prompt_token_ids: must not be empty")
        slot = self.slots.get(rid)
        if slot is None or slot.done:
            raise NotFound(f"no decode stream open for request {rid!r} (it ended, or never opened here)")
        if slot.imported or slot.prefill_start or slot.first_sent:
            raise FailedPrecondition(f"request {rid!r} is prefilled here already, or its KV came from a prefill worker")
        slot.queue_ms = max(0.0, request.queue_ms)
        await self._prefill_here(slot, request)
        return w_pb.PrefillHereResponse()

    async def _compile_format(self, params) -> None:
        """Compile a structured output format on a thread, not on the engine's (where the steps of
        every running sequence would wait for it): the engine then finds it compiled. One that does
        not compile is refused there, where the request's errors are answered."""
        if params.structured_output is not None and self.engine.grammars is not None:
            with contextlib.suppress(InvalidRequestError):
                await asyncio.to_thread(self.engine.grammars.check, params.structured_output)

    async def _prefill_here(self, slot: Slot, request: w_pb.DecodeRequest | w_pb.PrefillHereRequest) -> None:
        """This engine prefills the prompt (chunked, inside continuous batching): colocated, a
        request the router kept off the prefill workers (conditional disaggregation), or one it took
        back from their queue (PrefillHere)."""
        ids = list(request.prompt_token_ids)
        params = convert.sampling_from_pb(request.sampling, self.s.default_max_tokens)
        convert.check_cache_salt(request.cache_salt)
        slot.prefill_start = time.time()  # set first: a second PrefillHere is refused meanwhile
        samples = [(s.index, list(s.token_ids), s.chars) for s in getattr(request, "resumed_samples", ())]
        slot.samples_left = len(samples) or params.n
        await self._compile_format(params)
        self._start_decode_span(slot, {"splitserve.prefill.local": True, "gen_ai.usage.input_tokens": len(ids)})
        try:
            if samples:  # sampling.n > 1, resumed: each sample not finished goes on from its own tokens
                ended = await self.runner.submit(
                    lambda e: e.resume_samples(
                        slot.request_id, ids, params, samples, priority=request.priority, cache_salt=request.cache_salt
                    )
                )
                for out in ended:  # those its tokens already end: their last message, now
                    self._on_output(slot, out)
            else:
                resumed = getattr(request, "resumed_tokens", 0), getattr(request, "resumed_chars", 0)
                await self.runner.submit(
                    lambda e: e.add_request(
                        slot.request_id,
                        ids,
                        params,
                        priority=request.priority,
                        cache_salt=request.cache_salt,
                        resumed=resumed[0],
                        resumed_chars=resumed[1],
                    )
                )
        except (
            asyncio.CancelledError
        ):  # the engine takes it yet (its commands run in order): the stream's end aborts it
            slot.imported = True
            raise
        except Exception:
            slot.prefill_start = 0.0
            self._end_decode_span(slot, "error", None)
            raise
        slot.imported = True

    def _start_decode_span(self, slot: Slot, extra: dict | None = None) -> None:
        """The request's time here after its KV exists (adopted, or about to be prefilled here) until it ends."""
        slot.decode_span = tracing.tracer().start_span(
            "decode",
            context=slot.trace.ctx if slot.trace else None,
            attributes={"splitserve.request_id": slot.request_id, "splitserve.decode_worker": self.name}
            | (extra or {}),
        )

    def _end_decode_span(self, slot: Slot, finish_reason: str, out: RequestOutput | None) -> None:
        span, slot.decode_span = slot.decode_span, None
        if span is None:
            return
        span.set_attribute("gen_ai.response.finish_reasons", [finish_reason])
        if slot.max_gap_s:
            span.set_attribute("splitserve.decode.max_token_gap_ms", round(slot.max_gap_s * 1000, 3))
        if slot.preemptions:
            span.set_attribute("splitserve.decode.preemptions", slot.preemptions)
        if out is not None:
            span.set_attribute("gen_ai.usage.output_tokens", out.num_output_tokens)
            if out.num_cached_tokens:  # prefilled here: prompt tokens found in this worker's prefix cache
                span.set_attribute("splitserve.prefix_cache.tokens", out.num_cached_tokens)
            if out.error:
                span.set_status(tracing.Status(tracing.StatusCode.ERROR, out.error))
        span.end()

    def _from_engine(self, slot: Slot, out: RequestOutput) -> None:
        if slot.held is not None:  # the import's own output (its first token) goes out first: _adopt
            slot.held.append(out)
        else:
            self._on_output(slot, out)

    def _on_output(self, slot: Slot, out: RequestOutput) -> None:
        try:
            self._emit(slot, out)
        except Exception as e:  # noqa: BLE001 - one request's output must not end the others' (runner._deliver)
            self._output_failed(slot, e)

    def _output_failed(self, slot: Slot, e: Exception) -> None:
        """An engine output could not be told (none is known to fail; an event that does not build,
        say): the request ends INTERNAL, naming the cause, its sequences are aborted (their KV
        freed), and the other requests of its step get theirs."""
        log.exception("request %s: an engine output could not be sent", slot.request_id)
        if slot.done:
            return
        slot.done = True
        rid = slot.request_id
        self.runner.submit_nowait(lambda eng: eng.abort_request(rid))
        message = f"decode worker {self.name} could not send an output of {rid}: {type(e).__name__}: {e}"
        if slot.decode_span is not None:
            slot.decode_span.set_status(tracing.Status(tracing.StatusCode.ERROR, message[:300]))
        self._end_decode_span(slot, "error", None)
        slot.events.put_nowait(
            w_pb.DecodeEvent(error=fit_details(message), error_code=grpc.StatusCode.INTERNAL.value[0])
        )

    def _emit(self, slot: Slot, out: RequestOutput) -> None:
        if slot.done:  # cancelled: its abort is on the way to the engine
            return
        now = time.monotonic()
        if slot.last_output:
            slot.max_gap_s = max(slot.max_gap_s, now - slot.last_output)
        slot.last_output = now
        slot.sample_tokens[out.index] = out.num_output_tokens
        ev = w_pb.DecodeEvent(
            token_ids=out.new_token_ids,
            text=out.new_text,
            completion_tokens=out.num_output_tokens,
            logprobs=convert.logprobs_to_pb(out.new_logprobs),
            index=out.index,
        )
        if not slot.first_sent or out.finished:
            ev.timings.CopyFrom(
                gen_pb.Timings(queue_ms=slot.queue_ms, prefill_ms=slot.prefill_ms, kv_transfer_ms=slot.transfer_ms)
            )
        if not slot.first_sent:
            slot.first_sent = True
            ev.prompt_logprobs.extend(convert.logprobs_to_pb(out.prompt_logprobs))
            self.metrics.first_tokens.labels("local" if slot.prefill_start else "kv").inc()
            if slot.prefill_start:  # prefilled here: the engine's own prefill produced this token
                slot.kv_done = slot.first_token_at = time.time()
                slot.cached_tokens = out.num_cached_tokens
                slot.prefill_ms = (slot.kv_done - slot.prefill_start) * 1000
                ev.timings.prefill_ms = slot.prefill_ms
            ev.first_token_unix = slot.first_token_at or slot.kv_done
            ev.cached_tokens = slot.cached_tokens
            ev.prefill_worker = slot.prefill_worker
        if out.finished:
            ev.cached_tokens = slot.cached_tokens
            ev.finish_reason = out.finish_reason or "error"
            if out.error:
                ev.error = fit_details(out.error)
                if out.exception is not None:  # the engine's reason (a format that failed: INVALID_ARGUMENT)
                    ev.error_code = code_of(out.exception).value[0]
                if slot.samples_left > 1:  # the stream ends here: the request's other samples stop too
                    self.runner.submit_nowait(lambda e, rid=slot.request_id: e.abort_request(rid))
            slot.samples_left -= 1
            if slot.samples_left > 0 and not out.error and ev.finish_reason != "cancelled":
                ev.more = True  # (the stream goes on: other samples of the request still run)
            else:
                self._end_decode_span(slot, ev.finish_reason, out)
        slot.events.put_nowait(ev)

    def preempted(self, request_ids: list[str], at: float) -> None:
        """Sequences the engine preempted in a step (at: unix time), on their requests' decode spans."""
        for rid in request_ids:
            slot = self.slots.get(rid)
            if slot is not None and slot.decode_span is not None:
                slot.preemptions += 1
                slot.decode_span.add_event("preempted", timestamp=tracing.ns(at))

    def _ended(self, rid: str) -> None:
        _remember(self.ended, rid, None)

    async def _stream(self, rid: str) -> Slot:
        """The request's open stream. A handoff can come before it (the router admits the job
        while the stream opens), so it is waited for, unless it has ended here already."""
        slot = self.slots.get(rid)
        if slot is not None:
            return slot
        if rid not in self.ended and not self.draining:
            waiting = self.arrivals.get(rid)
            if waiting is None:
                waiting = self.arrivals[rid] = asyncio.get_running_loop().create_future()
            try:
                return await aio.wait_for(asyncio.shield(waiting), STREAM_WAIT_S)
            except TimeoutError:
                pass
            finally:  # timed out or cancelled: never leave a future behind for a stream that may not come
                if self.arrivals.get(rid) is waiting:
                    del self.arrivals[rid]
            if (slot := self.slots.get(rid)) is not None:  # opened after another waiter dropped the future
                return slot
        raise NotFound(f"no decode stream open for request {rid!r} (cancelled, or never opened here)")

    # -- FirstToken ---------------------------------------------------------------------

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
        if _other_leg(slot, request):  # a job superseded when the request resumed (see _slot_for)
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

    def cut_off(self, why: str) -> None:
        """End every stream still open with UNAVAILABLE and `why` (this worker is stopping), its KV freed."""
        for slot in list(self.slots.values()):
            if slot.done:
                continue
            if slot.decode_span is not None:
                slot.decode_span.set_status(tracing.Status(tracing.StatusCode.ERROR, why))
            log.warning("request %s: %s", slot.request_id, why)
            self._end_stream(
                slot,
                "error",
                w_pb.DecodeEvent(
                    error=why,
                    error_code=grpc.StatusCode.UNAVAILABLE.value[0],
                    completion_tokens=slot.completion_tokens,
                    worker_stopping=True,
                ),
            )

    # -- Fail ---------------------------------------------------------------------------

    async def Fail(self, request: w_pb.FailRequest, context):
        """A producer could not prefill or hand over this request: its stream ends with that status."""
        if not request.request_id:
            raise Invalid("request_id: must be set")
        code = status_code(request.code)
        if code is None or code == grpc.StatusCode.OK:
            raise Invalid(f"code: {request.code} is not a gRPC error status (1..16)")
        slot = await self._stream(request.request_id)
        if _other_leg(slot, request):  # a superseded job's failure: not this stream's
            return w_pb.FailResponse(ended=False)
        return w_pb.FailResponse(
            ended=self._end_with_error(slot, code, request.message or code.name, request.handoff_lost)
        )

    def _end_with_error(self, slot: Slot, code: grpc.StatusCode, message: str, handoff_lost: bool = False) -> bool:
        """End a stream still waiting for its KV with an error; False if it has ended or its KV is here.
        handoff_lost: the producer could not reach this worker, so the router may resume the request
        elsewhere (worker_stopping). Before, a worker stopped for a while that got this once it went on
        ended the stream with the failure, and the request did not resume."""
        if slot.done or slot.imported:
            return False
        slot.done = True
        slot.events.put_nowait(
            w_pb.DecodeEvent(error=fit_details(message), error_code=code.value[0], worker_stopping=handoff_lost)
        )
        return True

    # -- PutKV --------------------------------------------------------------------------

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
        if _other_leg(slot, seq):  # a job superseded as the request resumed, prefilled all the same, and a later
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
        if h.dtype != "float32":
            raise Invalid(f"handle.dtype: {h.dtype!r} is not float32")
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
        return w_pb.PutKVResponse(transfer_ms=adopt_s * 1000)

    @staticmethod
    def _import(engine, export, payload, priority: int) -> tuple:
        """Engine thread: adopt the KV; (its first output, the tokens whose KV was cached here already)."""
        first = engine.import_kv(export, payload, priority)
        seq = engine.seqs.get(export.request_id)  # (gone if its first token ended it: sampling.n > 1)
        return first, seq.num_shared_on_import if seq is not None else engine.last_shared_on_import

    # -- registry -----------------------------------------------------------------------

    async def warm_arenas(self) -> None:
        """Map the arenas of prefill workers on this host before their first handoff, and unmap
        those of prefill workers that have gone."""
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
            if arena and host == self.host and arena not in self.warmed:
                if await asyncio.to_thread(self.reader.warm, arena):
                    self.warmed.add(arena)

    def info(self, address: str) -> WorkerInfo:
        e = self.engine
        return WorkerInfo(
            worker_id=self.name,
            role="decode",
            address=address,
            host_id=self.host,
            running=e.num_running,
            waiting=e.num_waiting,
            free_kv_tokens=e.cache.pool.num_free * e.cache.block_size,
            kv_capacity_tokens=e.kv_capacity_tokens,
            pending=sum(1 for slot in self.slots.values() if not slot.imported),  # open streams still without KV
            opened=self.opened,
            closed=self.closed,
            epoch=self.epoch,
        )


async def serve(settings: Settings, stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    name = settings.worker_name("decode")
    servicer_ref: list[DecodeServicer] = []
    metrics = DecodeMetrics()

    def on_step():  # engine thread
        metrics.observe_step(engine)
        loop.call_soon_threadsafe(servicer_ref[0].capacity.set)
        if engine.last_stats.preempted:
            loop.call_soon_threadsafe(servicer_ref[0].preempted, engine.last_stats.preempted, time.time())

    watch = StepWatch(settings.engine_stall_s, f"decode worker {name}")
    runner = EngineRunner(lambda: LLMEngine(settings.engine_config("decode")), loop, on_step=on_step, watch=watch)
    engine = await runner.start()  # no step runs before the servicer below takes a request
    metrics.follow(engine)
    r = connect(settings.redis_url, settings.redis_cluster, asyncio=True)
    keys = Keys(settings.redis_prefix)
    servicer = DecodeServicer(settings, runner, r, keys, name, metrics)
    servicer_ref.append(servicer)
    server = grpc_server.new_server(settings.keepalive_s)
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
    port, health = await grpc_server.start(server, settings.host, settings.port, [SERVICE])
    address = settings.address(port)
    metrics_port = metrics.serve(settings.host, settings.metrics_port)
    lease = 3 * settings.heartbeat_s
    redis_scripts = Scripts(r)

    async def heartbeat():
        serving = True
        while True:
            stalled = runner.watch.stalled()
            metrics.stalled.set(int(stalled))
            if stalled == serving:  # a step that does not return: report it, and let the lease lapse
                serving = not stalled
                status = (
                    health_pb2.HealthCheckResponse.NOT_SERVING if stalled else health_pb2.HealthCheckResponse.SERVING
                )
                for svc in ("", SERVICE):
                    await health.set(svc, status)
            if stalled:
                await asyncio.sleep(settings.heartbeat_s)
                continue
            started = time.monotonic()
            try:  # Redis down or restarted empty: keep trying, so the worker registers again when it is back
                info = servicer.info(address)
                if metrics_port:
                    info.metrics = f"{settings.host}:{metrics_port}"
                await redis_scripts.run(scripts.heartbeat(keys, info=info, lease_s=lease))
                await servicer.warm_arenas()
            except redis.RedisError as e:
                log.warning("heartbeat failed: %s", e)
            except Exception:  # noqa: BLE001 - the heartbeat must outlive any round (its lease would lapse)
                log.exception("heartbeat round failed")
            # One write a heartbeat, the round's time included: a round that Redis held (stalled
            # past the lease, which lapsed meanwhile) is followed by a write at once, not a heartbeat on.
            await asyncio.sleep(max(0.0, settings.heartbeat_s - (time.monotonic() - started)))

    hb = asyncio.create_task(heartbeat())
    log.info(
        "decode worker %s serving on %s (model %s, fingerprint %s)",
        name,
        address,
        engine.model_name,
        engine.fingerprint,
    )
    if metrics_port:
        print(f"METRICS {settings.host}:{metrics_port}", flush=True)
    print(f"READY {address}", flush=True)
    await stop.wait()
    # Drain: out of the registry, then no new streams; running sequences finish (up to drain_s), then stop.
    t_end = time.time() + settings.drain_s
    await grpc_server.set_not_serving(health, [SERVICE])
    hb.cancel()
    try:
        await r.delete(keys.worker("decode", name))
    except redis.RedisError as e:  # its lease ends it anyway; drain regardless
        log.warning("could not remove the registry entry: %s", e)
    # A router places requests here until it reads the registry again (every half heartbeat): the
    # streams it opens meanwhile are taken and drained too, not refused (UNAVAILABLE to a client).
    await asyncio.sleep(max(0.0, min(2 * settings.heartbeat_s, t_end - time.time())))
    servicer.draining = True
    log.info("draining: %d stream(s) open, taking no more", len(servicer.slots))
    while servicer.slots and time.time() < t_end:
        await asyncio.sleep(0.05)
    # Those still open fail UNAVAILABLE saying why (a client may retry), not with gRPC's "Cancelling all calls".
    servicer.cut_off(
        f"decode worker {name} stopped before this request finished (its drain of "
        f"{settings.drain_s:g} s ran out); retry"
    )
    for task in servicer.token_streams:  # prefill workers keep these open: they end now (FirstTokens)
        task.cancel()
    await server.stop(grace=1.0)
    runner.stop()
    servicer.reader.close()
    await r.aclose()
    metrics.close()
    log.info("decode worker %s stopped", name)
