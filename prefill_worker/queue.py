"""Pulling prefill jobs from the Redis streams, and the bookkeeping of the jobs a prefill worker holds
(see splitserve.service.redis_scripts for the scripts)."""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING

import grpc
import redis

from splitserve.service import redis_scripts as scripts
from splitserve.service.errors import REDIS_UNREACHABLE
from splitserve.service.redis_scripts import failed
from splitserve.service.redis_state import GROUP, Job

if TYPE_CHECKING:
    pass

log = logging.getLogger("splitserve.prefill")


def state_of(raw) -> str:
    """A pickup's outcome as Redis returns it."""
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def skipped(outcome: str, request_id: str) -> str:
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


class JobQueue:
    """The prefill worker's side of the Redis queue: pulling jobs in priority order, picking each up,
    dropping those it cannot read or that ended, acking them, keeping them claimed, putting back
    what Redis lost, and giving them up at a drain. State: the worker's (PrefillWorker.__init__)."""

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

    def _settle_pickups(self) -> None:
        """The outcomes of the pickups that ran beside the forward just done: a request that ended
        (or expired) in the queue is dropped as admit drops it, before its outputs are handled.
        One whose pickup failed (Redis away) is dropped unacked, as a failed pull leaves it: it is
        claimed and picked up again later."""
        with self.lock:
            pending = [fl for fl in self.inflight.values() if fl.pickup is not None]
        for fl in pending:
            try:
                outcome = state_of(fl.pickup.result()[0])
            except redis.RedisError as e:
                log.warning("pickup of %s failed (picked up again once claimed): %s", fl.job.request_id, e)
                outcome = None
            fl.pickup = None
            if outcome != "prefilling":
                self._abandon(
                    fl,
                    {"splitserve.skipped": outcome or "pickup failed"},
                    skipped(outcome, fl.job.request_id) if outcome is not None else None,
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

    def _leave_registry(self) -> None:
        """Out of the registry. Decode workers on this host go on taking handoffs from its arena
        (Keys.draining_arena) until the arena closes: a draining worker still hands over what it holds,
        and one that registered a moment ago may not have been read by them yet."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.keys.draining_arena(self.arena.name), self.host, ex=int(self.s.drain_s) + 60)
        pipe.delete(self.keys.worker("prefill", self.name))
        pipe.execute()

    def _leave(self) -> None:
        """Out of the registry (the heartbeat has left it already, unless the drain was shorter than a
        heartbeat), and this worker's own stream removed when nothing is left in it; one with jobs in
        it is read by the other workers, and removed by them once empty."""
        try:
            self._leave_registry()
            self.scripts.run(scripts.forget_stream(self.keys, worker_id=self.name))
        except redis.RedisError as e:
            log.warning("could not leave the registry: %s", e)

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
