"""Prefix affinity: a chat's next turn goes to the decode worker and to the prefill worker
holding its start, and elsewhere once those are gone."""

import os
import signal
import threading
import time

from service_helpers import scrape, wait_for, workers

from splitserve.client import Client

from .common import finish_stack, start_stack


def test_a_chats_next_turn_goes_to_the_decode_worker_holding_its_prefix_which_computes_only_the_rest(smol_loaded):
    """Disaggregated, two decode workers, two routers, local_prefill_max_tokens 64. A request whose
    prompt starts with an earlier request's prompt and completion (a chat's next turn) goes to the
    decode worker that ran it, though that worker has a stream more open than the other (prefix
    affinity), and though it reaches the other router, which learnt of the first turn from the
    shared record; with at most 64 tokens left to compute there, that worker prefills it from its
    prefix cache: no prefill worker, no KV handed over. Under another cache_salt the same prompt
    is placed by load and prefilled by a prefill worker, with the same greedy output."""
    s = start_stack(decode=2, routers=2, local_prefill_max_tokens=64)
    tok = smol_loaded.tokenizer
    applied = "splitserve_prefix_records_applied_total"
    try:
        with Client(s.router_address) as c, Client(s.router_addresses[1]) as c1:
            first = tok.encode("Affinity: " + "apple banana cherry " * 60)  # a first word of its own
            a = c.generate(token_ids=first, max_tokens=8, ignore_eos=True, request_id="aff-a", timeout=120)
            assert c.get_request("aff-a").prefill_worker  # too long to prefill locally, and nothing cached
            home = c.get_request("aff-a").decode_worker
            # A long stream with the same start goes there too (prefilled there), leaving home the
            # busier worker.
            streaming, ends = threading.Event(), []

            def long_one():
                for chunk in c.generate_stream(
                    token_ids=first + tok.encode(" Go on."),
                    max_tokens=400,
                    ignore_eos=True,
                    request_id="aff-long",
                    timeout=180,
                ):
                    streaming.set()
                    ends.append(chunk.finish_reason)

            long = threading.Thread(target=long_one)
            long.start()
            assert streaming.wait(60), "the long stream did not start"
            il = c.get_request("aff-long")
            assert (il.decode_worker, il.prefill_worker) == (home, "")
            # router-1 has seen none of these: it learns of aff-a's prompt and completion and of
            # aff-long's prompt from router 0's entries (and its registry read, of aff-long's stream)
            wait_for(
                lambda: scrape(s.proc("router-1").metrics_address).get(applied, 0) >= 3,
                timeout=10,
                what="router 0's prefix records applied at router 1",
            )
            time.sleep(4 * s.settings.heartbeat_s)
            turn = first + list(a.token_ids) + tok.encode(" Now say it again, shorter.")
            b = c1.generate(token_ids=turn, max_tokens=6, ignore_eos=True, request_id="aff-b", timeout=120)
            ib = c.get_request("aff-b")
            assert (ib.decode_worker, ib.prefill_worker, ib.kv_transport) == (home, "", "")
            # the blocks of the first prompt and all but the last of its completion's tokens
            assert b.usage.cached_tokens >= (len(first) + 7) // 16 * 16 > len(turn) - 64
            assert not ends[-1]  # the long stream still runs: home still the busier worker
            salted = c1.generate(
                token_ids=turn, max_tokens=6, ignore_eos=True, request_id="aff-c", cache_salt="x", timeout=120
            )
            ic = c.get_request("aff-c")
            assert ic.decode_worker != home and ic.prefill_worker and salted.usage.cached_tokens == 0
            assert list(salted.token_ids) == list(b.token_ids)
            # b at least went past the least loaded worker for its prefix (aff-long maybe: a tie)
            assert scrape(s.proc("router").metrics_address)["splitserve_requests_placed_by_prefix_total"] in (0, 1)
            assert scrape(s.proc("router-1").metrics_address)["splitserve_requests_placed_by_prefix_total"] == 1
            assert not ends[-1]
            c.abort("aff-long")
            long.join(60)
            assert ends[-1] == "cancelled"
            # Asking for the prompt's log probabilities: its prefix cache cannot serve them, so the
            # prompt is too long to prefill locally after all.
            scored = c.generate(
                token_ids=turn, max_tokens=6, ignore_eos=True, prompt_logprobs=0, request_id="aff-d", timeout=120
            )
            assert c.get_request("aff-d").prefill_worker and scored.usage.cached_tokens == 0
            assert list(scored.token_ids) == list(b.token_ids) and len(scored.prompt_logprobs) == len(turn) - 1
    finally:
        finish_stack(s)


def test_a_chats_next_turn_goes_to_the_prefill_worker_holding_its_start_and_to_another_once_that_one_is_gone():
    """Prefill affinity: with two prefill workers, each later turn of a chat is queued for the worker
    that prefilled the turn before, whose prefix cache holds the chat's prompt so far: it computes
    the rest only. A turn queued for a worker that then stops (SIGSTOP: its lease lapses) is taken
    by the other once it has left the registry; its stream is removed when empty, and made again
    when the worker comes back."""
    s = start_stack(
        prefill=2, heartbeat_s=1.0
    )  # a lease of 3 s: the stopped worker is still registered at the next admission
    stopped = []
    try:
        r = s.redis()
        procs = {f"prefill-{i}-{s.stack_id}": s.proc(f"prefill-{i}") for i in range(2)}
        router = s.proc("router").metrics_address
        chats = {k: list(range(1000 + 300 * k, 1100 + 300 * k)) for k in range(3)}
        turns = {k: [] for k in chats}  # (prefill worker, cached tokens, the prompt's tokens before this turn's)
        with Client(s.router_address) as c:

            def send(k, rid):
                ids = chats[k]
                out = c.generate(token_ids=ids, max_tokens=8, ignore_eos=True, request_id=rid, timeout=60)
                turns[k].append(
                    (
                        c.get_request(rid).prefill_worker,
                        out.usage.cached_tokens,
                        len(turns[k]) and turns[k][-1][3],
                        len(ids),
                    )
                )
                chats[k] = (
                    ids
                    + list(out.token_ids)
                    + list(range(5000 + 40 * len(turns[k]) + 7 * k, 5040 + 40 * len(turns[k]) + 7 * k))
                )

            for turn in range(4):
                for k in chats:
                    send(k, f"chat{k}-{turn}")
            for got in turns.values():
                assert {w for w, *_ in got} <= set(procs) and len({w for w, *_ in got}) == 1, got
                for _, cached, before, _ in got[1:]:  # the blocks of the last turn's prompt, and no more
                    assert cached == before // 16 * 16, got
            assert scrape(router)["splitserve_requests_sent_to_prefill_worker_total"] == 3 * 3

            # The worker holding chat 0 stops: its next turn, queued for it, is taken by the other.
            holder = turns[0][-1][0]
            other = next(w for w in procs if w != holder)
            os.kill(procs[holder].popen.pid, signal.SIGSTOP)
            stopped.append(procs[holder].popen.pid)
            send(0, "chat0-stopped")
            assert scrape(router)["splitserve_requests_sent_to_prefill_worker_total"] == 3 * 3 + 1
            assert turns[0][-1][0] == other and turns[0][-1][1] == 0, turns[0]  # computed whole there
            wait_for(
                lambda: not r.exists(s.keys.stream_to(holder)), timeout=20, what="the stopped worker's stream removed"
            )
            assert r.smembers(s.keys.directed) == {other.encode()}
            os.kill(procs[holder].popen.pid, signal.SIGCONT)
            stopped.remove(procs[holder].popen.pid)
            wait_for(
                lambda: r.exists(s.keys.stream_to(holder)) and len(workers(s, "prefill")) == 2,
                timeout=20,
                what="the stopped worker registered again, with its stream",
            )
            started = {w: scrape(p.metrics_address) for w, p in procs.items()}
            key = "splitserve_prefill_jobs_started_total{stream=%s}"
            # The nine later turns from the workers' own streams; and the stopped turn once more where
            # the holder was stopped in its blocking read, which Redis answered with that entry: it
            # reads it on waking, a job queued alone, started beside its pickup, which finds it ended.
            assert sum(m.get(key % "own", 0) for m in started.values()) in (3 * 3, 3 * 3 + 1), started
            assert started[other].get(key % "departed") == 1 and started[holder].get(key % "departed", 0) == 0
            # The router's view of the registry (every half heartbeat) has the worker back too: until
            # then it knows one prefill worker only and directs no job (a fresh-clone CI run's turn went
            # to the common stream, and the worker back first took it)
            time.sleep(s.settings.heartbeat_s)
            send(0, "chat0-after")  # the other worker holds the chat now
            assert turns[0][-1][0] == other and turns[0][-1][1] > 0, turns[0]
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        finish_stack(s)
