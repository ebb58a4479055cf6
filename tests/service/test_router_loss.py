"""A router lost: its requests failed and its queued jobs skipped, or its streams going on
through another router with a resuming client."""

import concurrent.futures as cf
import os
import signal
import threading
import time

import grpc
from service_helpers import kv_idle, scrape, wait_for

from splitserve.client import Client
from splitserve.observability import traceview

from .common import finish_stack, outcome_in_thread, prefill_paused, stack_redis_hget, start_stack, state_of


def test_a_router_that_dies_has_its_requests_failed_and_its_queued_jobs_skipped(stack, client, other_router):
    router = stack.proc("router-1")
    name = f"router-1-{stack.stack_id}"
    decoding, queued = {}, {}
    with Client(router.address) as doomed:
        t1 = outcome_in_thread(
            doomed.generate_stream(
                "Count to one thousand:", max_tokens=400, ignore_eos=True, request_id="orphan-decoding", timeout=120
            ),
            decoding,
        )
        wait_for(lambda: decoding.get("tokens", 0) >= 3, timeout=60, what="first tokens")
        with prefill_paused(stack):  # the second one stays queued
            t2 = outcome_in_thread(
                doomed.generate_stream("A queued request", max_tokens=50, request_id="orphan-queued", timeout=120),
                queued,
            )
            wait_for(lambda: state_of(client, "orphan-queued") == "queued", what="request queued")
            router.popen.kill()
            router.popen.wait()
            # Once its lease (10 heartbeats) has run out the other router marks them failed, naming
            # the router; guards against: GetRequest said "decoding" / "queued" for an hour.
            wait_for(
                lambda: {state_of(client, "orphan-decoding"), state_of(client, "orphan-queued")} == {"failed"},
                timeout=20,
                interval=0.1,
                what="the dead router's requests marked failed",
            )
        t1.join(30)
        t2.join(30)
    assert decoding["code"] == queued["code"] == "UNAVAILABLE"  # their client lost its router
    assert 3 <= decoding["tokens"] < 400
    for rid in ("orphan-decoding", "orphan-queued"):
        info = client.get_request(rid)
        assert info.state == "failed" and f"router {name} went away" in info.error, info
    time.sleep(1.0)  # prefill runs again: it skips the failed job, never picks it up
    assert client.get_request("orphan-queued").prefill_worker == ""
    wait_for(lambda: kv_idle(stack), timeout=20, what="the dead router's KV freed")
    assert stack.redis().zscore(stack.keys.routers, name) is None
    assert scrape(stack.proc("router").metrics_address)["splitserve_requests_reaped_total"] == 2
    # Restarted under the same id and port, it serves again (other_router's channel reconnects).
    stack.restart("router-1")
    wait_for(
        lambda: other_router.generate("hi", max_tokens=2, ignore_eos=True, timeout=30).token_ids,
        timeout=30,
        what="the restarted router serving",
    )


PREFILLED, CACHE_HITS = "splitserve_engine_prefill_tokens_total", "splitserve_prefix_cache_hit_tokens_total"


def test_a_stream_whose_router_stops_or_is_killed_goes_on_through_another_with_a_resuming_client():
    """A seeded 120-token stream through one of two routers, by a client balancing over both with
    resumes=1. Its router is sent SIGTERM with a drain time far shorter than the stream (later,
    restarted, the one holding the next stream is killed): the client sends the request again with
    the tokens it has (resume_from) to the other router, which goes on from there. The stream ends
    OK with the tokens, text and log probabilities of an unbroken run. Killed, the earlier attempt
    is still running for the dead router (until another reaps it, 10 heartbeats on): the re-send
    supersedes it (marked failed), rather than waiting. So too a stream of two seeded samples, each
    sent again with its own tokens (resume_from.samples). Each re-send goes on at the decode worker
    that was running it, from the KV its prefix cache kept. Without resumes, the stream fails
    UNAVAILABLE."""
    s = start_stack(routers=2, drain_s=0.5, batch_invariant=True)  # (see the decode-worker test above)
    down = []
    sp = dict(max_tokens=120, ignore_eos=True, temperature=0.8, seed=7, logprobs=0, stop=["@@@@@@@@"])
    prompt = "Tell me a story about a lighthouse keeper."
    target = "ipv4:" + ",".join(a.removeprefix("ipv4:") for a in s.router_addresses)
    try:
        with Client(s.router_address) as c, cf.ThreadPoolExecutor(2) as pool:
            want, two = pool.map(lambda n: c.generate(prompt, timeout=120, n=n, **sp), (1, 2))
            want_samples = two.choices
        names = {f"router-{s.stack_id}": "router", f"router-1-{s.stack_id}": "router-1"}

        def through(tag: str, disrupt, resumes: int, n: int = 1) -> tuple[dict, dict, str, dict]:
            got = [{}, {}, None, {}]  # by sample: tokens, text, (outcome), log probabilities

            def run():
                try:
                    with Client(target, balance=True) as cc:
                        for chunk in cc.generate_stream(
                            prompt, request_id=tag, timeout=120, resumes=resumes, n=n, **sp
                        ):
                            i = chunk.index
                            got[0].setdefault(i, []).extend(chunk.token_ids)
                            got[1][i] = got[1].get(i, "") + chunk.text
                            got[3].setdefault(i, []).extend((lp.token_id, lp.logprob) for lp in chunk.logprobs)
                    got[2] = "OK"
                except grpc.RpcError as e:
                    got[2] = f"{e.code().name}: {e.details()}"

            t = threading.Thread(target=run)
            t.start()
            wait_for(
                lambda: len(got[0]) == n and all(10 <= len(v) for v in got[0].values()),
                timeout=120,
                interval=0.02,
                what="the stream part-way",
            )
            assert all(len(v) <= 40 for v in got[0].values()), {i: len(v) for i, v in got[0].items()}
            holder = names[stack_redis_hget(s, tag, "router")]
            down.append(holder)
            disrupt(s.proc(holder))
            t.join(120)
            assert not t.is_alive()
            s.restart(down.pop())
            return got

        def terminate(p):
            p.popen.send_signal(signal.SIGTERM)
            assert p.popen.wait(60) == 0

        def kill(p):
            p.popen.kill()
            p.popen.wait()

        def said_what_it_carried(tag: str) -> bool:  # the re-sent call's request span
            if not os.path.exists(s.settings.trace_file):
                return False
            return any(
                sp.attrs.get("splitserve.resume_from.tokens", 0) >= 10
                and sp.attrs["splitserve.request_id"].split("#")[0] == tag
                for sp in traceview.load_spans(s.settings.trace_file)
            )

        dm, work = s.proc("decode-0").metrics_address, {}
        for tag, disrupt, wants in (("t", terminate, [want]), ("k", kill, [want]), ("s", kill, want_samples)):
            before = scrape(dm)
            got = through(tag, disrupt, resumes=1, n=len(wants))
            # (waited for here: the router that wrote it may be the next one killed, before its export)
            wait_for(
                lambda: said_what_it_carried(tag),
                timeout=20,
                what=f"the re-sent call's span of {tag} naming the tokens it carried",
            )
            after = scrape(dm)
            work[tag] = {k: after.get(k, 0) - before.get(k, 0) for k in (PREFILLED, CACHE_HITS)}
            assert got[2] == "OK", (tag, got[2])
            for i, w in enumerate(wants):
                assert got[0][i] == list(w.token_ids) and got[1][i] == w.text, (tag, i)
                assert [t for t, _ in got[3][i]] == [lp.token_id for lp in w.logprobs], (tag, i)
                # (the KV of the tokens sent was computed by a prefill: batch-invariant, bit for bit)
                assert [x for _, x in got[3][i]] == [lp.logprob for lp in w.logprobs], (tag, i)
        assert want_samples[0].token_ids != want_samples[1].token_ids
        for tag in ("k", "s"):
            first = s.redis().hgetall(s.keys.req(tag))
            assert first[b"state"] == b"failed" and first[b"superseded"] == b"1", first
            assert first[b"current"] == f"{tag}#2".encode(), first
        # Each went on at the decode worker that was running it, which found the KV of the prompt and
        # of the tokens sent in its prefix cache and computed only the rest of their last block itself
        # (guards against: a stream of one sample was queued for the prefill worker, which computed the tokens
        # sent again, behind any other re-sends, and handed all of its KV over)
        bs = s.settings.block_size
        for tag, n in (("t", 1), ("k", 1), ("s", 2)):
            again = s.redis().hgetall(s.keys.req(f"{tag}#2"))
            assert again[b"local"] == b"1" and b"prefill_worker" not in again, (tag, again)
            # (a sample whose tokens but the last were all in the cache computes that one as a decode
            # step does, and the engine counts it so: none prefilled)
            assert 0 <= work[tag][PREFILLED] <= n * bs and work[tag][CACHE_HITS] >= n * bs, (tag, work[tag])
            if n == 1:  # the prompt and the tokens its client had, all but their last block's from the cache
                held = int(again[b"prompt_tokens"]) + int(again[b"result_start"])
                assert work[tag][PREFILLED] + work[tag][CACHE_HITS] == held or (
                    work[tag][PREFILLED] == 0 and work[tag][CACHE_HITS] == held - 1
                ), (tag, work[tag], again)
        got = through("u", terminate, resumes=0)
        assert got[2].startswith("UNAVAILABLE") and got[0][0] == list(want.token_ids)[: len(got[0][0])], got[2]
        assert not said_what_it_carried("u")  # (not sent again)
    finally:
        for name in down:
            s.restart(name)
        finish_stack(s)
