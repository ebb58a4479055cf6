"""Legs of a resumed request: jobs of a superseded leg skipped, resumes capped, and a lost
decode worker kept from new requests until it is back."""

import collections
import concurrent.futures as cf
import os
import signal
import threading
import time

import grpc
import pytest
from service_helpers import scrape, wait_for, workers

from splitserve.client import Client

from .common import finish_stack, outcome_in_thread, prefill_paused, start_stack, state_of


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_worker_stuck_in_one_step_reports_not_serving_and_lets_its_lease_lapse(role):
    """A step that does not return leaves the process up: its health must say so (a liveness probe
    then restarts it) and its registry lease must lapse. A 1900-token prefill forward, with the
    limit at 1 s, stands in for a hung one (a decode worker's: colocated, it prefills itself);
    when it returns the worker serves again."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stall = {"SPLITSERVE_ENGINE_STALL_S": "1"}
    if role == "prefill":
        s = start_stack(prefill_env=stall)
    else:
        s = start_stack(mode="colocated", prefill=0, decode_env={**stall, "SPLITSERVE_MAX_NUM_BATCHED_TOKENS": "2048"})
    try:
        worker = s.proc(f"{role}-0")
        serving = health_pb2.HealthCheckResponse.SERVING
        with Client(s.router_address) as c, grpc.insecure_channel(worker.address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == serving
            out = {}
            t = outcome_in_thread(
                c.generate_stream(token_ids=list(range(100, 2000)), max_tokens=3, ignore_eos=True, timeout=120), out
            )
            seen = []

            def stalled_and_unregistered():
                seen.append(
                    (
                        health.Check(health_pb2.HealthCheckRequest(), timeout=10).status,
                        len(workers(s, role)),
                        scrape(worker.metrics_address)["splitserve_engine_stalled"],
                    )
                )
                return seen[-1] == (health_pb2.HealthCheckResponse.NOT_SERVING, 0, 1.0)

            wait_for(stalled_and_unregistered, timeout=60, interval=0.05, what="NOT_SERVING, unregistered, stalled")
            t.join(120)
            assert out["code"] == "OK" and out["tokens"] == 3, out
            wait_for(
                lambda: (
                    health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == serving
                    and len(workers(s, role)) == 1
                ),
                timeout=10,
                what="serving again",
            )
            assert scrape(worker.metrics_address)["splitserve_engine_stalled"] == 0
    finally:
        finish_stack(s)


def test_a_new_leg_waits_while_its_prefill_worker_still_hands_the_superseded_one_to_the_lost_worker():
    """A request queued for a decode worker that then hangs (SIGSTOP): the prefill worker takes it
    and hands its KV to the hung worker, a handoff that holds until the prefill worker's keepalive
    (3 s here) drops it. The router, whose keepalive is 1 s, resumes the request on the other
    decode worker first, and the new leg's job reaches the same prefill worker while the old leg's
    handoff is still in flight there: it waits for that one to go (deferred, counted), keeping its
    claim, then is prefilled and handed to the new worker. The stream ends OK with an unbroken
    run's tokens, and nothing is left held."""
    s = start_stack(decode=2, keepalive_s=1.0, prefill_env={"SPLITSERVE_KEEPALIVE_S": "3"})
    stopped = []
    sp = dict(max_tokens=24, ignore_eos=True, temperature=0.0)
    prompt = "Write a line about a paper boat."
    try:
        with Client(s.router_address) as c:
            want = list(c.generate(prompt, timeout=120, **sp).token_ids)
            got: dict = {}
            with prefill_paused(s):
                t = outcome_in_thread(c.generate_stream(prompt, request_id="defer", timeout=120, **sp), got)
                wait_for(lambda: state_of(c, "defer") == "queued", what="request queued")
                lost = c.get_request("defer").decode_worker.rsplit("-", 1)[0]
                os.kill(s.proc(lost).popen.pid, signal.SIGSTOP)
                stopped.append(lost)
            t.join(120)
            assert not t.is_alive() and got["code"] == "OK" and got["ids"] == want, got
            info = c.get_request("defer")
            assert info.resumes == 1 and not info.decode_worker.startswith(lost), info
            assert scrape(s.proc("prefill-0").metrics_address).get("splitserve_prefill_jobs_deferred_total") == 1
        os.kill(s.proc(stopped.pop()).popen.pid, signal.SIGCONT)
    finally:
        for name in stopped:
            os.kill(s.proc(name).popen.pid, signal.SIGCONT)
        finish_stack(s)


def test_a_new_leg_waiting_on_a_prefill_worker_sent_sigterm_is_given_up_with_its_held_jobs():
    """As above, a new leg's job waits on prefill-0 for the old leg's handoff to the hung decode
    worker (deferred), prefill-1 stopped meanwhile. prefill-0, sent SIGTERM (DRAIN_S 0), admits no
    deferred job in its drain: it gives that one up to the other workers with the jobs it held, not
    CLAIM_IDLE_MS (20 s here) after it went, and prefill-1, let go on, prefills it."""
    s = start_stack(
        prefill=2,
        decode=2,
        keepalive_s=1.0,
        claim_idle_ms=20000,
        prefill_env={"SPLITSERVE_KEEPALIVE_S": "3", "SPLITSERVE_DRAIN_S": "0"},
    )
    stopped = []
    sp = dict(max_tokens=24, ignore_eos=True, temperature=0.0)
    prompt = "Write a line about a paper kite."
    try:
        r = s.redis()
        os.kill(s.proc("prefill-1").popen.pid, signal.SIGSTOP)
        stopped.append("prefill-1")
        victim = s.proc("prefill-0")
        with Client(s.router_address) as c:
            want = list(c.generate(prompt, timeout=120, **sp).token_ids)
            got: dict = {}
            os.kill(victim.popen.pid, signal.SIGSTOP)
            t = outcome_in_thread(c.generate_stream(prompt, request_id="defer-term", timeout=120, **sp), got)
            wait_for(lambda: state_of(c, "defer-term") == "queued", what="request queued")
            lost = c.get_request("defer-term").decode_worker.rsplit("-", 1)[0]
            os.kill(s.proc(lost).popen.pid, signal.SIGSTOP)
            stopped.append(lost)
            os.kill(victim.popen.pid, signal.SIGCONT)
            wait_for(
                lambda: scrape(victim.metrics_address).get("splitserve_prefill_jobs_deferred_total") == 1,
                timeout=60,
                what="the new leg's job deferred on prefill-0",
            )
            victim.popen.send_signal(signal.SIGTERM)
            assert victim.popen.wait(60) == 0
            held = {
                e["message_id"]: e["time_since_delivered"]
                for st in (s.keys.stream, *[k.decode() for k in r.scan_iter(f"{s.keys.stream}:*", _type="STREAM")])
                for e in r.xpending_range(st, "prefill", "-", "+", 100, consumername=f"prefill-0-{s.stack_id}")
            }
            assert len(held) == 1 and all(idle >= 20000 for idle in held.values()), held  # claimable at once
            os.kill(s.proc("prefill-1").popen.pid, signal.SIGCONT)
            stopped.remove("prefill-1")
            t.join(120)
            assert not t.is_alive() and got["code"] == "OK" and got["ids"] == want, got
            info = c.get_request("defer-term")
            assert info.resumes == 1 and info.prefill_worker == f"prefill-1-{s.stack_id}", info
    finally:
        for name in stopped:
            os.kill(s.proc(name).popen.pid, signal.SIGCONT)
        s.procs = [p for p in s.procs if p.popen.poll() is None]  # prefill-0 is gone; stop() removes its arena
        s.n_prefill = 1
        finish_stack(s)


def test_requests_queued_for_a_decode_worker_that_is_killed_resume_on_another_and_their_old_jobs_are_skipped():
    """Lost before its first token: six greedy requests queued while the prefill worker is stopped,
    then one of the two decode workers is killed. Each of its requests resumes on the other as a
    new leg, queued anew; the prefill worker, let go on, skips the earlier legs' jobs (superseded,
    their counts returned) and prefills the new ones. All six end OK with an unbroken run's tokens,
    and the queue's counts come back to zero (the leak check)."""
    s = start_stack(decode=2, keepalive_s=1.0)
    down = []
    prompts = [f"Write a line about the color number {i}." for i in range(6)]
    sp = dict(max_tokens=24, ignore_eos=True, temperature=0.0)
    try:
        with Client(s.router_address) as c:
            with cf.ThreadPoolExecutor(6) as pool:
                want = [list(r.token_ids) for r in pool.map(lambda p: c.generate(p, timeout=120, **sp), prompts)]
            time.sleep(2 * s.settings.heartbeat_s)  # placement by load: fresh registry entries
            prefill = s.proc("prefill-0")
            os.kill(prefill.popen.pid, signal.SIGSTOP)
            got = {}

            def run(i):
                try:
                    with Client(s.router_address) as cc:
                        got[i] = ("OK", list(cc.generate(prompts[i], request_id=f"q{i}", timeout=120, **sp).token_ids))
                except grpc.RpcError as e:
                    got[i] = (e.code().name, e.details())

            threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
            try:
                for t in threads:
                    t.start()
                wait_for(
                    lambda: all(state_of(c, f"q{i}") == "queued" for i in range(6)),
                    timeout=60,
                    what="six requests queued",
                )
                placed = [c.get_request(f"q{i}").decode_worker.rsplit("-", 1)[0] for i in range(6)]
                assert set(placed) == {"decode-0", "decode-1"}, placed
                victims = {i for i in range(6) if placed[i] == "decode-0"}
                down.append("decode-0")
                s.proc("decode-0").popen.kill()
                s.proc("decode-0").popen.wait()
                wait_for(
                    lambda: {i for i in range(6) if c.get_request(f"q{i}").resumes} == victims,
                    timeout=30,
                    what="the killed worker's requests resumed",
                )
                assert all(c.get_request(f"q{i}").decode_worker.startswith("decode-1") for i in range(6))
            finally:
                os.kill(prefill.popen.pid, signal.SIGCONT)
            for t in threads:
                t.join(120)
            assert got == {i: ("OK", want[i]) for i in range(6)}, got
            jobs = scrape(prefill.metrics_address)
            assert jobs.get("splitserve_prefill_jobs_total{outcome=superseded}") == len(victims)
    finally:
        for name in down:
            s.restart(name)
        finish_stack(s)


def test_a_request_resumes_at_most_decode_resumes_times_then_fails_naming_the_worker():
    """DECODE_RESUMES=1, three decode workers: a stream whose worker is killed resumes on another;
    when that one is killed too it fails UNAVAILABLE naming it, though a third could take it, and
    is recorded failed, resumed once."""
    s = start_stack(decode=3, keepalive_s=1.0, decode_resumes=1)
    down = []
    got = {"tokens": [], "outcome": None}

    def run():
        try:
            with Client(s.router_address) as cc:
                for chunk in cc.generate_stream(
                    "Tell me a long story.",
                    request_id="cap",
                    max_tokens=400,
                    ignore_eos=True,
                    temperature=0.0,
                    timeout=120,
                ):
                    got["tokens"] += chunk.token_ids
            got["outcome"] = ("OK", "")
        except grpc.RpcError as e:
            got["outcome"] = (e.code().name, e.details())

    t = threading.Thread(target=run)
    try:
        t.start()
        with Client(s.router_address) as c:

            def on() -> str:
                return c.get_request("cap").decode_worker.rsplit("-", 1)[0]

            def kill(name):
                down.append(name)
                s.proc(name).popen.kill()
                s.proc(name).popen.wait()

            wait_for(lambda: len(got["tokens"]) >= 5, timeout=60, interval=0.02, what="tokens out")
            first = on()
            kill(first)
            n = len(got["tokens"])
            wait_for(
                lambda: len(got["tokens"]) >= n + 5 and on() != first,
                timeout=60,
                interval=0.02,
                what="the stream going on on another worker",
            )
            assert c.get_request("cap").resumes == 1
            second = on()
            kill(second)
            t.join(60)
            code, details = got["outcome"]
            assert code == "UNAVAILABLE" and f"decode worker {second}-{s.stack_id}" in details, got["outcome"]
            assert "went away" in details and "resume" not in details, details
            assert n + 5 <= len(got["tokens"]) < 400
            info = c.get_request("cap")
            assert info.state == "failed" and info.resumes == 1, info
            assert info.error == details, info  # (it was empty)
    finally:
        t.join(60)
        for name in down:
            s.restart(name)
        finish_stack(s)


def test_a_killed_decode_worker_gets_no_new_requests_while_its_lease_runs_and_rejoins_once_restarted():
    """Killed, a decode worker stays in the registry until its lease runs out (3 heartbeats, 12 s
    here, 8 s or more of it left at the kill). The router's channel to it fails to connect at
    once, and the router places nothing there meanwhile (guards against: about half of the new requests
    went to it and failed UNAVAILABLE). Restarted at the same address, it is connected again and
    given requests within seconds."""
    # (heartbeats of 2 s left as little as 4 s of the lease at the kill, which a slow machine's
    # bursts outlasted: the entry was gone before the check that it is still there)
    s = start_stack(decode=2, heartbeat_s=4.0)
    try:
        with Client(s.router_address) as c:

            def burst(tag: str) -> collections.Counter:
                rids = [f"{tag}-{i}" for i in range(4)]
                with cf.ThreadPoolExecutor(4) as pool:
                    done = list(
                        pool.map(
                            lambda rid: c.generate(
                                "Once upon a time", max_tokens=16, ignore_eos=True, request_id=rid, timeout=60
                            ),
                            rids,
                        )
                    )
                assert all(len(r.token_ids) == 16 for r in done)
                return collections.Counter(c.get_request(rid).decode_worker.rsplit("-", 1)[0] for rid in rids)

            def entry_of_decode_1() -> dict:  # its registry entry ({}: none): a restarted worker's has a new epoch
                return next((w for w in workers(s, "decode") if w["worker_id"].startswith("decode-1")), {})

            assert set(burst("warm")) == {"decode-0", "decode-1"}  # the router is connected to both
            victim = s.proc("decode-1")
            entry = entry_of_decode_1()
            old_epoch, victim_id = entry.get("epoch", ""), entry.get("worker_id", "")
            assert old_epoch
            victim.popen.kill()
            victim.popen.wait()
            t_killed = time.monotonic()
            lease_left = s.redis().pttl(s.keys.worker("decode", victim_id)) / 1000
            time.sleep(0.3)
            for r in range(3):
                assert burst(f"after-kill-{r}") == {"decode-0": 4}, r
            assert time.monotonic() - t_killed < lease_left, "the bursts outlasted its lease"
            assert len(workers(s, "decode")) == 2  # still registered: the router did not learn it from there

            s.restart("decode-1")
            wait_for(
                lambda: entry_of_decode_1().get("epoch", "") not in ("", old_epoch), what="decode-1 registered again"
            )
            end = time.monotonic() + 15
            placed = collections.Counter()
            while "decode-1" not in placed and time.monotonic() < end:
                placed = burst(f"after-restart-{int(time.monotonic() * 1000)}")
            assert "decode-1" in placed, placed
    finally:
        finish_stack(s)


def test_a_lone_decode_worker_restarted_at_its_address_takes_the_next_requests_at_once():
    """Killed while a prefill for it runs, a lone decode worker leaves both the router's and the
    prefill worker's channels to its address failing to connect (the handoff was tried), and
    gRPC retries those on its backoff, up to 2 s apart. Restarted there, it must complete the
    very next requests: the router and the prefill worker each open a new channel to its new
    run (the epoch it registers). Guards against: the first requests failed UNAVAILABLE at the router,
    and one that got through hung to its deadline: its handoff failed at once, and so did the
    call that should have ended its stream."""
    s = start_stack(decode=1)
    try:
        with Client(s.router_address) as c:
            assert c.generate("Once upon a time", max_tokens=4).finish_reason == "length"
            old_epoch = workers(s, "decode")[0]["epoch"]
            failed = []

            def long_one():  # one forward of ~1500 tokens: its handoff is tried after the kill
                try:
                    c.generate("word " * 1500, max_tokens=4, request_id="cut-off", timeout=60)
                except grpc.RpcError as e:
                    failed.append(e.code())

            t = threading.Thread(target=long_one)
            t.start()
            wait_for(
                lambda: state_of(c, "cut-off") == "prefilling",
                timeout=30,
                interval=0.02,
                what="the long prompt in its prefill forward",
            )
            s.proc("decode-0").popen.kill()
            s.proc("decode-0").popen.wait()
            t.join(60)
            assert failed == [grpc.StatusCode.UNAVAILABLE]
            wait_for(
                lambda: all(w["running"] == "0" for w in workers(s, "prefill")),
                timeout=30,
                what="the prefill worker done with the handoff it could not make",
            )

            s.restart("decode-0")
            assert workers(s, "decode")[0]["epoch"] != old_epoch
            for i in range(8):
                r = c.generate(
                    "Once upon a time", max_tokens=4, ignore_eos=True, request_id=f"after-restart-{i}", timeout=20
                )
                assert len(r.token_ids) == 4, i
    finally:
        finish_stack(s)
