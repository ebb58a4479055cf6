"""Helpers shared by the service tests: starting stacks, leak checks, and the requests they send."""

import concurrent.futures as cf
import contextlib
import os
import pathlib
import signal
import socket
import threading
import time

import grpc
from service_helpers import departed_streams, keys_without_ttl, kv_idle, scrape, wait_for

from splitserve.client import Client
from splitserve.engine.sampling import SamplingParams
from splitserve.service.redis_state import LOCAL_FIELD, QUEUE_FIELDS, queue_counts
from splitserve.service.settings import Settings
from splitserve.stack import Stack

# Every prompt goes to a prefill worker (local_prefill_queue_tokens 0, and none prefilled by its decode
# worker while the prefill workers are stopped and out of the registry): these tests are of the handoff.
BASE = dict(
    kv_cache_bytes=256 << 20,
    prefill_kv_cache_bytes=256 << 20,
    arena_bytes=64 << 20,
    heartbeat_s=0.25,
    drain_s=3.0,
    claim_idle_ms=1500,
    local_prefill_queue_tokens=0,
    local_prefill_without_prefill_workers=False,
)


def start_stack(**kw):
    extra = {
        k: kw.pop(k)
        for k in ("prefill", "decode", "prefill_env", "decode_env", "router_env", "routers", "port", "http_port", "tls")
        if k in kw
    }
    stack = Stack(Settings.from_env(**{**BASE, **kw}), **extra).start()
    return stack


def free_port() -> int:
    """A port free now on 127.0.0.1 (for a router's HTTP: the stack binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def assert_idle(stack):
    """Leak checks: no KV or arena region held, no key without a TTL, the queue's counts at zero."""
    wait_for(lambda: kv_idle(stack), timeout=20, what="KV blocks and arena regions back to zero")
    for p in stack.procs:  # and the prefill engines' own blocks (those kept for a handoff included)
        if p.name.startswith("prefill") and p.popen.poll() is None and p.metrics_address:
            wait_for(
                lambda p=p: scrape(p.metrics_address).get("splitserve_kv_cache_blocks_used") == 0,
                timeout=5,
                what=f"{p.name}'s KV blocks back to zero",
            )
    wait_for(lambda: departed_streams(stack) == [], timeout=20, what="departed prefill workers' streams removed")
    assert keys_without_ttl(stack) == []
    assert admission_counts(stack) == [0, 0]  # every admitted request left the queue's counts
    assert int(stack.redis().hget(stack.keys.admission, LOCAL_FIELD) or 0) == 0  # ... those prefilled locally too


def finish_stack(stack):
    """Leak checks, then stop; afterwards nothing may be left."""
    try:
        assert_idle(stack)
    finally:
        stack.stop()
    assert all(p.popen.poll() is not None for p in stack.procs)
    assert stack.redis_proc is None or stack.redis_proc.poll() is not None
    assert stack.shm_segments() == []


# A seeded random request asking for the 3 most likely tokens at each position (the logprobs tests)
LOGPROBS_KW = dict(max_tokens=10, temperature=0.8, seed=7, ignore_eos=True, logprobs=3)


# A prompt longer than a KV block (so a prefix cache can hold some of it), scored (prompt_logprobs)
PROMPT_LP_TEXT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"


PROMPT_LP_KW = dict(max_tokens=4, ignore_eos=True, prompt_logprobs=3)


def resume_with(*samples):
    """resume_from for n > 1: (index, tokens, finished) of each sample, one character a token."""
    from splitserve_proto.v1 import generation_pb2 as pb

    return pb.Continuation(
        samples=[pb.SampleContinuation(index=i, token_ids=t, text_chars=len(t), finished=f) for i, t, f in samples]
    )


def concurrent_generate(address, prompts):
    with Client(address) as c, cf.ThreadPoolExecutor(len(prompts)) as ex:
        futs = [ex.submit(c.generate, token_ids=p, max_tokens=n, ignore_eos=True, timeout=300) for p, n in prompts]
        return [f.result() for f in futs]


@contextlib.contextmanager
def greedy_clients_beside(stack, client, n: int = 2):
    """n clients sending greedy requests through the router while the block runs (and after it, until
    they have sent 10); each request got the tokens it got alone."""
    prompts = ["The capital of France is", "1, 2, 3,", "Write a haiku about"]
    want = {p: list(client.generate(p, max_tokens=8, ignore_eos=True).token_ids) for p in prompts}
    stop, others = threading.Event(), []

    def other_requests():
        with Client(stack.router_address) as c:
            while not stop.is_set():
                p = prompts[len(others) % len(prompts)]
                others.append((p, list(c.generate(p, max_tokens=8, ignore_eos=True, timeout=60).token_ids)))

    with cf.ThreadPoolExecutor(n) as pool:
        background = [pool.submit(other_requests) for _ in range(n)]
        try:
            yield
            wait_for(
                lambda: len(others) >= 10 or any(f.done() for f in background), timeout=60, what="10 requests beside"
            )
        finally:
            stop.set()
        for f in background:
            f.result(timeout=120)
    assert len(others) >= 10 and all(got == want[p] for p, got in others), others


def consume_in_thread(stream, into: list) -> threading.Thread:
    def run():
        for chunk in stream:
            into.append(chunk)

    t = threading.Thread(target=run)
    t.start()
    return t


def outcome_in_thread(stream, into: dict) -> threading.Thread:
    """Consume a stream in a thread; into["tokens"] counts its tokens (into["ids"]), into["code"] its ending."""

    def run():
        into["tokens"], into["ids"] = 0, []
        try:
            for chunk in stream:
                into["tokens"] += len(chunk.token_ids)
                into["ids"] += chunk.token_ids
            into["code"], into["details"] = "OK", ""
        except grpc.RpcError as e:
            into["code"], into["details"] = e.code().name, e.details()

    t = threading.Thread(target=run)
    t.start()
    return t


def prefill_pids(stack):
    return [p.popen.pid for p in stack.procs if p.name.startswith("prefill")]


@contextlib.contextmanager
def prefill_paused(stack):
    """Every prefill worker stopped (SIGSTOP) inside the block, so nothing leaves the queue; resumed after, always."""
    for pid in prefill_pids(stack):
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in prefill_pids(stack):
            os.kill(pid, signal.SIGCONT)


def state_of(client, rid) -> str:
    try:
        return client.get_request(rid).state
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.NOT_FOUND:
            return ""
        raise


@contextlib.contextmanager
def stopped_process(pid: int):
    """The process stopped (SIGSTOP) inside the block; sent SIGCONT after, always."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def resuming_on_a_stopped_worker(s, c: Client, pool: cf.Executor, rid: str, prompt: str, down: list):
    """A 2000-token stream `rid` (a future of its messages, in `got`) part-way on one of the stack's
    two decode workers, which is then killed (named in `down`) while the other is stopped inside
    the block: the stream resumes on it, which cannot accept it yet. Yields (the future, got, the
    stopped worker)."""
    got = []

    def stream():
        for chunk in c.generate_stream(prompt, request_id=rid, max_tokens=2000, ignore_eos=True, timeout=120):
            got.append(chunk)

    ended = pool.submit(stream)
    wait_for(lambda: sum(len(m.token_ids) for m in got) >= 5, what="the stream part-way")
    on = c.get_request(rid).decode_worker.rsplit("-", 1)[0]
    other = s.proc("decode-1" if on == "decode-0" else "decode-0")
    with stopped_process(other.popen.pid):
        down.append(on)
        s.proc(on).popen.kill()
        s.proc(on).popen.wait()
        yield ended, got, other


def admission_counts(stack) -> list[int]:
    """The admission hash's (requests, tokens)."""
    r = stack.redis()
    return list(queue_counts(r.hmget(stack.keys.admission, *QUEUE_FIELDS)))


def admitted_by_hand(stack, stub, rid: str, n: int):
    """What the router's admission does before it queues a job: the decode stream, the request
    hash and the admission counts. Returns the decode stream."""
    from splitserve_proto.v1 import worker_pb2 as w

    r, p = stack.redis(), stack.keys.prefix
    stream = stub.Decode(w.DecodeRequest(request_id=rid, prompt_tokens=n), timeout=60)
    assert next(stream).accepted
    r.hset(f"{p}:req:{rid}", mapping={"state": "queued", "prompt_tokens": n})
    r.expire(f"{p}:req:{rid}", 600)
    r.hincrby(f"{p}:admission", "requests", 1)
    r.hincrby(f"{p}:admission", "tokens", n)
    return stream


def job_json(dec: dict, rid: str, token_ids: list[int], max_tokens: int = 3) -> dict:
    from splitserve.service.redis_state import sampling_to_dict

    return dict(
        request_id=rid,
        token_ids=token_ids,
        sampling=sampling_to_dict(SamplingParams(max_tokens=max_tokens, ignore_eos=True)),
        decode_worker=dec["worker_id"],
        decode_address=dec["address"],
        decode_host_id=dec["host_id"],
        deadline_unix=0,
        traceparent="",
        t_received=time.time(),
        t_admitted=time.time(),
        priority=0,
    )


def model_fingerprint(stack) -> str:
    import re

    with open(stack.proc("decode-0").log_path) as f:
        return re.search(r"fingerprint (\w+)", f.read()).group(1)


def stack_redis_hget(s, rid: str, field: str) -> str:
    got = s.redis().hget(s.keys.req(rid), field)
    return got.decode() if got is not None else ""


FAULTS = pathlib.Path(__file__).resolve().parent / "faults"


def with_module(tmp_path, name: str) -> dict:
    """The environment of a process that imports the module ``faults/<name>.py`` first (as its
    sitecustomize): a fault, or a release before this one, put into one role's processes."""
    # A module that cannot be put in (a patched name that moved) ends the process at once, so its
    # stack fails to start, naming it: Python only prints an error in sitecustomize and goes on.
    (tmp_path / "sitecustomize.py").write_text(
        f"try:\n    import {name}  # noqa: F401\nexcept BaseException:\n"
        "    import os, traceback\n    traceback.print_exc()\n    os._exit(3)\n"
    )
    path = [str(tmp_path), str(FAULTS), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(path).rstrip(os.pathsep)}
