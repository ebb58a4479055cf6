"""Streams end as their clients ask: a cancel, an Abort (at this router or another), a deadline,
a client that stops reading; each frees the request's KV everywhere."""

import concurrent.futures as cf
import threading
import time

import grpc
import pytest
from service_helpers import kv_idle, scrape, wait_for, workers

from splitserve.client import Client
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.sampling import SamplingParams

from .common import admission_counts, consume_in_thread, finish_stack, prefill_paused, start_stack, state_of


def test_cancel_mid_stream_frees_everything(stack, client):
    wait_for(lambda: kv_idle(stack), what="idle before the test")
    stream = client.generate_stream(
        "Write a very long story about a lighthouse.", max_tokens=400, ignore_eos=True, request_id="cancel-mid-stream"
    )
    got = 0
    for chunk in stream:
        got += len(chunk.token_ids)
        if got >= 5:
            # Its worker's registry entry counts it once: as running, not as pending (streams still
            # waiting for their KV), and as one open stream (opened - closed, the load the router
            # goes by); a stream counted twice sent the next ones all to the other workers.
            def counted_once():
                return [
                    (w["running"], w["pending"], int(w["opened"]) - int(w["closed"])) for w in workers(stack, "decode")
                ] == [("1", "0", 1)]

            wait_for(counted_once, timeout=5, what="the decoding stream counted once in the registry")
            stream.cancel()
            break
    wait_for(lambda: kv_idle(stack), timeout=20, what="KV freed after a mid-stream cancel")
    wait_for(
        lambda: [w["opened"] == w["closed"] for w in workers(stack, "decode")] == [True],
        timeout=5,
        what="the cancelled stream closed in the registry",
    )
    # The decode worker's gauges say so too (an autoscaler reads num_requests_running): no step ran
    # after the abort, and they must not keep that last step's sequence and blocks.
    m = scrape(stack.proc("decode-0").metrics_address)
    assert (m["splitserve_num_requests_running"], m["splitserve_kv_cache_blocks_used"]) == (0, 0), m
    assert wait_for(lambda: client.get_request("cancel-mid-stream").state == "cancelled")


def test_abort_ends_the_stream_with_cancelled(stack, client):
    results = []

    def consume():
        results.extend(
            client.generate_stream("Count to one thousand:", max_tokens=400, ignore_eos=True, request_id="to-abort")
        )

    t = threading.Thread(target=consume)
    t.start()
    wait_for(lambda: results, what="first tokens")
    assert client.abort("to-abort").found
    t.join(30)
    assert results[-1].finish_reason == "cancelled"
    assert sum(len(r.token_ids) for r in results) < 400
    wait_for(lambda: kv_idle(stack), timeout=20, what="KV freed after Abort")
    with pytest.raises(grpc.RpcError) as e:
        client.abort("never-existed")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_abort_at_another_router_ends_the_stream_and_frees_its_kv(stack, client, other_router):
    got = []
    t = consume_in_thread(
        client.generate_stream("Count to one thousand:", max_tokens=400, ignore_eos=True, request_id="abort-elsewhere"),
        got,
    )
    wait_for(lambda: sum(len(c.token_ids) for c in got) >= 3, what="first tokens")
    reply = other_router.abort("abort-elsewhere")
    assert reply.found and reply.state in ("prefilling", "decoding")
    t.join(30)
    assert not t.is_alive(), "the stream did not end after Abort at the other router"
    assert got[-1].finish_reason == "cancelled"
    streamed = sum(len(c.token_ids) for c in got)
    assert streamed < 400 and got[-1].usage.completion_tokens == streamed
    wait_for(lambda: kv_idle(stack), timeout=20, what="KV freed after Abort at the other router")
    for c in (client, other_router):
        assert c.get_request("abort-elsewhere").state == "cancelled"


def test_abort_at_another_router_while_queued_ends_the_stream_at_once(stack, client, other_router):
    with prefill_paused(stack):  # the job stays queued
        got = []
        t = consume_in_thread(
            client.generate_stream("A queued request", max_tokens=50, request_id="abort-queued-elsewhere", timeout=120),
            got,
        )
        wait_for(lambda: state_of(client, "abort-queued-elsewhere") == "queued", what="request queued")
        other_router.abort("abort-queued-elsewhere")
        t.join(10)  # not: the stream waited for a prefill that never comes, until its deadline
        assert not t.is_alive(), "the stream did not end after Abort at the other router"
        assert [c.finish_reason for c in got] == ["cancelled"]
    _assert_skipped_by_prefill(client, "abort-queued-elsewhere")
    wait_for(lambda: kv_idle(stack), what="KV idle")


def _assert_skipped_by_prefill(client, rid: str) -> None:
    """A request cancelled while queued: once prefill runs again, it is skipped, never picked up."""
    time.sleep(1.0)  # the worker pulls the job and must skip it
    info = client.get_request(rid)
    assert info.state == "cancelled" and info.prefill_worker == ""


def test_cancel_while_queued_is_never_prefilled(stack, client):
    with prefill_paused(stack):  # nothing is pulled from the queue while stopped
        stream = client.generate_stream("A queued request", max_tokens=50, request_id="cancel-queued")
        wait_for(lambda: state_of(client, "cancel-queued") == "queued", what="request queued")
        stream.cancel()
        wait_for(lambda: state_of(client, "cancel-queued") == "cancelled", what="cancelled state")
    _assert_skipped_by_prefill(client, "cancel-queued")
    r = stack.redis()
    assert r.xlen(stack.keys.stream) == 0  # skipped jobs are acked and deleted
    wait_for(lambda: kv_idle(stack), what="KV idle")


def test_deadline_exceeded(stack, client):
    with pytest.raises(grpc.RpcError) as e:
        client.generate(
            "Tell me everything about the ocean.", max_tokens=500, ignore_eos=True, timeout=1.0, request_id="deadline"
        )
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: kv_idle(stack), timeout=20, what="KV freed after a deadline")


def test_a_prompt_cancelled_while_prefilling_stops_between_its_chunks(mixed_workload):
    # 128-token forwards and a ~1500-token prompt: about 12 forwards. Cancelled during the
    # first, the rest must never run, and the worker must serve the next request as usual.
    stack = start_stack(prefill_token_budget=128, max_queue_requests=64, max_queue_tokens=1 << 20)
    try:
        ids = [t for it in mixed_workload[:12] for t in it["prompt_token_ids"]][:1500]
        assert len(ids) == 1500
        prefill_metrics = stack.proc("prefill-0").metrics_address
        key = "splitserve_prefill_jobs_total{outcome=%s}"
        with Client(stack.router_address) as c:
            stream = c.generate_stream(token_ids=ids, max_tokens=4, request_id="long-cancelled", timeout=120)
            wait_for(lambda: state_of(c, "long-cancelled") == "prefilling", interval=0.01, what="prefilling")
            stream.cancel()
            wait_for(
                lambda: scrape(prefill_metrics).get(key % "cancelled_prefilling") == 1.0,
                timeout=10,
                what="the prefill worker aborted the cancelled prompt",
            )
            info = c.get_request("long-cancelled")
            assert info.state == "cancelled" and "prefill_end" not in info.timestamps
            assert scrape(prefill_metrics).get(key % "prefilled", 0.0) == 0.0
            r = c.generate(token_ids=ids[:200], max_tokens=3, ignore_eos=True, timeout=60)
            assert len(r.token_ids) == 3
            assert scrape(prefill_metrics)[key % "prefilled"] == 1.0
    finally:
        finish_stack(stack)


def test_an_abort_ends_every_sample(stack, client):
    chunks = []
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(
            lambda: chunks.extend(
                client.generate_stream(
                    "Tell me a long story about a lighthouse.",
                    n=3,
                    max_tokens=400,
                    ignore_eos=True,
                    temperature=0.8,
                    request_id="n-abort",
                    timeout=120,
                )
            )
        )
        wait_for(lambda: len({c.index for c in chunks}) == 3, what="all three samples streaming")
        assert client.abort("n-abort").found
        fut.result(timeout=60)
    assert chunks[-1].finish_reason == "cancelled" and sum(1 for c in chunks if c.finish_reason) == 1
    assert client.get_request("n-abort").state == "cancelled"
    wait_for(lambda: kv_idle(stack), what="every sample's KV freed")


def test_a_client_that_stops_reading_a_stream_cancels_its_request(stack, client):
    """Leaving the loop over a stream (no cancel(), no close) cancels the request everywhere, with
    the sync client (the call is dropped) and the asyncio client (its generator is finalized)."""
    import asyncio

    from splitserve.client import AsyncClient

    wait_for(lambda: kv_idle(stack), what="idle before the test")

    def walk_away():
        for chunk in client.generate_stream(
            "Write a very long story about a ship.", max_tokens=400, ignore_eos=True, request_id="walked-away"
        ):
            if chunk.token_ids:
                break

    walk_away()
    assert wait_for(
        lambda: client.get_request("walked-away").state == "cancelled",
        timeout=10,
        what="the sync client's abandoned stream cancelled",
    )

    async def go():
        async with AsyncClient(stack.router_address) as ac:
            async for chunk in ac.generate_stream(
                "Write a very long story about a train.",
                max_tokens=400,
                ignore_eos=True,
                request_id="walked-away-async",
            ):
                if chunk.token_ids:
                    break
            end = time.monotonic() + 10  # the channel stays open: only the generator's end can cancel it
            while time.monotonic() < end:
                if (await ac.get_request("walked-away-async")).state == "cancelled":
                    return True
                await asyncio.sleep(0.05)
            return False

    assert asyncio.run(go()), "the asyncio client's abandoned stream was not cancelled"
    wait_for(lambda: kv_idle(stack), timeout=20, what="KV freed after both streams were abandoned")


def test_a_mix_of_cancels_aborts_deadlines_and_bad_requests_leaves_the_rest_correct_and_nothing_held(
    stack, smol_loaded, mixed_workload
):
    """Six clients over both routers send a seeded mix: plain greedy requests (streamed, unary,
    sampled), streams cancelled after some tokens or after a delay, Aborts sent to either router,
    short deadlines and invalid requests, so that the endings land in every phase of other
    requests (queued, prefilling, handing over, decoding). Every call ends with the status its
    kind allows; every greedy request that completes equals the in-process engine's output;
    afterwards every request has a final state, and no KV block, arena region, queue count or
    running sequence is left anywhere."""
    import random

    wait_for(lambda: kv_idle(stack), what="idle before the test")
    prompts = [it["prompt_token_ids"][: 24 + 17 * (i % 9)] for i, it in enumerate(mixed_workload[:40])]
    rng = random.Random(7)
    plan = []  # (request_id, kind, prompt index, max_tokens, delay_s or tokens before the cancel)
    kinds = [
        "stream",
        "stream",
        "unary",
        "sampled",
        "cancel_after_tokens",
        "cancel_after_delay",
        "abort",
        "abort_elsewhere",
        "deadline",
        "bad",
    ]
    for k in range(72):
        kind = kinds[k % len(kinds)] if k < len(kinds) else rng.choice(kinds)
        plan.append(
            (
                f"mix-{k}",
                kind,
                rng.randrange(len(prompts)),
                rng.randint(1, 24),
                rng.randint(0, 5) if kind == "cancel_after_tokens" else rng.uniform(0.0, 0.6),
            )
        )
    max_tokens = {p[0]: p[3] for p in plan}
    greedy = [
        p for p in plan if p[1] in ("stream", "unary", "cancel_after_delay", "abort", "abort_elsewhere", "deadline")
    ]
    eng = LLMEngine(EngineConfig(kv_cache_bytes=256 << 20), loaded=smol_loaded)
    want = dict(
        zip(
            (p[0] for p in greedy),
            eng.generate(
                [prompts[p[2]] for p in greedy], [SamplingParams(max_tokens=p[3], ignore_eos=True) for p in greedy]
            ),
        )
    )
    allowed = {
        "stream": {"OK"},
        "unary": {"OK"},
        "sampled": {"OK"},
        "bad": {"INVALID_ARGUMENT"},
        "cancel_after_tokens": {"OK", "CANCELLED"},
        "cancel_after_delay": {"OK", "CANCELLED"},
        "abort": {"OK"},
        "abort_elsewhere": {"OK"},
        "deadline": {"OK", "DEADLINE_EXCEEDED"},
    }
    got: dict[str, tuple] = {}
    clients = [Client(a) for a in stack.router_addresses]
    timers: list[threading.Timer] = []

    def run(rid, kind, pi, n, arg, c, other):
        kw = dict(token_ids=prompts[pi], max_tokens=n, ignore_eos=True, request_id=rid)
        tokens, finish = [], ""
        try:
            if kind == "bad":
                c.generate(**{**kw, "top_p": 1.5}, timeout=30)
            elif kind in ("unary", "sampled"):
                r = c.generate(
                    **kw, **({"temperature": 0.9, "top_p": 0.9, "seed": pi} if kind == "sampled" else {}), timeout=120
                )
                tokens, finish = list(r.token_ids), r.finish_reason
            else:
                stream = c.generate_stream(**kw, timeout=arg if kind == "deadline" else 120)
                if kind in ("cancel_after_delay", "abort", "abort_elsewhere"):
                    end = {
                        "cancel_after_delay": stream.cancel,
                        "abort": lambda: c.abort(rid),
                        "abort_elsewhere": lambda: other.abort(rid),
                    }[kind]
                    timers.append(threading.Timer(arg, end))
                    timers[-1].start()
                for chunk in stream:
                    tokens += chunk.token_ids
                    finish = chunk.finish_reason or finish
                    if kind == "cancel_after_tokens" and len(tokens) >= arg:
                        stream.cancel()
                        return "CANCELLED", tokens, "cancelled by the client"
            return "OK", tokens, finish
        except grpc.RpcError as e:
            return e.code().name, tokens, e.details()

    def client_loop(i):
        c, other = clients[i % 2], clients[1 - i % 2]
        for rid, kind, pi, n, arg in plan[i::6]:
            got[rid] = (kind, *run(rid, kind, pi, n, arg, c, other))
            time.sleep(0.05 * (i % 3))

    try:
        with cf.ThreadPoolExecutor(6) as ex:
            list(ex.map(client_loop, range(6)))
        for rid, kind, *_ in plan:
            code, tokens, finish = got[rid][1:]
            assert code in allowed[kind], (rid, kind, code, finish)
            if rid in want and code == "OK" and finish == "length":  # ran to the end: token for token
                assert tokens == want[rid], (rid, kind)
            elif rid in want and code == "OK":  # an Abort ends the stream with 'cancelled', after a prefix
                assert finish == "cancelled" and kind in ("abort", "abort_elsewhere"), (rid, kind, finish)
                assert tokens == want[rid][: len(tokens)], (rid, kind)
            if kind in ("stream", "unary", "sampled"):
                assert finish == "length" and len(tokens) == max_tokens[rid], (rid, tokens, finish)
        sent = [rid for rid, (kind, *_) in got.items() if kind != "bad"]
        wait_for(
            lambda: {clients[0].get_request(rid).state for rid in sent} <= {"finished", "cancelled"},
            timeout=20,
            what="every request in a final state",
        )
        assert sum(kind == "bad" for kind, *_ in got.values()) >= 7
        assert sum(code == "CANCELLED" for _, code, *_ in got.values()) >= 5
        assert sum(kind.startswith("abort") and finish == "cancelled" for kind, _, _, finish in got.values()) >= 3
        wait_for(lambda: kv_idle(stack), timeout=20, what="KV blocks and arena regions back to zero")
        assert admission_counts(stack) == [0, 0]
        for name in ("prefill-0", "decode-0"):
            m = scrape(stack.proc(name).metrics_address)
            assert (m["splitserve_num_requests_running"], m["splitserve_kv_cache_blocks_used"]) == (0, 0), (name, m)
        assert all(p.popen.poll() is None for p in stack.procs)
    finally:
        for t in timers:
            t.join()
        for c in clients:
            c.close()
