"""The Redis scripts that keep request hashes honest, against a real redis-server."""

import asyncio
import json
import time

import grpc
import pytest
import redis

from splitserve.service.errors import MAX_DETAILS_BYTES
from splitserve.service.redis_scripts import SOURCES, Call, Scripts, failed
from splitserve.service.redis_scripts import field_args as update_args
from splitserve.service.redis_state import GROUP, Job, Keys


@pytest.fixture(scope="module")
def r(redis_socket):
    return redis.Redis(unix_socket_path=redis_socket, decode_responses=True)


def test_update_touches_only_a_hash_that_exists_and_never_leaves_a_final_state(r):
    update = r.register_script(SOURCES["update"])
    assert update(keys=["t:req:gone"], args=update_args({"state": "decoding", "t_kv_done": 1.5})) == 0
    assert not r.exists("t:req:gone")  # not recreated (it would have had no TTL)

    r.hset("t:req:a", mapping={"state": "prefilling"})
    assert update(keys=["t:req:a"], args=update_args({"state": "decoding", "kv_bytes": 10})) == 1
    assert r.hgetall("t:req:a") == {"state": "decoding", "kv_bytes": "10"}

    for final in ("finished", "cancelled", "failed"):
        r.hset("t:req:b", mapping={"state": final})
        update(keys=["t:req:b"], args=update_args({"state": "decoding", "error": "late", "t_prefill_end": 2}))
        assert r.hgetall("t:req:b") == {"state": final, "t_prefill_end": "2"}  # the rest is still recorded

    # A failure's message is kept as a status carries it: 100 000 characters are cut to MAX_DETAILS_BYTES.
    r.hset("t:req:c", mapping={"state": "prefilling"})
    assert update(keys=["t:req:c"], args=update_args(failed(grpc.StatusCode.INTERNAL, "boom " + "x" * 100_000))) == 1
    error = r.hget("t:req:c", "error")
    assert error.startswith("boom x") and error.endswith(" more characters)") and len(error) <= MAX_DETAILS_BYTES


def test_reap_fails_a_dead_routers_unended_requests_and_leaves_a_live_router_alone(r):
    keys = Keys("t")
    reap = r.register_script(SOURCES["reap"])
    now = time.time()
    r.zadd(keys.routers, {"live": now + 3, "dead": now - 1})
    states = {"q": "queued", "p": "prefilling", "d": "decoding", "f": "finished", "c": "cancelled"}
    for router in ("live", "dead"):
        for rid, state in states.items():
            r.hset(keys.req(f"{router}-{rid}"), mapping={"state": state})
            r.sadd(keys.router_requests(router), f"{router}-{rid}")

    def run(router, force=0):
        members = r.smembers(keys.router_requests(router))
        return reap(
            keys=[keys.routers, keys.router_requests(router), keys.admission, *(keys.req(m) for m in members)],
            args=[router, time.time(), 60, force],
        )

    assert run("live") == 0  # within its lease: untouched
    assert r.zscore(keys.routers, "live") is not None and r.scard(keys.router_requests("live")) == 5
    assert r.hget(keys.req("live-d"), "state") == "decoding"

    assert run("dead") == 3  # queued, prefilling and decoding; the ended ones keep their states
    for rid, state in states.items():
        h = r.hgetall(keys.req(f"dead-{rid}"))
        if state in ("finished", "cancelled"):
            assert h == {"state": state}
        else:
            assert h["state"] == "failed" and h["error"] == "its router dead went away" and h["reaped"] == "1"
            assert 0 < r.ttl(keys.req(f"dead-{rid}")) <= 60
    assert r.zscore(keys.routers, "dead") is None and not r.exists(keys.router_requests("dead"))

    assert run("live", force=1) == 3  # a router's own id at start or stop: whatever its lease
    assert not r.exists(keys.routers)  # its last member gone


def test_local_prefills_leave_the_queue_counts_once_by_their_router_or_by_its_reaper(r):
    """A request its decode worker prefills holds the queue's counts until its first token; its
    router returns them, or, if that router died first, the reaper does: once either way."""
    keys = Keys("l")
    reap, dequeue = r.register_script(SOURCES["reap"]), r.register_script(SOURCES["dequeue"])
    r.hset(keys.admission, mapping={"requests": 4, "tokens": 400, "local_tokens": 300})
    for rid, state, local in (("a", "queued", 1), ("b", "decoding", 1), ("c", "queued", 0), ("d", "finished", 1)):
        r.hset(keys.req(rid), mapping={"state": state, "prompt_tokens": 100, **({"local": 1} if local else {})})
        r.sadd(keys.router_requests("dead"), rid)
    # d went on from 40 tokens its client had (resume_from): its prompt is 60, and it counts 100
    r.hset(keys.req("d"), mapping={"prompt_tokens": 60, "queued_tokens": 100})
    assert dequeue(keys=[keys.admission, keys.req("b")], args=[100]) == 1  # b's first token came
    assert dequeue(keys=[keys.admission, keys.req("b")], args=[100]) == 0  # ... and its end: not again
    assert r.hgetall(keys.admission) == {"requests": "3", "tokens": "300", "local_tokens": "200"}
    r.zadd(keys.routers, {"dead": time.time() - 1})
    members = r.smembers(keys.router_requests("dead"))
    assert (
        reap(
            keys=[keys.routers, keys.router_requests("dead"), keys.admission, *(keys.req(m) for m in members)],
            args=["dead", time.time(), 60, 0],
        )
        == 3
    )  # a, b, c failed; d had finished
    # a and d (d's router died between its end and returning its counts) are returned; b was
    # already; c, queued for a prefill worker, is returned when a prefill worker skips it.
    assert r.hgetall(keys.admission) == {"requests": "1", "tokens": "100", "local_tokens": "0"}
    assert dequeue(keys=[keys.admission, keys.req("a")], args=[100]) == 0  # its router, alive after all
    assert dequeue(keys=[keys.admission, keys.req("gone")], args=[100]) == 1  # hash gone: returned, never below 0
    assert r.hgetall(keys.admission) == {"requests": "0", "tokens": "0", "local_tokens": "0"}


def test_a_take_back_and_a_pickup_exclude_each_other_and_the_counts_leave_once(r):
    """A router takes back a queued request (no prefill worker registered) for its decode worker
    to prefill: only one still queued and not picked up. A prefill worker that pulls its job later
    skips it ('local') without touching the counts, which its router returns at its first token;
    one picked up first is not taken back."""
    keys = Keys("tb")
    take, pickup, dequeue = (
        r.register_script(x) for x in (SOURCES["take_back"], SOURCES["pickup"], SOURCES["dequeue"])
    )
    r.hset(keys.admission, mapping={"requests": 3, "tokens": 300, "local_tokens": 0})
    for rid in ("a", "b", "c"):
        r.hset(keys.req(rid), mapping={"state": "queued", "prompt_tokens": 100})
    r.hset(keys.req("c"), "state", "cancelled")

    def picked(rid):
        return pickup(keys=[keys.admission, keys.req(rid)], args=[100, 1, time.time(), "prefill-x", 0])

    assert picked("b") == "prefilling"  # b is picked up first: it left the queue counts
    assert [take(keys=[keys.admission, keys.req(rid)], args=[100, 7.5]) for rid in ("a", "b", "c", "gone")] == [
        1,
        0,
        0,
        0,
    ]
    assert take(keys=[keys.admission, keys.req("a")], args=[100, 8.0]) == 0  # once
    assert r.hget(keys.req("a"), "local") == "1" and r.hget(keys.req("a"), "t_taken_back") == "7.5"
    assert r.hgetall(keys.admission) == {"requests": "2", "tokens": "200", "local_tokens": "100"}
    assert picked("a") == "local"  # its job pulled later: skipped, the counts untouched, still queued
    assert r.hget(keys.req("a"), "state") == "queued" and r.hget(keys.req("a"), "prefill_worker") is None
    assert r.hgetall(keys.admission) == {"requests": "2", "tokens": "200", "local_tokens": "100"}
    assert dequeue(keys=[keys.admission, keys.req("a")], args=[100]) == 1  # its first token, at its router
    assert picked("c") == "cancelled"  # c: cancelled while queued, left at its pickup
    assert r.hgetall(keys.admission) == {"requests": "0", "tokens": "0", "local_tokens": "0"}


def test_a_job_picked_up_past_its_deadline_fails_deadline_exceeded_not_unavailable(r):
    """A job whose deadline passed in the queue is failed at its pickup with the status its client
    gets: DEADLINE_EXCEEDED (its router ends the stream with the 'code' it reads there, when it
    reads it before the client's own timer fires). Guards against: the hash had no code, and a soak's
    client with a 50 ms deadline got UNAVAILABLE "deadline exceeded in queue"."""
    import grpc

    from splitserve.service.errors import status_code

    keys = Keys("dl")
    pickup = r.register_script(SOURCES["pickup"])
    r.hset(keys.admission, mapping={"requests": 2, "tokens": 200})
    for rid in ("late", "in-time"):
        r.hset(keys.req(rid), mapping={"state": "queued", "prompt_tokens": 100})
    now = time.time()
    assert pickup(keys=[keys.admission, keys.req("late")], args=[100, 1, now, "prefill-x", now - 0.01]) == "expired"
    assert pickup(keys=[keys.admission, keys.req("in-time")], args=[100, 1, now, "prefill-x", now + 5]) == "prefilling"
    late = r.hgetall(keys.req("late"))
    assert (late["state"], late["error"]) == ("failed", "deadline exceeded in queue")
    assert status_code(int(late["code"])) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "code" not in r.hgetall(keys.req("in-time"))
    assert r.hgetall(keys.admission) == {"requests": "0", "tokens": "0"}  # both left the queue's counts


def test_a_resumed_request_is_queued_again_only_while_it_runs_and_its_counts_leave_once_more(r):
    """A request whose decode worker was lost: queued again (its prompt and the tokens its client
    has) while it has not ended and was not aborted, within the bounds themselves, as a new leg
    whose pickup returns its counts (under a marker of its own). A job of an earlier leg still
    queued is superseded: its pickup returns its own counts and skips it; its worker's report of a
    failure is ignored, as is anything else it writes, or a decode worker of that leg (taken for
    lost, adopting its KV late). Its decode worker prefilling it instead, it enters no count."""
    keys = Keys("rs")
    resume, pickup, abort, update = (
        r.register_script(x) for x in (SOURCES["resume"], SOURCES["pickup"], SOURCES["abort"], SOURCES["update"])
    )
    stream = keys.stream_for(0)
    r.hset(keys.admission, mapping={"requests": 1, "tokens": 10, "local_tokens": 0})

    def resumed(rid, local=False, bounds=(3, 500)):
        job = json.dumps({"request_id": rid, "decode_worker": "decode-9", "t_admitted": 12.5})
        return resume(keys=[keys.admission, stream, keys.req(rid)], args=[120, *bounds, 60, job, 0 if local else 1])

    for rid, state in (("a", "decoding"), ("b", "decoding"), ("f", "finished"), ("x", "failed"), ("ab", "decoding")):
        r.hset(
            keys.req(rid), mapping={"state": state, "prompt_tokens": 100, "dequeued": 1, "decode_worker": "decode-0"}
        )
    abort(keys=[keys.req("ab")], args=[time.time(), 60, 5])
    assert [resumed(rid)[0] for rid in ("f", "x", "ab", "gone")] == [-2] * 4  # ended, aborted, or not there
    assert resumed("a", bounds=(1, 500)) == [0, 1, 10]  # the queue is full (by its bounds)
    assert resumed("a", bounds=(3, 100)) == [0, 1, 10]
    assert r.xlen(stream) == 0
    assert resumed("a") == [1, 2, 130]
    got = r.hgetall(keys.req("a"))
    assert {k: got[k] for k in ("state", "resumed", "decode_worker", "t_resumed")} == {
        "state": "queued",
        "resumed": "1",
        "decode_worker": "decode-9",
        "t_resumed": "12.5",
    }
    assert r.ttl(keys.req("a")) > 0
    ((_, fields),) = r.xrange(stream)
    assert fields["tokens"] == "120" and json.loads(fields["job"])["request_id"] == "a"
    assert pickup(keys=[keys.admission, keys.req("a")], args=[120, 1, time.time(), "prefill-x", 0, 1]) == "prefilling"
    assert r.hgetall(keys.admission) == {"requests": "1", "tokens": "10", "local_tokens": "0"}
    assert pickup(keys=[keys.admission, keys.req("a")], args=[120, 0, time.time(), "prefill-y", 0, 1]) == "prefilling"
    assert r.hgetall(keys.admission) == {"requests": "1", "tokens": "10", "local_tokens": "0"}  # (claimed: once)

    # lost before its first token: its first job, still queued, is superseded by the new leg's
    r.hset(keys.req("q"), mapping={"state": "queued", "prompt_tokens": 100})
    r.hset(keys.admission, mapping={"requests": 2, "tokens": 110})  # (the first job's counts)
    assert resumed("q")[0] == 1
    assert r.hgetall(keys.admission) == {"requests": "3", "tokens": "230", "local_tokens": "0"}
    assert pickup(keys=[keys.admission, keys.req("q")], args=[100, 1, time.time(), "prefill-x", 0]) == "superseded"
    assert r.hgetall(keys.admission) == {"requests": "2", "tokens": "130", "local_tokens": "0"}
    assert r.hget(keys.req("q"), "state") == "queued"
    # the first job's worker fails it (its handoff to the lost worker): ignored, all of it; so is
    # the lost worker's late 'decoding' (guards against: it wrote its name and times over the new leg's)
    before = r.hgetall(keys.req("q"))
    assert (
        update(keys=[keys.req("q")], args=update_args({"_leg": 0, "state": "failed", "error": "handoff", "t_x": 1}))
        == 1
    )
    assert (
        update(
            keys=[keys.req("q")],
            args=update_args({"state": "decoding", "decode_worker": "decode-0", "t_kv_done": 3, "_leg": 0}),
        )
        == 1
    )
    assert r.hgetall(keys.req("q")) == before and before["decode_worker"] == "decode-9"
    update(keys=[keys.req("q")], args=update_args({"_leg": 1, "t_x": 1}))
    assert r.hget(keys.req("q"), "t_x") == "1" and "_leg" not in r.hgetall(keys.req("q"))
    assert pickup(keys=[keys.admission, keys.req("q")], args=[120, 1, time.time(), "prefill-x", 0, 1]) == "prefilling"
    assert r.hgetall(keys.admission) == {"requests": "1", "tokens": "10", "local_tokens": "0"}
    # its handoff went through (the new leg's decode worker says so, with the leg), and its prefill
    # worker died before its ack: the claim's pickup skips it, not prefilled again, the counts
    # untouched. Said by a worker of an older release (no leg), or left by an earlier leg: prefilled
    # again.
    cases = (({}, False, "prefilling"), ({}, True, "prefilling"), ({"_leg": 1}, False, "decoding"))
    for said, earlier, outcome in cases:
        update(keys=[keys.req("q")], args=update_args({"state": "decoding", "decode_worker": "decode-9", **said}))
        if earlier:
            r.hset(keys.req("q"), "kv_leg", 0)  # (leg 0's record, before the request resumed)
        assert pickup(keys=[keys.admission, keys.req("q")], args=[120, 0, time.time(), "prefill-y", 0, 1]) == outcome
    assert r.hget(keys.req("q"), "kv_leg") == "1"
    assert r.hget(keys.req("q"), "state") == "decoding" and r.hget(keys.req("q"), "prefill_worker") == "prefill-y"
    assert r.hgetall(keys.admission) == {"requests": "1", "tokens": "10", "local_tokens": "0"}
    update(keys=[keys.req("q")], args=update_args({"_leg": 1, "state": "failed", "error": "handoff"}))
    assert r.hget(keys.req("q"), "state") == "failed"
    # prefilled by its new decode worker: no count, and its reaper or a stray pickup returns none
    assert resumed("b", local=True) == [1, 1, 10]
    assert r.hget(keys.req("b"), "local") == "1" and r.hget(keys.req("b"), "state") == "prefilling"
    assert r.xlen(stream) == 2  # (a's and q's)
    assert pickup(keys=[keys.admission, keys.req("b")], args=[120, 1, time.time(), "prefill-x", 0]) == "superseded"
    assert r.hgetall(keys.admission) == {"requests": "1", "tokens": "10", "local_tokens": "0"}


def test_a_request_that_ended_unfinished_is_admitted_again_once_as_a_new_attempt(r):
    """A request_id whose latest attempt failed, or was cancelled without an Abort, is admitted
    again under a new attempt's id, once: a second retry that read the same attempt count (they
    raced) is refused, as is a retry of an attempt that is queued, finished or was aborted."""
    import json

    keys = Keys("at")
    admit = r.register_script(SOURCES["admit"])
    r.hset(keys.req("x"), mapping={"state": "failed", "prompt_tokens": 3})

    def send(attempt_id, expected, latest, supersede=0):
        job = json.dumps(
            {"request_id": attempt_id, "t_admitted": 1.0, "t_received": 1.0, "decode_worker": "d", "priority": 0}
        )
        return admit(
            keys=[
                keys.admission,
                keys.stream,
                keys.req(attempt_id),
                keys.router_requests("rt"),
                keys.req("x"),
                keys.req(latest),
            ],
            args=[3, 100, 1000, 1.0, 60, job, 1, "rt", expected, "fp-x", "", supersede],
        )[0]

    assert send("x#2", 1, "x") == 1
    assert r.hget(keys.req("x#2"), "fingerprint") == "fp-x"  # what a later retry must match
    assert r.hget(keys.req("x"), "current") == "x#2" and r.hget(keys.req("x"), "attempts") == "2"
    assert r.hget(keys.req("x#2"), "state") == "queued" and 0 < r.ttl(keys.req("x")) <= 60
    assert send("x#2", 1, "x") == -1  # the same retry again (it raced the first): refused
    assert send("x#3", 2, "x#2") == -1  # the latest attempt is queued, not failed
    r.hset(keys.req("x#2"), "state", "failed")
    assert send("x#3", 2, "x#2") == 1
    assert r.hget(keys.req("x"), "current") == "x#3" and r.xlen(keys.stream) == 2
    assert r.hgetall(keys.admission) == {"requests": "2", "tokens": "6"}
    # Cancelled by its client or its deadline (the router marks it so): it may run again.
    r.hset(keys.req("x#3"), "state", "cancelled")
    assert send("x#4", 3, "x#3") == 1
    assert r.hget(keys.req("x"), "current") == "x#4"
    # Cancelled by an Abort: not run again, nor once the router has marked its end as well.
    abort = r.register_script(SOURCES["abort"])
    assert abort(keys=[keys.req("x#4")], args=[2.0, 60, 60])[0] == "queued"
    r.hset(keys.req("x#4"), "state", "cancelled")
    assert send("x#5", 4, "x#4") == -1
    r.hset(keys.req("x#4"), "state", "finished")
    r.hdel(keys.req("x#4"), "aborted")
    assert send("x#5", 4, "x#4") == -1  # finished: never twice
    assert send("x#5", 4, "x#4", supersede=1) == -1  # ... nor to go on
    assert r.xlen(keys.stream) == 3


def test_a_request_sent_again_to_go_on_supersedes_its_running_attempt_but_not_an_aborted_one(r):
    """A client that lost its stream with its router sends the request again with the tokens it has
    (resume_from): the latest attempt, still running for the lost router, does not refuse it (it
    would until that router is reaped) but is marked failed, superseded, once the new attempt is
    admitted; not when the queue refuses the new one, nor when the latest was aborted."""
    import json

    keys = Keys("sup")
    admit, abort = r.register_script(SOURCES["admit"]), r.register_script(SOURCES["abort"])
    r.hset(keys.req("y"), mapping={"state": "decoding", "prompt_tokens": 3})

    def send(attempt_id, expected, latest, max_requests=100):
        job = json.dumps(
            {
                "request_id": attempt_id,
                "t_admitted": 2.0,
                "t_received": 2.0,
                "decode_worker": "d",
                "priority": 0,
                "token_ids": [1, 2, 3, 7, 8],
                "resumed": 2,
            }
        )
        return admit(
            keys=[
                keys.admission,
                keys.stream,
                keys.req(attempt_id),
                keys.router_requests("rt"),
                keys.req("y"),
                keys.req(latest),
            ],
            args=[5, max_requests, 1000, 1.0, 60, job, 1, "rt", expected, "fp-y", "", 1],
        )[0]

    r.hset(keys.admission, "requests", 1)
    assert send("y#2", 1, "y", max_requests=1) == 0  # the queue is full: the running one is left alone
    assert r.hget(keys.req("y"), "state") == "decoding"
    assert send("y#2", 1, "y") == 1
    h = r.hgetall(keys.req("y"))
    assert h["state"] == "failed" and h["superseded"] == "1" and "y#2" in h["error"] and h["current"] == "y#2"
    assert r.hget(keys.req("y#2"), "prompt_tokens") == "3" and r.hget(keys.req("y#2"), "queued_tokens") == "5"
    assert abort(keys=[keys.req("y#2")], args=[3.0, 60, 60])[0] == "queued"
    assert send("y#3", 2, "y#2") == -1  # aborted: not run again, to go on or not
    assert r.xlen(keys.stream) == 1


def test_an_abort_after_a_request_ended_unfinished_keeps_it_from_running_again(r):
    """Abort of a request that already failed or was cancelled leaves its state and marks it
    aborted; of one that finished, changes nothing."""
    abort = r.register_script(SOURCES["abort"])
    for state in ("failed", "cancelled", "finished"):
        key = f"ab:req:{state}"
        r.hset(key, mapping={"state": state, "decode_worker": "d"})
        assert abort(keys=[key], args=[2.0, 60, 60]) == [state, "d"]
        assert r.hget(key, "state") == state
        assert r.hget(key, "aborted") == (None if state == "finished" else "1")


def test_a_router_reaps_others_only_after_a_lease_of_timely_renewals(r):
    """After Redis stalled or was down, every router's lease has run out; the first to renew must
    not take the others for dead (it would fail their queued requests) before they could renew."""
    import asyncio

    import redis.asyncio as aioredis

    from splitserve.router.requests import ROUTER_LEASE_HEARTBEATS
    from splitserve.router.server import RouterServicer
    from splitserve.service.settings import Settings

    sock = r.connection_pool.connection_kwargs["path"]
    s = Settings(redis_prefix="g", heartbeat_s=0.1)
    keys = Keys("g")
    lease = ROUTER_LEASE_HEARTBEATS * s.heartbeat_s

    async def go():
        ar = aioredis.Redis(unix_socket_path=sock)
        try:
            a = RouterServicer(s.replace(worker_id="a"), None, ar)
            b = RouterServicer(s.replace(worker_id="b"), None, ar)
            await a.keep_alive()
            await b.keep_alive()
            await ar.hset(keys.req("b1"), mapping={"state": "queued"})
            await ar.sadd(keys.router_requests("b"), "b1")
            await asyncio.sleep(lease + 0.1)  # a stall: neither renewed, both leases ran out
            await a.keep_alive()  # a's renewals were late, so it waits a lease before reaping
            assert await a.reap() == 0
            await b.keep_alive()  # b renews in that time: it is alive
            end = time.monotonic() + lease + 0.2
            while time.monotonic() < end:
                await a.keep_alive()
                await b.keep_alive()
                assert await a.reap() == 0
                await asyncio.sleep(s.heartbeat_s / 2)
            assert await ar.hget(keys.req("b1"), "state") == b"queued"
            # Held up after a renewal (Redis stalled in the middle of a's refresh): a's own lease and
            # b's run out meanwhile, yet a reaps no one, itself least of all, until it renews on time.
            await asyncio.sleep(lease + 0.1)
            assert await a.reap() == 0
            await a.keep_alive()
            assert await a.reap() == 0
            await b.keep_alive()
            assert await ar.hget(keys.req("b1"), "state") == b"queued"
            # b stops renewing (killed): once its lease has run out, a marks its request failed.
            marked, end = 0, time.monotonic() + 10 * lease
            while not marked and time.monotonic() < end:
                await a.keep_alive()
                marked = await a.reap()
                await asyncio.sleep(s.heartbeat_s / 2)
            assert marked == 1
            assert await ar.hget(keys.req("b1"), "state") == b"failed"
            assert await ar.zscore(keys.routers, "b") is None
        finally:
            await ar.aclose()

    asyncio.run(go())


async def _write_decode_entry(
    ar, keys, wid: str, opened: int, closed: int, epoch: str = "e1", free: int = 10_000
) -> None:
    from splitserve.service.redis_state import WorkerInfo

    await ar.hset(
        keys.worker("decode", wid),
        mapping=WorkerInfo(
            worker_id=wid,
            role="decode",
            address=f"127.0.0.1:{len(wid)}",
            host_id="h",
            running=opened - closed,
            free_kv_tokens=free,
            kv_capacity_tokens=10_000,
            opened=opened,
            closed=closed,
            epoch=epoch,
        ).to_mapping(),
    )


def test_a_routers_pick_corrects_stale_registry_entries_by_its_own_streams(r):
    """A decode worker writes its stream counts once a heartbeat, and a router reads them twice
    as often, so an entry can be a heartbeat old. The router corrects it by its own streams: those
    it placed since (counted once, however many reads bring no newer entry, and not again once a
    newer entry counts them) and those that ended since (right after a busy spell, a worker whose
    entry still shows its streams is idle)."""
    import asyncio
    from collections import Counter

    import redis.asyncio as aioredis

    from splitserve.router.server import RouterServicer
    from splitserve.service.settings import Settings

    sock = r.connection_pool.connection_kwargs["path"]
    s = Settings(redis_prefix="p", heartbeat_s=0.1)
    keys = Keys("p")

    async def write(wid: str, opened: int, closed: int, epoch: str = "e1") -> None:
        await _write_decode_entry(ar, keys, wid, opened, closed, epoch)

    ar = aioredis.Redis(unix_socket_path=sock)

    async def go():
        try:
            await write("d0", 0, 0)
            await write("d1", 0, 0)
            router = RouterServicer(s.replace(worker_id="a"), None, ar)
            await router.refresh_workers()
            streams = {"d0": [], "d1": []}
            for i in range(6):
                w, placed, _ = router.pick(10)
                streams[w.worker_id].append(placed)
                if i % 2 == 0:
                    await router.refresh_workers()  # no worker has written since: the picks still count
            assert Counter({k: len(v) for k, v in streams.items()}) == {"d0": 3, "d1": 3}
            for ps in streams.values():  # each worker accepts its three: streams 1, 2, 3 there
                for n, placed in enumerate(ps, 1):
                    router.placements.accepted(placed, "e1", n)
            assert [router.placements.load(w) for w in router.workers] == [3, 3]
            # d1 writes an entry that counts its three: they are not counted twice.
            await write("d1", 3, 0)
            await router.refresh_workers()
            assert sorted(router.placements.load(w) for w in router.workers) == [3, 3]

            # The busy spell ends: d0's three close (streams 1, 2, 3 it closed), d1's first one too.
            # d0's entry still shows three open, d1's (rewritten since) one of two.
            for n, placed in enumerate(streams["d0"], 1):
                router.placements.ended("d0", placed, close_seq=n)
            router.placements.ended("d1", streams["d1"][0], close_seq=1)
            await write("d1", 3, 1)
            await router.refresh_workers()
            load = {w.worker_id: router.placements.load(w) for w in router.workers}
            assert load == {"d0": 0, "d1": 2}  # by the entries alone: 3 and 2
            picks = [router.pick(10)[0].worker_id for _ in range(2)]
            assert picks == ["d0", "d0"]  # 1 < 2, then 2 ties with 2

            # d0's next entry counts its closed streams: those three are forgotten, the new two stay.
            await write("d0", 3, 3)
            await router.refresh_workers()
            assert len(router.placements.at["d0"]) == 2
            assert {w.worker_id: router.placements.load(w) for w in router.workers} == {"d0": 2, "d1": 2}

            # A stream that ended without its last event (cancelled here) is left to the entry.
            router.placements.ended("d1", streams["d1"][1])
            assert {w.worker_id: router.placements.load(w) for w in router.workers}["d1"] == 2

            # d1 restarts (a new epoch, its counts from zero): the ended streams of its last run are
            # forgotten; the one still open here counts (its new entry does not).
            await write("d1", 0, 0, epoch="e2")
            await router.refresh_workers()
            assert len(router.placements.at["d1"]) == 1
            assert {w.worker_id: router.placements.load(w) for w in router.workers}["d1"] == 1
        finally:
            await ar.aclose()

    asyncio.run(go())


def test_a_routers_pick_corrects_stale_free_kv_by_its_own_streams(r):
    """The free KV an entry shows is as old as the entry. A stream the router placed since takes
    its prompt + max_tokens off it, and one that closed since gives back what it held, so two
    long requests in a row do not both go to the worker whose entry still shows room for one."""
    import asyncio

    import redis.asyncio as aioredis

    from splitserve.router.server import RouterServicer
    from splitserve.service.settings import Settings

    s = Settings(redis_prefix="p", heartbeat_s=0.1)
    keys = Keys("p")
    ar = aioredis.Redis(unix_socket_path=r.connection_pool.connection_kwargs["path"])

    async def go():
        try:
            await _write_decode_entry(ar, keys, "d0", 0, 0, free=1000)
            await _write_decode_entry(ar, keys, "d1", 1, 0, free=1000)  # one stream open, as much room
            router = RouterServicer(s.replace(worker_id="a"), None, ar)
            await router.refresh_workers()
            a_worker, a, _ = router.pick(800)
            assert a_worker.worker_id == "d0"  # fewer streams
            router.placements.accepted(a, "e1", 1)
            assert {w.worker_id: router.placements.free_kv(w) for w in router.workers} == {"d0": 200, "d1": 1000}
            # One stream each now; d0's entry still says 1000 free, but a's 800 are spoken for there.
            assert router.pick(800)[0].worker_id == "d1"
            assert router.pick(100)[0].worker_id == "d0"  # a small one still fits at d0

            # d0's next entry counts a (and the small one it has not accepted yet: still taken off),
            # then a ends having held 700 tokens: they count as free before d0's entry says so.
            await _write_decode_entry(ar, keys, "d0", 1, 0, free=300)
            await router.refresh_workers()
            d0 = next(w for w in router.workers if w.worker_id == "d0")
            assert router.placements.free_kv(d0) == 300 - 100
            router.placements.ended("d0", a, close_seq=1, held=700)
            assert router.placements.free_kv(d0) == 300 - 100 + 700
        finally:
            await ar.aclose()

    asyncio.run(go())


def test_a_routers_pick_prefers_the_worker_holding_the_prompts_prefix_within_its_load_slack(r):
    """A decode worker this router has seen compute a prompt's blocks gets a request starting with
    them while it has at most prefix_affinity_slack more streams open than the least loaded; past
    that, or for a prompt under another cache_salt, or with the slack at -1, placement is by load.
    A worker short of KV for the request is not preferred for its cache."""
    import asyncio

    import redis.asyncio as aioredis

    from splitserve.router.server import RouterServicer
    from splitserve.service.settings import Settings

    keys = Keys("p")
    ar = aioredis.Redis(unix_socket_path=r.connection_pool.connection_kwargs["path"])
    prompt = list(range(1000, 1100))  # 6 whole blocks and 4 tokens

    async def go():
        try:
            await _write_decode_entry(ar, keys, "d0", 0, 0)
            await _write_decode_entry(ar, keys, "d1", 2, 0)  # two streams open
            router = RouterServicer(Settings(redis_prefix="p", worker_id="a", prefix_affinity_slack=2), None, ar)
            await router.refresh_workers()
            router.prefixes.record("d1", router.prefixes.chain(prompt + [7, 8, 9]))
            turn2 = prompt + [7, 8, 9] + list(range(40))
            hashes = router.prefixes.prompt_chain(turn2)
            w, _, cached = router.pick(200, hashes)
            assert (w.worker_id, cached) == ("d1", 96)  # 3 more open there (with this one), within 2 + 1
            w, _, cached = router.pick(200, hashes)
            assert (w.worker_id, cached) == ("d0", 0)  # d1 now has 4 open to d0's 0: past the slack
            assert router.pick(200, router.prefixes.prompt_chain(turn2, "other salt"))[0].worker_id == "d0"
            assert router.pick(200)[0].worker_id == "d0"  # no prompt given: by load alone

            off = RouterServicer(Settings(redis_prefix="p", worker_id="b", prefix_affinity_slack=-1), None, ar)
            await off.refresh_workers()
            off.prefixes.record("d1", off.prefixes.chain(prompt))
            w, _, cached = off.pick(200, off.prefixes.prompt_chain(turn2))
            assert not off.affinity and (w.worker_id, cached) == ("d0", 0)  # with the slack at 2, d1's

            await _write_decode_entry(ar, keys, "d1", 0, 0, free=100)  # idle, but no room for 200
            again = RouterServicer(Settings(redis_prefix="p", worker_id="c"), None, ar)
            await again.refresh_workers()
            again.prefixes.record("d1", again.prefixes.chain(prompt))
            assert again.pick(200, again.prefixes.prompt_chain(turn2))[0].worker_id == "d0"
            assert again.pick(50, again.prefixes.prompt_chain(turn2))[0].worker_id == "d1"  # room for 50
        finally:
            await ar.aclose()

    asyncio.run(go())


def test_a_routers_pick_sends_a_stream_going_on_back_to_the_worker_it_ran_on_while_that_one_can_take_it(r):
    """A stream sent again to go on (its router lost) goes back to the decode worker that was running
    it (prefer), more loaded or not, and whatever this router recorded of the prompt elsewhere; not
    when that worker has no room for it, or is no longer registered: then placement is as usual."""
    import asyncio

    import redis.asyncio as aioredis

    from splitserve.router.server import RouterServicer
    from splitserve.service.settings import Settings

    keys = Keys("g")
    ar = aioredis.Redis(unix_socket_path=r.connection_pool.connection_kwargs["path"])
    prompt = list(range(2000, 2100))

    async def go():
        try:
            await _write_decode_entry(ar, keys, "d0", 0, 0)
            await _write_decode_entry(ar, keys, "d1", 12, 0)  # twelve streams open: past any slack
            router = RouterServicer(Settings(redis_prefix="g", worker_id="a"), None, ar)
            await router.refresh_workers()
            router.prefixes.record("d0", router.prefixes.chain(prompt))  # and the prompt recorded at d0
            hashes = router.prefixes.prompt_chain(prompt)
            assert router.pick(200, hashes)[0].worker_id == "d0"
            w, _, cached = router.pick(200, hashes, prefer="d1")
            assert (w.worker_id, cached) == ("d1", 0)
            assert router.pick(200, hashes, prefer="d9")[0].worker_id == "d0"  # not registered
            await _write_decode_entry(ar, keys, "d1", 0, 0, free=100)  # idle, but no room for 200 there
            again = RouterServicer(Settings(redis_prefix="g", worker_id="b"), None, ar)
            await again.refresh_workers()
            assert again.pick(200, hashes, prefer="d1")[0].worker_id == "d0"
            assert again.pick(50, hashes, prefer="d1")[0].worker_id == "d1"
        finally:
            await ar.aclose()

    asyncio.run(go())


def test_run_all_runs_each_once_in_order_and_reloads_a_lost_script(r):
    s = Scripts(
        r,
        {
            "incr": "return redis.call('INCRBY', KEYS[1], ARGV[1])",
            "echo": "return 'got ' .. ARGV[1]",
            "boom": "return redis.error_reply('boom')",
        },
    )
    r.delete("t:n")
    calls = [Call("incr", ["t:n"], [2]), Call("echo", [], ["a"]), Call("incr", ["t:n"], [5])]
    assert s.run_all(calls) == [2, "got a", 7]
    # The server lost its scripts (a restart): each still runs exactly once, none twice.
    r.script_flush()
    assert s.run_all([Call("incr", ["t:n"], [1]), Call("echo", [], ["b"])]) == [8, "got b"]
    assert int(r.get("t:n")) == 8
    # One that fails is raised; the others have run.
    with pytest.raises(redis.ResponseError, match="boom"):
        s.run_all([Call("incr", ["t:n"], [1]), Call("boom", [], [])])
    assert int(r.get("t:n")) == 9


def test_each_script_loads_with_its_includes_and_the_lua_states_are_the_pythons(r):
    """Every script compiles in Redis (SCRIPT LOAD), with the functions it includes; the Lua's idea
    of a final state and of one that may run again is the Python constants', and an expired job
    fails with DEADLINE_EXCEEDED's number."""
    from splitserve.service import redis_scripts
    from splitserve.service.redis_state import ACTIVE_STATES, FINAL_STATES, MAY_RUN_AGAIN

    assert set(SOURCES) >= {"admit", "abort", "pickup", "pull", "update", "heartbeat", "reap", "resume", "drop"}
    for name, source in SOURCES.items():
        assert r.script_load(source), name
    lib = (redis_scripts.LUA_DIR / "lib" / "is_final.lua").read_text()
    lib += (redis_scripts.LUA_DIR / "lib" / "may_run_again.lua").read_text()
    for state in (*ACTIVE_STATES, *FINAL_STATES, "other"):
        final = r.eval(lib + "return is_final(ARGV[1]) and 1 or 0", 0, state)
        again = r.eval(lib + "return may_run_again(ARGV[1], false) and 1 or 0", 0, state)
        assert (final, again) == (int(state in FINAL_STATES), int(state in MAY_RUN_AGAIN)), state
    assert redis_scripts.DEADLINE_CODE == grpc.StatusCode.DEADLINE_EXCEEDED.value[0] == 4
    assert "'code', 4)" in SOURCES["pickup"]


def test_a_job_goes_to_its_prefill_workers_own_stream_only_while_that_worker_is_there_and_has_room(r):
    """Prefill affinity: admission queues the job in the worker's own stream while the worker is
    registered, its stream (with the group) exists and holds fewer entries than the bound; else in
    the shared stream. A stream whose worker left is removed once it is empty, not before."""
    import json

    keys = Keys("aff")
    admit = r.register_script(SOURCES["admit"])
    own = r.register_script(SOURCES["own_stream"])
    forget = r.register_script(SOURCES["forget_stream"])
    mine, entry = keys.stream_to("p1"), keys.worker("prefill", "p1")

    def send(rid, bound=2, attempt_keys=(), attempt_args=("", "")):
        job = json.dumps({"request_id": rid, "t_admitted": 1.0, "t_received": 1.0, "decode_worker": "d", "priority": 0})
        return admit(
            keys=[keys.admission, keys.stream, keys.req(rid), keys.router_requests("rt"), *attempt_keys, mine, entry],
            args=[5, 100, 1000, 1.0, 60, job, 1, "rt", *attempt_args, bound],
        )

    assert send("a") == [1, 1, 5, 0, 0]  # not registered: the shared stream
    r.set(entry, "x")
    assert send("b") == [
        1,
        2,
        10,
        0,
        0,
    ]  # registered, but its stream is not there (XADD would make one without the group)
    assert own(keys=[mine, keys.directed], args=[GROUP, "p1"]) == 1
    assert own(keys=[mine, keys.directed], args=[GROUP, "p1"]) == 1  # again: the stream and its group are kept
    assert r.smembers(keys.directed) == {"p1"}
    assert send("c")[4] == 1 and send("d")[4] == 1
    assert send("e")[4] == 0  # two wait there: the bound
    assert [json.loads(f["job"])["request_id"] for _, f in r.xrange(mine)] == ["c", "d"]
    assert [json.loads(f["job"])["request_id"] for _, f in r.xrange(keys.stream)] == ["a", "b", "e"]
    got = r.xreadgroup(GROUP, "p1", {mine: ">"}, count=1)  # the group is there
    assert json.loads(got[0][1][0][1]["job"])["request_id"] == "c"
    assert send("f")[4] == 0  # pulled, not done (acked and deleted): it still counts
    # A request sent again (a new attempt: two more keys before the stream's) goes there too.
    r.xdel(mine, got[0][1][0][0])
    r.hset(keys.req("x"), mapping={"state": "failed", "prompt_tokens": 5})
    assert send("x#2", attempt_keys=(keys.req("x"), keys.req("x")), attempt_args=(1, "fp"))[4] == 1
    assert r.hget(keys.req("x"), "current") == "x#2" and r.hget(keys.req("x#2"), "fingerprint") == "fp"

    assert forget(keys=[mine, entry, keys.directed], args=["p1"]) == -1  # registered: kept
    r.delete(entry)
    assert send("g")[4] == 0  # left the registry: the shared stream
    assert forget(keys=[mine, entry, keys.directed], args=["p1"]) == 2  # its jobs still wait: kept
    r.xtrim(mine, maxlen=0)
    assert forget(keys=[mine, entry, keys.directed], args=["p1"]) == 0
    assert not r.exists(mine) and r.smembers(keys.directed) == set()


def test_a_write_redis_did_not_take_is_made_once_it_answers_and_given_up_past_its_time(tmp_path):
    """The routers' and decode workers' bookkeeping while Redis is away (until_answered): a write
    that fails is made again every every_s until Redis takes it, for up to for_s."""
    import asyncio
    import functools

    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from service_helpers import start_redis

    from splitserve.service.process import until_answered

    proc, sock = start_redis(tmp_path)
    proc.terminate()  # Redis down (its socket is removed: connections fail at once)
    proc.wait(10)

    async def go():
        # (no retries within a call: redis-py's own would take ~3.7 s to fail each)
        ar = aioredis.Redis(unix_socket_path=sock, socket_timeout=2, retry=Retry(NoBackoff(), 0))
        try:

            def write(key):
                return functools.partial(ar.hset, key, mapping={"t_kv_done": "1.5"})

            short = asyncio.create_task(until_answered(write("t:gave-up"), "a write", 0.1, 0.5, at_once=True))
            long = asyncio.create_task(until_answered(write("t:later"), "a write", 0.1, 60, at_once=True))
            await asyncio.sleep(1.5)
            assert short.done() and not long.done()
            back, _ = start_redis(tmp_path)  # (blocks the loop until it answers: the writes wait meanwhile)
            try:
                await asyncio.wait_for(long, 10)
                got = redis.Redis(unix_socket_path=sock, decode_responses=True)
                return got.hgetall("t:later"), got.exists("t:gave-up")
            finally:
                back.terminate()
                back.wait(10)
        finally:
            await ar.aclose()

    later, gave_up = asyncio.run(go())
    assert later == {"t_kv_done": "1.5"} and gave_up == 0


def test_a_settled_call_runs_to_its_answer_and_its_task_is_cancelled_after():
    """settled: a request's task cancelled (its client went) while a Redis call whose effect its
    cleanup must know of is under way gets the call's answer, and the cancel at its next await;
    a call that fails raises its error, and the cancel comes after all the same."""
    import asyncio

    from splitserve.service.process import settled

    async def go():
        answer, seen = asyncio.Event(), []

        async def call():
            await answer.wait()
            return "admitted"

        async def request():
            seen.append(await settled(call()))
            await asyncio.sleep(10)  # the cancel comes here
            seen.append("not cancelled")

        task = asyncio.create_task(request())
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.sleep(0.05)
        assert not task.done() and seen == []  # waiting for the call, not cut off
        answer.set()
        try:
            await task
        except asyncio.CancelledError:
            seen.append("cancelled")

        async def fails():
            await answer.wait()
            raise ValueError("no answer")

        async def request_failing():  # its call fails after the cancel: the error first, then the cancel
            try:
                await settled(fails())
            except ValueError:
                seen.append("raised")
            await asyncio.sleep(10)
            seen.append("not cancelled")

        answer.clear()
        task = asyncio.create_task(request_failing())
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.sleep(0.05)
        answer.set()
        try:
            await task
        except asyncio.CancelledError:
            seen.append("cancelled")
        return seen

    assert asyncio.run(go()) == ["admitted", "cancelled", "raised", "cancelled"]


def test_a_cancel_that_comes_as_the_call_waited_for_completes_is_not_lost():
    """aio.wait_for (3.12's): on 3.11, asyncio.wait_for runs what it waits for as a task of its own
    and, cancelled as that completes, returns its result: the cancel is lost (CPython gh-86296)."""
    import asyncio
    import sys

    from splitserve.service import aio

    async def outcome(wait_for) -> str:
        answer = asyncio.get_running_loop().create_future()

        async def call():
            return await wait_for(answer, 5)

        task = asyncio.create_task(call())
        await asyncio.sleep(0)  # the task waits in wait_for
        answer.set_result("answered")
        task.cancel()  # as the answer comes
        await asyncio.wait({task})
        return "cancelled" if task.cancelled() else task.result()

    assert asyncio.run(outcome(aio.wait_for)) == "cancelled"
    if sys.version_info < (3, 12):
        assert asyncio.run(outcome(aio._original_wait_for)) == "answered"  # the loss the module is for

    async def times_out():  # and a timeout is still a timeout
        with pytest.raises(asyncio.TimeoutError):
            await aio.wait_for(asyncio.sleep(1), 0.05)
        with pytest.raises(asyncio.TimeoutError):
            await aio.wait_for(asyncio.sleep(1), 0)
        assert await aio.wait_for(asyncio.sleep(0, "done"), None) == "done"

    asyncio.run(times_out())


def test_work_handed_to_another_thread_is_waited_for_past_a_cancel_and_the_cancel_kept():
    """aio.outlast_cancel: the engine's thread runs a command submitted to it even if the task that
    awaits it is cancelled (a decode worker's KV import, its handoff's call cancelled); the task
    gets the result all the same, told it was cancelled, so it keeps what was done and ends
    cancelled. What failed did nothing to keep: the cancel is raised."""
    import asyncio

    from splitserve.service import aio

    async def outcome(result, cancels: int):
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        task = asyncio.create_task(aio.outlast_cancel(done))
        await asyncio.sleep(0)
        for _ in range(cancels):  # cancelled while the other thread works, as often as you like
            task.cancel()
            await asyncio.sleep(0.01)
        assert not task.done()
        if isinstance(result, Exception):
            done.set_exception(result)
        else:
            done.set_result(result)
        await asyncio.wait({task})
        return "cancelled" if task.cancelled() else task.exception() or task.result()

    assert asyncio.run(outcome("imported", 0)) == ("imported", False)
    assert asyncio.run(outcome("imported", 1)) == ("imported", True)
    assert asyncio.run(outcome("imported", 3)) == ("imported", True)
    err = ValueError("no room")
    assert asyncio.run(outcome(err, 0)) is err
    assert asyncio.run(outcome(err, 2)) == "cancelled"

    async def cancelled_as_it_completes():
        done = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(aio.outlast_cancel(done))
        await asyncio.sleep(0)
        done.set_result("imported")
        task.cancel()  # in the same turn
        return await task

    assert asyncio.run(cancelled_as_it_completes()) == ("imported", True)


def test_a_loop_of_redis_calls_ends_at_its_first_cancel(redis_socket):
    """A task that loops over calls of an asyncio client from connect() (a socket timeout: redis-py
    writes each command under asyncio.wait_for), cancelled at random points, ends at once every
    time. With 3.11's wait_for, about one cancel in three was lost and the loop went on; a
    router's heartbeat loop so kept a router sent SIGTERM from exiting (a soak)."""
    import asyncio
    import random

    from splitserve.service.redis_state import connect

    async def go() -> list[int]:
        r = connect(f"unix://{redis_socket}", "off", asyncio=True)
        rng, lost = random.Random(5), []

        async def calls():
            while True:
                await asyncio.sleep(0.001)
                await r.ping()
                await r.hgetall("t:nothing")

        try:
            for i in range(150):
                task = asyncio.create_task(calls())
                await asyncio.sleep(rng.random() * 0.02)
                task.cancel()
                await asyncio.wait({task}, timeout=1.0)
                if not task.done():
                    lost.append(i)
                    while not task.done():
                        task.cancel()
                        await asyncio.wait({task}, timeout=0.1)
        finally:
            await r.aclose()
        return lost

    assert asyncio.run(go()) == []


def test_a_process_end_cancels_the_tasks_left_until_they_end(caplog):
    """end_tasks (run, at a process's end): a task that ignores some cancels is cancelled again
    until it ends; one that ignores more than it has rounds for is named in an ERROR line and
    returned, not waited for without end (asyncio.run, cancelling once, would wait forever)."""
    import asyncio
    import logging

    from splitserve.service.process import end_tasks

    async def deaf(n: int, ended: list):
        for _ in range(n):
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                pass  # a lost cancel
        ended.append(n)

    async def go():
        ended = []
        tasks = [asyncio.create_task(deaf(n, ended), name=f"deaf-{n}") for n in (1, 3, 8)]
        await asyncio.sleep(0)
        left = await end_tasks(rounds=5, wait_s=0.05)
        assert sorted(ended) == [1, 3] and left == [tasks[2]]
        assert await end_tasks(rounds=5, wait_s=0.05) == [] and sorted(ended) == [1, 3, 8]

    with caplog.at_level(logging.ERROR, logger="splitserve.service.process"):
        asyncio.run(go())
    assert [r.getMessage()[:54] for r in caplog.records] == ["1 task(s) still running after 5 cancels each: deaf-8 ("]


def test_a_job_takes_values_as_a_router_writes_them_and_refuses_others_naming_the_field():
    """Job.from_dict, the prefill worker's reading of a stream entry: a router's job comes back as
    it was; a value a router would not write is refused, naming the field (a cache_salt over the
    256 characters a router takes was served)."""
    job = Job(
        request_id="j-1",
        token_ids=[1, 2, 3],
        sampling={"max_tokens": 4},
        decode_worker="decode-0",
        decode_address="127.0.0.1:1",
        decode_host_id="h",
        deadline_unix=0,
        traceparent="",
        t_received=1.7e9,
        t_admitted=1.7e9,
        priority=-1,
        cache_salt="x" * 256,
        leg=2,
    )
    d = json.loads(job.to_json())
    assert Job.from_dict(d) == job
    for name, value in [
        ("cache_salt", "x" * 257),
        ("cache_salt", 5),
        ("priority", 2**31),
        ("priority", True),
        ("deadline_unix", float("inf")),
        ("t_admitted", "x"),
        ("leg", -1),
        ("request_id", ""),
        ("token_ids", [1.5]),
        ("sampling", []),
    ]:
        with pytest.raises(ValueError, match=f"^job's {name} is not "):
            Job.from_dict({**d, name: value})


def test_a_tenants_quota_refuses_it_alone_and_its_counts_come_back_once(r):
    """A tenant's request (id <tenant>~<id>) counts in its own fields beside the stack's; over its
    quota it is refused (-3, with its counts) while another tenant is admitted; the counts come back
    with the stack's at pickup and at a local request's first token, once, even with the hash gone."""
    import json

    keys = Keys("tq")
    admit, pickup = r.register_script(SOURCES["admit"]), r.register_script(SOURCES["pickup"])
    dequeue = r.register_script(SOURCES["dequeue"])

    def send(rid, tokens, quotas, queue=1):
        job = json.dumps({"request_id": rid, "t_admitted": 1.0, "t_received": 1.0, "decode_worker": "d", "priority": 0})
        keys_ = [keys.admission, keys.stream, keys.req(rid), keys.router_requests("rt")]
        return admit(keys=keys_, args=[tokens, 100, 10000, 1.0, 60, job, queue, "rt", "", "", "", 0, *quotas])

    assert send("a~1", 10, (2, 0))[0] == 1
    assert send("a~2", 10, (2, 0), queue=0)[0] == 1  # prefilled by its decode worker
    assert send("a~3", 10, (2, 0)) == [-3, 2, 20, 0]  # over a's 2 requests
    assert send("b~1", 10, (2, 15))[0] == 1  # b is admitted meanwhile
    assert send("b~2", 10, (2, 15)) == [-3, 1, 10, 0]  # over b's 15 tokens
    assert send("c", 10, ())[0] == 1  # no tenant: the stack's bounds alone
    assert r.hgetall(keys.admission) == {
        "requests": "4", "tokens": "40", "local_tokens": "10",
        "requests@a": "2", "tokens@a": "20", "requests@b": "1", "tokens@b": "10",
    }  # fmt: skip
    assert pickup(keys=[keys.admission, keys.req("a~1")], args=[10, 1, 2.0, "p", 0, 0]) == "prefilling"
    assert dequeue(keys=[keys.admission, keys.req("a~2")], args=[10]) == 1
    assert dequeue(keys=[keys.admission, keys.req("a~2")], args=[10]) == 0  # once
    r.delete(keys.req("b~1"))  # expired: its counts still come back, by its id's tenant
    assert pickup(keys=[keys.admission, keys.req("b~1")], args=[10, 1, 2.0, "p", 0, 0]) != "prefilling"
    assert r.hgetall(keys.admission) == {"requests": "1", "tokens": "10", "local_tokens": "0"}
    assert send("a~3", 10, (2, 0))[0] == 1  # a has room again


def test_an_asyncio_client_holds_more_commands_in_flight_than_it_has_connections(redis_socket):
    """A burst at a router keeps hundreds of commands in flight: past the pool's connections they wait
    for one, not fail (redis-py's default pool raised "Too many connections", and the router answered
    UNAVAILABLE)."""
    from splitserve.service.redis_state import ASYNC_POOL_CONNECTIONS, connect

    async def burst():
        client = connect(f"unix://{redis_socket}", "off", asyncio=True)
        n = ASYNC_POOL_CONNECTIONS
        try:
            await client.set("burst-key", "v")
            held = [client.blpop(["burst-list"], timeout=0.2) for _ in range(n)]
            got = await asyncio.gather(*held, *(client.get("burst-key") for _ in range(n)))
            pool = client.connection_pool
            return got, len(pool._in_use_connections) + len(pool._available_connections)
        finally:
            await client.aclose()

    got, opened = asyncio.run(burst())
    assert got[:ASYNC_POOL_CONNECTIONS] == [None] * ASYNC_POOL_CONNECTIONS  # each held a connection 0.2 s
    assert got[ASYNC_POOL_CONNECTIONS:] == [b"v"] * ASYNC_POOL_CONNECTIONS  # the others waited for one
    assert opened <= ASYNC_POOL_CONNECTIONS
