"""Admission and backpressure: floods refused fast, the queue's counts exact, prefill work pulled
one forward at a time, and prompts prefilled by their decode worker when that is quicker."""

import concurrent.futures as cf
import json
import os
import signal
import threading
import time

import grpc
import pytest
from service_helpers import kv_idle, scrape, wait_for, workers

from splitserve.client import Client
from splitserve.service.redis_state import LOCAL_FIELD

from .common import (
    admission_counts,
    admitted_by_hand,
    concurrent_generate,
    finish_stack,
    job_json,
    prefill_paused,
    start_stack,
    state_of,
)


def test_conditional_disaggregation_prefills_short_prompts_and_overflow_on_the_decode_worker(
    reference_prompts, reference_outputs
):
    """Disaggregated, with local prefill on: prompts of at most local_prefill_max_tokens, and every
    prompt while prefill workers are behind by more than local_prefill_queue_tokens, are prefilled
    by their decode worker. Greedy output stays the in-process engine's, and the counts go back."""
    s = start_stack(
        local_prefill_max_tokens=100, local_prefill_queue_tokens=150, max_queue_requests=64, max_queue_tokens=1 << 20
    )
    try:
        got = concurrent_generate(s.router_address, reference_prompts)
        assert [list(r.token_ids) for r in got] == reference_outputs
        with Client(s.router_address) as c:
            infos = [c.get_request(r.request_id) for r in got]
            local = [(not i.prefill_worker, i.kv_transport) for i in infos]
            for (p, _), (here, transport) in zip(reference_prompts, local):
                assert not here or transport == ""  # no KV handed over for a prompt prefilled where it decodes
                if len(p) <= 100:
                    assert here, f"a {len(p)}-token prompt went to a prefill worker"
            router = s.proc("router").metrics_address
            assert scrape(router)["splitserve_local_prefills_total"] == sum(h for h, _ in local)
            assert any(not h for h, _ in local)  # the long ones went to the prefill worker at least at first

            short = next(p for p, _ in reference_prompts if len(p) <= 100)
            ia, ib = [i for i, (p, _) in enumerate(reference_prompts) if len(p) > 150][:2]
            (a, n_a), (b, n_b) = reference_prompts[ia], reference_prompts[ib]
            c.generate(token_ids=short, max_tokens=2)  # its admission shows this router an empty prefill queue
            with prefill_paused(s):
                out_a = {}
                # a salt of their own: the router has seen a decode worker compute these prompts
                # above, and would expect it to hold all but a few of their tokens (prefix affinity)
                t = threading.Thread(
                    target=lambda: out_a.update(
                        r=c.generate(
                            token_ids=a,
                            max_tokens=n_a,
                            ignore_eos=True,
                            request_id="cond-a",
                            timeout=120,
                            cache_salt="cond",
                        )
                    )
                )
                t.start()
                wait_for(lambda: state_of(c, "cond-a") == "queued", what="a long prompt queued for prefill")
                # More than 150 tokens now wait for the (stopped) prefill worker: the next long prompt
                # is prefilled by its decode worker, and finishes while the prefill worker is stopped.
                out_b = c.generate(
                    token_ids=b, max_tokens=n_b, ignore_eos=True, request_id="cond-b", timeout=120, cache_salt="cond"
                )
                assert list(out_b.token_ids) == reference_outputs[ib]
                assert c.get_request("cond-b").prefill_worker == ""
                assert state_of(c, "cond-a") == "queued"
            t.join(120)
            assert list(out_a["r"].token_ids) == reference_outputs[ia]
            assert c.get_request("cond-a").prefill_worker != ""
    finally:
        finish_stack(s)


def test_a_client_with_retries_waits_out_a_full_queue_as_the_router_hints(small_queue_stack):
    stack = small_queue_stack
    refused = "splitserve_requests_refused_total{reason=queue_full}"
    router_metrics = stack.proc("router").metrics_address
    with prefill_paused(stack):  # on leaving, the queue drains; a retry after the 500 ms hint gets in

        def filler(i):
            with Client(stack.router_address) as c:
                c.generate(f"Filler {i}.", max_tokens=2, ignore_eos=True, timeout=120)

        fill = [threading.Thread(target=filler, args=(i,)) for i in range(6)]
        for t in fill:
            t.start()
        wait_for(lambda: admission_counts(stack)[0] == 6, what="the queue at its refusal point")
        with Client(stack.router_address) as plain, pytest.raises(grpc.RpcError) as e:
            plain.generate("No retries.", max_tokens=2)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        before = scrape(router_metrics)[refused]
        result = {}

        def retrying():
            with Client(stack.router_address, retries=4) as c:
                result["r"] = c.generate("With retries.", max_tokens=2, ignore_eos=True, timeout=60)

        t = threading.Thread(target=retrying)
        t.start()
        wait_for(lambda: scrape(router_metrics)[refused] > before, what="the retrying client refused once")
    t.join(30)
    assert len(result["r"].token_ids) == 2
    for f in fill:
        f.join(60)
    with pytest.raises(ValueError, match="retries"):
        Client(stack.router_address, retries=5)


def test_flood_is_refused_fast_and_admitted_requests_complete(small_queue_stack):
    stack = small_queue_stack
    # With prefill stopped, the queue fills at 80% of 8 = 6 requests; the rest must be refused at once.
    # High priority (< 0) may use the headroom up to the bound itself, and is prefilled first.
    with prefill_paused(stack):
        outcomes = {}
        lock = threading.Lock()

        def one(rid, priority=0):
            t = time.perf_counter()
            try:
                with Client(stack.router_address) as c:
                    r = c.generate(
                        f"Flood request {rid}.",
                        max_tokens=8,
                        ignore_eos=True,
                        timeout=120,
                        request_id=rid,
                        priority=priority,
                    )
                res = ("ok", time.perf_counter() - t, len(r.token_ids), None)
            except grpc.RpcError as e:
                md = dict(e.trailing_metadata() or ())
                res = (e.code().name, time.perf_counter() - t, 0, md)
            with lock:
                outcomes[rid] = res

        def codes(prefix):
            with lock:
                return [o[0] for rid, o in outcomes.items() if rid.startswith(prefix)]

        threads = [threading.Thread(target=one, args=(f"normal-{i}",)) for i in range(40)]
        for t in threads:
            t.start()
        wait_for(
            lambda: codes("normal").count("RESOURCE_EXHAUSTED") >= 34,
            timeout=60,
            what="refusals while the queue is full",
        )
        high = [threading.Thread(target=one, args=(f"high-{i}", -1)) for i in range(3)]
        for t in high:
            t.start()
        wait_for(lambda: codes("high").count("RESOURCE_EXHAUSTED") >= 1, timeout=60, what="a refusal at the bound")
    for t in threads + high:
        t.join(120)
    assert set(codes("")) <= {"ok", "RESOURCE_EXHAUSTED"}
    assert codes("normal").count("ok") == 6 and codes("normal").count("RESOURCE_EXHAUSTED") == 34
    assert codes("high").count("ok") == 2 and codes("high").count("RESOURCE_EXHAUSTED") == 1
    assert all(o[2] == 8 for o in outcomes.values() if o[0] == "ok")  # every admitted request completed
    refused = [o for o in outcomes.values() if o[0] == "RESOURCE_EXHAUSTED"]
    assert all(o[3].get("retry-after-ms") for o in refused)
    assert sorted(o[1] for o in refused)[len(refused) // 2] < 1.0  # refusals are fast (median)
    # The high jobs were pulled before the normal ones still in the queue. At most one normal
    # job may go first: a read that was blocked when the worker stopped takes the first one.
    with Client(stack.router_address) as c:
        start = {rid: c.get_request(rid).timestamps["prefill_start"] for rid, o in outcomes.items() if o[0] == "ok"}
    first_high = min(t for rid, t in start.items() if rid.startswith("high"))
    assert sum(t < first_high for rid, t in start.items() if rid.startswith("normal")) <= 1, start
    assert all(p.popen.poll() is None for p in stack.procs)


def test_prefill_holds_one_forward_of_work_and_high_priority_joins_at_the_next_forward(mixed_workload):
    # 256-token forwards, 320-token prompts: a worker holding its token budget of work holds
    # at most two prompts (the one finishing and the next), and pulls again at every forward.
    stack = start_stack(prefill_token_budget=256, prefill_batch=32, max_queue_requests=64, max_queue_tokens=1 << 20)
    try:
        ids = [t for it in mixed_workload[:6] for t in it["prompt_token_ids"]]
        assert len(ids) >= 900
        prompts = {f"normal-{i}": ids[i * 50 : i * 50 + 320] for i in range(8)} | {"high": ids[560:880]}
        done = {}

        def one(rid, priority=0):
            with Client(stack.router_address) as c:
                done[rid] = c.generate(
                    token_ids=prompts[rid],
                    max_tokens=2,
                    ignore_eos=True,
                    timeout=120,
                    request_id=rid,
                    priority=priority,
                )

        with Client(stack.router_address) as c:
            normal = [threading.Thread(target=one, args=(rid,)) for rid in prompts if rid != "high"]
            with prefill_paused(stack):
                for t in normal:
                    t.start()
                wait_for(lambda: all(state_of(c, f"normal-{i}") == "queued" for i in range(8)), what="8 queued")
            # The high job arrives once the worker is busy with the normal ones.
            wait_for(
                lambda: any(state_of(c, f"normal-{i}") != "queued" for i in range(8)),
                interval=0.01,
                what="a normal job pulled",
            )
            high = threading.Thread(target=one, args=("high", -1))
            high.start()
            for t in normal + [high]:
                t.join(120)
            assert sorted(done) == sorted(prompts) and all(len(r.token_ids) == 2 for r in done.values())
            ts = {rid: c.get_request(rid).timestamps for rid in prompts}
        # Held at once: picked up and not yet prefilled. Pulling by job count alone took all 8.
        held = max(
            sum(t["prefill_start"] <= s["prefill_start"] < t["prefill_end"] for t in ts.values()) for s in ts.values()
        )
        assert held <= 3, ts
        # Pulled at the next forward, ahead of the normal jobs still in the stream.
        end = {rid: t["prefill_end"] for rid, t in ts.items()}
        assert sum(end[rid] > end["high"] for rid in prompts if rid != "high") >= 5, end
    finally:
        finish_stack(stack)


def test_requests_whose_deadline_passes_while_redis_runs_their_admission_return_their_queue_counts():
    """A request whose deadline passes while Redis runs its admission (a slow Redis, here stopped):
    the script runs once Redis goes on, admitting it. Guards against: the router's cancelled task dropped
    the answer, so the counts of a request its decode worker prefills (colocated here) were never
    returned: six such requests left six in the queue's counts for good (a soak left twelve after
    eight stops of 1.5 s), and a full queue refused requests that nothing held."""
    s = start_stack(mode="colocated", prefill=0)
    try:
        with Client(s.router_address) as c, cf.ThreadPoolExecutor(6) as pool:
            list(pool.map(lambda i: c.generate(f"warm {i}", max_tokens=1), range(6)))  # Redis connections, idle
            os.kill(s.redis_proc.pid, signal.SIGSTOP)
            try:
                cut = [pool.submit(c.generate, f"Cut off {i}", max_tokens=1, timeout=0.5) for i in range(6)]
                for f in cut:
                    with pytest.raises(grpc.RpcError) as e:
                        f.result()
                    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            finally:
                os.kill(s.redis_proc.pid, signal.SIGCONT)
            local = lambda: int(s.redis().hget(s.keys.admission, LOCAL_FIELD) or 0)  # noqa: E731
            wait_for(
                lambda: admission_counts(s) == [0, 0] and local() == 0,
                timeout=10,
                what="the cut-off requests' queue counts returned",
            )
            assert len(c.generate("And then", max_tokens=2, ignore_eos=True).token_ids) == 2
    finally:
        finish_stack(s)


def test_a_request_that_finds_no_decode_worker_registered_waits_for_one_to_register():
    """The registry empty for a moment (a Redis stall longer than the workers' lease lapses every
    entry at once, and a worker writes its entry again up to a heartbeat after): a request then
    waits for a worker to register, up to two heartbeats. Guards against: it failed UNAVAILABLE "no decode
    worker is registered" at once (a CI run's request did, right after a stall of Redis)."""
    # heartbeats of 1 s: the worker, stopped, must write its entry again within the request's wait
    # once it goes on, and a loaded machine took longer than the 0.5 s of the other tests' heartbeats
    s = start_stack(mode="colocated", prefill=0, heartbeat_s=1.0)
    try:
        with Client(s.router_address) as c, cf.ThreadPoolExecutor(1) as pool:
            assert len(c.generate("warm", max_tokens=1).token_ids) == 1
            r = s.redis()
            worker = s.proc("decode-0").popen.pid
            os.kill(worker, signal.SIGSTOP)  # its heartbeat cannot write its entry again meanwhile
            try:
                for key in r.scan_iter(match=s.keys.worker_pattern("decode")):
                    r.delete(key)  # as if its lease had lapsed
                wait_for(
                    lambda: scrape(s.proc("router").metrics_address)["splitserve_decode_workers"] == 0,
                    what="the router read the empty registry",
                )
                late = pool.submit(c.generate, "Placed once it is back", max_tokens=2, ignore_eos=True, timeout=30)
                wait_for(
                    lambda: scrape(s.proc("router").metrics_address)["splitserve_requests_in_flight"] == 1,
                    interval=0.01,
                    what="the request at the router",
                )
                time.sleep(s.settings.heartbeat_s / 4)
                assert not late.done()
            finally:
                os.kill(worker, signal.SIGCONT)
            assert len(late.result().token_ids) == 2
            # None registers within the wait: the request fails so, a wait later, not at its deadline.
            wait_for(
                lambda: scrape(s.proc("router").metrics_address)["splitserve_decode_workers"] == 1,
                what="the router's gauge past the first empty read",
            )
            os.kill(worker, signal.SIGSTOP)
            try:
                for key in r.scan_iter(match=s.keys.worker_pattern("decode")):
                    r.delete(key)
                wait_for(
                    lambda: scrape(s.proc("router").metrics_address)["splitserve_decode_workers"] == 0,
                    what="the router read the empty registry",
                )
                t0 = time.monotonic()
                with pytest.raises(grpc.RpcError) as e:
                    c.generate("None comes", max_tokens=2, timeout=30)
                waited = time.monotonic() - t0
            finally:
                os.kill(worker, signal.SIGCONT)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "no decode worker is registered" in e.value.details()
            assert 2 * s.settings.heartbeat_s <= waited < 10, waited
    finally:
        finish_stack(s)


def test_a_job_queued_alone_is_picked_up_beside_its_forward_and_dropped_if_it_ended(stack, client):
    """An idle prefill worker starts the forward of a job that was queued alone and runs its pickup
    beside it. A request that ended in the queue meanwhile is dropped after that forward: no
    first token goes out, its KV is freed, the entry is acked and its admission counts come back
    once. One that did not end is served as usual."""
    from splitserve_proto.v1 import worker_pb2_grpc

    r, p = stack.redis(), stack.keys.prefix
    stream = f"{p}:prefill"
    dec, pre = workers(stack, "decode")[0], workers(stack, "prefill")[0]

    def jobs(m, outcome):
        return m.get(f"splitserve_prefill_jobs_total{{outcome={outcome}}}", 0)

    def firsts():
        return sum(v for k, v in scrape(dec["metrics"]).items() if k.startswith("splitserve_first_tokens_total"))

    ids = [1, 504, 3277, 28, 8296, 30]
    before, m0, f0 = admission_counts(stack), scrape(pre["metrics"]), firsts()
    with grpc.insecure_channel(dec["address"]) as ch:
        stub = worker_pb2_grpc.DecodeWorkerStub(ch)
        gone = admitted_by_hand(stack, stub, "alone-ended", len(ids))
        r.hset(f"{p}:req:alone-ended", "state", "cancelled")  # as Abort leaves it, before any pickup
        r.xadd(stream, {"job": json.dumps(job_json(dec, "alone-ended", ids)), "tokens": str(len(ids)), "queued": "1"})
        wait_for(
            lambda: jobs(scrape(pre["metrics"]), "skipped_cancelled") == jobs(m0, "skipped_cancelled") + 1,
            what="the ended job skipped",
        )
        wait_for(lambda: r.xlen(stream) == 0 and r.xpending(stream, "prefill")["pending"] == 0, what="its entry acked")
        wait_for(lambda: admission_counts(stack) == before, what=f"admission counts back to {before}")
        assert r.hget(f"{p}:req:alone-ended", "state") == b"cancelled"
        assert firsts() == f0, "a first token went out for a request that had ended"
        steps = scrape(pre["metrics"])["splitserve_engine_steps_total"]
        assert steps == m0["splitserve_engine_steps_total"] + 1, "its forward did not run beside its pickup"
        gone.cancel()
        served = admitted_by_hand(stack, stub, "alone-served", len(ids))
        r.xadd(stream, {"job": json.dumps(job_json(dec, "alone-served", ids)), "tokens": str(len(ids)), "queued": "1"})
        events = list(served)
    assert sum(len(e.token_ids) for e in events) == 3 and events[-1].finish_reason == "length", events
    assert list(client.generate(token_ids=ids, max_tokens=3, ignore_eos=True).token_ids) == [
        t for e in events for t in e.token_ids
    ]
    wait_for(lambda: admission_counts(stack) == before, what=f"admission counts back to {before}")
    wait_for(lambda: kv_idle(stack), timeout=20, what="KV blocks and arena regions back to zero")


def test_a_job_pulled_by_a_worker_that_died_before_picking_it_up_returns_its_counts_once(stack, client):
    """A worker that read a job and died before its pickup never returned the job's admission
    counts; the worker that claims it must, once, and serve it."""
    from splitserve_proto.v1 import worker_pb2_grpc

    r = stack.redis()
    p = stack.keys.prefix
    stream = f"{p}:prefill"
    dec = workers(stack, "decode")[0]
    ch = grpc.insecure_channel(dec["address"])
    before = admission_counts(stack)
    ids = [1, 504, 3277, 28, 8296, 30, 17]
    decode = admitted_by_hand(stack, worker_pb2_grpc.DecodeWorkerStub(ch), "ghosted", len(ids))
    # queued and read by a consumer that then "dies", in one step, so no live worker reads it first
    r.eval(
        "redis.call('XADD', KEYS[1], '*', 'job', ARGV[1], 'tokens', ARGV[2]) "
        "return redis.call('XREADGROUP', 'GROUP', 'prefill', 'ghost', 'COUNT', 1, 'STREAMS', KEYS[1], '>')",
        1,
        stream,
        json.dumps(job_json(dec, "ghosted", ids)),
        len(ids),
    )
    assert admission_counts(stack) == [before[0] + 1, before[1] + len(ids)]
    events = list(decode)  # claimed after claim_idle_ms by the live worker, then served
    ch.close()
    assert sum(len(e.token_ids) for e in events) == 3 and events[-1].finish_reason == "length", events
    wait_for(lambda: admission_counts(stack) == before, what=f"admission counts back to {before}")
    r.xgroup_delconsumer(stream, "prefill", "ghost")


def test_admission_counts_never_go_below_zero(stack):
    """A job with no 'left the queue' marker on its hash (one picked up by an older worker) may be
    picked up again; the counts stop at zero instead of going negative, which would raise the bound."""
    from splitserve.service.redis_scripts import SOURCES
    from splitserve.service.redis_state import Keys

    r = stack.redis()
    keys = Keys(f"{stack.settings.redis_prefix}-clamp")
    try:
        r.hset(keys.req("old"), mapping={"state": "queued", "prompt_tokens": 5})
        r.hset(keys.admission, mapping={"requests": 0, "tokens": 3})
        pickup = r.register_script(SOURCES["pickup"])
        assert pickup(keys=[keys.admission, keys.req("old")], args=[5, 0, time.time(), "w", 0]) == b"prefilling"
        assert r.hmget(keys.admission, "requests", "tokens") == [b"0", b"0"]
        assert r.hget(keys.req("old"), "dequeued") == b"1"
        r.hset(keys.admission, mapping={"requests": 2, "tokens": 10})  # a second pickup returns nothing
        pickup(keys=[keys.admission, keys.req("old")], args=[5, 0, time.time(), "w", 0])
        assert r.hmget(keys.admission, "requests", "tokens") == [b"2", b"10"]
    finally:
        r.delete(keys.req("old"), keys.admission)


def test_with_no_prefill_worker_registered_the_decode_worker_prefills_and_a_returning_one_takes_over():
    """Disaggregated, with every prefill worker gone (killed, its lease run out), a new request is
    prefilled by its decode worker (LOCAL_PREFILL_WITHOUT_PREFILL_WORKERS, on by default) and
    gives the same greedy output; guards against: it waited in the queue for a prefill worker until its
    deadline. A prefill worker that registers again takes the next request."""
    s = start_stack(local_prefill_without_prefill_workers=True)
    prompt = "The capital of France is"
    try:
        with Client(s.router_address) as c:
            first = c.generate(prompt, max_tokens=8, ignore_eos=True, request_id="before")
            assert c.get_request("before").prefill_worker.startswith("prefill-0")
            s.proc("prefill-0").popen.kill()
            s.proc("prefill-0").popen.wait()
            wait_for(lambda: not workers(s, "prefill"), timeout=10, what="the prefill worker's lease run out")
            time.sleep(s.settings.heartbeat_s)  # the router reads the registry every half heartbeat
            alone = c.generate(prompt, max_tokens=8, ignore_eos=True, request_id="without", timeout=20)
            assert list(alone.token_ids) == list(first.token_ids)
            info = c.get_request("without")
            assert info.state == "finished" and info.prefill_worker == "" and info.kv_transport == ""

            s.restart("prefill-0")
            wait_for(lambda: workers(s, "prefill"), timeout=10, what="the prefill worker registered again")
            time.sleep(s.settings.heartbeat_s)
            again = c.generate(prompt, max_tokens=8, ignore_eos=True, request_id="after")
            assert list(again.token_ids) == list(first.token_ids)
            assert c.get_request("after").prefill_worker.startswith("prefill-0")
    finally:
        finish_stack(s)


def test_requests_queued_when_the_last_prefill_worker_hangs_are_taken_back_and_prefilled_by_their_decode_worker():
    """Requests queued for the only prefill worker when it hangs (SIGSTOP: it stops pulling and its
    lease runs out) are taken back by their router once no prefill worker is registered, and
    their decode worker prefills them: the same greedy output, their queue time reported. Before,
    they waited for a prefill worker until their deadlines. The worker, resumed, skips their jobs
    (taken_back), the queue's counts come back to zero (finish_stack), and it takes the next request."""
    s = start_stack(local_prefill_without_prefill_workers=True, heartbeat_s=1.0)  # a lease of 3 s to queue in
    prompts = ["The capital of France is", "Write a haiku about autumn.", "1, 2, 3, 4,", "Tell me about owls."]
    try:
        with Client(s.router_address) as c:
            ref = [list(c.generate(p, max_tokens=8, ignore_eos=True).token_ids) for p in prompts]
            pre = workers(s, "prefill")[0]
            with prefill_paused(s):
                t_paused = time.monotonic()
                with cf.ThreadPoolExecutor(len(prompts)) as ex:
                    futs = [
                        ex.submit(c.generate, p, max_tokens=8, ignore_eos=True, request_id=f"taken-{i}", timeout=30)
                        for i, p in enumerate(prompts)
                    ]
                    wait_for(
                        lambda: all(state_of(c, f"taken-{i}") for i in range(len(prompts))),
                        timeout=5,
                        interval=0.02,
                        what="all four admitted",
                    )
                    assert time.monotonic() - t_paused < 3 * s.settings.heartbeat_s, "admitted after the lease ran out"
                    got = [f.result() for f in futs]
                assert [list(g.token_ids) for g in got] == ref
                for i, g in enumerate(got):
                    info = c.get_request(f"taken-{i}")
                    assert info.state == "finished" and info.prefill_worker == "" and info.kv_transport == ""
                    assert "taken_back" in info.timestamps  # queued for a prefill worker, then taken back
                    assert g.timings.queue_ms >= 1000 * (info.timestamps["taken_back"] - info.timestamps["admitted"])
                router = scrape(s.proc("router").metrics_address)
                assert router["splitserve_requests_taken_back_total"] == len(prompts)
            skipped = lambda: scrape(pre["metrics"]).get("splitserve_prefill_jobs_total{outcome=taken_back}", 0)  # noqa: E731
            wait_for(lambda: skipped() == len(prompts), timeout=10, what="the resumed worker skipping the four jobs")
            wait_for(lambda: workers(s, "prefill"), timeout=10, what="the prefill worker registered again")
            time.sleep(s.settings.heartbeat_s)  # the router reads the registry every half heartbeat
            again = c.generate(prompts[0], max_tokens=8, ignore_eos=True, request_id="after")
            assert list(again.token_ids) == ref[0]
            assert c.get_request("after").prefill_worker.startswith("prefill-0")
    finally:
        finish_stack(s)


def test_a_bursts_refusals_come_from_the_local_view_and_the_admitted_count_is_exact(small_queue_stack):
    """With prefill stopped, 30 calls at once from one asyncio client, two of them invalid: once the
    first admissions have answered, the router's local view (the counts they returned, and its
    admissions in flight) refuses the rest without a Redis call. Exactly 6 are admitted (80% of 8),
    as the admission script alone would (the invalid calls take no place); they complete once
    prefill goes on, and the admitting count returns to zero."""
    import asyncio
    import contextlib

    from splitserve.client import AsyncClient

    stack = small_queue_stack
    router = stack.proc("router").metrics_address
    before = scrape(router).get("splitserve_local_refusals_total", 0)

    async def burst(paused: contextlib.ExitStack):
        async with AsyncClient(stack.router_address) as c:

            async def one(i):
                ids = [70000] if i < 2 else [11 + i, 12, 13]  # 70000: past the vocabulary
                try:
                    return len((await c.generate(token_ids=ids, max_tokens=3, ignore_eos=True, timeout=120)).token_ids)
                except grpc.RpcError as e:
                    return e.code().name

            calls = [asyncio.ensure_future(one(i)) for i in range(30)]
            t = time.monotonic()
            while sum(f.done() for f in calls) < 24 and time.monotonic() - t < 60:  # all but the 6 admitted
                await asyncio.sleep(0.02)
            paused.close()  # prefill goes on: the admitted ones complete
            return [await f for f in calls]

    with contextlib.ExitStack() as paused:
        paused.enter_context(prefill_paused(stack))
        got = asyncio.run(burst(paused))
    # (an invalid call handled once the queue is full is refused before it is validated)
    assert set(got[:2]) <= {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"} and set(got[2:]) <= {3, "RESOURCE_EXHAUSTED"}, got
    assert got.count(3) == 6, got
    metrics = scrape(router)
    assert metrics["splitserve_local_refusals_total"] - before >= 10, (metrics, got)
    assert metrics["splitserve_requests_admitting"] == 0
