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
import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field

import grpc
import redis
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2

from splitserve.decode_worker.handoff import SERVICE, HandoffReceiver, other_leg
from splitserve.decode_worker.liveness import Heartbeat
from splitserve.engine.engine import LLMEngine
from splitserve.engine.errors import InvalidRequestError
from splitserve.engine.loader import served_model_name
from splitserve.engine.outputs import RequestOutput
from splitserve.handoff.arena import ArenaReader
from splitserve.observability import tracing
from splitserve.observability.metrics import DecodeMetrics
from splitserve.service import aio, convert, grpc_server, tls
from splitserve.service.errors import (
    AlreadyExists,
    FailedPrecondition,
    Invalid,
    NotFound,
    Unavailable,
    code_of,
    fit_details,
    status_code,
)
from splitserve.service.process import Background
from splitserve.service.redis_scripts import Scripts
from splitserve.service.redis_state import Keys, WorkerInfo, open_redis
from splitserve.service.runner import EngineRunner
from splitserve.service.settings import Settings, host_id
from splitserve.service.watchdog import StepWatch
from splitserve_proto.v1 import generation_pb2 as gen_pb
from splitserve_proto.v1 import worker_pb2 as w_pb
from splitserve_proto.v1 import worker_pb2_grpc

log = logging.getLogger(__name__)
# The router queues a request's prefill job while its Decode stream is still opening, so a
# handoff (FirstToken, PutKV, Fail) may arrive before the stream: it waits this long for it.
STREAM_WAIT_S = 2.0
ENDED_KEEP = 4096  # request ids whose stream ended here, remembered so their late handoffs are refused at once
# A stream whose reader (its router, and behind it the client) is this many events behind has its
# sequence paused in the engine (its KV kept); it goes on once the reader is within RESUME_EVENTS.
# The router ends a request whose client reads nothing for slow_reader_timeout_s, and with it this
# stream and the KV.
PAUSE_EVENTS = 32
RESUME_EVENTS = 8
# A Cancel can come before its stream too (Abort right after admission): a stream that opens
# this soon after it ends cancelled at once.
CANCEL_KEEP_S = 10.0


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
    paused: bool = False  # its sequence is paused in the engine: the stream's reader is PAUSE_EVENTS behind

    @property
    def completion_tokens(self) -> int:
        """Sent so far, of all its samples."""
        return sum(self.sample_tokens.values())


class DecodeServicer(HandoffReceiver, worker_pb2_grpc.DecodeWorkerServicer):
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
        self.local_arenas: set[str] = set()  # the arenas of the prefill workers registered on this host
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
                    if slot.paused and slot.events.qsize() <= RESUME_EVENTS:
                        self._pause(slot, False)
                    if ev.finish_reason and not ev.more or ev.error:
                        ev.close_seq = self._close(slot)
                        slot.done = True
                        yield ev
                        return
                    yield ev
            finally:
                if slot.paused:
                    slot.paused = False
                    self.metrics.paused.dec()
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
        if not slot.paused and slot.events.qsize() >= PAUSE_EVENTS and not out.finished:
            self._pause(slot, True)

    def _pause(self, slot: Slot, paused: bool) -> None:
        """Pause a stream's sequence in the engine (its reader is behind; its KV stays), or resume it."""
        slot.paused = paused
        rid = slot.request_id
        self.runner.submit_nowait(lambda e: e.pause_request(rid, paused))
        self.metrics.paused.inc(1 if paused else -1)
        if paused:
            self.metrics.pauses.inc()

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
        if other_leg(slot, request):  # a superseded job's failure: not this stream's
            return w_pb.FailResponse(ended=False)
        return w_pb.FailResponse(
            ended=self._end_with_error(slot, code, request.message or code.name, request.handoff_lost)
        )

    def _end_with_error(self, slot: Slot, code: grpc.StatusCode, message: str, handoff_lost: bool = False) -> bool:
        """End a stream still waiting for its KV with an error; False if it has ended or its KV is here.
        handoff_lost: the producer could not reach this worker, so the router may resume the request
        elsewhere (worker_stopping), also when this worker was stopped for a while and gets it late."""
        if slot.done or slot.imported:
            return False
        slot.done = True
        slot.events.put_nowait(
            w_pb.DecodeEvent(error=fit_details(message), error_code=code.value[0], worker_stopping=handoff_lost)
        )
        return True

    # -- PutKV --------------------------------------------------------------------------

    # -- registry -----------------------------------------------------------------------

    def info(self, address: str, metrics_port: int | None = None) -> WorkerInfo:
        """This worker's registry entry; read from the heartbeat thread (hence the copy of slots)."""
        e = self.engine
        slots = list(self.slots.values())
        return WorkerInfo(
            worker_id=self.name,
            role="decode",
            address=address,
            host_id=self.host,
            running=e.num_running,
            waiting=e.num_waiting,
            free_kv_tokens=e.cache.pool.num_free * e.cache.block_size,
            kv_capacity_tokens=e.kv_capacity_tokens,
            pending=sum(1 for slot in slots if not slot.imported),  # open streams still without KV
            opened=self.opened,
            closed=self.closed,
            epoch=self.epoch,
            fingerprint=e.fingerprint,
            dtype=str(e.cache.kv.dtype).removeprefix("torch."),
            metrics=self.s.metrics_address(metrics_port) if metrics_port else "",
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
    metrics.label_model(served_model_name(settings.served_model_name, engine.model_name))
    r = open_redis(settings, asyncio=True)
    keys = Keys(settings.redis_prefix)
    servicer = DecodeServicer(settings, runner, r, keys, name, metrics)
    servicer_ref.append(servicer)
    server = grpc_server.new_server(settings.keepalive_s)
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
    port, health = await grpc_server.start(
        server,
        settings.host,
        settings.port,
        [SERVICE],
        tls.files_of(settings),
        reflection_on=settings.reflection,
        health_port=settings.health_port,
    )
    address = settings.address(port)
    metrics_port = metrics.serve(settings.metrics_bind, settings.metrics_port)

    def set_health(stalled: bool) -> None:  # heartbeat thread
        status = health_pb2.HealthCheckResponse.NOT_SERVING if stalled else health_pb2.HealthCheckResponse.SERVING
        for svc in ("", SERVICE):
            asyncio.run_coroutine_threadsafe(health.set(svc, status), loop)

    beat = Heartbeat(settings, name, runner.watch, metrics, lambda: servicer.info(address, metrics_port), set_health)
    beat.start()

    async def warm():  # the arenas of this host's prefill workers, mapped before their first handoff
        while True:
            try:
                await servicer.warm_arenas()
            except redis.RedisError as e:
                log.debug("arenas not warmed: %s", e)
            except Exception:  # noqa: BLE001 - the next round tries again
                log.exception("warming the arenas failed")
            await asyncio.sleep(settings.heartbeat_s)

    hb = asyncio.create_task(warm())
    log.info(
        "decode worker %s serving on %s (model %s, fingerprint %s)",
        name,
        address,
        engine.model_name,
        engine.fingerprint,
    )
    if metrics_port:
        print(f"METRICS {settings.metrics_address(metrics_port)}", flush=True)
    print(f"READY {address}", flush=True)
    await stop.wait()
    # Drain: out of the registry, then no new streams; running sequences finish (up to drain_s), then stop.
    t_end = time.time() + settings.drain_s
    await grpc_server.set_not_serving(health, [SERVICE])
    hb.cancel()
    await asyncio.to_thread(beat.leave)
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
    await grpc_server.stop(server, grace=1.0)
    runner.stop()
    servicer.reader.close()
    await r.aclose()
    metrics.close()
    log.info("decode worker %s stopped", name)
