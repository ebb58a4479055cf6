"""Helpers for tests that run a real stack."""

from __future__ import annotations

import subprocess
import time
import urllib.request

import redis
from prometheus_client.parser import text_string_to_metric_families

from splitserve.service import redis_scripts
from splitserve.service.redis_state import Keys, WorkerInfo


def wait_for(pred, timeout: float = 30.0, interval: float = 0.05, what: str = "condition"):
    end = time.time() + timeout
    while time.time() < end:
        value = pred()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


def scrape(address: str) -> dict[str, float]:
    """A /metrics page: sample name (with labels but model_name, which every sample carries) -> value."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def workers(stack, role: str) -> list[dict]:
    r = stack.redis()
    out = []
    for key in r.scan_iter(match=stack.keys.worker_pattern(role)):
        m = {k.decode(): v.decode() for k, v in r.hgetall(key).items()}
        if m:
            out.append(m)
    return out


def heartbeat(r, keys: Keys, info: WorkerInfo, lease_s: float) -> None:
    """A registry entry written by hand, as a worker's heartbeat writes its own (a ghost's, an
    older release's)."""
    redis_scripts.Scripts(r).run(redis_scripts.heartbeat(keys, info=info, lease_s=lease_s))


def kv_idle(stack) -> bool:
    """Every decode worker holds no KV block and no slot; every prefill arena is empty."""
    dec = workers(stack, "decode")
    pre = workers(stack, "prefill")
    if len(dec) != stack.n_decode or len(pre) < min(1, stack.n_prefill):  # colocated: no prefill workers
        return False
    if any(int(w["running"]) or int(w["waiting"]) or int(w["pending"]) or w["opened"] != w["closed"] for w in dec):
        return False
    capacity = (
        stack.settings.kv_cache_bytes // (2 * 30 * 3 * 64 * 4 * stack.settings.block_size) * stack.settings.block_size
    )
    if any(int(w["free_kv_tokens"]) != capacity for w in dec):
        return False
    full_arena = stack.settings.arena_bytes // (2 * 30 * 3 * 64 * 4)
    return all(int(w["running"]) == 0 and int(w["free_kv_tokens"]) == full_arena for w in pre)


def departed_streams(stack) -> list[str]:
    """The own streams (prefill affinity) of prefill workers gone from the registry, not yet removed:
    the others remove them once they are empty (and none is left when no prefill worker is there to)."""
    r = stack.redis()
    registered = {w["worker_id"] for w in workers(stack, "prefill")}
    listed = {m.decode() for m in r.smembers(stack.keys.directed)}
    return sorted(listed - registered) if registered else []


def keys_without_ttl(stack) -> list[str]:
    r = stack.redis()
    keys = Keys(stack.settings.redis_prefix)
    # the prefill workers' own streams, while listed: removed once their worker is gone and they are empty
    allowed = {
        *keys.streams,
        keys.admission,
        keys.routers,
        keys.directed,
        *(keys.stream_to(m.decode()) for m in r.smembers(keys.directed)),
    }
    bad = []
    for key in r.scan_iter(match=f"{stack.keys.prefix}:*"):
        k = key.decode()
        if k in allowed:
            continue
        if r.ttl(key) < 0:
            bad.append(k)
    return bad


def start_redis(d) -> tuple:
    """A real redis-server (no persistence) on a unix socket in folder d, answering: (process, socket path)."""
    from splitserve.stack import redis_server_binary

    sock = str(d / "redis.sock")
    proc = subprocess.Popen(
        [
            redis_server_binary(),
            "--port",
            "0",
            "--unixsocket",
            sock,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(d),
        ],
        stdout=subprocess.DEVNULL,
    )
    try:
        client = redis.Redis(unix_socket_path=sock)

        def up():
            try:
                return client.ping()
            except (redis.ConnectionError, FileNotFoundError):
                return False

        wait_for(up, timeout=10, what="redis-server up")
        client.close()
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise
    return proc, sock
