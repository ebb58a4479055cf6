"""Redis down: requests are UNAVAILABLE, and a Redis back empty is served again."""

import os
import signal
import time

import grpc
import pytest
from service_helpers import scrape, wait_for

from splitserve.client import Client
from splitserve.service.redis_state import CALL_TIMEOUT_S

from .common import finish_stack, outcome_in_thread, prefill_paused, start_stack, state_of


def _state_unless_refused(client, rid) -> str:
    """state_of, or "" while the router refuses calls for Redis not answering its last one."""
    try:
        return state_of(client, rid)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.UNAVAILABLE and "did not answer" in e.details():
            return ""
        raise


def test_redis_down_is_unavailable_and_an_empty_redis_is_served_again():
    # forwards of 512 tokens: the prompts below take two and three, their KV within the arena
    stack = start_stack(routers=2, prefill_token_budget=512)
    try:
        with Client(stack.router_address) as c:
            assert len(c.generate("hi", max_tokens=3, ignore_eos=True, timeout=60).token_ids) == 3
            # Redis stalls for longer than a router's lease: when it answers again, every lease has run
            # out, and no router may take another for dead (it would fail that router's queued requests).
            held = {}
            with Client(stack.router_addresses[1]) as c1:
                with prefill_paused(stack):
                    t = outcome_in_thread(
                        c1.generate_stream(
                            "Held across a stall", max_tokens=3, ignore_eos=True, request_id="stalled", timeout=120
                        ),
                        held,
                    )
                    wait_for(lambda: state_of(c, "stalled") == "queued", what="request queued")
                    os.kill(stack.redis_proc.pid, signal.SIGSTOP)
                    try:
                        time.sleep(10 * stack.settings.heartbeat_s + 1.0)
                    finally:
                        os.kill(stack.redis_proc.pid, signal.SIGCONT)
                    time.sleep(10 * stack.settings.heartbeat_s + 1.0)  # past the time it takes to renew, and more
                    assert state_of(c, "stalled") == "queued"
                t.join(60)
            assert held["code"] == "OK" and held["tokens"] == 3, held
            lost = {}
            with prefill_paused(stack):  # a job that stays queued until Redis has lost it
                t = outcome_in_thread(
                    c.generate_stream("A queued request", max_tokens=5, request_id="lost", timeout=120), lost
                )
                wait_for(lambda: state_of(c, "lost") == "queued", what="request queued")
                stack.redis_proc.kill()
                stack.redis_proc.wait()
                for call in (
                    lambda: c.generate("hi", max_tokens=3, timeout=30),
                    lambda: c.get_request("any"),
                    lambda: c.abort("any"),
                ):
                    with pytest.raises(grpc.RpcError) as e:
                        call()
                    # retryable, and says why, not: INTERNAL "internal error: ConnectionError ..."
                    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "Redis" in e.value.details()
                time.sleep(1.0)  # heartbeats and pulls fail meanwhile
                assert all(p.popen.poll() is None for p in stack.procs)
                # Back, but empty: the decode worker registers again (guards against: its heartbeat task had died
                # on the first error) and the prefill worker recreates its consumer group (rather than NOGROUP).
                stack.start_redis()
                # The queued job went with the old Redis: its stream ends now (not: at its deadline).
                t.join(10)
                assert not t.is_alive(), "a request whose job Redis lost waited for its deadline"
            assert lost["code"] == "UNAVAILABLE" and "no longer holds this request" in lost["details"], lost
            assert c.get_request("lost").state == "failed"

            def served():
                try:
                    return len(c.generate("hi again", max_tokens=3, ignore_eos=True, timeout=10).token_ids) == 3
                except grpc.RpcError as e:
                    assert e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), e
                    return False

            wait_for(served, timeout=30, interval=0.5, what="served again after Redis came back empty")

            # A request a prefill worker is running when Redis comes back empty completes: the worker
            # puts its hash back at its next heartbeat, within the router's grace of two heartbeats
            # for a missing hash (guards against: the router ended it UNAVAILABLE like a lost queued job).
            midway = {}
            t = outcome_in_thread(
                c.generate_stream(
                    token_ids=list(range(100, 1100)), max_tokens=3, ignore_eos=True, request_id="midway", timeout=120
                ),
                midway,
            )
            wait_for(lambda: state_of(c, "midway") == "prefilling", interval=0.02, what="its prefill started")
            stack.redis_proc.kill()
            stack.redis_proc.wait()
            stack.start_redis()
            t.join(120)
            assert midway["code"] == "OK" and midway["tokens"] == 3, midway
            assert stack.redis().hget(stack.keys.req("midway"), "restored") == b"1"  # not finished before Redis went
            # and its router took it back (its set of requests held, for reaping, went with the old Redis)
            assert stack.redis().hget(stack.keys.req("midway"), "router") == f"router-{stack.stack_id}".encode()

            # A Redis that hangs does not stall the prompts a prefill worker holds: a 1200-token prompt
            # (three forwards) whose first forward runs when Redis stops gets its tokens while Redis is
            # still stopped, having waited one call timeout (CALL_TIMEOUT_S; bounded at two, for noise)
            # past the time it takes with Redis: the first call to time out marks Redis away, and
            # neither the prefill worker (its pulls, cancellation checks, ack) nor the router (the
            # request's end, recorded before its last message) waits on it again. Guards against: four calls
            # did: its tokens came 20 s later than that.
            # Its stream entry is acked once Redis answers again, and not claimed and prefilled again.
            # (ids of their own: midway's are in the prefix cache, and would make it one forward)
            t0 = time.monotonic()
            assert (
                len(c.generate(token_ids=list(range(3400, 4600)), max_tokens=3, ignore_eos=True, timeout=60).token_ids)
                == 3
            )
            with_redis = time.monotonic() - t0
            prefill_metrics = stack.proc("prefill-0").metrics_address
            prefilled = scrape(prefill_metrics)["splitserve_prefill_jobs_total{outcome=prefilled}"]
            away = {}
            t = outcome_in_thread(
                c.generate_stream(
                    token_ids=list(range(2100, 3300)), max_tokens=3, ignore_eos=True, request_id="away", timeout=120
                ),
                away,
            )
            wait_for(lambda: state_of(c, "away") == "prefilling", interval=0.02, what="its prefill started")
            os.kill(stack.redis_proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            try:
                wait_for(lambda: away["tokens"] == 3, timeout=60, interval=0.05, what="its tokens with Redis stopped")
                assert time.monotonic() - t0 < with_redis + 2 * CALL_TIMEOUT_S, (time.monotonic() - t0, with_redis)
                # A new request meanwhile is UNAVAILABLE naming Redis once the call times out (it waited
                # for its deadline before), and at once when the router's lease renewal has timed out
                # already (by the time the first call's has); so are GetRequest and Abort.
                t0 = time.monotonic()
                with pytest.raises(grpc.RpcError) as e:
                    c.generate("hi", max_tokens=3, timeout=30)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "Redis" in e.value.details(), e.value
                assert time.monotonic() - t0 < 10  # one call timeout (5 s), not two
                for call in (
                    lambda: c.generate("hi", max_tokens=3, timeout=30),
                    lambda: c.get_request("away"),
                    lambda: c.abort("any"),
                ):
                    t0 = time.monotonic()
                    with pytest.raises(grpc.RpcError) as e:
                        call()
                    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "did not answer" in e.value.details()
                    assert time.monotonic() - t0 < 2, e.value.details()
            finally:
                os.kill(stack.redis_proc.pid, signal.SIGCONT)
            t.join(60)
            assert away["code"] == "OK", away
            r = stack.redis()
            wait_for(
                lambda: r.xlen(stack.keys.stream) == 0 and r.xpending(stack.keys.stream, "prefill")["pending"] == 0,
                timeout=20,
                what="its entry acked and deleted once Redis answered",
            )
            # The router refuses calls until its lease renewal is answered again (half a heartbeat at most
            # after Redis is; a call that comes first is UNAVAILABLE as above, to retry)
            wait_for(
                lambda: _state_unless_refused(c, "away") == "finished",
                timeout=10,
                what="its end recorded once Redis answered",
            )
            # and what its workers recorded meanwhile (guards against: its prefill's end and its KV's adoption
            # were left out of its timestamps for good)
            wait_for(
                lambda: {"prefill_end", "kv_done"} <= set(c.get_request("away").timestamps),
                timeout=10,
                what="its prefill's end and its KV's adoption recorded once Redis answered",
            )
            info = c.get_request("away")
            ts = info.timestamps
            assert ts["prefill_start"] <= ts["prefill_end"] <= ts["kv_done"] <= ts["finished"], dict(ts)
            assert info.kv_transport == "shm" and info.kv_bytes > 0, info
            assert c.get_request("midway").state == "finished"
            got = scrape(prefill_metrics)
            assert got["splitserve_prefill_jobs_total{outcome=prefilled}"] == prefilled + 1
            assert got.get("splitserve_prefill_jobs_total{outcome=claimed}", 0.0) == 0.0
    finally:
        finish_stack(stack)


def test_a_supervised_stack_starts_again_what_dies_and_serves_again():
    """Stack.supervise (splitserve up's loop): the embedded Redis killed, then the decode worker,
    then the router: each is started again, said, and the stack serves again; Redis comes back
    empty and the workers register in it anew."""
    import threading

    stack = start_stack()
    said, stop = [], threading.Event()
    watcher = threading.Thread(target=stack.supervise, args=(stop, lambda m, **_: said.append(m), 0.1), daemon=True)
    watcher.start()

    def serves() -> bool:
        try:
            with Client(stack.router_address) as c:
                return len(c.generate("hi", max_tokens=3, ignore_eos=True, timeout=20).token_ids) == 3
        except grpc.RpcError:
            return False

    try:
        assert serves()
        for name, proc in (
            ("redis", lambda: stack.redis_proc),
            ("decode-0", lambda: stack.proc("decode-0").popen),
            ("router", lambda: stack.proc("router").popen),
        ):
            old = proc()
            os.kill(old.pid, signal.SIGKILL)
            wait_for(lambda: f"{name} is back" in said, timeout=90, what=f"{name} started again")
            assert proc() is not old and proc().poll() is None
            wait_for(serves, timeout=60, what=f"the stack serving again after {name} was killed")
        assert [m.split(" exited")[0] for m in said if " exited with " in m] == ["redis", "decode-0", "router"]
    finally:
        stop.set()
        watcher.join(10)
        stack.stop()
    assert stack.shm_segments() == []
