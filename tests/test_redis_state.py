"""The Redis scripts that keep request hashes honest, against a real redis-server."""

import subprocess
import time

import pytest
import redis

from service_helpers import wait_for
from splitserve.service.redis_state import REAP_LUA, UPDATE_LUA, Keys, update_args
from splitserve.stack import redis_server_binary


@pytest.fixture(scope="module")
def r(tmp_path_factory):
    d = tmp_path_factory.mktemp("redis")
    sock = str(d / "redis.sock")
    proc = subprocess.Popen([redis_server_binary(), "--port", "0", "--unixsocket", sock, "--save", "",
                             "--appendonly", "no", "--dir", str(d)], stdout=subprocess.DEVNULL)
    try:
        client = redis.Redis(unix_socket_path=sock, decode_responses=True)

        def up():
            try:
                return client.ping()
            except (redis.ConnectionError, FileNotFoundError):
                return False
        wait_for(up, timeout=10, what="redis-server up")
        yield client
    finally:
        proc.terminate()
        proc.wait(10)


def test_update_touches_only_a_hash_that_exists_and_never_leaves_a_final_state(r):
    update = r.register_script(UPDATE_LUA)
    assert update(keys=["t:req:gone"], args=update_args({"state": "decoding", "t_kv_done": 1.5})) == 0
    assert not r.exists("t:req:gone")  # not recreated (it would have had no TTL)

    r.hset("t:req:a", mapping={"state": "prefilling"})
    assert update(keys=["t:req:a"], args=update_args({"state": "decoding", "kv_bytes": 10})) == 1
    assert r.hgetall("t:req:a") == {"state": "decoding", "kv_bytes": "10"}

    for final in ("finished", "cancelled", "failed"):
        r.hset("t:req:b", mapping={"state": final})
        update(keys=["t:req:b"], args=update_args({"state": "decoding", "error": "late", "t_prefill_end": 2}))
        assert r.hgetall("t:req:b") == {"state": final, "t_prefill_end": "2"}  # the rest is still recorded


def test_reap_fails_a_dead_routers_unended_requests_and_leaves_a_live_router_alone(r):
    keys = Keys("t")
    reap = r.register_script(REAP_LUA)
    now = time.time()
    r.zadd(keys.routers, {"live": now + 3, "dead": now - 1})
    states = {"q": "queued", "p": "prefilling", "d": "decoding", "f": "finished", "c": "cancelled"}
    for router in ("live", "dead"):
        for rid, state in states.items():
            r.hset(keys.req(f"{router}-{rid}"), mapping={"state": state})
            r.sadd(keys.router_requests(router), f"{router}-{rid}")

    def run(router, force=0):
        members = r.smembers(keys.router_requests(router))
        return reap(keys=[keys.routers, keys.router_requests(router), *(keys.req(m) for m in members)],
                    args=[router, time.time(), 60, force])

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


def test_a_router_reaps_others_only_after_a_lease_of_timely_renewals(r):
    """After Redis stalled or was down, every router's lease has run out; the first to renew must
    not take the others for dead (it would fail their queued requests) before they could renew."""
    import asyncio

    import redis.asyncio as aioredis

    from splitserve.router.server import ROUTER_LEASE_HEARTBEATS, RouterServicer
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


def test_requests_sent_count_towards_a_worker_until_its_entry_is_rewritten(r):
    """A burst spread over two decode workers stays even across registry reads that bring no
    newer entry (a worker writes its load once a heartbeat; a router reads twice as often)."""
    import asyncio
    from collections import Counter

    import redis.asyncio as aioredis

    from splitserve.router.server import RouterServicer
    from splitserve.service.redis_state import WorkerInfo
    from splitserve.service.settings import Settings

    sock = r.connection_pool.connection_kwargs["path"]
    s = Settings(redis_prefix="p", heartbeat_s=0.1)
    keys = Keys("p")

    def entry(wid: str, running: int, updated: float) -> dict:
        return WorkerInfo(worker_id=wid, role="decode", address=f"127.0.0.1:{len(wid)}", host_id="h",
                          running=running, free_kv_tokens=10_000, kv_capacity_tokens=10_000,
                          updated=updated).to_mapping()

    async def go():
        ar = aioredis.Redis(unix_socket_path=sock)
        try:
            await ar.hset(keys.worker("decode", "d0"), mapping=entry("d0", 0, 1.0))
            await ar.hset(keys.worker("decode", "d1"), mapping=entry("d1", 0, 1.0))
            router = RouterServicer(s.replace(worker_id="a"), None, ar)
            await router.refresh_workers()
            picks = Counter()
            for i in range(6):
                picks[router.pick(10).worker_id] += 1
                if i % 2 == 0:
                    await router.refresh_workers()  # no worker has written since: the sends still count
            assert picks == {"d0": 3, "d1": 3}
            # d0 writes a newer entry (one stream left running): its own count replaces the router's.
            await ar.hset(keys.worker("decode", "d0"), mapping=entry("d0", 1, 2.0))
            await router.refresh_workers()
            assert [router.pick(10).worker_id for _ in range(2)] == ["d0", "d0"]  # 1, 2 < d1's 3 sent
        finally:
            await ar.aclose()

    asyncio.run(go())
