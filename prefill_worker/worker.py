"""The prefill worker's loop: pull -> one forward -> for each finished prompt: first token,
export into the arena, PutKV, free, XACK -> pull again (jobs join between forwards).

Pulling is the load balancer and the backpressure. A worker reads jobs with XREADGROUP
up to its token budget, about one forward's work; the rest waits in the stream for
whichever worker is free first. Exporting a KV waits for arena room, and a region stays
allocated until the decode worker's PutKV returns, so a full decode pool stalls the
arena, which stalls pulling, which lets the stream grow until the routers' admission
refuses. There is one stream per priority class; each pull takes from the high one
first and the low one last. Jobs left pending by a dead worker are claimed with
XAUTOCLAIM after ``claim_idle_ms``; a live worker re-claims its own in-flight jobs on
every heartbeat so they are never taken from it.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass

import grpc
import redis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from splitserve.engine.engine import LLMEngine
from splitserve.engine.errors import EngineError, StepFailed
from splitserve.engine.loader import served_model_name
from splitserve.engine.outputs import RequestOutput
from splitserve.handoff.arena import Arena
from splitserve.observability import tracing
from splitserve.observability.logs import setup_logging
from splitserve.observability.metrics import PrefillMetrics
from splitserve.prefill_worker.handoff import HandoffSender
from splitserve.prefill_worker.queue import JobQueue, skipped, state_of
from splitserve.service import grpc_server, tls
from splitserve.service import redis_scripts as scripts
from splitserve.service.errors import code_of, fit_details
from splitserve.service.grpc_server import options
from splitserve.service.peers import Peers
from splitserve.service.process import parse_settings
from splitserve.service.redis_scripts import Scripts, failed
from splitserve.service.redis_state import Job, Keys, WorkerInfo, ensure_group, open_redis
from splitserve.service.settings import Settings, host_id
from splitserve.service.watchdog import StepWatch
from splitserve_proto.v1 import worker_pb2 as w_pb
from splitserve_proto.v1 import worker_pb2_grpc

log = logging.getLogger("splitserve.prefill")


def _retire(peer) -> None:
    """Close a replaced peer's channel once the calls its threads hold have ended."""
    for ex in peer.pools.values():
        ex.shutdown(wait=True)
    peer.channel.close()


class TokenStream:
    """One FirstTokens stream to a decode worker. Messages go from a queue, fed by the worker's
    loop, to the thread gRPC runs to send them."""

    def __init__(self, stub: worker_pb2_grpc.DecodeWorkerStub):
        self.stub = stub
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.future = stub.FirstTokens.future(self._messages())
        self.future.add_done_callback(self._ended)

    def _messages(self):
        while (item := self._queue.get()) is not None:
            request, sent = item
            yield request
            sent.set()  # gRPC asks for the next message once it has sent this one

    def _ended(self, f) -> None:
        self._queue.put(None)  # its sending thread stops, if it waits for a message
        if f.code() not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
            log.info("first-token stream to a decode worker ended: %s %s", f.code().name, f.details())

    @property
    def ended(self) -> bool:
        return self.future.done()

    @property
    def unsupported(self) -> bool:
        """The decode worker has no FirstTokens (an older version)."""
        return self.future.done() and self.future.code() == grpc.StatusCode.UNIMPLEMENTED

    def send(self, request: w_pb.FirstTokenRequest) -> threading.Event:
        sent = threading.Event()
        self._queue.put((request, sent))
        return sent

    def close(self) -> None:
        self._queue.put(None)  # the call ends once what is queued has gone


class TokenStreams:
    """The FirstTokens streams a prefill worker keeps open, one per decode worker. A message on an
    open stream costs about half of a new call (0.57 against 1.03 ms p50 measured here, 0.2 s
    apart). One that a broken stream loses is not resent: the KV's handoff carries the token too.
    A stream that ended is opened again on the next token, and so is one on a channel reopened."""

    def __init__(self):
        self._streams: dict[str, TokenStream] = {}
        self._lock = threading.Lock()

    def send(
        self, address: str, stub: worker_pb2_grpc.DecodeWorkerStub, request: w_pb.FirstTokenRequest, wait_s: float
    ) -> bool:
        """Send on the stream to address, waiting up to wait_s for it to leave; False (nothing sent)
        if that worker has no FirstTokens."""
        with self._lock:
            ts = self._streams.get(address)
            if ts is None or ts.stub is not stub or ts.ended and not ts.unsupported:
                ts = self._streams[address] = TokenStream(stub)
        if ts.unsupported:
            return False
        ts.send(request).wait(wait_s)
        return True

    def drop(self, addresses) -> None:
        """Close the streams to these workers (their channels are being closed)."""
        with self._lock:
            gone = [self._streams.pop(a) for a in addresses if a in self._streams]
        for ts in gone:
            ts.close()

    def close(self) -> None:
        with self._lock:
            addresses = list(self._streams)
        self.drop(addresses)


@dataclass
class InFlight:
    job: Job
    stream: str
    entry_id: str
    t_start: float
    t_end: float = 0.0
    cached_tokens: int = 0  # prompt tokens found in this worker's prefix cache
    span: object = None  # this request's prefill span (batch spans link to it)
    kv_span: object = None  # prefill done -> PutKV answered
    pickup: cf.Future | None = None  # its pickup, running beside its first forward (see pull)

    @property
    def queue_ms(self) -> float:
        return (self.t_start - self.job.t_admitted) * 1000

    @property
    def prefill_ms(self) -> float:
        return (self.t_end - self.t_start) * 1000


class PrefillWorker(JobQueue, HandoffSender):
    def __init__(self, settings: Settings):
        self.s = settings
        self.engine = LLMEngine(settings.engine_config("prefill"))
        # A Redis that hangs fails a call within CALL_TIMEOUT_S: the jobs in hand go on meanwhile.
        self.redis = open_redis(settings)
        self.keys = Keys(settings.redis_prefix)
        self.name = settings.worker_name("prefill")
        self.host = host_id()
        self.arena = Arena(f"{settings.shm_prefix}{self.name}", settings.arena_bytes)
        # Calls to decode workers run on each worker's own threads: one that hangs holds its own
        # handoffs until keepalive drops it, not the others'. First tokens go on a stream kept open
        # to each worker (token_streams); to a worker without one, on threads that stay up (a gRPC
        # future would start a thread per call on an idle channel: 0.7 ms of the light-load TTFT).
        # The shared pool is for what has no known worker.
        self.tls = tls.files_of(settings)  # mTLS to the decode workers, when set
        self.peers = Peers(
            lambda address: tls.channel(address, self.tls, options(settings.keepalive_s)),
            pools={"handoff": 8, "first-token": 4},
        )
        self.token_streams = TokenStreams()
        self.pickups = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pickup")
        self.pool = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="fail")
        self.inflight: dict[str, InFlight] = {}  # request id -> job (pulled, not yet acked)
        self.deferred: list[tuple] = []  # admit()'s arguments for jobs waiting on an earlier leg's (_held)
        self.unacked: set[tuple[str, str]] = set()  # (stream, entry id) done with while Redis was away
        self.unrecorded: list[tuple[Job, dict]] = []  # progress (_update) that Redis did not take meanwhile
        # Set when a Redis call got no answer (timed out, refused), cleared when one does (the
        # heartbeat's, every heartbeat): meanwhile the jobs in hand are prefilled and handed over
        # without a call that would wait CALL_TIMEOUT_S first (a pull, the cancellation check, the acks).
        self.redis_away = threading.Event()
        # Request ids whose KV stayed in the engine for their handoff (on_output); the loop releases
        # them, on the engine's thread, once the handoff is over.
        self.to_release: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.lock = threading.Lock()
        # Held over a claim of the jobs held here, and over giving them up (_give_back): a heartbeat's
        # claim (idle 0) read before they were given up must not land after, keeping them ours.
        self.claims = threading.RLock()
        self.scripts = Scripts(self.redis)
        # Prefill affinity: routers send this worker the jobs whose prompts start with what its prefix
        # cache holds, on a stream of its own, read after the high-priority one. Another worker's,
        # once that worker has left the registry (died, or drained), is read by every worker after
        # the shared streams, until it is empty (orphans: looked for every heartbeat).
        self.own = self.keys.stream_to(self.name)
        self.orphans: list[str] = []
        self.claimable: list[str] = []  # the own streams, this worker's among them, to claim idle jobs from
        self._last_look = 0.0
        self.stop = threading.Event()  # set on SIGTERM: no more pulls; what is held is finished (run)
        self.stopped = threading.Event()  # set once the worker holds nothing: the heartbeat thread ends
        self.on_drain = None  # called once the worker starts to drain (sets health)
        self.watch = StepWatch(settings.engine_stall_s, f"prefill worker {self.name}")
        self.on_stall = None  # called by the heartbeat with whether the engine is stalled (sets health)
        self.address = ""
        self.metrics_address = ""
        self._last_claim = 0.0
        self.metrics = PrefillMetrics()
        self.metrics.follow(self.engine)
        self.metrics.label_model(served_model_name(settings.served_model_name, self.engine.model_name))
        self.metrics.arena_size.set(self.arena.size)
        self.metrics.arena_used.set_function(lambda: self.arena.used_bytes)

    # -- pulling ------------------------------------------------------------------------

    def admit(self, stream: str, entry_id: str, job: Job, first: bool, outcome, again: bool = False) -> None:
        """Start prefilling a pulled job, by its pickup's outcome: 'prefilling', the state of a
        request that has ended (or 'expired') and is skipped, or the pickup still running (a
        future: settled after the forward, by _settle_pickups). again: deferred before."""
        if self._held(job.request_id, job.leg):  # an earlier leg of it, superseded, is still being handed off here
            self.deferred.append((stream, entry_id, job, first, outcome))
            if not again:
                self.metrics.deferred.inc()
            return
        pickup = outcome if isinstance(outcome, cf.Future) else None
        outcome = "prefilling" if pickup is not None else state_of(outcome)
        t = time.time()
        parent = tracing.context_of(job.traceparent)
        if first:
            tracing.tracer().start_span(
                "queue wait",
                context=parent,
                start_time=tracing.ns(job.t_admitted),
                attributes={
                    "splitserve.request_id": job.request_id,
                    "splitserve.prefill_worker": self.name,
                },
            ).end(end_time=tracing.ns(t))
        if outcome != "prefilling":
            self._ack(stream, entry_id)  # cancelled while queued, finished, expired, taken back or handed off: skip it
            self.metrics.jobs.labels(skipped(outcome, job.request_id)).inc()
            return
        if (old := self.peers.follow(job.decode_address, job.decode_epoch)) is not None:
            log.info("decode worker at %s restarted: connecting to it anew", job.decode_address)
            self.token_streams.drop([job.decode_address])
            threading.Thread(target=_retire, args=(old,), name="retire", daemon=True).start()
        try:
            self.engine.add_request(
                job.request_id,
                job.token_ids,
                job.params(),
                prefill_only=True,
                priority=job.priority,
                cache_salt=job.cache_salt,
                resumed=job.resumed,
                resumed_chars=job.resumed_chars,
            )
        except EngineError as e:  # e.g. a prompt that can never fit in this worker's KV cache
            log.warning("job %s refused: %s", job.request_id, e)
            if pickup is not None:  # its 'prefilling' must not land after the 'failed' below
                cf.wait([pickup])
            self._update(job, failed(code_of(e), str(e)))
            self._ack(stream, entry_id)
            self.metrics.jobs.labels("failed").inc()
            self.peers.submit(
                job.decode_address, "handoff", self._fail, job, code_of(e), str(e)
            )  # off the pulling loop
            return
        source = "shared" if stream in self.keys.streams else "own" if stream == self.own else "departed"
        self.metrics.jobs_from.labels(source).inc()
        span = tracing.tracer().start_span(
            "prefill",
            context=parent,
            start_time=tracing.ns(t),
            attributes={
                "splitserve.request_id": job.request_id,
                "splitserve.prefill_worker": self.name,
                "gen_ai.usage.input_tokens": len(job.token_ids),
                "splitserve.prefill.stream": source,
            },
        )
        with self.lock:
            self.inflight[job.request_id] = InFlight(job, stream, entry_id, t, span=span, pickup=pickup)

    def _abandon(self, fl: InFlight, span_attributes: dict, outcome: str | None) -> None:
        """Stop holding a job: its KV is freed here (prefilled or not; its decode stream has ended
        or never hears of it), its span ends saying why, and it is acked and counted under outcome
        (None: left unacked, for a claim to pick it up again)."""
        with self.lock:
            self.inflight.pop(fl.job.request_id, None)
        self.engine.abort_request(fl.job.request_id)
        if fl.span.is_recording():  # (ended already when its prefill had: _output_failed)
            fl.span.set_attributes(span_attributes)
            fl.span.end()
        if outcome is not None:
            self._ack(fl.stream, fl.entry_id)
            self.metrics.jobs.labels(outcome).inc()

    # -- after prefill ------------------------------------------------------------------

    def _held(self, request_id: str, leg: int) -> bool:
        """This worker still has an earlier leg's job of this request in hand, or its KV (a leg
        superseded when its decode worker was lost, resume.lua): the new leg waits for it to go
        (admit_deferred), its claim kept meanwhile (_keep_claims)."""
        if not leg:
            return False
        with self.lock:
            fl = self.inflight.get(request_id)
        if fl is not None:
            return fl.job.leg < leg
        return request_id in self.engine.seqs or request_id in self.engine.parked

    def admit_deferred(self) -> None:
        """Admit the jobs deferred while an earlier leg of their request was still here."""
        waiting, self.deferred = self.deferred, []
        for d in waiting:
            self.admit(*d, again=True)

    def on_output(self, out: RequestOutput) -> None:
        if not out.finished:
            return
        fl = self.inflight.get(out.request_id)
        if fl is None:
            return
        fl.t_end = time.time()
        try:
            self._hand_on(fl, out)
        except Exception as e:  # noqa: BLE001 - one request's output must not end the worker, nor its batch's
            self._output_failed(fl, e)

    def _output_failed(self, fl: InFlight, e: Exception) -> None:
        """_hand_on raised before its handoff was submitted (its last call; none is known to raise
        now that a job's values are checked, Job.from_dict): the job is given up, INTERNAL, its KV
        freed (the region's freed by _hand_on), its entry acked, and the worker goes on."""
        job = fl.job
        log.exception("handing on the prefill of %s failed", job.request_id)
        message = fit_details(f"prefill of {job.request_id} could not be handed on: {type(e).__name__}: {e}")
        for span in (fl.kv_span, fl.span):
            if span is not None and span.is_recording():
                span.set_status(tracing.Status(tracing.StatusCode.ERROR, message[:300]))
        if fl.kv_span is not None:
            fl.kv_span.end()
        with self.lock:
            held = self.inflight.get(job.request_id) is fl  # (not when a failure's own telling raised)
        if held:
            self._abandon(fl, {}, "failed")
        try:
            self.peers.submit(job.decode_address, "handoff", self._give_up, job, grpc.StatusCode.INTERNAL, message)
        except Exception:  # noqa: BLE001 - (the peers' pool itself failing): told here, on the engine's thread
            self._give_up(job, grpc.StatusCode.INTERNAL, message)

    def _fail(self, job: Job, code: grpc.StatusCode, message: str, handoff_lost: bool = False) -> None:
        """End the request's decode stream with this status, so its client hears now, not at its deadline."""
        self._fail_stream(job.request_id, job.decode_address, code, message, handoff_lost, job.leg)

    def _batch_links(self) -> list:
        """Links to the prefill span of every request the last step carried."""
        if not tracing.enabled():
            return []
        return [
            tracing.Link(fl.span.get_span_context())
            for rid in self.engine.last_stats.request_ids
            if (fl := self.inflight.get(rid)) is not None and fl.span is not None
        ]

    def _observe_step(self, t0: float, links: list) -> None:
        """Metrics, and a batch span linked to the prefill span of every request it carried."""
        self.metrics.observe_step(self.engine)
        st = self.engine.last_stats
        if not st.num_tokens or not tracing.enabled():
            return
        tracing.tracer().start_span(
            "prefill batch",
            start_time=tracing.ns(t0),
            links=links,
            attributes={
                "splitserve.prefill_worker": self.name,
                "splitserve.batch.sequences": st.num_seqs,
                "splitserve.batch.tokens": st.num_tokens,
                "splitserve.batch.prefill_tokens": st.num_prefill_tokens,
                "splitserve.batch.forward_ms": st.forward_time_s * 1000,
                "splitserve.batch.cuda_graphs": st.graphed,
            },
        ).end(end_time=tracing.ns(t0 + st.step_time_s))

    # -- loop ---------------------------------------------------------------------------

    def heartbeat_loop(self) -> None:
        lease = 3 * self.s.heartbeat_s
        left = False
        wait = 0.0  # the first beat at once: in the registry as soon as it pulls, not a heartbeat later
        while not self.stopped.wait(wait):
            wait = self.s.heartbeat_s
            with self.lock:
                calling = {fl.job.decode_address for fl in self.inflight.values()}
            pruned = self.peers.prune(calling)  # decode workers not called for a while (gone, moved)
            self.token_streams.drop(p.address for p in pruned)
            for peer in pruned:
                peer.channel.close()
            stalled = self.watch.stalled()
            self.metrics.stalled.set(int(stalled))
            if self.on_stall is not None:
                self.on_stall(stalled)
            if stalled:  # a step that does not return: let the lease and the held jobs' claims lapse
                continue  # (after CLAIM_IDLE_MS another worker claims the jobs)
            try:
                if self.stop.is_set():  # draining: out of the registry (once), the held jobs kept ours
                    if not left:
                        self._leave_registry()
                        left = True
                    self._ack_later()
                    self._keep_claims()
                    self._record_later()
                    continue
                e = self.engine
                self._own_stream()  # before the registry entry: routers send jobs there only when both are there
                info = WorkerInfo(
                    worker_id=self.name,
                    role="prefill",
                    address=self.address,
                    host_id=self.host,
                    running=len(self.inflight),
                    waiting=e.num_waiting,
                    free_kv_tokens=(self.arena.size - self.arena.used_bytes)
                    // max(1, e.model.shape.kv_bytes_per_token),
                    metrics=self.metrics_address,
                    arena=self.arena.name,
                    kv_capacity_tokens=e.kv_capacity_tokens,
                )
                self.scripts.run(scripts.heartbeat(self.keys, info=info, lease_s=lease))
                self._restore_lost()
                self._ack_later()
                self._keep_claims()
                self._record_later()
                if self.redis_away.is_set():
                    log.info("Redis answers again")
                    self.redis_away.clear()
            except redis.RedisError as e:
                self._unanswered(e)
                log.warning("heartbeat failed: %s", e)
            except Exception:  # noqa: BLE001 - the heartbeat must outlive any round (lease and claims would lapse)
                log.exception("heartbeat round failed")

    def run(self) -> None:
        """Pull, prefill and hand over until stopped; then drain: no more pulls, and the jobs held are
        prefilled and handed over (up to DRAIN_S), as a rolling update expects of a worker it stops.
        Those still held after it are given up to the other workers at once (_give_back)."""
        ensure_group(self.redis, self.keys)
        self._own_stream()
        threading.Thread(target=self.heartbeat_loop, name="heartbeat", daemon=True).start()
        pull_failing = False
        drain_end = 0.0
        while True:
            self._release_kept()
            if self.stop.is_set():
                if not drain_end:
                    drain_end = time.monotonic() + self.s.drain_s
                    if self.on_drain is not None:
                        self.on_drain()
                    log.info("draining: %d job(s) held, pulling no more", len(self.inflight))
                if not self.engine.has_unfinished() or time.monotonic() >= drain_end:
                    break
            else:
                if self.deferred:
                    self.admit_deferred()
                # The jobs in hand need no Redis to be prefilled and handed over: while it is away,
                # no pull waits on it before their next forward (the heartbeat finds it back).
                if not (self.redis_away.is_set() and self.engine.has_unfinished()):
                    pull_failing = self._top_up(pull_failing)
                if pull_failing and not self.engine.has_unfinished():
                    time.sleep(0.5)
                    continue
            if self.engine.has_unfinished():  # one forward, then top up again (iteration-level)
                t0 = time.time()
                try:
                    with self.watch.step():
                        outputs = self.engine.step()
                except Exception as e:  # noqa: BLE001 - never lose the process; fail what was running
                    log.exception("engine step failed; failing its jobs")
                    outputs = self.engine.fail_all(StepFailed(e))
                self._settle_pickups()
                links = self._batch_links()  # before the handoffs drop their requests
                for out in outputs:  # first: the first tokens go out before the bookkeeping
                    self.on_output(out)
                try:
                    self._observe_step(t0, links)
                except Exception:  # noqa: BLE001 - a step's metrics and span must not stop the worker
                    log.exception("observing a prefill step failed")
                try:
                    if not self.redis_away.is_set():  # it would wait on Redis too
                        self._drop_cancelled()
                except redis.RedisError as e:
                    self._unanswered(e)
                    log.warning("checking held jobs for cancellation failed: %s", e)
        self._give_back()
        self._leave()
        self.token_streams.close()
        for peer in self.peers.clear(wait=True):  # the handoffs in hand finish first
            peer.channel.close()
        self._release_kept()
        self.pool.shutdown(wait=True)
        self.pickups.shutdown(wait=True)
        self.stopped.set()

    def _top_up(self, failing: bool) -> bool:
        """Pull jobs and admit them (pull); True if the pull failed (`failing`: it did the last time,
        so it is not logged again). One Redis did not answer marks it away."""
        try:
            for stream, entry_id, job, first, outcome in self.pull():
                try:
                    self.admit(stream, entry_id, job, first, outcome)
                except Exception as e:  # noqa: BLE001 - well-formed JSON with bad values; no job stops the worker
                    if not isinstance(e, (ValueError, TypeError)):
                        log.exception("job %s could not be admitted", job.request_id)
                    if isinstance(outcome, cf.Future):  # its 'prefilling' must not land after the drop's 'failed'
                        cf.wait([outcome])
                    # its pickup has returned the admission counts already (tokens None: not again)
                    self._drop(stream, entry_id, repr(e), None, job.request_id, job.decode_address)
            return False
        except redis.RedisError as e:
            if self._unanswered(e) and not failing:
                log.warning("pulling jobs failed (again while idle, and once the heartbeat gets an answer): %s", e)
            if isinstance(e, redis.ResponseError) and "NOGROUP" in str(e):
                try:  # Redis came back empty (restarted without persistence): make the groups again
                    ensure_group(self.redis, self.keys)
                    self._own_stream()
                except redis.RedisError:
                    pass
            return True


def main(argv: list[str] | None = None) -> int:
    setup_logging("prefill_worker")
    try:
        settings = parse_settings("prefill_worker", argv)
        setup_logging("prefill_worker", settings.log_format)
        tracing.setup_tracing(
            "prefill", settings.worker_name("prefill"), settings.trace_file, settings.trace_file_max_bytes
        )
        worker = PrefillWorker(settings)
    except (ValueError, EngineError) as e:
        print(f"splitserve prefill_worker: error: {e}", file=sys.stderr)
        return 2
    server = grpc.server(cf.ThreadPoolExecutor(max_workers=4), options=options(settings.keepalive_s))
    hs = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    if settings.reflection:
        grpc_server.add_reflection(server, [])
    port = tls.bind(server, f"{settings.host}:{settings.port}", worker.tls, client_auth=True)
    server.start()
    if settings.health_port:  # the health service alone, in plaintext, for probes (Settings.health_port)
        probes = grpc.server(cf.ThreadPoolExecutor(max_workers=1))
        health_pb2_grpc.add_HealthServicer_to_server(hs, probes)
        try:
            grpc_server.bind_probes(probes, settings.host, settings.health_port)
        except ValueError as e:
            print(f"splitserve prefill_worker: error: {e}", file=sys.stderr)
            server.stop(0)
            return 2
        probes.start()
    worker.address = settings.address(port)
    metrics_port = worker.metrics.serve(settings.metrics_bind, settings.metrics_port)
    worker.metrics_address = settings.metrics_address(metrics_port) if metrics_port else ""
    hs.set("", health_pb2.HealthCheckResponse.SERVING)

    def on_stall(stalled: bool) -> None:
        if not worker.stop.is_set():
            hs.set(
                "", health_pb2.HealthCheckResponse.NOT_SERVING if stalled else health_pb2.HealthCheckResponse.SERVING
            )

    worker.on_stall = on_stall
    worker.on_drain = lambda: hs.set("", health_pb2.HealthCheckResponse.NOT_SERVING)

    def on_signal(*_):
        worker.stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info(
        "prefill worker %s serving on %s, arena %s (%d MiB)",
        worker.name,
        worker.address,
        worker.arena.name,
        settings.arena_bytes >> 20,
    )
    if metrics_port:
        print(f"METRICS {worker.metrics_address}", flush=True)
    print(f"READY {worker.address}", flush=True)
    try:
        worker.run()
    finally:
        hs.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        try:
            worker.redis.delete(worker.keys.worker("prefill", worker.name))
        except redis.RedisError as e:  # its lease ends it anyway; the arena must still go
            log.warning("could not remove the registry entry: %s", e)
        worker.arena.close()
        try:
            worker.redis.delete(worker.keys.draining_arena(worker.arena.name))
        except redis.RedisError:  # it expires
            pass
        server.stop(grace=1.0)
        worker.metrics.close()
        tracing.shutdown_tracing()
        log.info("prefill worker %s stopped", worker.name)
    return 0
