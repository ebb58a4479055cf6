"""The worker registry: never an entry without its lease, and an entry no worker wrote left out."""

import time

from service_helpers import kv_idle, wait_for, workers


def test_a_workers_registry_entry_is_never_seen_without_its_lease(stack):
    """A worker's heartbeat writes its registry entry and the entry's lease in one step. The decode
    worker wrote them in two calls (HSET, then PEXPIRE), so an entry made anew (at a worker's
    start, or after its lease lapsed) was there without a lease until the second: a worker killed
    between them stayed registered for good. Each worker's entry is removed 15 times, and Redis is
    asked for its lease as fast as it answers until the heartbeat has made it again: it always
    has one."""
    r = stack.redis()
    entries = [stack.keys.worker(role, w["worker_id"]) for role in ("decode", "prefill") for w in workers(stack, role)]
    assert len(entries) == 2
    seen = []
    for _ in range(15):
        for key in entries:
            r.delete(key)
            t_end = time.monotonic() + 5
            while (ttl := r.pttl(key)) == -2 and time.monotonic() < t_end:  # -2: no such key; -1: no lease
                pass
            seen.append((key, ttl))
    assert all(ttl > 0 for _, ttl in seen), [(k, t) for k, t in seen if t <= 0]
    wait_for(lambda: kv_idle(stack), what="both workers registered again")


def test_a_registry_entry_no_worker_wrote_is_left_out_told_once_and_the_router_serves_on(stack, client):
    """Hashes under the registry's keys that are not entries a worker writes (a worker of another
    release, a hand): no address, a count that is not one, a time that is not one, bytes that are
    not UTF-8, a key of another type. Each is left out of the router's reading of the registry, and
    told once in its log; the router places requests as before, `splitserve status` lists the
    workers and each entry it left out, and the decode worker, which reads the prefill workers'
    entries for their arenas, heartbeats on. Guards against: each failed every reading of the registry (and
    `status` with a traceback); an arena or host not UTF-8 ended the decode worker's heartbeat (its
    lease lapsed), and a prefill key of another type failed each of its heartbeats after the write."""
    import subprocess
    import sys

    r = stack.redis()
    here = workers(stack, "prefill")[0]["host_id"]  # arenas a decode worker on this host maps (warm_arenas)
    dec_key = stack.keys.worker("decode", workers(stack, "decode")[0]["worker_id"])
    good = {"role": "decode", "address": "127.0.0.1:1", "host_id": "elsewhere"}
    entries = {
        "no-address": {"role": "decode", "host_id": "h"},
        "count": {**good, "running": "abc"},
        "minus": {**good, "free_kv_tokens": "-5"},
        "time": {**good, "updated": "nan"},
        "bytes": {**good, "epoch": b"\xff\xfe"},
    }
    bad = []

    def put(role: str, name: str, m: dict) -> None:
        key = stack.keys.worker(role, f"bad-{name}")
        r.hset(key, mapping={"worker_id": f"bad-{name}", **m, "role": role})
        r.pexpire(key, 60_000)
        bad.append(key)

    for role in ("decode", "prefill"):
        for name, m in entries.items():
            put(role, name, m)
    for name, m in {
        "host": {"host_id": b"\xff", "arena": "splitserve-x"},
        "arena": {"host_id": here, "arena": b"\xfe"},
        "path": {"host_id": here, "arena": "../../etc/passwd"},
    }.items():
        put("prefill", name, {**m, "address": "127.0.0.1:1"})
    bad.append(stack.keys.worker("decode", "a-string"))
    r.set(bad[-1], "not a hash", px=60_000)
    unreadable = [k for k in bad if "bad-path" not in k]  # (an entry a worker may write: its arena is refused)
    router_log = stack.proc("router").log_path

    def beats() -> None:
        beat = float(r.hget(dec_key, "updated"))
        wait_for(
            lambda: float(r.hget(dec_key, "updated") or 0) > beat + 1, timeout=10, what="the decode worker's heartbeat"
        )

    try:
        wait_for(
            lambda: sum("left out" in line for line in open(router_log)) >= len(unreadable),
            timeout=10,
            what="the router telling each entry it left out",
        )
        for prompt in ("The capital of France is", "1, 2, 3,", "Write a haiku about"):
            assert len(client.generate(prompt, max_tokens=4, ignore_eos=True, timeout=60).token_ids) == 4
        st = subprocess.run(
            [
                sys.executable,
                "-m",
                "splitserve.cli",
                "status",
                "--redis-url",
                stack.settings.redis_url,
                "--prefix",
                stack.settings.redis_prefix,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert st.returncode == 0 and "2 prefill, 1 decode" in st.stdout, (st.stdout, st.stderr)  # (and bad-path)
        assert sum("left out, not a registry entry" in line for line in st.stdout.splitlines()) == len(unreadable), (
            st.stdout
        )
        assert "registry entry's running is not a count: 'abc'" in st.stdout and "has no address" in st.stdout
        told = [line for line in open(router_log) if "left out" in line]
        told_keys = sorted(line.split("registry entry ")[1].split(" left out")[0] for line in told)
        assert told_keys == sorted(unreadable), told  # each once, however many readings since
        beats()
        bad.append(stack.keys.worker("prefill", "a-string"))
        r.set(bad[-1], "not a hash", px=60_000)
        beats()
        assert "heartbeat failed" not in open(stack.proc("decode-0").log_path).read()
    finally:
        r.delete(*bad)


def test_a_decode_worker_whose_loop_is_held_keeps_its_lease_and_no_admitted_request_fails(tmp_path):
    """The decode worker's event loop is held for 5 s mid-stream (20 leases of 0.25 s heartbeats).
    Its registry entry is written from a thread of its own, so it never lapses, and the requests
    sent while the loop is held are admitted, placed there and all complete. Guards against: the
    heartbeat ran on that loop, the lease lapsed, and the router failed every request it admitted
    meanwhile UNAVAILABLE "no decode worker is registered"."""
    import concurrent.futures as cf

    from splitserve.client import Client

    from .common import finish_stack, start_stack, with_module

    s = start_stack(decode_env=with_module(tmp_path, "decode_loop_stall"))
    try:
        r = s.redis()
        key = s.keys.worker("decode", workers(s, "decode")[0]["worker_id"])
        with Client(s.router_address) as c, cf.ThreadPoolExecutor(12) as pool:
            held = pool.submit(
                c.generate, "Count: 1, 2,", max_tokens=12, ignore_eos=True, request_id="stall-loop-1", timeout=60
            )
            time.sleep(1.0)  # its third token has come: the loop is held now
            leases, others = [], []
            for i in range(10):
                others.append(pool.submit(c.generate, f"Request {i}:", max_tokens=6, ignore_eos=True, timeout=60))
                leases.append(r.pttl(key))
                time.sleep(0.3)
            results = [f.result() for f in [held, *others]]
        assert all(ttl > 0 for ttl in leases), leases  # -2: the entry lapsed
        assert [x.finish_reason for x in results] == ["length"] * 11
        assert [x.usage.completion_tokens for x in results] == [12] + [6] * 10
        with open(s.proc("decode-0").log_path) as f:
            assert "registry lease lapsed" not in f.read()
    finally:
        finish_stack(s)
