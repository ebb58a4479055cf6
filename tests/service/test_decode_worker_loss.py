"""A decode worker lost (killed, hung, stopped past its drain) mid-stream: its streams fail by
name or resume on another, unbroken, and the rest is served."""

import collections
import concurrent.futures as cf
import os
import signal
import threading
import time

import grpc
import pytest
from service_helpers import heartbeat, kv_idle, scrape, wait_for, workers

from splitserve.client import Client
from splitserve.observability import traceview

from .common import (
    finish_stack,
    outcome_in_thread,
    prefill_paused,
    resuming_on_a_stopped_worker,
    stack_redis_hget,
    start_stack,
    state_of,
)


def test_a_request_aborted_as_it_resumes_on_another_decode_worker_ends_cancelled():
    """An Abort that comes as a stream resumes on another decode worker (here stopped: it cannot
    accept the stream yet), after the resume was queued for a prefill: it cancelled the call to the
    worker that was lost, not the new one. Now the new call is cancelled as the resume ends, and the
    stream ends as aborted (finish_reason "cancelled")."""
    s = start_stack(decode=2)
    down = []
    try:
        with Client(s.router_address) as c, cf.ThreadPoolExecutor(1) as pool:
            assert len(c.generate("warm", max_tokens=1).token_ids) == 1
            with resuming_on_a_stopped_worker(s, c, pool, "aborted", "Aborted as it resumes", down) as (
                ended,
                got,
                other,
            ):
                wait_for(
                    lambda: stack_redis_hget(s, "aborted", "decode_worker").startswith(other.name + "-"),
                    interval=0.01,
                    what="the resume queued for the stopped worker",
                )
                assert c.abort("aborted").found
                time.sleep(0.5)
                assert not ended.done()
            ended.result(timeout=30)
            assert got[-1].finish_reason == "cancelled", [m.finish_reason for m in got[-5:]]
            assert c.get_request("aborted").state == "cancelled"
    finally:
        s.procs = [p for p in s.procs if p.name not in down]
        s.n_decode -= len(down)
        finish_stack(s)


def _six_streams_one_worker_lost(s, c, tag: str, victim: str, disrupt) -> None:
    """Six streams over two decode workers; `disrupt(proc)` on `victim` once both decode some. The
    victim's streams must end UNAVAILABLE naming it, and within a minute (their deadline is two);
    the other worker's must complete."""
    outcomes, tokens = {}, 80
    # The router places the six by the load in its last registry read, which can be a heartbeat
    # and a refresh older than what kv_idle() saw: a worker still shown busy gets none of them.
    time.sleep(2 * s.settings.heartbeat_s)

    def run(i):
        n = 0
        try:
            with Client(s.router_address) as cc:
                for chunk in cc.generate_stream(
                    f"Story number {i}:", max_tokens=tokens, ignore_eos=True, request_id=f"{tag}{i}", timeout=120
                ):
                    n += len(chunk.token_ids)
            outcomes[i] = ("OK", n, "")
        except grpc.RpcError as e:
            outcomes[i] = (e.code().name, n, e.details())

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()

    def both_decoding():
        infos = [c.get_request(f"{tag}{i}") for i in range(6) if state_of(c, f"{tag}{i}")]
        on = {i.decode_worker.rsplit("-", 1)[0] for i in infos if i.state == "decoding"}
        return on == {"decode-0", "decode-1"}

    try:
        wait_for(both_decoding, timeout=120, interval=0.1, what="requests decoding on both workers")
    except AssertionError as e:
        placed = {f"{tag}{i}": c.get_request(f"{tag}{i}").decode_worker for i in range(6)}
        raise AssertionError(f"{e}; placed: {placed}") from None
    disrupt(s.proc(victim))
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a stream on the lost worker waited for its deadline"
    on_victim = {i for i in range(6) if c.get_request(f"{tag}{i}").decode_worker.startswith(victim)}
    assert on_victim and len(on_victim) < 6
    for i, (code, n, details) in outcomes.items():
        if i in on_victim:  # retryable, naming the worker that went away
            assert code == "UNAVAILABLE" and f"decode worker {victim}-{s.stack_id}" in details, details
            assert c.get_request(f"{tag}{i}").state == "failed"
        else:
            assert (code, n) == ("OK", tokens)


def test_a_decode_worker_that_hangs_or_is_killed_fails_its_streams_by_name_and_the_rest_is_served():
    """With resuming off (decode_resumes=0; see the next test for it on)."""
    s = start_stack(decode=2, keepalive_s=1.0, decode_resumes=0)
    killed = False
    try:
        with Client(s.router_address) as c:
            # First, bursts right after a busy spell spread evenly: the second burst goes out as the
            # first ends, while the registry entries (a heartbeat old) still show the first's streams.
            for burst in range(3):
                rids = [f"b{burst}-{i}" for i in range(6)]
                with cf.ThreadPoolExecutor(6) as pool:
                    list(
                        pool.map(
                            lambda rid: c.generate(
                                "Once upon a time", max_tokens=24, ignore_eos=True, request_id=rid, timeout=120
                            ),
                            rids,
                        )
                    )
                placed = collections.Counter(c.get_request(rid).decode_worker.rsplit("-", 1)[0] for rid in rids)
                assert placed == {"decode-0": 3, "decode-1": 3}, (burst, placed)

            # Hung (SIGSTOP: its sockets stay open, nothing answers): the router's keepalive pings go
            # unanswered, so its streams end within ~2 s (not: they waited for their deadlines).
            def hang(p):
                os.kill(p.popen.pid, signal.SIGSTOP)
                try:
                    time.sleep(4.0)
                finally:
                    os.kill(p.popen.pid, signal.SIGCONT)

            _six_streams_one_worker_lost(s, c, "h", "decode-1", hang)
            wait_for(lambda: kv_idle(s), timeout=30, what="the resumed worker freed its dropped streams' KV")

            # Killed.
            def kill(p):
                nonlocal killed
                p.popen.kill()
                p.popen.wait()
                killed = True

            _six_streams_one_worker_lost(s, c, "k", "decode-0", kill)
            # Once the victim's lease has run out, every new request goes to the survivor.
            time.sleep(3 * s.settings.heartbeat_s + 0.5)
            assert all(
                len(c.generate("after", max_tokens=3, ignore_eos=True, timeout=60).token_ids) == 3 for _ in range(4)
            )
    finally:
        if killed:
            s.procs = [p for p in s.procs if p.name != "decode-0"]  # gone
            s.n_decode = 1
        finish_stack(s)


def test_a_handoff_failure_relayed_by_the_decode_worker_it_could_not_reach_resumes_the_request():
    """A prefill worker that could not reach a decode worker (stopped for a while) records the request
    failed (lost_to) and asks that worker to end its stream; once the worker goes on, it gets that
    Fail and ends the stream. The Fail says the handoff was lost (handoff_lost), the stream's event
    says so (worker_stopping), and the router resumes the request on the other worker. Guards against: the
    stream ended with the failure: UNAVAILABLE "KV handoff ... failed" (a soak: 2 of ~830). Here the
    prefill worker's record and Fail are made by hand, while the prefill workers are stopped."""
    from splitserve.service.redis_scripts import failed
    from splitserve_proto.v1 import worker_pb2 as w
    from splitserve_proto.v1 import worker_pb2_grpc

    s = start_stack(decode=2)
    try:
        with Client(s.router_address) as c:
            want = c.generate("Name a river.", max_tokens=8, ignore_eos=True, timeout=60)
            got = {}
            with prefill_paused(s):
                t = outcome_in_thread(
                    c.generate_stream(
                        "Name a river.", max_tokens=8, ignore_eos=True, request_id="relayed", timeout=120
                    ),
                    got,
                )
                wait_for(lambda: state_of(c, "relayed") == "queued", what="request queued")
                wid = c.get_request("relayed").decode_worker
                entry = next(e for e in workers(s, "decode") if e["worker_id"] == wid)
                message = f"KV handoff to decode worker {wid} failed: UNAVAILABLE: Stream removed (ping timeout)"
                r = s.redis()
                r.hset(s.keys.req("relayed"), mapping={**failed(grpc.StatusCode.UNAVAILABLE, message), "lost_to": wid})
                with grpc.insecure_channel(entry["address"]) as ch:
                    assert (
                        worker_pb2_grpc.DecodeWorkerStub(ch)
                        .Fail(
                            w.FailRequest(
                                request_id="relayed",
                                code=grpc.StatusCode.UNAVAILABLE.value[0],
                                message=message,
                                handoff_lost=True,
                            ),
                            timeout=10,
                        )
                        .ended
                    )
                wait_for(lambda: c.get_request("relayed").resumes == 1, what="the request resumed")
            t.join(60)
            assert got["code"] == "OK" and got["tokens"] == 8, got
            info = c.get_request("relayed")
            assert (info.state, info.resumes, info.error) == ("finished", 1, ""), info
            assert info.decode_worker != wid and got["ids"] == list(want.token_ids)
    finally:
        finish_stack(s)


def test_a_stream_aborted_through_another_router_as_its_decode_worker_is_lost_ends_cancelled():
    """An Abort through another router marks the request cancelled and asks its decode worker to end
    the stream; that worker is lost meanwhile (stopped, then killed), so the Cancel never reaches it,
    and the router holding the stream, seeing the worker lost, finds the request ended when it would
    resume it. It ends the stream as aborted (finish_reason "cancelled"), as for an Abort through
    itself. Guards against: it failed UNAVAILABLE "... could not resume on another: it has ended" (a soak,
    1 of ~900)."""
    s = start_stack(mode="colocated", prefill=0, decode=2, routers=2)
    down = None
    try:
        with Client(s.router_addresses[0]) as c, Client(s.router_addresses[1]) as other:
            stream = c.generate_stream(
                "Tell me a long story.", max_tokens=2000, ignore_eos=True, request_id="aborted-as-lost", timeout=120
            )
            chunks = iter(stream)
            next(chunks)
            wid = c.get_request("aborted-as-lost").decode_worker
            down = next(p for p in s.procs if wid == f"{p.name}-{s.stack_id}")
            os.kill(down.popen.pid, signal.SIGSTOP)
            with cf.ThreadPoolExecutor(1) as pool:
                aborted = pool.submit(other.abort, "aborted-as-lost")
                wait_for(lambda: c.get_request("aborted-as-lost").state == "cancelled", what="the Abort recorded")
                down.popen.kill()
                down.popen.wait()
                assert aborted.result(timeout=30).found
            rest = list(chunks)
            assert rest and rest[-1].finish_reason == "cancelled", rest[-1:]
            assert c.get_request("aborted-as-lost").state == "cancelled"
    finally:
        if down is not None:
            s.restart(down.name)
        finish_stack(s)


@pytest.mark.parametrize("how", ["killed", "stopped", "paused"])
def test_a_request_whose_handoff_breaks_as_its_decode_worker_is_lost_resumes_on_the_other(how):
    """A decode worker lost while a prefill worker hands it a request's KV (stopped first, so the
    handoff waits on it; then killed, or left stopped past the keepalive): the handoff breaks as the
    router's stream does, and the prefill worker records the request failed (UNAVAILABLE), often
    before the router, seeing the same loss, resumes it (DECODE_RESUMES). Guards against: that record ended
    the request (a soak: 2 of ~500 requests with decode workers killed, 5 of ~600 with one stopped
    for 3 s; the router's check of requests without a first token read it first); now it names the
    lost worker ('lost_to'), the router waits for its own stream to drop, and the request resumes.
    Stopped, the router's keepalive is the longer, so the prefill worker's failure comes first.
    Paused: the worker goes on once the prefill worker has given up, so the router's stream never
    drops, and the handoff never comes: past two of its keepalives the router cuts that stream and
    the request resumes all the same (a soak: 1 of ~900 failed UNAVAILABLE "KV handoff ... failed")."""
    s = start_stack(decode=2, keepalive_s=1.0, router_env={"SPLITSERVE_KEEPALIVE_S": "3"} if how != "killed" else {})
    down = None
    try:
        prompt = "Count with me: " + "one two three four five six seven eight " * 70
        with Client(s.router_address) as c:
            n = c.tokenize(prompt).count
            prefill = s.proc("prefill-0").metrics_address
            before = scrape(prefill).get("splitserve_engine_prefill_tokens_total", 0)
            got = {}

            def run():
                try:
                    got["r"] = c.generate(prompt, max_tokens=8, ignore_eos=True, request_id="lost-handoff", timeout=120)
                except grpc.RpcError as e:
                    got["r"] = e

            t = threading.Thread(target=run)
            t.start()

            def prefilling():
                try:
                    return (i := c.get_request("lost-handoff")).state == "prefilling" and i
                except grpc.RpcError:  # not admitted yet
                    return None

            info = wait_for(prefilling, what="its prefill")
            down = next(p for p in s.procs if info.decode_worker == f"{p.name}-{s.stack_id}")
            os.kill(down.popen.pid, signal.SIGSTOP)
            wait_for(
                lambda: scrape(prefill).get("splitserve_engine_prefill_tokens_total", 0) >= before + n,
                timeout=60,
                what="its prefill done",
            )
            time.sleep(0.5)  # its first token and handoff wait on the stopped worker
            if how == "killed":
                down.popen.kill()
            if how == "paused":
                # Gone on only once the prefill worker's Fail to it has failed too: a Fail it gets after
                # (handoff_lost) would resume the request itself, and this case is of the router's cut.
                def fail_given_up():
                    with open(s.proc("prefill-0").log_path) as f:
                        return "could not end lost-handoff's decode stream" in f.read()

                wait_for(
                    lambda: s.redis().hget(s.keys.req("lost-handoff"), "lost_to"),
                    timeout=30,
                    what="the prefill worker gave the handoff up",
                )
                wait_for(fail_given_up, timeout=30, what="the prefill worker's Fail to the stopped worker failed")
                os.kill(down.popen.pid, signal.SIGCONT)
            t.join(120)
            if how == "stopped":
                os.kill(down.popen.pid, signal.SIGCONT)
            r = got["r"]
            assert not isinstance(r, grpc.RpcError), f"{r.code().name}: {r.details()}"
            assert len(r.token_ids) == 8 and r.finish_reason == "length"
            info = c.get_request("lost-handoff")
            assert (info.state, info.resumes, info.error) == ("finished", 1, ""), info
        with open(s.proc("prefill-0").log_path) as f:  # the handoff did break
            assert "handoff of lost-handoff" in f.read()
        if how == "paused":
            with open(s.proc("router").log_path) as f:
                assert "this router's stream there is up: resuming it on another" in f.read()
    finally:
        if down is not None and how == "killed":
            s.restart(down.name)
        elif down is not None:
            os.kill(down.popen.pid, signal.SIGCONT)
        finish_stack(s)


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_a_request_placed_on_a_decode_worker_lost_before_it_accepts_the_stream_resumes_on_another(mode):
    """A decode worker killed, its registry entry not yet lapsed, and a router with no channel to it
    yet: a request placed there finds nothing at its address. It resumes on the other worker at once,
    with the tokens it would have had. Guards against: it failed UNAVAILABLE "decode worker ... went away"
    (a soak saw 1-3 a run). Disaggregated, its job was queued by then (a new leg supersedes it);
    colocated, it was not admitted yet."""
    import socket

    from splitserve.service.redis_state import WorkerInfo

    s = start_stack(decode=1, **({"mode": mode, "prefill": 0} if mode == "colocated" else {}))
    prompt = "Name three rivers of Europe, and say which is the longest."
    try:
        with Client(s.router_address) as c:
            want = c.generate(prompt, max_tokens=8, ignore_eos=True, timeout=60)
            held = c.generate_stream("Hold a stream open.", max_tokens=4000, ignore_eos=True, timeout=300)
            next(iter(held))  # decode-0 has a stream open: the router's least loaded worker is the ghost
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                address = f"127.0.0.1:{sock.getsockname()[1]}"  # nothing listens here once it is closed
            entry = workers(s, "decode")[0]
            heartbeat(
                s.redis(),
                s.keys,
                WorkerInfo(
                    worker_id="ghost",
                    role="decode",
                    address=address,
                    host_id="elsewhere",
                    free_kv_tokens=int(entry["free_kv_tokens"]),
                    kv_capacity_tokens=int(entry["kv_capacity_tokens"]),
                ),
                lease_s=60,
            )
            try:
                wait_for(
                    lambda: scrape(s.proc("router").metrics_address)["splitserve_decode_workers"] == 2,
                    what="the router read the ghost's entry",
                )
                resumed0 = scrape(s.proc("router").metrics_address).get("splitserve_requests_resumed_total", 0)
                got = c.generate(prompt, max_tokens=8, ignore_eos=True, request_id="placed-on-a-ghost", timeout=60)
                assert list(got.token_ids) == list(want.token_ids) and got.finish_reason == "length"
                info = c.get_request("placed-on-a-ghost")
                assert (info.state, info.resumes, info.error) == ("finished", 1, ""), info
                assert info.decode_worker == entry["worker_id"], info
                assert scrape(s.proc("router").metrics_address)["splitserve_requests_resumed_total"] - resumed0 == 1
            finally:
                s.redis().delete(s.keys.worker("decode", "ghost"))
                held.cancel()
        with open(s.proc("router").log_path) as f:
            assert "decode worker ghost lost" in f.read()
    finally:
        finish_stack(s)


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_a_stream_whose_decode_worker_is_killed_or_stops_past_its_drain_time_goes_on_on_another_unbroken(mode):
    """Streams of 100 tokens (greedy, sampled with a seed, and one of three seeded samples) over two
    decode workers. The worker holding the three samples is killed while each stream is part-way;
    later the one holding them then is sent SIGTERM with a drain time far shorter than its streams.
    Every stream still ends OK, and its tokens, text and log probabilities are those of an unbroken
    run: the router queued its prompt and the tokens sent so far for a prefill again (colocated, and
    the samples: the other worker prefilled them, each sample with its own tokens), and the other
    worker went on from there, sending only what is new. (A stop string that never comes holds text
    back: the client's text lags its tokens.)"""
    # Batch-invariant: a resumed stream's prefill of its tokens gives the logits of its unbroken run
    # bit for bit. Without it, they were ~1e-5 off (MKL rounds a row by the rows beside it), and a
    # sampled token that fell that near the edge of its draw differed: a fresh-clone CI run failed so.
    s = start_stack(
        decode=2,
        keepalive_s=1.0,
        drain_s=1.0,
        batch_invariant=True,
        **({"mode": mode, "prefill": 0} if mode == "colocated" else {}),
    )
    down = []  # the workers killed or stopped, started again at the end
    # greedy, and (odd streams) sampled with a seed: its generator goes on where it was; the last
    # stream is of three samples (sample j seeded seed + j)
    sps = [
        dict(
            max_tokens=100,
            ignore_eos=True,
            stop=["@@@@@@@@"],
            logprobs=0,
            **({"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.8, "seed": 100 + i}),
        )
        for i in range(6)
    ]
    sps[5]["n"] = 3
    try:
        prompts = [f"Tell me a story about the number {i}." for i in range(6)]
        with Client(s.router_address) as c, cf.ThreadPoolExecutor(6) as pool:  # side by side, as the rounds run
            want = {
                i: list(w.choices) or [w]
                for i, w in enumerate(pool.map(lambda i: c.generate(prompts[i], timeout=120, **sps[i]), range(6)))
            }
        assert len(want[5]) == 3 and len({tuple(w.token_ids) for w in want[5]}) == 3

        def run_round(tag: str, disrupt) -> dict:
            time.sleep(2 * s.settings.heartbeat_s)  # placement by load needs a fresh registry read
            # by stream, by sample: tokens, text, log probabilities; and by stream, its outcome
            got: dict[int, dict[int, list]] = {i: {j: [[], "", []] for j in range(len(want[i]))} for i in range(6)}
            outcome: dict[int, str] = {}

            def run(i):
                try:
                    with Client(s.router_address) as cc:
                        for chunk in cc.generate_stream(prompts[i], request_id=f"{tag}{i}", timeout=120, **sps[i]):
                            g = got[i][chunk.index]
                            g[0] += chunk.token_ids
                            g[1] += chunk.text
                            g[2] += [(lp.token_id, lp.logprob) for lp in chunk.logprobs]
                    outcome[i] = "OK"
                except grpc.RpcError as e:
                    outcome[i] = f"{e.code().name}: {e.details()}"

            threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
            for t in threads:
                t.start()
            with Client(s.router_address) as c:
                # Every stream has tokens out (one with none yet fails UNAVAILABLE: its client may retry
                # it, as nothing was sent) and is far from its end; both workers have some.
                seen = {}

                def part_way_on_both():
                    seen["tokens"] = {i: [len(g[0]) for g in got[i].values()] for i in range(6)}
                    seen["outcomes"] = dict(outcome)
                    if not all(5 <= len(g[0]) <= 50 for i in range(6) for g in got[i].values()):
                        return False
                    seen["on"] = {i: c.get_request(f"{tag}{i}").decode_worker for i in range(6)}
                    return {w.rsplit("-", 1)[0] for w in seen["on"].values()} == {"decode-0", "decode-1"}

                try:
                    wait_for(part_way_on_both, timeout=120, interval=0.02, what="streams part-way on both workers")
                except AssertionError as e:  # say how far each stream was, and where
                    raise AssertionError(f"{e}: {seen}") from None
                victim = c.get_request(f"{tag}5").decode_worker.rsplit("-", 1)[0]  # the samples' worker
                on_victim = {i for i in range(6) if c.get_request(f"{tag}{i}").decode_worker.startswith(victim)}
                down.append(victim)
                disrupt(s.proc(victim))
                for t in threads:
                    t.join(120)
                assert not any(t.is_alive() for t in threads)
                for i in range(6):
                    assert outcome.get(i) == "OK", (i, outcome.get(i))
                    for j, w in enumerate(want[i]):
                        tokens, text, logprobs = got[i][j]
                        assert tokens == list(w.token_ids) and text == w.text, (i, j)
                        assert [t for t, _ in logprobs] == [lp.token_id for lp in w.logprobs], (i, j)
                        # (after a resume, the KV was computed by a prefill: batch-invariant, bit for bit)
                        assert [x for _, x in logprobs] == [lp.logprob for lp in w.logprobs], (i, j)
                moved = {i for i in range(6) if not c.get_request(f"{tag}{i}").decode_worker.startswith(victim)}
                assert on_victim and on_victim <= moved, (on_victim, moved)
                assert {i for i in range(6) if c.get_request(f"{tag}{i}").resumes == 1} == on_victim
            return on_victim

        resumed0 = scrape(s.proc("router").metrics_address).get("splitserve_requests_resumed_total", 0)

        def kill(p):
            p.popen.kill()
            p.popen.wait()

        killed = run_round("k", kill)
        lost = len(killed)

        def one_trace_with_both_legs():  # the router's span tells of the resume; both Decode calls in it
            if not os.path.exists(s.settings.trace_file):
                return False
            spans = traceview.load_spans(s.settings.trace_file)
            rid = f"k{min(killed)}"
            ids = {sp.trace_id for sp in spans if sp.attrs.get("splitserve.request_id") == rid}
            if len(ids) != 1:
                return False
            trace = [sp for sp in spans if sp.trace_id in ids]
            calls = [sp for sp in trace if sp.name == "splitserve.v1.DecodeWorker/Decode" and sp.kind == "client"]
            return (
                len(calls) == 2
                and any(name == "resumed" for sp in trace for _, name in sp.events)
                and [sp.status.startswith("ERROR: UNAVAILABLE") for sp in sorted(calls, key=lambda x: x.start_ns)]
                == [True, False]
                and calls[1].attrs.get("splitserve.resumed_tokens", 0) >= 5
            )

        wait_for(one_trace_with_both_legs, timeout=20, what="one trace holding both decode calls and the resume")
        assert scrape(s.proc("router").metrics_address)["splitserve_requests_resumed_total"] - resumed0 == lost
        s.restart(down.pop())

        def terminate(p):
            p.popen.send_signal(signal.SIGTERM)
            assert p.popen.wait(60) == 0

        lost += len(run_round("t", terminate))
        assert scrape(s.proc("router").metrics_address)["splitserve_requests_resumed_total"] - resumed0 == lost
    finally:
        s.procs = [p for p in s.procs if p.name not in down]  # the one stopped last is gone
        s.n_decode -= len(down)
        finish_stack(s)
