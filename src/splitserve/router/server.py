"""The Generation service.

Per request: validate (INVALID_ARGUMENT naming the field) -> tokenize -> a cheap look
at the queue counters (fast refusal under floods) -> pick a decode worker -> open its
Decode stream -> one atomic Redis script admits, records the request and XADDs the
prefill job (or refuses: RESOURCE_EXHAUSTED with a retry hint, and the decode stream
is closed) -> relay tokens. A client that cancels, disconnects or runs out of
deadline cancels the decode stream, which stops the work downstream and frees its KV;
the request hash says "cancelled" so a prefill worker skips a job still queued.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

import grpc
import redis.asyncio as aioredis

from splitserve.engine.config import ModelSpec
from splitserve.engine.errors import InvalidRequestError
from splitserve.engine.loader import load_frontend
from splitserve.engine.model import context_length
from splitserve.engine.sampling import SamplingParams
from splitserve.engine.tokenizer import Tokenizer
from splitserve.service import convert, grpc_server
from splitserve.service.errors import AlreadyExists, NotFound, Refused, ServiceError, Unavailable
from splitserve.service.redis_state import ADMIT_LUA, FINAL_STATES, Job, Keys, WorkerInfo, sampling_to_dict
from splitserve.service.settings import Settings
from splitserve_proto.v1 import generation_pb2 as gen_pb
from splitserve_proto.v1 import generation_pb2_grpc
from splitserve_proto.v1 import worker_pb2 as w_pb
from splitserve_proto.v1 import worker_pb2_grpc

log = logging.getLogger(__name__)
SERVICE = gen_pb.DESCRIPTOR.services_by_name["Generation"].full_name


class UpstreamError(ServiceError):
    code = grpc.StatusCode.INTERNAL


@dataclass
class Active:
    call: object  # the Decode call on the decode worker
    aborted: bool = False


class Frontend:
    """What the router knows of the model: tokenizer, vocabulary, context."""

    def __init__(self, settings: Settings):
        hf_tok, config = load_frontend(ModelSpec(path=settings.model or None, cache_dir=settings.cache_dir))
        self.tokenizer = Tokenizer(hf_tok) if hf_tok is not None else None
        self.vocab = config.vocab_size
        self.context = context_length(config)
        self.name = getattr(config, "_name_or_path", "") or settings.model or "SmolLM2-135M-Instruct"

    def prompt_ids(self, req: gen_pb.GenerateRequest) -> list[int]:
        kind, value = convert.input_of(req)
        if kind == "token_ids":
            bad = next((t for t in value if not 0 <= t < self.vocab), None)
            if bad is not None:
                raise InvalidRequestError("token_ids", f"token id {bad} is outside the vocabulary [0, {self.vocab})")
            return value
        if self.tokenizer is None:
            raise InvalidRequestError(kind, "this model has no tokenizer; send token_ids")
        text = self.tokenizer.apply_chat_template(value) if kind == "messages" else value
        ids = self.tokenizer.encode(text)
        if not ids:
            raise InvalidRequestError(kind, "tokenizes to nothing")
        return ids


class RouterServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, settings: Settings, frontend: Frontend, r: aioredis.Redis):
        self.s = settings
        self.front = frontend
        self.redis = r
        self.keys = Keys(settings.redis_prefix)
        self.admit_script = r.register_script(ADMIT_LUA)
        self.workers: list[WorkerInfo] = []
        self.sent: dict[str, int] = {}  # requests sent to each worker since the last registry read
        self.channels: dict[str, worker_pb2_grpc.DecodeWorkerStub] = {}
        self.active: dict[str, Active] = {}

    # -- registry -----------------------------------------------------------------------

    async def refresh_workers(self) -> None:
        found = []
        async for key in self.redis.scan_iter(match=self.keys.worker_pattern("decode"), count=100):
            m = await self.redis.hgetall(key)
            if m:
                found.append(WorkerInfo.from_mapping(m))
        self.workers = found
        self.sent = {}

    def pick(self, need_tokens: int) -> WorkerInfo:
        if not self.workers:
            raise Unavailable("no decode worker is registered; retry shortly")

        def load(w: WorkerInfo) -> tuple:
            return (w.free_kv_tokens < need_tokens, w.running + w.waiting + w.pending + self.sent.get(w.worker_id, 0))

        w = min(self.workers, key=load)
        self.sent[w.worker_id] = self.sent.get(w.worker_id, 0) + 1
        return w

    def stub(self, address: str) -> worker_pb2_grpc.DecodeWorkerStub:
        stub = self.channels.get(address)
        if stub is None:
            stub = worker_pb2_grpc.DecodeWorkerStub(grpc_server.channel(address))
            self.channels[address] = stub
        return stub

    # -- the request path ---------------------------------------------------------------

    def _validate(self, request: gen_pb.GenerateRequest) -> tuple[str, list[int], SamplingParams]:
        convert.check_request_id(request.request_id)
        params = convert.sampling_from_pb(request.sampling, self.s.default_max_tokens)
        ids = self.front.prompt_ids(request)
        total = len(ids) + params.max_tokens
        if total > self.front.context:
            raise InvalidRequestError(
                "sampling.max_tokens",
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds the context length "
                f"{self.front.context}",
            )
        if any(t < 0 or t >= self.front.vocab for t in params.stop_token_ids):
            raise InvalidRequestError("sampling.stop_token_ids", f"token ids must be in [0, {self.front.vocab})")
        return request.request_id or uuid.uuid4().hex, ids, params

    def _refusal(self, q: int, t: int) -> Refused:
        hint = self.s.retry_after_ms
        return Refused(
            f"queue is full ({q} requests, {t} tokens queued; refusing from {self.s.admit_fraction:.0%} of "
            f"{self.s.max_queue_requests} requests / {self.s.max_queue_tokens} tokens); retry after {hint} ms",
            metadata=(("retry-after-ms", str(hint)), ("grpc-retry-pushback-ms", str(hint))),
        )

    async def _events(self, request: gen_pb.GenerateRequest, context):
        """Yields (rid, prompt_tokens, DecodeEvent) for every decode event of the request."""
        t_recv = time.time()
        rid, ids, params = self._validate(request)
        frac = self.s.admit_fraction
        q, t = [int(x or 0) for x in await self.redis.hmget(self.keys.admission, "requests", "tokens")]
        if q + 1 > int(self.s.max_queue_requests * frac) or t + len(ids) > int(self.s.max_queue_tokens * frac):
            raise self._refusal(q, t)  # fast path: no decode stream opened for a refusal
        remaining = context.time_remaining()
        deadline = t_recv + remaining if remaining is not None else 0.0
        worker = self.pick(len(ids) + params.max_tokens)
        call = self.stub(worker.address).Decode(
            w_pb.DecodeRequest(request_id=rid, prompt_tokens=len(ids), deadline_unix=deadline), timeout=remaining
        )
        state = "failed"
        try:
            first = await call.read()
            if first is grpc.aio.EOF or not first.accepted:
                raise Unavailable(f"decode worker {worker.worker_id} did not accept the request")
            job = Job(
                request_id=rid, token_ids=ids, sampling=sampling_to_dict(params), decode_worker=worker.worker_id,
                decode_address=worker.address, decode_host_id=worker.host_id, deadline_unix=deadline,
                traceparent="", t_received=t_recv, t_admitted=time.time(), priority=request.priority,
            )
            ok, q, t = await self.admit_script(
                keys=[self.keys.admission, self.keys.stream, self.keys.req(rid)],
                args=[len(ids), self.s.max_queue_requests, self.s.max_queue_tokens, frac, self.s.request_ttl_s,
                      job.to_json()],
            )
            if ok == -1:
                state = ""
                raise AlreadyExists(f"request_id {rid!r} already exists (see GetRequest)")
            if ok == 0:
                state = ""
                raise self._refusal(int(q), int(t))
            active = self.active[rid] = Active(call)
            final = None
            try:
                while True:
                    ev = await call.read()
                    if ev is grpc.aio.EOF:
                        raise Unavailable("decode stream ended without a finish")
                    if ev.error:
                        raise UpstreamError(f"decode failed: {ev.error}")
                    yield rid, len(ids), ev
                    if ev.finish_reason:
                        final = ev
                        break
            except asyncio.CancelledError:
                if not active.aborted:
                    state = "cancelled"
                    raise
                final = w_pb.DecodeEvent(finish_reason="cancelled")
                yield rid, len(ids), final
            state = "cancelled" if final.finish_reason == "cancelled" else "finished"
            await self._mark(rid, state, final)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED and rid in self.active and self.active[rid].aborted:
                state = "cancelled"
                yield rid, len(ids), w_pb.DecodeEvent(finish_reason="cancelled")
                await self._mark(rid, state)
                return
            state = "cancelled" if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else "failed"
            raise
        finally:
            self.active.pop(rid, None)
            call.cancel()
            if state in ("cancelled", "failed"):
                await self._mark(rid, state)

    async def _mark(self, rid: str, state: str, final=None) -> None:
        """Record how a request ended (with its last decode event, if any); the hash then expires sooner."""
        key = self.keys.req(rid)
        mapping = {"state": state, "t_finished": time.time()}
        if final is not None:
            mapping.update(completion_tokens=final.completion_tokens, finish_reason=final.finish_reason)
        try:
            async with self.redis.pipeline(transaction=False) as p:
                p.hset(key, mapping=mapping)
                p.expire(key, self.s.finished_ttl_s)
                await p.execute()
        except Exception:  # noqa: BLE001 - bookkeeping must not hide the real outcome
            log.exception("could not record the end of %s", rid)

    def _timings(self, t0: float, t_first: float | None, ev) -> gen_pb.Timings:
        now = time.perf_counter()
        tm = gen_pb.Timings()
        if ev is not None and ev.HasField("timings"):
            tm.CopyFrom(ev.timings)
        tm.e2e_ms = (now - t0) * 1000
        if t_first is not None:
            tm.ttft_ms = (t_first - t0) * 1000
            tm.decode_ms = (now - t_first) * 1000
        return tm

    async def GenerateStream(self, request, context):
        t0 = time.perf_counter()
        t_first = None
        async for rid, n_prompt, ev in self._events(request, context):
            resp = gen_pb.GenerateResponse(request_id=rid, token_ids=ev.token_ids, text=ev.text)
            if t_first is None and ev.token_ids:
                t_first = time.perf_counter()
            if ev.finish_reason:
                resp.finish_reason = ev.finish_reason
                resp.usage.CopyFrom(gen_pb.Usage(prompt_tokens=n_prompt, completion_tokens=ev.completion_tokens))
                resp.timings.CopyFrom(self._timings(t0, t_first, ev))
            yield resp

    async def Generate(self, request, context):
        t0 = time.perf_counter()
        t_first = None
        resp = gen_pb.GenerateResponse()
        text = []
        async for rid, n_prompt, ev in self._events(request, context):
            resp.request_id = rid
            if t_first is None and ev.token_ids:
                t_first = time.perf_counter()
            resp.token_ids.extend(ev.token_ids)
            text.append(ev.text)
            if ev.finish_reason:
                resp.finish_reason = ev.finish_reason
                resp.usage.CopyFrom(gen_pb.Usage(prompt_tokens=n_prompt, completion_tokens=ev.completion_tokens))
                resp.timings.CopyFrom(self._timings(t0, t_first, ev))
        resp.text = "".join(text)
        return resp

    async def Abort(self, request, context):
        rid = request.request_id
        if not rid:
            raise InvalidRequestError("request_id", "must be set")
        key = self.keys.req(rid)
        state = await self.redis.hget(key, "state")
        if state is None:
            raise NotFound(f"no request {rid!r}")
        state = state.decode()
        if state not in FINAL_STATES:
            await self._mark(rid, "cancelled")  # a prefill worker skips it if still queued
        active = self.active.get(rid)
        if active is not None:
            active.aborted = True
            active.call.cancel()
        return gen_pb.AbortResponse(found=True, state=state)

    async def GetRequest(self, request, context):
        rid = request.request_id
        if not rid:
            raise InvalidRequestError("request_id", "must be set")
        m = await self.redis.hgetall(self.keys.req(rid))
        if not m:
            raise NotFound(f"no request {rid!r} (unknown, or expired)")
        m = {k.decode(): v.decode() for k, v in m.items()}
        return gen_pb.RequestInfo(
            request_id=rid, state=m.get("state", ""),
            timestamps={k[2:]: float(v) for k, v in m.items() if k.startswith("t_")},
            prefill_worker=m.get("prefill_worker", ""), decode_worker=m.get("decode_worker", ""),
            prompt_tokens=int(m.get("prompt_tokens", 0)), completion_tokens=int(m.get("completion_tokens", 0)),
            finish_reason=m.get("finish_reason", ""), error=m.get("error", ""),
            kv_transport=m.get("kv_transport", ""), kv_bytes=int(m.get("kv_bytes", 0)),
        )


async def serve(settings: Settings, stop: asyncio.Event) -> None:
    frontend = await asyncio.to_thread(Frontend, settings)
    r = aioredis.from_url(settings.redis_url)
    servicer = RouterServicer(settings, frontend, r)
    await servicer.refresh_workers()
    server = grpc_server.new_server()
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    port, health = await grpc_server.start(server, settings.host, settings.port, [SERVICE])

    async def refresh():
        while True:
            await asyncio.sleep(settings.heartbeat_s / 2)
            try:
                await servicer.refresh_workers()
            except Exception as e:  # noqa: BLE001
                log.warning("registry refresh failed: %s", e)

    task = asyncio.create_task(refresh())
    address = settings.address(port)
    log.info("router serving on %s", address)
    print(f"READY {address}", flush=True)
    await stop.wait()
    await grpc_server.set_not_serving(health, [SERVICE])
    task.cancel()
    await server.stop(grace=settings.drain_s)  # in-flight requests finish, new ones are refused
    await r.aclose()
    log.info("router stopped")
