"""Draining: a router or worker sent SIGTERM finishes its streams, and what its drain leaves
is cut off as the rest was."""

import concurrent.futures as cf
import os
import signal
import threading
import time

import grpc
import pytest
from service_helpers import scrape, wait_for, workers

from splitserve.client import Client

from .common import finish_stack, resuming_on_a_stopped_worker, stack_redis_hget, start_stack, state_of, stopped_process


def test_a_request_admitted_after_its_routers_drain_ran_out_is_cut_off_as_the_others_were():
    """A router's drain cut off the requests it held, but not one still in admission (its decode
    worker had not accepted it: a padded batch running there, or a stopped worker): admitted after
    the cut, it ran on until gRPC's grace (DRAIN_S + 5 s) ended it, "Cancelling all calls",
    recorded cancelled as if its client had gone (a soak under static batching). Now it is cut off
    as it comes out of admission: UNAVAILABLE "router ... stopped before this request finished",
    recorded failed, so a resuming client sends it again at once."""
    s = start_stack(mode="colocated", prefill=0, drain_s=0.5)
    try:
        with Client(s.router_address) as c, cf.ThreadPoolExecutor(1) as pool:
            assert len(c.generate("warm", max_tokens=1).token_ids) == 1
            worker, router = s.proc("decode-0").popen.pid, s.proc("router")
            with stopped_process(worker):  # it cannot accept the stream meanwhile
                late = pool.submit(
                    lambda: list(
                        c.generate_stream(
                            "Accepted late", request_id="late", max_tokens=2000, ignore_eos=True, timeout=120
                        )
                    )
                )
                wait_for(
                    lambda: scrape(router.metrics_address)["splitserve_requests_in_flight"] == 1,
                    interval=0.01,
                    what="the request in admission",
                )
                _cut_off_as_the_drain_runs_out(s, late, router, worker)
        s.restart("router")
    finally:
        finish_stack(s)


def _cut_off_as_the_drain_runs_out(s, late: cf.Future, router, stopped: int) -> None:
    """The router is sent SIGTERM while stream `late` ("late") waits on the decode worker stopped
    (pid `stopped`); once its drain has run out, the worker goes on. The stream must fail at once,
    cut off by the router, which exits 0, and the request is recorded failed."""
    try:
        router.popen.send_signal(signal.SIGTERM)
        time.sleep(s.settings.drain_s + 1.0)  # the drain ran out; its cut-off is done
        assert router.popen.poll() is None and not late.done()
    finally:
        os.kill(stopped, signal.SIGCONT)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        late.result(timeout=60)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
    assert "stopped before this request finished" in e.value.details(), e.value.details()
    assert time.monotonic() - t0 < 3.0  # at once, not at the grace's end
    assert router.popen.wait(30) == 0
    assert stack_redis_hget(s, "late", "state") == "failed"


def test_a_request_resuming_as_its_routers_drain_runs_out_is_cut_off_as_the_others_were():
    """A stream whose decode worker is killed resumes on the other, which is stopped: it cannot
    accept the stream. The router is sent SIGTERM meanwhile, and its drain runs out. Its cut-off
    cancelled the call to the worker that was lost, not the new one: when the other worker went on,
    the stream ran on until gRPC's grace ended it, "Cancelling all calls". Now it is cut off as the
    resume ends, as the others were."""
    s = start_stack(mode="colocated", prefill=0, decode=2, drain_s=0.5)
    down = []
    try:
        with Client(s.router_address) as c, cf.ThreadPoolExecutor(1) as pool:
            assert len(c.generate("warm", max_tokens=1).token_ids) == 1
            router = s.proc("router")
            with resuming_on_a_stopped_worker(s, c, pool, "late", "Resumed as its router stops", down) as (
                late,
                _,
                other,
            ):

                def resuming():
                    with open(router.log_path) as f:
                        return "resuming on " + other.name in f.read()

                wait_for(resuming, interval=0.01, what="the request resuming on the stopped worker")
                _cut_off_as_the_drain_runs_out(s, late, router, other.popen.pid)
        s.restart("router")
    finally:
        s.procs = [p for p in s.procs if p.name not in down]
        s.n_decode -= len(down)
        finish_stack(s)


def test_a_router_sent_sigterm_while_a_request_is_in_its_admission_waits_for_that_request():
    """A request the router's gRPC server took before the SIGTERM, still in admission (here Redis,
    stopped, holds its admission's script): the drain waits for it as for one generating. Before,
    the drain looked only at requests past admission, found none, and ended at once: the request
    was cut off as it came out of admission, UNAVAILABLE "its drain of 30 s ran out", 0.1 s later
    (a CI run's call under clients balanced over two routers did)."""
    s = start_stack(mode="colocated", prefill=0, heartbeat_s=1.0, drain_s=30.0)
    try:
        with Client(s.router_address) as c, cf.ThreadPoolExecutor(1) as pool:
            assert len(c.generate("warm", max_tokens=2, ignore_eos=True).token_ids) == 2  # a Redis connection, idle
            router = s.proc("router")
            with stopped_process(s.redis_proc.pid):
                held = pool.submit(c.generate, "Once upon a time", max_tokens=8, ignore_eos=True, timeout=60)
                time.sleep(0.3)  # in admission: its script waits for Redis
                router.popen.send_signal(signal.SIGTERM)
                time.sleep(0.5)  # the drain has begun
                assert not held.done()
            assert len(held.result(timeout=60).token_ids) == 8
            assert router.popen.wait(60) == 0
    finally:
        finish_stack(s)


def test_a_decode_worker_or_router_sent_sigterm_finishes_its_streams_and_no_request_sent_meanwhile_fails():
    """A rolling update stops a decode worker with SIGTERM while clients keep sending: its streams
    finish, and no request fails, though a router may place one there until it reads the registry
    again (half a heartbeat: 0.5 s here). The worker takes the streams opened in that time too.
    Then a router, under clients that balance over both routers as a Kubernetes Service's would."""
    # (decode_resumes=0: its last part is of a decode worker's stream cut at its drain's end, which
    # would otherwise resume on the other worker, as the test before this one shows)
    s = start_stack(decode=2, heartbeat_s=1.0, drain_s=60.0, routers=2, decode_resumes=0)
    try:
        time.sleep(2 * s.settings.heartbeat_s)  # placement by load needs a fresh registry read (see above)
        long = {}

        def run_long(i):
            with Client(s.router_address) as cc:
                long[i] = cc.generate(
                    f"Story number {i}:", max_tokens=100, ignore_eos=True, request_id=f"long{i}", timeout=240
                )

        threads = [threading.Thread(target=run_long, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        with Client(s.router_address) as c:
            wait_for(
                lambda: (
                    {
                        c.get_request(f"long{i}").decode_worker.rsplit("-", 1)[0]
                        for i in range(4)
                        if state_of(c, f"long{i}") == "decoding"
                    }
                    == {"decode-0", "decode-1"}
                ),
                timeout=120,
                interval=0.1,
                what="long streams decoding on both workers",
            )
        short, stop = [], threading.Event()

        def run_short(k):  # closed loop: one request after another until told to stop
            with Client(s.router_address) as cc:
                n = 0
                while not stop.is_set():
                    rid = f"short{k}-{n}"
                    try:
                        r = cc.generate("Hi", max_tokens=2, ignore_eos=True, request_id=rid, timeout=120)
                        short.append((rid, time.time(), "OK", len(r.token_ids)))
                    except grpc.RpcError as e:
                        short.append((rid, time.time(), e.code().name, e.details()))
                    n += 1

        loaders = [threading.Thread(target=run_short, args=(k,)) for k in range(4)]
        for t in loaders:
            t.start()
        time.sleep(2.0)
        victim = s.proc("decode-0")
        # A FirstTokens stream open to it, as a prefill worker keeps one: its stop ends the stream OK
        # (guards against: the stream held its gRPC server's stop for the whole grace, then was cut:
        # UNAVAILABLE "Cancelling all calls")
        import queue

        from splitserve_proto.v1 import worker_pb2_grpc

        held_open, nothing = grpc.insecure_channel(victim.address), queue.SimpleQueue()
        first_tokens = worker_pb2_grpc.DecodeWorkerStub(held_open).FirstTokens.future(iter(nothing.get, None))
        t_term = time.time()
        victim.popen.send_signal(signal.SIGTERM)
        time.sleep(4 * s.settings.heartbeat_s)
        stop.set()
        for t in loaders + threads:
            t.join(240)
        assert victim.popen.wait(120) == 0
        nothing.put(None)  # (its sending thread waits for a message)
        assert first_tokens.code() == grpc.StatusCode.OK, first_tokens.details()
        held_open.close()
        assert sorted(long) == list(range(4)) and all(len(r.token_ids) == 100 for r in long.values())
        assert [x for x in short if x[2:] != ("OK", 2)] == []
        with Client(s.router_address) as c:
            after = [c.get_request(rid).decode_worker.rsplit("-", 1)[0] for rid, t, *_ in short if t > t_term]
        assert len(after) >= 8 and after[-4:] == ["decode-1"] * 4, after  # the last ones all on the survivor

        # A router: its streams finish, new calls go to the other (gRPC retries those it refused
        # unseen), and it exits 0.
        target = "ipv4:" + ",".join(s.router_addresses)
        calls, stop = [], threading.Event()

        def run_balanced():
            with Client(target, balance=True) as cc:  # round robin over the addresses
                while not stop.is_set():
                    t0 = time.time()
                    try:
                        r = cc.generate("Once upon a time", max_tokens=40, ignore_eos=True, timeout=120)
                        calls.append((t0, time.time(), "OK", len(r.token_ids)))
                    except grpc.RpcError as e:
                        calls.append((t0, time.time(), e.code().name, e.details()))

        loaders = [threading.Thread(target=run_balanced) for _ in range(4)]
        for t in loaders:
            t.start()
        wait_for(lambda: len(calls) >= 4, timeout=120, what="calls through both routers")
        router = s.proc("router-1")
        t_term = time.time()
        router.popen.send_signal(signal.SIGTERM)
        assert router.popen.wait(120) == 0
        # (a call is recorded once it ends: those in flight at the SIGTERM may end just before the exit)
        wait_for(lambda: any(t0 > t_term for t0, *_ in calls), timeout=60, what="a call sent after the SIGTERM")
        stop.set()
        for t in loaders:
            t.join(240)
        assert [x for x in calls if x[2:] != ("OK", 40)] == []
        assert any(t0 < t_term < t1 for t0, t1, *_ in calls)  # calls in flight when it was stopped
        assert any(t0 > t_term for t0, *_ in calls)

        # A call still running when the router's drain is over fails UNAVAILABLE saying so, and is
        # recorded failed (gRPC's own cut said "Cancelling all calls", and the request "cancelled").
        s.router_env = {"SPLITSERVE_DRAIN_S": "1"}
        router = s.restart("router-1")
        cut = {}

        def run_cut(kind, rid=None, address=None):
            n, rid = 0, rid or f"cut-{kind[0]}"
            try:
                with Client(address or router.address) as cc:
                    if kind == "stream":
                        for chunk in cc.generate_stream(
                            "Once", max_tokens=1500, ignore_eos=True, request_id=rid, timeout=120
                        ):
                            n += len(chunk.token_ids)
                    else:
                        cc.generate("Once", max_tokens=1500, ignore_eos=True, request_id=rid, timeout=120)
                cut[rid if address else kind] = ("OK", n, "")
            except grpc.RpcError as e:
                cut[rid if address else kind] = (e.code().name, n, e.details())

        threads = [threading.Thread(target=run_cut, args=(k,)) for k in ("stream", "unary")]
        for t in threads:
            t.start()
        with Client(s.router_address) as c:
            wait_for(
                lambda: all(state_of(c, rid) == "decoding" for rid in ("cut-s", "cut-u")),
                timeout=60,
                what="both decoding",
            )
            router.popen.send_signal(signal.SIGTERM)
            assert router.popen.wait(60) == 0
            for t in threads:
                t.join(60)
            why = f"router router-1-{s.stack_id} stopped before this request finished (its drain of 1 s ran out)"
            assert cut["stream"][0] == cut["unary"][0] == "UNAVAILABLE" and cut["stream"][1] > 0, cut
            assert why in cut["stream"][2] and why in cut["unary"][2], cut
            for rid in ("cut-s", "cut-u"):
                info = c.get_request(rid)
                assert info.state == "failed" and why in info.error, info

            # The same for a decode worker's streams (gRPC's cut came as "... went away (Cancelling all
            # calls)", recorded failed without a word): each worker takes one of two long streams.
            s.decode_env = {"SPLITSERVE_DRAIN_S": "1"}
            victim = s.restart("decode-0")
            wait_for(lambda: len(workers(s, "decode")) == 2, timeout=30, what="decode-0 registered again")
            time.sleep(2 * s.settings.heartbeat_s)  # and read by the router
            cut.clear()
            threads = [
                threading.Thread(
                    target=run_cut, args=("stream",), kwargs={"rid": f"dcut{i}", "address": s.router_address}
                )
                for i in range(2)
            ]
            for t in threads:
                t.start()

            def on():  # decode worker -> the long stream decoding there
                return {
                    c.get_request(f"dcut{i}").decode_worker.rsplit("-", 1)[0]: f"dcut{i}"
                    for i in range(2)
                    if state_of(c, f"dcut{i}") == "decoding"
                }

            wait_for(lambda: len(on()) == 2, timeout=60, what="a long stream decoding on each worker")
            victim_rid, other_rid = on()["decode-0"], on()["decode-1"]
            victim.popen.send_signal(signal.SIGTERM)
            assert victim.popen.wait(60) == 0
            c.abort(other_rid)
            for t in threads:
                t.join(60)
            why = f"decode worker decode-0-{s.stack_id} stopped before this request finished (its drain of 1 s ran out)"
            code, n, details = cut[victim_rid]
            assert code == "UNAVAILABLE" and n > 0 and why in details, cut
            info = c.get_request(victim_rid)
            assert info.state == "failed" and why in info.error, info
    finally:
        s.procs = [p for p in s.procs if p.popen.poll() is None]  # decode-0 and router-1 are gone
        s.n_decode = len([p for p in s.procs if p.name.startswith("decode")])
        finish_stack(s)
