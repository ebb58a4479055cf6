"""A prefill worker lost (kill -9) or stopped (SIGTERM): no admitted request is lost."""

import json
import os
import signal
import threading

from service_helpers import wait_for, workers

from splitserve.client import Client

from .common import admission_counts, finish_stack, start_stack


def test_kill9_prefill_worker_loses_no_admitted_request(reference_prompts):
    s = start_stack(prefill=2, claim_idle_ms=1500)
    try:
        r = s.redis()
        stream, group = s.keys.stream, "prefill"
        victim = s.proc("prefill-0")
        os.kill(s.proc("prefill-1").popen.pid, signal.SIGSTOP)  # so the victim takes the jobs
        results = {}

        def run(i, p, n):
            with Client(s.router_address) as c:
                results[i] = c.generate(token_ids=p, max_tokens=n, ignore_eos=True, timeout=240)

        prompts = reference_prompts[:10]
        threads = [threading.Thread(target=run, args=(i, p, n)) for i, (p, n) in enumerate(prompts)]
        for t in threads:
            t.start()

        def victim_has_jobs():
            info = r.xpending(stream, group)
            return any(
                c["name"].decode() == f"prefill-0-{s.stack_id}" and c["pending"] > 0 for c in info.get("consumers", [])
            )

        wait_for(victim_has_jobs, timeout=60, what="jobs in flight on the victim")
        victim.popen.kill()  # kill -9 with jobs in flight
        victim.popen.wait()
        os.kill(s.proc("prefill-1").popen.pid, signal.SIGCONT)
        for t in threads:
            t.join(240)
        assert len(results) == len(prompts)
        assert all(len(results[i].token_ids) == n for i, (_, n) in enumerate(prompts))
        assert r.xlen(stream) == 0
    finally:
        s.procs = [p for p in s.procs if p.name != "prefill-0"]  # gone; its arena is removed by stop()
        s.n_prefill = 1
        finish_stack(s)


def test_a_prefill_worker_sent_sigterm_prefills_what_it_holds_and_gives_up_what_its_drain_leaves():
    """A rolling update stops a prefill worker with SIGTERM: it pulls no more, prefills and hands over
    the jobs it holds, acks them and exits 0. Those its DRAIN_S leaves (0 here) are given up at once,
    not CLAIM_IDLE_MS (60 s here) after it went: the next worker to look claims them."""
    s = start_stack(prefill=2, claim_idle_ms=60000, drain_s=60.0, prefill_token_budget=1024)
    stopped = []
    try:
        r = s.redis()
        stream, group = s.keys.stream, "prefill"
        other = s.proc("prefill-1").popen.pid

        def consumer(name):
            return f"{name}-{s.stack_id}"

        def held_by(name):  # the entries the worker holds (pulled, not acked): id -> idle ms
            return {
                e["message_id"]: e["time_since_delivered"]
                for e in r.xpending_range(stream, group, "-", "+", 100, consumername=consumer(name))
            }

        def request_of(entry_id):  # None once the worker acked and deleted it
            entries = r.xrange(stream, entry_id, entry_id)
            return json.loads(entries[0][1][b"job"])["request_id"] if entries else None

        def held_requests():
            """Entries prefill-0 holds -> their request ids, read while it holds three or more. One it
            finished between the two reads (acked and deleted) is left out: prefill-1 is stopped, so
            prefill-0 prefilled it."""
            held = {e: request_of(e) for e in held_by("prefill-0")}
            held = {e: rid for e, rid in held.items() if rid is not None}
            return held if len(held) >= 3 else None

        def send(tag, first):
            """Eight 300-token prompts (new ones: no prefill worker holds them, prefill affinity sends
            them nowhere), queued while both workers are stopped; then prefill-0 goes on, prefill-1
            still stopped: prefill-0 takes them about four at a time (its token budget, 1024), so it
            holds jobs not yet prefilled for a few forwards (had they trickled in, each could be
            done before the next came). Returns the threads, the results and the entries held."""
            victim = s.proc("prefill-0").popen.pid
            for pid in (other, victim):
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
            results = {}

            def run(i):
                with Client(s.router_address) as c:
                    results[i] = c.generate(
                        token_ids=list(range(first + 10 * i, first + 300 + 10 * i)),
                        max_tokens=4,
                        ignore_eos=True,
                        request_id=f"{tag}{i}",
                        timeout=240,
                    )

            threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
            for t in threads:
                t.start()
            wait_for(lambda: admission_counts(s) == [8, 8 * 300], timeout=60, what="the eight jobs queued")
            os.kill(victim, signal.SIGCONT)
            stopped.remove(victim)
            return threads, results, wait_for(held_requests, timeout=60, what="jobs held by prefill-0")

        def finish(threads, results):
            os.kill(other, signal.SIGCONT)
            stopped.remove(other)
            for t in threads:
                t.join(240)
            assert sorted(results) == list(range(8))
            assert all(len(results[i].token_ids) == 4 for i in range(8))

        # A drain long enough: every job held is prefilled there, prefill-1 still stopped.
        threads, results, held = send("drain", 2000)
        victim = s.proc("prefill-0")
        victim.popen.send_signal(signal.SIGTERM)
        assert victim.popen.wait(120) == 0
        assert held_by("prefill-0") == {}  # nothing left unacked for a claim 60 s on
        with Client(s.router_address) as c:
            infos = {f"drain{i}": c.get_request(f"drain{i}") for i in range(8)}
        by_victim = {rid for rid, i in infos.items() if i.prefill_worker == consumer("prefill-0")}
        assert set(held.values()) <= by_victim, (held, infos)  # and those it pulled since, if any
        assert all(infos[rid].state in ("decoding", "finished") for rid in by_victim), infos
        assert not any(i.prefill_worker for rid, i in infos.items() if rid not in by_victim)  # none ran yet
        assert not any(seg.startswith(s.settings.shm_prefix + consumer("prefill-0")) for seg in s.shm_segments())
        assert not r.keys(s.keys.draining_arena("*"))  # known to decode workers while it drained, no more
        finish(threads, results)

        # No drain: the jobs held are given up as the worker stops, before prefill-1 comes back.
        s.prefill_env = {"SPLITSERVE_DRAIN_S": "0"}
        victim = s.restart("prefill-0")
        wait_for(lambda: len(workers(s, "prefill")) == 2, timeout=30, what="prefill-0 registered again")
        threads, results, held = send("nodrain", 7000)
        victim.popen.send_signal(signal.SIGTERM)
        assert victim.popen.wait(120) == 0
        given_up = held_by("prefill-0")
        assert given_up, "it held jobs when it stopped"
        assert all(idle >= 60000 for idle in given_up.values()), given_up  # claimable at once
        given_up_ids = [request_of(entry_id) for entry_id in given_up]
        finish(threads, results)
        with Client(s.router_address) as c:
            for rid in given_up_ids:
                info = c.get_request(rid)
                assert info.state == "finished" and info.prefill_worker == consumer("prefill-1"), info
        assert held_by("prefill-0") == {}
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        s.procs = [p for p in s.procs if p.popen.poll() is None]  # prefill-0 is gone; stop() removes its arena
        s.n_prefill = 1
        finish_stack(s)
