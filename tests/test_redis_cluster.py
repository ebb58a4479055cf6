"""The stack on a real three-node Redis Cluster: every key carries the prefix's hash tag, so the
scripts (which touch several keys at once) run in one slot, and the clients follow redirects.
REDIS_URL names a node that does not hold that slot."""

import socket
import subprocess
import sys

import grpc
import pytest
import redis
from redis.cluster import RedisCluster, key_slot
from service_helpers import keys_without_ttl, kv_idle, scrape, wait_for

from splitserve.client import Client
from splitserve.service.redis_state import Keys, connect, is_cluster
from splitserve.service.settings import Settings
from splitserve.stack import Stack, redis_server_binary

PREFIX = "ss-cluster"
RANGES = [(0, 5460), (5461, 10922), (10923, 16383)]


def _free_port_pair() -> int:
    """A port whose cluster bus port (+10000) is free too."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Three masters, the slots split in three; yields their ports."""
    procs, ports = [], []
    try:
        for i in range(3):
            d = tmp_path_factory.mktemp(f"node{i}")
            port = _free_port_pair()
            procs.append(
                subprocess.Popen(
                    [
                        redis_server_binary(),
                        "--port",
                        str(port),
                        "--bind",
                        "127.0.0.1",
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        str(d / "nodes.conf"),
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                        "--dir",
                        str(d),
                    ],
                    stdout=subprocess.DEVNULL,
                )
            )
            ports.append(port)
        nodes = [redis.Redis(port=p) for p in ports]

        def up():
            try:
                return all(n.ping() for n in nodes)
            except redis.ConnectionError:
                return False

        wait_for(up, timeout=10, what="three redis-servers up")
        for n, (lo, hi) in zip(nodes, RANGES):
            n.execute_command("CLUSTER ADDSLOTS", *range(lo, hi + 1))
        for p in ports[1:]:
            nodes[0].execute_command("CLUSTER MEET", "127.0.0.1", p)
        wait_for(
            lambda: all(
                n.cluster("info")["cluster_state"] == "ok" and int(n.cluster("info")["cluster_known_nodes"]) == 3
                for n in nodes
            ),
            timeout=30,
            what="the cluster's state ok on every node",
        )
        yield ports
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)


def _node_of(ports: list[int], slot: int) -> int:
    return next(p for p, (lo, hi) in zip(ports, RANGES) if lo <= slot <= hi)


def test_a_cluster_node_is_told_from_a_single_redis(cluster, tmp_path):
    url = f"redis://127.0.0.1:{cluster[0]}"
    assert is_cluster(url) and is_cluster(url, "on") and not is_cluster(url, "off")
    assert isinstance(connect(url), RedisCluster)
    port = _free_port_pair()
    single = subprocess.Popen(
        [
            redis_server_binary(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
    )
    try:

        def up():
            try:
                return redis.Redis(port=port).ping()
            except redis.ConnectionError:
                return False

        wait_for(up, timeout=10, what="redis-server up")
        assert not is_cluster(f"redis://127.0.0.1:{port}")  # asked: not a cluster
        assert type(connect(f"redis://127.0.0.1:{port}")) is redis.Redis
    finally:
        single.terminate()
        single.wait(10)
    assert not is_cluster(f"redis://127.0.0.1:{port}")  # unreachable: taken as a single Redis
    assert not is_cluster(f"unix://{tmp_path / 'r.sock'}")  # a socket is never a cluster node: not asked
    with pytest.raises(ValueError, match="redis_cluster"):
        is_cluster(url, "yes")


def test_the_stack_serves_on_a_redis_cluster(cluster):
    keys = Keys(PREFIX)
    assert keys.prefix == "{" + PREFIX + "}"
    slot = key_slot(keys.stream.encode())
    home = _node_of(cluster, slot)
    elsewhere = next(p for p in cluster if p != home)  # REDIS_URL names a node without the slot
    s = Stack(
        Settings.from_env(
            redis_url=f"redis://127.0.0.1:{elsewhere}",
            redis_prefix=PREFIX,
            kv_cache_bytes=256 << 20,
            prefill_kv_cache_bytes=256 << 20,
            arena_bytes=64 << 20,
            heartbeat_s=0.25,
            drain_s=3.0,
        ),
        prefill=2,
        decode=1,
        routers=2,
    ).start()
    try:
        with Client(s.router_address) as c:
            ref = c.generate("The capital of France is", max_tokens=8, ignore_eos=True, request_id="c-unary")
            assert len(ref.token_ids) == 8 and ref.finish_reason == "length"
            streamed = [
                t
                for ch in c.generate_stream("The capital of France is", max_tokens=8, ignore_eos=True)
                for t in ch.token_ids
            ]
            assert streamed == list(ref.token_ids)
            assert c.get_request("c-unary").state == "finished"
            # A running stream's progress reaches GetRequest (progress.lua, on the request hashes of
            # all the router's streams at once); a cancel mid-stream frees the KV, through the same scripts.
            stream = c.generate_stream("Write a long story.", max_tokens=1000, ignore_eos=True, request_id="c-cancel")
            for n, _ in enumerate(stream):
                if n == 3:
                    wait_for(lambda: c.get_request("c-cancel").completion_tokens >= 4, timeout=10, what="progress")
                    stream.cancel()
                    break
            wait_for(lambda: c.get_request("c-cancel").state == "cancelled", timeout=20, what="cancelled")
            with pytest.raises(grpc.RpcError) as e:
                c.generate("x", max_tokens=0)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # A prompt of whole KV blocks: router 0's prefix records reach router 1 (a stream's
            # blocking read, through the cluster client).
            c.generate("Shared records: " + "one two three " * 20, max_tokens=4, ignore_eos=True)
            wait_for(
                lambda: (
                    scrape(s.proc("router-1").metrics_address).get("splitserve_prefix_records_applied_total", 0) >= 2
                ),
                timeout=20,
                what="records applied at router 1",
            )
            # Prefill affinity: a chat's next turn is queued on the own stream of the prefill worker
            # that prefilled the last (admit.lua's extra keys, the worker's read of its stream).
            turn = "Prefill affinity: " + "alpha beta gamma " * 20
            c.generate(turn, max_tokens=4, ignore_eos=True, request_id="c-turn-1")
            c.generate(turn + "delta epsilon " * 10, max_tokens=4, ignore_eos=True, request_id="c-turn-2")
            first, second = (c.get_request(f"c-turn-{i}") for i in (1, 2))
            assert first.prefill_worker and second.prefill_worker == first.prefill_worker
            assert scrape(s.proc("router").metrics_address)["splitserve_requests_sent_to_prefill_worker_total"] == 1
            # ... and router 1, told by router 0 what that worker holds, queues the turn after for it.
            wait_for(
                lambda: (
                    scrape(s.proc("router-1").metrics_address).get("splitserve_prefix_records_applied_total", 0)
                    >= 3 * 3
                ),
                timeout=20,
                what="the turns' records applied at router 1",
            )  # 3 requests: prompt (decode, prefill), end (decode)
            with Client(s.router_addresses[1]) as c1:
                c1.generate(
                    turn + "delta epsilon " * 10 + "zeta " * 20, max_tokens=4, ignore_eos=True, request_id="c-turn-3"
                )
            assert c.get_request("c-turn-3").prefill_worker == first.prefill_worker
            assert scrape(s.proc("router-1").metrics_address)["splitserve_requests_sent_to_prefill_worker_total"] == 1
        wait_for(lambda: kv_idle(s), timeout=20, what="KV blocks and arena regions back to zero")
        assert keys_without_ttl(s) == []
        st = subprocess.run(
            [sys.executable, "-m", "splitserve.cli", "status", "--redis-url", s.settings.redis_url, "--prefix", PREFIX],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert st.returncode == 0 and "2 prefill, 1 decode" in st.stdout, st.stdout + st.stderr
        # Every key the stack wrote is on the node that holds the prefix's slot, none elsewhere.
        on = {p: [k.decode() for k in redis.Redis(port=p).scan_iter(match="*")] for p in cluster}
        assert on[home] and all(k.startswith(keys.prefix + ":") for k in on[home]), on[home]
        assert all(not ks for p, ks in on.items() if p != home), on
        assert keys.req("c-unary") in on[home] and keys.prefix_records in on[home]
        assert keys.stream_to(first.prefill_worker) in on[home] and keys.directed in on[home]
    finally:
        s.stop()
    assert all(p.popen.poll() is not None for p in s.procs)
    assert s.shm_segments() == []
