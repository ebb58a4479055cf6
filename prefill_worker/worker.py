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
import json
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
from grpc_reflection.v1alpha import reflection

from splitserve.engine.engine import LLMEngine
from splitserve.engine.errors import EngineError, StepFailed
from splitserve.engine.outputs import RequestOutput
from splitserve.handoff.arena import Arena
from splitserve.observability import tracing
from splitserve.observability.metrics import PrefillMetrics
from splitserve.prefill_worker.handoff import HandoffSender
from splitserve.service import redis_scripts as scripts
from splitserve.service.errors import REDIS_UNREACHABLE, code_of, fit_details
from splitserve.service.grpc_server import options
from splitserve.service.peers import Peers
from splitserve.service.process import parse_settings
from splitserve.service.redis_scripts import Scripts, failed
from splitserve.service.redis_state import GROUP, Job, Keys, WorkerInfo, connect, ensure_group
from splitserve.service.settings import Settings, host_id
from splitserve.service.watchdog import StepWatch
from splitserve_proto.v1 import worker_pb2 as w_pb
from splitserve_proto.v1 import worker_pb2_grpc

log = logging.getLogger("splitserve.prefill")


def _state(raw) -> str:
    """A pickup's outcome as Redis returns it."""
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def _skipped(outcome: str, request_id: str) -> str:
    """The jobs metric's outcome for a job whose pickup found it ended (or expired) in the queue,
    taken back by its router for its decode worker to prefill, or handed off already (logged)."""
    if outcome == "decoding":
        log.info(
            "request %s: its decode worker has its KV already (its prefill worker died before acking the job): "
            "not prefilled again",
            request_id,
        )
    return {"expired": "expired", "local": "taken_back", "superseded": "superseded", "decoding": "handed_off"}.get(
        outcome, "skipped_cancelled"
    )


def _counted(tokens: bytes | None) -> int:
    """A stream entry's 'tokens', the prompt tokens its admission counted; -1 where it has none:
    admission never counted it (a count of 2^31 tokens or more it could not have: never a prompt's)."""
    try:
        n = int(tokens) if tokens is not None else -1
    except ValueError:
        return -1
    return n if 0 <= n < 2**31 else -1


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


class PrefillWorker(HandoffSender):
    def __init__(self, settings: Settings):
        self.s = settings
        self.engine = LLMEngine(settings.engine_config("prefill"))
        # A Redis that hangs fails a call within CALL_TIMEOUT_S: the jobs in hand go on meanwhile.
        self.redis = connect(settings.redis_url, settings.redis_cluster)
        self.keys = Keys(settings.redis_prefix)
        self.name = settings.worker_name("prefill")
        self.host = host_id()
        self.arena = Arena(f"{settings.shm_prefix}{self.name}", settings.arena_bytes)
        # Calls to decode workers run on each worker's own threads: one that hangs holds its own
        # handoffs until keepalive drops it, not the others'. First tokens go on a stream kept open
        # to each worker (token_streams); to a worker without one, on threads that stay up (a gRPC
        # future would start a thread per call on an idle channel: 0.7 ms of the light-load TTFT).
        # The shared pool is for what has no known worker.
        self.peers = Peers(
            lambda address: grpc.insecure_channel(address, options=options(settings.keepalive_s)),
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
        self.metrics.arena_size.set(self.arena.size)
        self.metrics.arena_used.set_function(lambda: self.arena.used_bytes)

    # -- pulling ------------------------------------------------------------------------

    def pull(self) -> list[tuple[str, str, Job, bool, object]]:
        """New jobs, high priority first, then those sent to this worker (prefill affinity), normal,
        low, and those sent to workers gone from the registry (and, every so often, the jobs dead
        workers held).

        Tops the engine up to its token budget: jobs are pulled while the prompt tokens still
        to prefill are under ``prefill_token_budget`` (the last one may pass it; the engine
        chunks it) and fewer than ``prefill_batch`` jobs are held. So a worker holds about one
        forward's work and leaves the rest in the stream for the next free worker, a job that
        arrives while a forward runs joins at the next one, and one of higher priority is
        scheduled ahead of the held jobs not yet started.
        Each job's pickup (pickup.lua) goes in one round trip with the top-up that follows it.
        Returns (stream, entry id, job, first delivery, pickup outcome) in the order to prefill them
        (the outcome is a future for a job queued alone, whose pickup runs beside its forward).
        """
        held: list[tuple[str, str, Job, bool]] = []
        now = time.monotonic()
        if now - self._last_look > self.s.heartbeat_s:
            self._last_look = now
            self._look_at_directed()
        if now - self._last_claim > self.s.claim_idle_ms / 4000:
            self._last_claim = now
            # Our own jobs, re-delivered, are in hand already or done with and to be acked (the ack
            # waits for Redis, and a claim can come first: they would be prefilled and handed over
            # again). Which they are is read before the claim and after it: the heartbeat may ack
            # one (and forget it) in between, and a handoff may finish one (and keep it to ack).
            with self.lock:
                mine, done = set(self.inflight), set(self.unacked)
            for stream in [*self.keys.streams, *self.claimable]:
                try:
                    _, claimed, *_ = self.redis.xautoclaim(
                        stream, GROUP, self.name, self.s.claim_idle_ms, "0-0", count=self.s.prefill_batch
                    )
                except redis.ResponseError as e:  # a worker's own stream, removed since (it was empty)
                    if "NOGROUP" in str(e) and stream not in self.keys.streams:
                        continue
                    raise
                held += self._jobs(
                    [
                        (stream, entry_id, fields.get(b"job"), fields.get(b"tokens"))
                        for entry_id, fields in claimed
                        if fields
                    ],
                    first=False,
                )
            with self.lock:
                mine.update(self.inflight)
                done.update(self.unacked)
            held = [e for e in held if e[2].request_id not in mine and (e[0], e[1]) not in done]
            if held:
                log.info("claimed %d job(s) left by a dead prefill worker", len(held))
                self.metrics.jobs.labels("claimed").inc(len(held))
        if not held and not self.engine.has_unfinished() and self.orphans:  # a departed worker's jobs first
            held = self._jobs(
                self.scripts.run(
                    scripts.pull(
                        self.keys,
                        streams=self.orphans,
                        consumer=self.name,
                        jobs=self.s.prefill_batch,
                        tokens=self.s.prefill_token_budget,
                    )
                )
            )
        if not held and not self.engine.has_unfinished():  # idle: wait for a job in any class
            streams = self._streams(orphans=False)  # (one removed meanwhile would fail the read)
            got = self._read({stream: ">" for stream in streams}, 1, 200, alone := set())
            self.redis_away.clear()  # it answered
            held = sorted(got, key=lambda e: streams.index(e[0]))
            if not held:
                return []
            if len(held) == 1 and held[0][1] in alone and not 0 < held[0][2].deadline_unix < time.time():
                # Queued alone: there is nothing to top up with, and its pickup runs beside its first
                # forward (settled before that forward's outputs): a round trip off the TTFT path.
                # A request that ended meanwhile costs that one forward (chunk), as if it had ended
                # a moment later, during it.
                stream, entry_id, job, first = held[0]
                return [
                    (
                        stream,
                        entry_id,
                        job,
                        first,
                        self.pickups.submit(self.scripts.run_all, [self._pickup_call(job, first)]),
                    )
                ]
        jobs = self.s.prefill_batch - self.engine.num_waiting - self.engine.num_running - len(held)
        tokens = self.s.prefill_token_budget - self.engine.num_pending_tokens - sum(len(e[2].token_ids) for e in held)
        calls = [self._pickup_call(job, first) for _, _, job, first in held]
        top_up = jobs > 0 and tokens > 0
        if top_up:
            calls.append(scripts.pull(self.keys, streams=self._streams(), consumer=self.name, jobs=jobs, tokens=tokens))
        if not calls:
            return []
        results = self.scripts.run_all(calls)
        out = [(*e, outcome) for e, outcome in zip(held, results)]
        if top_up and (more := self._jobs(results[-1])):
            outcomes = self.scripts.run_all([self._pickup_call(job, first) for _, _, job, first in more])
            out += [(*e, outcome) for e, outcome in zip(more, outcomes)]
        return out

    def _streams(self, orphans: bool = True) -> list[str]:
        """The streams to pull from, in order: high priority, this worker's own, normal, low, and
        (`orphans`) the own streams of workers that left the registry with jobs there."""
        high, *rest = self.keys.streams
        return [high, self.own, *rest, *(self.orphans if orphans else ())]

    def _look_at_directed(self) -> None:
        """The other workers' own streams: those of workers that left the registry are read from now
        on until they are empty (self.orphans), and removed once they are. self.claimable: the own
        streams to claim idle jobs from (this worker's, and every other one still there)."""
        others = [m.decode() if isinstance(m, bytes) else m for m in self.redis.smembers(self.keys.directed)]
        others = [m for m in others if m != self.name]
        left = self.scripts.run_all([scripts.forget_stream(self.keys, worker_id=m) for m in others])
        orphans = [self.keys.stream_to(m) for m, n in zip(others, left) if int(n) > 0]
        if set(orphans) - set(self.orphans):
            log.info("reading the streams of %d prefill worker(s) gone from the registry", len(orphans))
        self.orphans = orphans
        self.claimable = [self.own, *(self.keys.stream_to(m) for m, n in zip(others, left) if int(n) != 0)]

    def _own_stream(self) -> None:
        """This worker's own stream and its group (made again if removed while its lease had lapsed)."""
        self.scripts.run(scripts.own_stream(self.keys, worker_id=self.name))

    def _pickup_call(self, job: Job, first: bool) -> scripts.Call:
        """A job's pickup: leave the admission counts (new deliveries), check the request is still
        wanted and in time, and mark it prefilling."""
        return scripts.pickup(
            self.keys,
            request_id=job.request_id,
            prompt_tokens=len(job.token_ids),
            first_delivery=first,
            now=time.time(),
            worker=self.name,
            deadline_unix=job.deadline_unix,
            leg=job.leg,
        )

    def _read(self, streams: dict, count: int, block: int | None, alone: set[str]) -> list[tuple[str, str, Job, bool]]:
        """New entries; adds to alone the ids of those admitted when no other request was queued."""
        resp = self.redis.xreadgroup(GROUP, self.name, streams, count=count, block=block)
        entries = [(stream, entry_id, fields) for stream, got in resp or [] for entry_id, fields in got]
        alone.update(entry_id.decode() for _, entry_id, fields in entries if fields.get(b"queued") == b"1")
        return self._jobs(
            [(stream, entry_id, fields.get(b"job"), fields.get(b"tokens")) for stream, entry_id, fields in entries]
        )

    def _jobs(self, entries: list, first: bool = True) -> list[tuple[str, str, Job, bool]]:
        """(stream, entry id, raw job, raw token count) as Redis returns them -> (stream, entry id, job,
        first delivery); malformed entries are dropped."""
        out = []
        for stream, entry_id, raw, tokens in entries:
            stream = stream.decode() if isinstance(stream, bytes) else stream
            entry_id = entry_id.decode()
            if (job := self._job(stream, entry_id, raw, tokens)) is not None:
                out.append((stream, entry_id, job, first))
        return out

    def _job(self, stream: str, entry_id: str, raw: bytes | None, tokens: bytes | None) -> Job | None:
        """The job in a stream entry; a malformed entry is dropped (acked and deleted), never fatal."""
        d = None
        try:
            if not raw:
                raise ValueError("the entry has no 'job' field")
            d = json.loads(raw)
            job = Job.from_dict(d)
            # A router's admission counts an entry's prompt tokens in 'tokens', and its pickup takes
            # len(token_ids) back out of the counts: one whose two differ (no router writes it) would
            # leave the difference in the counts for good, or take out what was never put in.
            if _counted(tokens) != len(job.token_ids):
                raise ValueError(
                    f"the entry's tokens ({tokens!r}) are not the count of its job's token_ids ({len(job.token_ids)})"
                )
            return job
        except (ValueError, RecursionError) as e:  # json.JSONDecodeError included; JSON nested past Python's limit
            rid, address = (d.get("request_id"), d.get("decode_address")) if isinstance(d, dict) else (None, None)
            self._drop(
                stream,
                entry_id,
                str(e),
                tokens,
                rid if isinstance(rid, str) and rid else None,
                address if isinstance(address, str) else None,
            )
            return None

    def _drop(
        self,
        stream: str,
        entry_id: str,
        why: str,
        tokens: bytes | None = None,
        request_id: str | None = None,
        decode_address: str | None = None,
    ) -> None:
        """Ack and delete an entry this worker cannot serve. Its admission counts go back (when the
        entry says what admission counted), and a request that can be named fails now: its
        hash says so and its decode stream, if the address is readable, ends with INTERNAL."""
        log.warning("dropping malformed job %s from %s: %s", entry_id, stream, why)
        message = f"malformed prefill job: {why}"[:300]
        n = _counted(tokens)
        key = self.keys.req(request_id) if request_id else f"{self.keys.prefix}:dropped"  # no request's key
        self.scripts.run(
            scripts.drop(self.keys, request_key=key, tokens=n, error=message, code=grpc.StatusCode.INTERNAL)
        )
        self._ack(stream, entry_id)
        self.metrics.jobs.labels("malformed").inc()
        if request_id and decode_address:
            self.pool.submit(self._fail_stream, request_id, decode_address, grpc.StatusCode.INTERNAL, message)

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
        outcome = "prefilling" if pickup is not None else _state(outcome)
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
            self.metrics.jobs.labels(_skipped(outcome, job.request_id)).inc()
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

    def _settle_pickups(self) -> None:
        """The outcomes of the pickups that ran beside the forward just done: a request that ended
        (or expired) in the queue is dropped as admit drops it, before its outputs are handled.
        One whose pickup failed (Redis away) is dropped unacked, as a failed pull leaves it: it is
        claimed and picked up again later."""
        with self.lock:
            pending = [fl for fl in self.inflight.values() if fl.pickup is not None]
        for fl in pending:
            try:
                outcome = _state(fl.pickup.result()[0])
            except redis.RedisError as e:
                log.warning("pickup of %s failed (picked up again once claimed): %s", fl.job.request_id, e)
                outcome = None
            fl.pickup = None
            if outcome != "prefilling":
                self._abandon(
                    fl,
                    {"splitserve.skipped": outcome or "pickup failed"},
                    _skipped(outcome, fl.job.request_id) if outcome is not None else None,
                )

    def _drop_cancelled(self) -> None:
        """Abort the held jobs whose requests ended while they waited or were being prefilled (the
        client cancelled or went away, Abort, a deadline): no forward is spent on them.

        Checked after each forward, for jobs still unfinished after it: one Redis round trip,
        and none when every job in hand was prefilled (light load).
        """
        with self.lock:
            pending = [fl for fl in self.inflight.values() if not fl.t_end]
        if not pending:
            return
        with self.redis.pipeline(transaction=False) as p:
            for fl in pending:
                p.hget(self.keys.req(fl.job.request_id), "state")
            states = p.execute()
        for fl, state in zip(pending, states):
            if state not in (b"cancelled", b"failed"):
                continue
            self._abandon(fl, {"splitserve.cancelled_while": "prefilling"}, "cancelled_prefilling")
            log.info("request %s ended (%s) while held for prefill: aborted", fl.job.request_id, state.decode())

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

    def _update(self, job: Job, mapping: dict) -> None:
        """Record on a request's hash, if it still exists and has not ended (update.lua); its state
        only while the request has not resumed past this job's leg (a job of a lost decode worker)."""
        self.scripts.run(scripts.update(self.keys, request_id=job.request_id, fields=mapping, leg=job.leg))

    def _give_up(self, job: Job, code: grpc.StatusCode, message: str, lost_to: str = "") -> None:
        """The request has failed: so its hash says (which its router also reads, should the decode
        worker not be told), and its decode stream ends with this status. lost_to: its decode
        worker, unreachable (its router may resume the request on another)."""
        try:
            self._update(job, failed(code, message) | ({"lost_to": lost_to} if lost_to else {}))
        except redis.RedisError as e:
            log.warning("could not record %s's failure: %s", job.request_id, e)
        self._fail(job, code, message, handoff_lost=bool(lost_to))

    def _fail(self, job: Job, code: grpc.StatusCode, message: str, handoff_lost: bool = False) -> None:
        """End the request's decode stream with this status, so its client hears now, not at its deadline."""
        self._fail_stream(job.request_id, job.decode_address, code, message, handoff_lost, job.leg)

    def _ack(self, stream: str, entry_id: str) -> None:
        """Done with a stream entry: acked and deleted. While Redis is away, it is kept to ack at the
        next heartbeat that reaches Redis (it stays this worker's meanwhile: no one claims it)."""
        try:
            self._unless_away()
            self._ack_all([(stream, entry_id)])
        except redis.RedisError as e:
            self._unanswered(e)
            log.warning("could not ack %s %s (acked later): %s", stream, entry_id, e)
            with self.lock:
                self.unacked.add((stream, entry_id))

    def _unless_away(self) -> None:
        """For a call not worth waiting CALL_TIMEOUT_S for: while Redis is marked away, it fails at
        once, as it would then."""
        if self.redis_away.is_set():
            raise redis.ConnectionError("Redis did not answer this worker's last call")

    def _unanswered(self, e: redis.RedisError) -> bool:
        """Note a failed call: one Redis did not answer marks it away (redis_away). Returns whether
        it was not marked away before (the first failure of an outage, to log)."""
        if not isinstance(e, REDIS_UNREACHABLE):  # an error Redis answered with
            return True
        first = not self.redis_away.is_set()
        self.redis_away.set()
        return first

    def _ack_later(self) -> None:
        with self.lock:
            todo = list(self.unacked)
        if todo:
            self._ack_all(todo)
            with self.lock:
                self.unacked.difference_update(todo)

    def _record_later(self) -> None:
        """What _update could not record while Redis was away, now that it answers (update.lua: only
        on a hash that still exists)."""
        with self.lock:
            todo, self.unrecorded = self.unrecorded, []
        for i, (job, mapping) in enumerate(todo):
            try:
                self._update(job, mapping)
            except REDIS_UNREACHABLE:
                with self.lock:
                    self.unrecorded[:0] = todo[i:]
                raise
            except redis.RedisError as e:
                log.warning("could not record %s's progress: %s", job.request_id, e)

    def _ack_all(self, entries: list[tuple[str, str]]) -> None:
        with self.redis.pipeline() as p:
            for stream, entry_id in entries:
                p.xack(stream, GROUP, entry_id)
                p.xdel(stream, entry_id)
            p.execute()

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
                        self.redis.delete(self.keys.worker("prefill", self.name))
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

    def _keep_claims(self) -> None:
        """Claim the jobs held here again with their idle time 0, which keeps them ours (no other
        worker claims a job idle less than CLAIM_IDLE_MS): those in hand, and those waiting for an
        earlier leg of their request to go (_held)."""
        with self.claims:
            with self.lock:
                held = [(fl.stream, fl.entry_id) for fl in self.inflight.values()]
            self._claim(held + [(d[0], d[1]) for d in list(self.deferred)], 0)

    def _claim(self, entries: list[tuple[str, str]], idle_ms: int) -> None:
        """Claim these (stream, entry id) for this worker with their idle time set to idle_ms
        (CLAIM_IDLE_MS gives them up: the next worker to look claims them at once)."""
        for stream in {st for st, _ in entries}:
            ids = [entry_id for st, entry_id in entries if st == stream]
            self.redis.xclaim(stream, GROUP, self.name, 0, ids, idle=idle_ms, justid=True)

    def _restore_lost(self) -> None:
        """Put back the hashes of the requests held here for prefill that Redis has lost (it restarted
        empty): their routers wait for them a grace of two heartbeats, then end them UNAVAILABLE."""
        with self.lock:
            held = [fl for fl in self.inflight.values() if not fl.t_end]
        if not held:
            return
        with self.redis.pipeline(transaction=False) as p:  # one round trip when nothing is lost
            for fl in held:
                p.exists(self.keys.req(fl.job.request_id))
            there = p.execute()
        for fl in (fl for fl, n in zip(held, there) if not n):
            j = fl.job
            fields = {
                "state": "prefilling",
                "prompt_tokens": j.prompt_len,
                "priority": j.priority,
                "t_received": j.t_received,
                "t_admitted": j.t_admitted,
                "decode_worker": j.decode_worker,
                "t_prefill_start": fl.t_start,
                "prefill_worker": self.name,
                "dequeued": 1,
                "restored": 1,
            }
            if self.scripts.run(
                scripts.restore(self.keys, request_id=j.request_id, ttl_s=self.s.request_ttl_s, fields=fields)
            ):
                log.warning("request %s: Redis had lost its hash (restarted empty?); put back", j.request_id)

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

    def _give_back(self) -> None:
        """After the drain: the jobs not prefilled in it, and those waiting for an earlier leg of their
        request (deferred: the drain admits none), are given up to the other workers, whose next claim
        (within CLAIM_IDLE_MS / 4) takes them, instead of CLAIM_IDLE_MS after this worker's end."""
        with self.claims:  # the heartbeat thread runs on: once they are out of inflight, it claims them no more
            with self.lock:
                left = [fl for fl in self.inflight.values() if not fl.t_end]
            deferred, self.deferred = self.deferred, []
            entries = [(fl.stream, fl.entry_id) for fl in left] + [(d[0], d[1]) for d in deferred]
            if not entries:
                return
            try:
                self._claim(entries, self.s.claim_idle_ms)
            except redis.RedisError as e:  # they are claimed CLAIM_IDLE_MS after the last heartbeat anyway
                log.warning("could not give up the %d job(s) left: %s", len(entries), e)
                return
            for fl in left:  # left unacked (outcome None): the next claim takes them
                self._abandon(fl, {"splitserve.given_back": True}, None)
        self.metrics.jobs.labels("given_back").inc(len(entries))
        log.info(
            "drain over: %d job(s) not prefilled given up to the other workers (%d waiting for an earlier leg)",
            len(entries),
            len(deferred),
        )

    def _leave(self) -> None:
        """Out of the registry (the heartbeat has left it already, unless the drain was shorter than a
        heartbeat), and this worker's own stream removed when nothing is left in it; one with jobs in
        it is read by the other workers, and removed by them once empty."""
        try:
            self.redis.delete(self.keys.worker("prefill", self.name))
            self.scripts.run(scripts.forget_stream(self.keys, worker_id=self.name))
        except redis.RedisError as e:
            log.warning("could not leave the registry: %s", e)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s prefill_worker %(levelname)s %(message)s")
    try:
        settings = parse_settings("prefill_worker", argv)
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
    reflection.enable_server_reflection(
        [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], server
    )
    port = server.add_insecure_port(f"{settings.host}:{settings.port}")
    server.start()
    worker.address = settings.address(port)
    metrics_port = worker.metrics.serve(settings.host, settings.metrics_port)
    worker.metrics_address = f"{settings.host}:{metrics_port}" if metrics_port else ""
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
        server.stop(grace=1.0)
        worker.metrics.close()
        tracing.shutdown_tracing()
        log.info("prefill worker %s stopped", worker.name)
    return 0
