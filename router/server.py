"""The Generation service.

Per request: validate (INVALID_ARGUMENT naming the field) -> tokenize -> a cheap look
at the queue counters (fast refusal under floods) -> pick a decode worker -> open its
Decode stream -> one atomic Redis script admits, records the request and XADDs the
prefill job (or refuses: RESOURCE_EXHAUSTED with a retry hint, and the decode stream
is closed) -> relay tokens. A client that cancels, disconnects or runs out of
deadline cancels the decode stream, which stops the work downstream and frees its KV;
the request hash says "cancelled" so a prefill worker skips a job still queued.

The servicer is assembled from one part per step of that path, each in a module of its own,
which share the servicer's state (set up in RouterServicer.__init__):

  frontend.py   validation and tokenizing (Frontend, FrontendChecks)
  admission.py  admission's fast path and refusals, queued requests taken back or lost (Admission)
  registry.py   the worker registry and placement (WorkerRegistry)
  relay.py      one request from admission to its end: the decode stream relayed (Relay)
  replay.py     idempotency, replay of a finished request, resume after a lost worker (Replay)
  lease.py      this router's lease, reaping lost routers' requests, and the drain (LeaseAndDrain)
  requests.py   what the router keeps of a request (Active, Sent, Result), and shared constants
This module holds the RPC handlers and serve().
"""

from __future__ import annotations

import asyncio
import time

import grpc
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2

from splitserve.engine.errors import InvalidRequestError
from splitserve.engine.params import check_vocab
from splitserve.observability import tracing
from splitserve.observability.metrics import RouterMetrics
from splitserve.router.admission import Admission
from splitserve.router.frontend import Frontend, FrontendChecks
from splitserve.router.http_api import HttpServer, OpenAIApi
from splitserve.router.lease import LeaseAndDrain
from splitserve.router.placement import Placements
from splitserve.router.prefix_index import PrefixIndex
from splitserve.router.prefix_share import SharedRecord
from splitserve.router.registry import WorkerRegistry
from splitserve.router.relay import Relay
from splitserve.router.replay import Replay
from splitserve.router.requests import (
    EARLY_ABORT_KEEP_S,
    INLINE_TOKENIZE_CHARS,
    ROUTER_LEASE_HEARTBEATS,
    SERVICE,
    Active,
    Recorded,
    log,
)
from splitserve.service import convert, grpc_server, tls
from splitserve.service import redis_scripts as scripts
from splitserve.service.errors import (
    Cancelled,
    NotFound,
    code_of,
)
from splitserve.service.peers import Peers
from splitserve.service.process import Background
from splitserve.service.redis_scripts import Scripts
from splitserve.service.redis_state import (
    FINAL_STATES,
    QUEUE_FIELDS,
    Keys,
    WorkerInfo,
    open_redis,
    queue_counts,
)
from splitserve.service.settings import Settings
from splitserve.service.tenants import Tenant, Tenants, scoped
from splitserve.wire import joined
from splitserve_proto.v1 import generation_pb2 as gen_pb
from splitserve_proto.v1 import generation_pb2_grpc
from splitserve_proto.v1 import worker_pb2 as w_pb


class RouterServicer(
    FrontendChecks, WorkerRegistry, Admission, Relay, Replay, LeaseAndDrain, generation_pb2_grpc.GenerationServicer
):
    def __init__(self, settings: Settings, frontend: Frontend, r: aioredis.Redis, metrics: RouterMetrics | None = None):
        self.s = settings
        self.tls = tls.files_of(settings)  # for its channels to the decode workers and its own ports
        self.front = frontend
        self.redis = r
        self.keys = Keys(settings.redis_prefix)
        self.scripts = Scripts(r)
        self.id = settings.worker_name("router")
        self.lease_s = ROUTER_LEASE_HEARTBEATS * settings.heartbeat_s
        self.clock = (0.0, 0.0)  # (Redis's TIME, time.monotonic()) at the last renewal: leases use Redis's clock
        self.renewing_since: float | None = None  # monotonic time since which renewals came every half heartbeat
        self.last_renewal = 0.0
        # Whether this router's last lease renewal (every half heartbeat) got no answer from Redis:
        # meanwhile a request's end is recorded in the background, not before its last message
        # (it would wait CALL_TIMEOUT_S), and so are the queue counts a first token returns; new
        # requests, GetRequest and Abort are refused at once (_check_redis).
        self.redis_away = False
        self.colocated = settings.mode == "colocated"
        self.workers: list[WorkerInfo] = []
        self.prefill_workers: int | None = None  # prefill workers registered (None: not read yet)
        self.unreadable: set[bytes] = set()  # registry keys told unreadable (_registry)
        self.lapsed: dict[str, float] = {}  # decode worker id -> monotonic time its entry was first found lapsed
        self.read_from = 0.0  # monotonic time the latest registry read (finished) began
        self.refreshing = asyncio.Lock()
        self.placements = Placements()  # corrects the registry's loads for what happened since
        self.prefixes = PrefixIndex(settings.block_size)  # what each decode worker has cached, as seen here
        # ... and each prefill worker (the prompts it prefilled): a job goes to the one with most of
        # its prompt, while that one has room (prefill_affinity_jobs; admit.lua)
        self.prefill_prefixes = PrefixIndex(settings.block_size)
        self.prefill_affinity = not self.colocated and settings.prefix_caching and settings.prefill_affinity_jobs > 0
        # only continuous engines cache prefixes (a decode worker's policy is the stack's)
        self.affinity = (
            settings.prefix_caching and settings.policy == "continuous" and settings.prefix_affinity_slack >= 0
        )
        self.peers = Peers(self._open_channel)
        self.active: dict[str, Active] = {}
        self.cut = ""  # why every request is cut off (cut_off: this router is stopping), once it is
        # Generate and GenerateStream calls being handled: a drain waits for these, not only for the
        # active requests, since one still in admission is not active yet
        self.calls = 0
        self.first_parts: dict[str, gen_pb.Timings] = {}  # TTFT parts, from the first token's event
        self.queue_seen = (0, 0, 0.0)  # (requests, tokens, monotonic time) from the last admission answer
        self.local_seen = 0  # ... and of those tokens, the ones their decode workers prefill
        # requests (and the tokens the queue counts for them) this router is admitting: validated, their
        # admission script not answered yet (Admission._admitting, _surely_full)
        self.admitting = [0, 0]
        self.view_read: asyncio.Future | None = None  # a read of the queue counts for the local view
        self.metrics = metrics or RouterMetrics()
        self.metrics.admitting.set_function(lambda: self.admitting[0])
        self.background = Background()
        # the other routers' records come in, and this one's go out (while run() runs: serve())
        self.shared = SharedRecord(
            r, self.keys.prefix_records, self.id, [self.prefixes, self.prefill_prefixes], self.metrics
        )
        # bearer tokens -> tenants (tenants.py), when the public API is authenticated
        self.tenants = Tenants(settings.auth_tokens_file) if settings.auth_tokens_file else None

    def authenticate(self, context, rpc: str) -> Tenant | None:
        """The call's tenant (None without tenants); UNAUTHENTICATED or PERMISSION_DENIED."""
        if self.tenants is None:
            return None
        if getattr(context, "tenant", None) is not None:  # an HTTP call, authenticated by its route
            return context.tenant
        tenant = self.tenants.authenticate(context.invocation_metadata(), rpc)
        self.metrics.tenant_calls.labels(tenant.name, rpc).inc()
        return tenant

    def _server_span(self, method: str, context) -> tracing.rpc_span:
        """The call's span: its gRPC method's, or for an HTTP call (http_api.HttpContext) its route's."""
        full = f"{SERVICE}/{method}"
        return tracing.rpc_span(
            getattr(context, "span_name", full),
            parent=tracing.extract(context.invocation_metadata()),
            attributes=tracing.rpc_attributes(full) | getattr(context, "span_attributes", {}),
        )

    def _record_error(self, e: BaseException) -> None:
        code = code_of(e)
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            self.metrics.refused.labels(
                "tenant_quota" if getattr(e, "reason", "") == "TENANT_QUOTA" else "queue_full"
            ).inc()
        elif code == grpc.StatusCode.CANCELLED:  # by the client, or by an Abort that came before it
            self.metrics.cancelled.labels("abort" if isinstance(e, Cancelled) else "client").inc()
        elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
            self.metrics.cancelled.labels("deadline").inc()
        else:
            self.metrics.failed.labels(code.name).inc()

    async def GenerateStream(self, request, context):
        t0 = time.perf_counter()
        t_first = None
        self.metrics.in_flight.inc()
        self.calls += 1
        try:
            with self._server_span("GenerateStream", context) as rs:
                try:
                    ended = []
                    tenant = self._tenant_of(context, "GenerateStream", rs)
                    async for rid, public_id, n_prompt, ev in self._events(request, context, rs, tenant):
                        resp = gen_pb.GenerateResponse(
                            request_id=public_id,
                            token_ids=ev.token_ids,
                            text=ev.text,
                            logprobs=ev.logprobs,
                            prompt_logprobs=ev.prompt_logprobs,
                            index=ev.index,
                        )
                        if t_first is None and ev.token_ids:
                            t_first = time.perf_counter()
                            rs.span.add_event("first_token")
                        if ev.finish_reason:
                            ended.append(ev)
                            self._finish(rs, resp, rid, n_prompt, ev, t0, t_first, ended, request.sampling.n)
                        yield resp
                except Recorded as r:
                    for resp in self._replayed(rs, r.responses, t0):
                        yield resp
        except BaseException as e:
            self._record_error(e)
            raise
        finally:
            self.metrics.in_flight.dec()
            self.calls -= 1

    async def Generate(self, request, context):
        t0 = time.perf_counter()
        t_first = None
        samples: dict[int, tuple[gen_pb.GenerateResponse, list[str]]] = {}  # index -> (its response, its texts)
        ended = []
        self.metrics.in_flight.inc()
        self.calls += 1
        try:
            with self._server_span("Generate", context) as rs:
                try:
                    tenant = self._tenant_of(context, "Generate", rs)
                    async for rid, public_id, n_prompt, ev in self._events(request, context, rs, tenant):
                        resp, text = samples.setdefault(ev.index, (gen_pb.GenerateResponse(index=ev.index), []))
                        resp.request_id = public_id
                        if t_first is None and ev.token_ids:
                            t_first = time.perf_counter()
                            rs.span.add_event("first_token")
                        resp.token_ids.extend(ev.token_ids)
                        resp.logprobs.extend(ev.logprobs)
                        resp.prompt_logprobs.extend(ev.prompt_logprobs)
                        text.append(ev.text)
                        if ev.finish_reason:
                            ended.append(ev)
                            self._finish(rs, resp, rid, n_prompt, ev, t0, t_first, ended, request.sampling.n)
                except Recorded as r:
                    return joined(
                        {resp.index: resp for resp in self._replayed(rs, r.responses, t0)}, request.sampling.n
                    )
        except BaseException as e:
            self._record_error(e)
            raise
        finally:
            self.metrics.in_flight.dec()
            self.calls -= 1
        for resp, text in samples.values():
            resp.text = "".join(text)
        return joined({i: resp for i, (resp, _) in samples.items()}, request.sampling.n)

    def _tenant_of(self, context, rpc: str, rs: tracing.rpc_span) -> Tenant | None:
        tenant = self.authenticate(context, rpc)
        if tenant is not None:
            rs.span.set_attribute("splitserve.tenant", tenant.name)
        return tenant

    async def Abort(self, request, context):
        tenant = self.authenticate(context, "Abort")
        convert.check_request_id(request.request_id, required=True)
        self._check_redis()
        rid = await self._latest(scoped(tenant, request.request_id))
        # Marked cancelled unless it has ended (a prefill worker then skips it, or aborts it between forwards).
        call = scripts.abort(
            self.keys, request_id=rid, now=time.time(), finished_ttl_s=self.s.finished_ttl_s,
            early_ttl_s=EARLY_ABORT_KEEP_S,
        )  # fmt: skip
        state, wid = (x.decode() if isinstance(x, bytes) else str(x or "") for x in await self.scripts.run(call))
        if not state:
            raise NotFound(
                f"no request {request.request_id!r} (yet: if it arrives within {EARLY_ABORT_KEEP_S} s, "
                "it is refused as cancelled)"
            )
        active = self.active.get(rid)
        if active is not None:
            active.aborted = True
            active.call.cancel()
        elif state not in FINAL_STATES:  # another router holds its stream: end it at its decode worker
            await self._cancel_at_worker(rid, wid)
        return gen_pb.AbortResponse(found=True, state=state)

    async def _cancel_at_worker(self, rid: str, wid: str) -> None:
        """Ask the request's decode worker to end its stream (finish_reason "cancelled") and free
        its KV; the router holding the stream then finishes it as it would its own abort."""
        address = next((w.address for w in self.workers if w.worker_id == wid), "")
        if not address and wid:  # registered since the last registry read
            address = (await self.redis.hget(self.keys.worker("decode", wid), "address") or b"").decode()
        if not address:
            log.warning(
                "abort %s: its decode worker %s is not registered (its stream ends when the worker goes)", rid, wid
            )
            return
        try:
            await self.stub(address).Cancel(w_pb.CancelRequest(request_id=rid), timeout=5.0)
        except grpc.aio.AioRpcError as e:
            log.warning("abort %s: Cancel at decode worker %s failed: %s", rid, address, e.code().name)

    async def GetRequest(self, request, context):
        tenant = self.authenticate(context, "GetRequest")
        rid = request.request_id
        convert.check_request_id(rid, required=True)
        self._check_redis()
        m = await self.redis.hgetall(self.keys.req(scoped(tenant, rid)))
        if m.get(b"early") == b"1":
            raise NotFound(f"no request {rid!r} (an Abort for it came first: it is refused if it arrives)")
        attempts = int(m.get(b"attempts", 1))
        if current := m.get(b"current"):  # sent again after it ended unfinished: its latest attempt
            m = await self.redis.hgetall(self.keys.req(current.decode()))
        if not m:
            raise NotFound(f"no request {rid!r} (unknown, or expired)")
        m = {k.decode(): v.decode() for k, v in m.items()}
        return gen_pb.RequestInfo(
            request_id=rid,
            state=m.get("state", ""),
            attempts=attempts,
            timestamps={k[2:]: float(v) for k, v in m.items() if k.startswith("t_")},
            prefill_worker=m.get("prefill_worker", ""),
            decode_worker=m.get("decode_worker", ""),
            prompt_tokens=int(m.get("prompt_tokens", 0)),
            completion_tokens=int(m.get("completion_tokens", 0)),
            cached_tokens=int(m.get("cached_tokens", 0)),
            finish_reason=m.get("finish_reason", ""),
            error=m.get("error", ""),
            kv_transport=m.get("kv_transport", ""),
            kv_bytes=int(m.get("kv_bytes", 0)),
            resumes=int(m.get("resumed", 0)),
        )

    async def Tokenize(self, request, context):
        self.authenticate(context, "Tokenize")
        kind = request.WhichOneof("input")
        if kind is None:
            raise InvalidRequestError("input", "one of prompt or messages is required")
        as_generate = gen_pb.GenerateRequest(**{kind: getattr(request, kind)})
        # Any length the router reads (max_request_bytes): counting a text that does not fit is the point.
        if self.front.check_input_size(as_generate, truncating=True) > INLINE_TOKENIZE_CHARS:
            ids = await asyncio.to_thread(self.front.prompt_ids, as_generate)
        else:
            ids = self.front.prompt_ids(as_generate)
        return gen_pb.TokenizeResponse(
            token_ids=ids, count=len(ids), max_model_len=self.front.context, model=self.front.name
        )

    async def ListModels(self, request, context):
        self.authenticate(context, "ListModels")
        return gen_pb.ListModelsResponse(models=[self._model_info()])

    async def GetModelInfo(self, request, context):
        self.authenticate(context, "GetModelInfo")
        self.front.check_model(request.name)
        return self._model_info()

    def _model_info(self) -> gen_pb.ModelInfo:
        """The served model; its dtype and fingerprint as a registered decode worker gives them."""
        worker = next((w for w in self.workers if w.fingerprint), None)
        return gen_pb.ModelInfo(
            name=self.front.name,
            context_length=self.front.context,
            vocab_size=self.front.vocab,
            dtype=worker.dtype if worker else "",
            fingerprint=worker.fingerprint if worker else "",
        )

    async def Detokenize(self, request, context):
        self.authenticate(context, "Detokenize")
        tok = self.front.tokenizer
        if tok is None:
            raise InvalidRequestError("token_ids", "this model has no tokenizer")
        ids = list(request.token_ids)
        check_vocab("token_ids", ids, self.front.vocab)
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        if len(ids) > INLINE_TOKENIZE_CHARS:
            return gen_pb.DetokenizeResponse(text=await asyncio.to_thread(tok.decode, ids, skip))
        return gen_pb.DetokenizeResponse(text=tok.decode(ids, skip))

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


async def serve(settings: Settings, stop: asyncio.Event) -> None:
    tls.files_of(settings)  # first: a file that cannot be read stops the start, naming it (the servicer keeps them)
    frontend = await asyncio.to_thread(Frontend, settings)
    r = open_redis(settings, asyncio=True)
    metrics = RouterMetrics()
    metrics.label_model(frontend.name)
    metrics.queue_limit_requests.set(int(settings.max_queue_requests * settings.admit_fraction))
    metrics.queue_limit_tokens.set(int(settings.max_queue_tokens * settings.admit_fraction))
    servicer = RouterServicer(settings, frontend, r, metrics)
    await servicer.reap(servicer.id)  # what an earlier life under this id left
    await servicer.keep_alive()
    await servicer.refresh_workers()
    http = None
    if settings.http_port:  # bound first: a port in use stops the start at once, naming it
        max_body = settings.http_max_body_bytes or frontend.max_request_bytes()
        api = OpenAIApi(
            servicer,
            frontend.name,
            frontend.context,
            max_body,
            settings.http_body_timeout_s,
            settings.slow_reader_timeout_s,
        )
        http = HttpServer(api, settings, servicer.tls)
    server = grpc_server.new_server(settings.keepalive_s, frontend.max_request_bytes(), settings.slow_reader_timeout_s)
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    # the public port: TLS with the stack's certificate, no client certificate asked for
    port, health = await grpc_server.start(
        server,
        settings.host,
        settings.port,
        [SERVICE],
        servicer.tls,
        client_auth=False,
        reflection_on=settings.reflection,
        health_port=settings.health_port,
    )
    metrics_port = metrics.serve(settings.metrics_bind, settings.metrics_port)
    if http is not None:
        http.start()
    # The Generation service is SERVING once a decode worker is registered (a readiness probe, or
    # a client's health check, sends no request that would only wait); the server's overall
    # health stays SERVING, for liveness probes.
    generation = [None]

    async def follow_workers():
        ready = bool(servicer.workers)
        if generation[0] != ready:
            generation[0] = ready
            await health.set(
                SERVICE, health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
            )

    await follow_workers()

    async def refresh():
        while True:
            await asyncio.sleep(settings.heartbeat_s / 2)
            try:
                await servicer.keep_alive()
                await servicer.refresh_workers()
                await follow_workers()
                q, t = queue_counts(await r.hmget(servicer.keys.admission, *QUEUE_FIELDS))
                metrics.queue_requests.set(q)
                metrics.queue_tokens.set(t)
                metrics.decode_workers.set(len(servicer.workers))
                await servicer.reap()
                await servicer.check_waiting()
                await servicer.record_progress()
                await servicer.close_idle_channels()
            except Exception as e:  # noqa: BLE001
                log.warning("registry refresh failed: %s", e)

    task = asyncio.create_task(refresh())
    sharing = (
        asyncio.create_task(servicer.shared.run()) if servicer.affinity and settings.share_prefix_records else None
    )
    address = settings.address(port)
    log.info("router serving on %s", address)
    if metrics_port:
        print(f"METRICS {settings.metrics_address(metrics_port)}", flush=True)
    if http is not None:
        log.info("OpenAI-compatible HTTP on %s://%s:%d/v1", http.scheme, settings.host, http.port)
        print(f"HTTP {settings.host}:{http.port}", flush=True)
    print(f"READY {address}", flush=True)
    await stop.wait()
    task.cancel()
    await grpc_server.set_not_serving(health, [SERVICE])
    if sharing is not None:
        sharing.cancel()
    # In-flight requests finish, new ones are refused (gRPC sends them to the other routers). Those
    # still running when DRAIN_S is over fail UNAVAILABLE saying so, and are recorded failed: gRPC's own
    # cut would say "Cancelling all calls", and the hash "cancelled", as if their clients had.
    stopping = asyncio.create_task(grpc_server.stop(server, grace=settings.drain_s + 5.0))
    if http is not None:
        http.stop_accepting()
    t_end = time.monotonic() + settings.drain_s
    # (the calls in hand, not only the active requests: one still in admission is not active yet,
    # and a drain over before its admission was would cut it off as it came out)
    while (servicer.active or servicer.calls) and time.monotonic() < t_end:
        await asyncio.sleep(0.05)
    servicer.cut_off(
        f"router {servicer.id} stopped before this request finished (its drain of "
        f"{settings.drain_s:g} s ran out); retry"
    )
    await stopping
    if http is not None:
        await http.stopped()
    for peer in servicer.peers.clear():  # their watchers end with them
        await peer.channel.close()
    try:
        await servicer.reap(servicer.id)  # leaves the routers set; anything not ended is marked failed
    except Exception as e:  # noqa: BLE001 - Redis may be gone too
        log.warning("could not leave the routers set: %s", e)
    await r.aclose()
    metrics.close()
    log.info("router stopped")
