"""The KV handoff between a prefill and a decode worker: what is sent, bad handles refused, failures
that end one request alone, handoffs that wait for blocks or for their stream, and legs."""

import json
import os
import threading
import time

import grpc
import pytest
from service_helpers import kv_idle, scrape, wait_for, workers

from splitserve.client import Client
from splitserve.handoff.arena import Arena
from splitserve.observability import traceview

from .common import finish_stack, greedy_clients_beside, model_fingerprint, prefill_paused, start_stack, with_module


@pytest.mark.parametrize(
    "transport, shared",
    [("grpc", False), ("grpc", True), ("shm", False)],
    ids=["grpc-records-unshared", "grpc-records-shared", "shm-records-unshared"],
)
def test_kv_handed_over_leaves_out_what_the_decode_worker_holds_and_is_sent_whole_when_it_was_evicted(
    smol_loaded, transport, shared
):
    """Two routers, one decode worker with a small KV cache. A chat's next turn (via router 0,
    which saw the last one) is handed over without the KV of the last turn's prompt and
    completion, which the decode worker holds: fewer bytes (sent over gRPC, or written to the
    shared-memory region), the same tokens as the whole handoff (under another salt). Then router
    1's traffic evicts that prefix from the decode worker; with the routers keeping their records
    to themselves, router 0 does not hear of it and still expects the prefix, so the next turn's
    partial KV is refused (FAILED_PRECONDITION) and sent whole (over shared memory: a new region,
    written from the KV the prefill engine kept for it), and the request is served all the same.
    With the records shared, router 0 models the eviction from router 1's entries and sends the KV
    whole at once: no refusal."""
    s = start_stack(routers=2, kv_transport=transport, kv_cache_bytes=40 << 20, share_prefix_records=shared)
    tok = smol_loaded.tokenizer
    per_token = 30 * 2 * 3 * 64 * 4  # SmolLM2's KV, fp32
    try:
        with Client(s.router_addresses[0]) as c, Client(s.router_addresses[1]) as other:
            first = tok.encode("Partial: " + "plum pear fig " * 45)
            a = c.generate(token_ids=first, max_tokens=8, ignore_eos=True, request_id="part-a", timeout=120)
            assert c.get_request("part-a").kv_bytes == 64 + per_token * len(first)
            turn = first + list(a.token_ids) + tok.encode(" And again, please.")
            b = c.generate(token_ids=turn, max_tokens=6, ignore_eos=True, request_id="part-b", timeout=120)
            ib = c.get_request("part-b")
            held = (len(first) + 7) // 16 * 16  # its prompt's and all but its last token's blocks
            assert (ib.kv_transport, ib.kv_bytes) == (transport, 64 + per_token * (len(turn) - held))
            whole = c.generate(
                token_ids=turn, max_tokens=6, ignore_eos=True, cache_salt="x", request_id="part-bx", timeout=120
            )
            assert c.get_request("part-bx").kv_bytes == 64 + per_token * len(turn)
            assert list(whole.token_ids) == list(b.token_ids)
            prefill = scrape(s.proc("prefill-0").metrics_address)
            assert prefill["splitserve_kv_unsent_tokens_total"] == held
            assert scrape(s.proc("decode-0").metrics_address)["splitserve_kv_shared_tokens_total"] >= held
            for i in range(8):  # 72 blocks through the other router: the decode worker holds 54
                other.generate(
                    token_ids=tok.encode(f"Flood {i}: " + "stone river cloud " * 45),
                    max_tokens=2,
                    ignore_eos=True,
                    cache_salt="flood",
                    timeout=120,
                )
            applied = scrape(s.proc("router").metrics_address).get("splitserve_prefix_records_applied_total", 0)
            if shared:  # each flood request's first token and end
                wait_for(
                    lambda: (
                        scrape(s.proc("router").metrics_address).get("splitserve_prefix_records_applied_total", 0) >= 16
                    ),
                    timeout=10,
                    what="router 1's records",
                )
            else:
                assert applied == 0
            turn2 = turn + list(b.token_ids) + tok.encode(" Once more.")
            d = c.generate(token_ids=turn2, max_tokens=6, ignore_eos=True, request_id="part-d", timeout=120)
            id_ = c.get_request("part-d")
            assert (id_.kv_transport, id_.kv_bytes) == (transport, 64 + per_token * len(turn2))  # sent whole
            refusals = 0 if shared else 1
            assert scrape(s.proc("prefill-0").metrics_address)["splitserve_kv_resent_whole_total"] == refusals
            assert (
                scrape(s.proc("decode-0").metrics_address).get(
                    "splitserve_kv_handoffs_refused_total{code=FAILED_PRECONDITION}", 0
                )
                == refusals
            )
            again = c.generate(token_ids=turn2, max_tokens=6, ignore_eos=True, cache_salt="y", timeout=120)
            assert list(again.token_ids) == list(d.token_ids) and d.finish_reason == "length"
    finally:
        finish_stack(s)


def test_kv_without_its_first_tokens_refused_by_a_decode_worker_of_the_release_before_is_sent_whole(
    smol_loaded, tmp_path
):
    """In a rolling update, a prefill worker of this release hands a chat's next turn over shared
    memory without the KV its decode worker holds (layout version 2), to a decode worker of the
    release before, which refuses it (INVALID_ARGUMENT naming handle.layout_version). The prefill
    worker writes the whole KV into a new region from the blocks its engine kept, the request is
    served with the tokens of a whole handoff, and nothing is left held."""
    s = start_stack(
        kv_transport="shm", decode_env=with_module(tmp_path, "old_decode_release")
    )  # the decode worker only
    tok = smol_loaded.tokenizer
    try:
        with Client(s.router_address) as c:
            first = tok.encode("Rolling: " + "plum pear fig " * 45)
            a = c.generate(token_ids=first, max_tokens=8, ignore_eos=True, request_id="old-a", timeout=120)
            turn = first + list(a.token_ids) + tok.encode(" And again, please.")
            b = c.generate(token_ids=turn, max_tokens=6, ignore_eos=True, request_id="old-b", timeout=120)
            whole = c.generate(token_ids=turn, max_tokens=6, ignore_eos=True, cache_salt="x", timeout=120)
            assert list(b.token_ids) == list(whole.token_ids) and b.finish_reason == "length"
            per_token = 30 * 2 * 3 * 64 * 4  # SmolLM2's KV, fp32
            ib = c.get_request("old-b")
            assert (ib.state, ib.kv_transport, ib.kv_bytes) == ("finished", "shm", 64 + per_token * len(turn))
        assert scrape(s.proc("prefill-0").metrics_address)["splitserve_kv_resent_whole_total"] == 1
        assert (
            scrape(s.proc("decode-0").metrics_address)["splitserve_kv_handoffs_refused_total{code=INVALID_ARGUMENT}"]
            == 1
        )
    finally:
        finish_stack(s)


def test_a_prefill_whose_handing_on_raises_fails_alone_and_the_prefill_worker_serves_on(tmp_path):
    """An exception while a prefill worker hands on an ended prefill (its first token, its KV's
    export, the record of a request its first token ends; put in by a sitecustomize), or while it
    observes a step (its metrics, once), used to end the worker's process, and every job it held;
    one in a round of its heartbeat ended the heartbeat (its lease and its jobs' claims lapsed). Now
    that request ends INTERNAL, naming the cause, its KV and region are freed and its entry acked,
    and the requests beside it get their tokens; the heartbeat goes on."""
    s = start_stack(prefill_env=with_module(tmp_path, "prefill_output_faults"))  # the prefill worker only
    try:
        with Client(s.router_address) as c:
            with greedy_clients_beside(s, c):
                for i in range(3):
                    for kind in ("first", "export", "done"):
                        rid = f"boom-{kind}-{i}"
                        with pytest.raises(grpc.RpcError) as e:
                            c.generate(
                                "Tell me a story", max_tokens=1 if kind == "done" else 8, request_id=rid, timeout=60
                            )
                        assert e.value.code() == grpc.StatusCode.INTERNAL, (rid, e.value.details())
                        assert f"could not be handed on: RuntimeError: {kind} fault" in e.value.details(), rid
                        assert c.get_request(rid).state == "failed", rid
            assert scrape(s.proc("prefill-0").metrics_address)["splitserve_prefill_jobs_total{outcome=failed}"] == 9
            assert len(c.generate("Tell me a story", max_tokens=8, ignore_eos=True, timeout=60).token_ids) == 8
        r = s.redis()
        wait_for(
            lambda: all(r.xlen(k) == 0 and r.xpending(k, "prefill")["pending"] == 0 for k in s.keys.streams),
            what="every entry acked and deleted",
        )
        assert s.proc("prefill-0").popen.poll() is None
        key = s.keys.worker("prefill", workers(s, "prefill")[0]["worker_id"])  # its heartbeat beats on
        beat = float(r.hget(key, "updated"))
        wait_for(
            lambda: float(r.hget(key, "updated") or 0) > beat + 1, timeout=10, what="the prefill worker's heartbeat"
        )
    finally:
        finish_stack(s)


def test_a_decode_output_that_cannot_be_sent_fails_its_request_alone(tmp_path):
    """An exception while a decode worker tells an engine output to its stream (put in by a
    sitecustomize) was raised in the event loop's callback that delivers a step's outputs: the
    outputs after it in that step were lost, and the request's sequence decoded on unheard. Now the
    request ends INTERNAL, naming the cause, its sequence is aborted and its KV freed, and the
    requests beside it get their tokens."""
    s = start_stack(decode_env=with_module(tmp_path, "decode_output_faults"))  # the decode worker only
    try:
        with Client(s.router_address) as c:
            with greedy_clients_beside(s, c):
                for i in range(3):
                    for kind in ("first", "later"):
                        rid = f"boom-{kind}-{i}"
                        chunks, err = [], None
                        try:
                            for chunk in c.generate_stream(
                                "Tell me a story", max_tokens=40, ignore_eos=True, request_id=rid, timeout=60
                            ):
                                chunks.append(chunk)
                        except grpc.RpcError as e:
                            err = e
                        assert err is not None and err.code() == grpc.StatusCode.INTERNAL, (rid, chunks, err)
                        assert "could not send an output of" in err.details(), (rid, err.details())
                        assert "RuntimeError: output fault" in err.details(), (rid, err.details())
                        got = sum(len(ch.token_ids) for ch in chunks)
                        assert got in ((0, 1) if kind == "first" else (2,)), (rid, got)  # (FirstToken's own)
                        assert c.get_request(rid).state == "failed", rid
            assert len(c.generate("Tell me a story", max_tokens=8, ignore_eos=True, timeout=60).token_ids) == 8
        assert s.proc("decode-0").popen.poll() is None
    finally:
        finish_stack(s)


def _handoffs_waiting(stack) -> float:
    return scrape(stack.proc("decode-0").metrics_address)["splitserve_kv_handoffs_waiting"]


def test_handoffs_waiting_for_kv_blocks_adopt_in_priority_order(mixed_workload):
    # A decode pool of 64 blocks (1024 tokens); a 480-token "hog" decodes in it, leaving 33
    # blocks, and every other prompt (560 tokens) needs 36, so their handoffs wait for blocks.
    # The hog's 540 steps must outlast four prefills: the decode worker gets one thread.
    kv_per_token = 30 * 2 * 3 * 64 * 4
    stack = start_stack(
        kv_cache_bytes=64 * 16 * kv_per_token,
        arena_bytes=256 << 20,
        max_queue_requests=64,
        max_queue_tokens=1 << 20,
        decode_env={"SPLITSERVE_THREADS": "1"},
    )
    try:
        ids = [t for it in mixed_workload[:12] for t in it["prompt_token_ids"]]
        assert len(ids) >= 1000
        prompts = {f"normal-{i}": ids[40 * i : 40 * i + 560] for i in range(3)} | {"high": ids[400:960]}
        done = {}

        def one(rid, priority=0):
            with Client(stack.router_address) as c:
                for r in c.generate_stream(
                    token_ids=prompts[rid],
                    max_tokens=2,
                    ignore_eos=True,
                    timeout=120,
                    request_id=rid,
                    priority=priority,
                ):
                    if r.finish_reason:
                        done[rid] = r.finish_reason

        with Client(stack.router_address) as c:
            # the hog is as urgent as "high", so no handoff here may preempt it (see the next test)
            # (salted: normal-0 starts with its prompt, and would share its blocks, needing only 6 more)
            hog = c.generate_stream(
                token_ids=ids[:480],
                max_tokens=540,
                ignore_eos=True,
                timeout=120,
                request_id="hog",
                priority=-1,
                cache_salt="hog",
            )
            hog_tokens = []

            def drain_hog():
                try:
                    for r in hog:
                        hog_tokens.extend(r.token_ids)
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.CANCELLED

            hog_thread = threading.Thread(target=drain_hog)
            hog_thread.start()
            wait_for(lambda: hog_tokens, what="the hog's first token")
            threads = [threading.Thread(target=one, args=(rid,)) for rid in prompts if rid != "high"]
            for t in threads:
                t.start()
            wait_for(lambda: _handoffs_waiting(stack) == 3, timeout=60, what="the normal handoffs waiting for blocks")
            threads.append(threading.Thread(target=one, args=("high", -1)))
            threads[-1].start()
            wait_for(lambda: _handoffs_waiting(stack) == 4, timeout=60, what="the high handoff waiting for blocks")
            t_free = time.time()
            hog_at = len(hog_tokens)
            hog.cancel()  # frees 31+ blocks: one waiting handoff fits at a time
            hog_thread.join(30)
            assert not hog_thread.is_alive(), "the hog's reader did not end after its cancel"
            assert hog_at < 540, "the hog finished before the test freed its blocks"
            for t in threads:
                t.join(120)
            assert done == {rid: "length" for rid in prompts}, done
            kv_done = {rid: c.get_request(rid).timestamps["kv_done"] for rid in prompts}
            assert c.get_request("hog").state == "cancelled"
        assert all(t > t_free for t in kv_done.values()), ("a handoff did not wait for the hog", t_free, kv_done)
        # The high one came last but takes the freed blocks first.
        assert all(kv_done["high"] < kv_done[rid] for rid in prompts if rid != "high"), kv_done
    finally:
        finish_stack(stack)


def test_an_urgent_handoff_preempts_a_less_urgent_decode_and_both_complete(mixed_workload):
    # The same 64-block decode pool: a low-priority request decoding from a 480-token prompt
    # holds 30+ blocks, and a normal one's 560-token KV needs 36. It gets them at once by
    # preempting the low one, which is recomputed afterwards and still completes.
    kv_per_token = 30 * 2 * 3 * 64 * 4
    stack = start_stack(kv_cache_bytes=64 * 16 * kv_per_token, arena_bytes=256 << 20)
    try:
        ids = [t for it in mixed_workload[:12] for t in it["prompt_token_ids"]]
        low_tokens, low_done = [], []
        with Client(stack.router_address) as c:
            low = c.generate_stream(
                token_ids=ids[:480], max_tokens=200, ignore_eos=True, timeout=120, request_id="low", priority=1
            )

            arrived = []

            def drain_low():
                for r in low:
                    low_tokens.extend(r.token_ids)
                    arrived.append(time.monotonic())
                low_done.append(time.time())

            low_thread = threading.Thread(target=drain_low)
            low_thread.start()
            wait_for(lambda: low_tokens, what="the low request's first token")
            urgent = c.generate(token_ids=ids[400:960], max_tokens=2, ignore_eos=True, timeout=120, request_id="urgent")
            low_thread.join(120)
            assert urgent.finish_reason == "length" and len(urgent.token_ids) == 2
            kv_done = c.get_request("urgent").timestamps["kv_done"]
            assert low_done and kv_done < low_done[0], "the urgent handoff waited for the low request to end"
            # the low one was preempted, recomputed, and produced what it produces alone
            preemptions = scrape(stack.proc("decode-0").metrics_address)["splitserve_num_preemptions_total"]
            assert preemptions >= 1
            assert low_tokens == list(
                c.generate(token_ids=ids[:480], max_tokens=200, ignore_eos=True, timeout=120).token_ids
            )

        # Its trace says so: the decode span holds an event at each preemption, their count, and the
        # longest gap between its tokens (the wait to be recomputed in it); the urgent one's holds none.
        def decode_spans():
            if not os.path.exists(stack.settings.trace_file):
                return None
            found = {
                sp.attrs.get("splitserve.request_id"): sp
                for sp in traceview.load_spans(stack.settings.trace_file)
                if sp.name == "decode"
            }
            return found if {"low", "urgent"} <= set(found) else None

        spans = wait_for(decode_spans, timeout=20, what="the decode spans")
        low_span, urgent_span = spans["low"], spans["urgent"]
        preempted_at = [t for t, name in low_span.events if name == "preempted"]
        assert len(preempted_at) == low_span.attrs["splitserve.decode.preemptions"] == preemptions, low_span
        assert low_span.start_ns < preempted_at[0] < low_span.end_ns
        # the stall its client saw, measured where it began (the client's adds only the relay's jitter)
        seen_gap_ms = max(b - a for a, b in zip(arrived, arrived[1:])) * 1000
        assert 0.5 * seen_gap_ms <= low_span.attrs["splitserve.decode.max_token_gap_ms"] <= low_span.duration_ms
        assert "splitserve.decode.preemptions" not in urgent_span.attrs and not urgent_span.events, urgent_span
    finally:
        finish_stack(stack)


def test_bad_kv_handles_are_invalid_argument_and_the_worker_keeps_serving(stack, client):
    from splitserve.service.errors import MAX_DETAILS_BYTES, fit_details
    from splitserve_proto.v1 import worker_pb2 as w
    from splitserve_proto.v1 import worker_pb2_grpc

    dec = workers(stack, "decode")[0]
    ch = grpc.insecure_channel(dec["address"])
    stub = worker_pb2_grpc.DecodeWorkerStub(ch)
    decode = stub.Decode(w.DecodeRequest(request_id="bad-handle", prompt_tokens=4))
    assert next(decode).accepted
    good = client.generate("hello", max_tokens=2)
    seq = w.SequenceState(request_id="bad-handle", prompt_len=4, token_ids=[1, 2, 3, 4, 5])
    seq.sampling.max_tokens = 4
    arena = workers(stack, "prefill")[0]["arena"]  # its name is random: the registry says it
    # a segment of the stack's prefix that no registered prefill worker owns, with the KV's length
    forged = Arena(stack.settings.shm_prefix + "forged", 1 << 20)
    ok = dict(
        arena=arena,
        offset=0,
        length=64 + 30 * 2 * 4 * 3 * 64 * 4,
        num_tokens=4,
        layout_version=1,
        dtype="float32",
        fingerprint=model_fingerprint(stack),
        host_id=dec["host_id"],
        transport="shm",
    )
    cases = [
        ({"arena": "splitserve-nonexistent"}, "handle.arena"),
        ({"arena": forged.name}, "not the arena of a prefill worker registered on this host"),
        ({"arena": "../../etc/passwd"}, "handle.arena"),
        ({"offset": 1 << 40}, "outside arena"),
        ({"fingerprint": "deadbeef"}, "handle.fingerprint"),
        ({"layout_version": 7}, "handle.layout_version"),
        ({"dtype": "bfloat16"}, "handle.dtype"),
        ({"length": 12}, "handle.length"),
        ({"num_tokens": 3}, "handle.num_tokens"),
        ({"start_token": 4}, "handle.start_token"),
        ({"start_token": 2}, "handle.start_token"),  # in layout version 1
        ({"start_token": 2, "layout_version": 2}, "handle.length"),  # that of all 4 tokens' KV, not the last 2
        ({"host_id": "elsewhere/ipc"}, "handle.host_id"),
        ({"lease_deadline_unix": 1.0}, "lease"),
    ]
    from splitserve.prefill_worker.handoff import wants_it_whole

    for change, words in cases:
        h = w.KVHandle(**{**ok, **change})
        with pytest.raises(grpc.RpcError) as e:
            try:
                stub.PutKV(w.PutKVRequest(sequence=seq, handle=h), timeout=10)
            finally:
                if change.get("arena") == forged.name:
                    forged.close()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (change, e.value.details())
        assert words in e.value.details()
        # A prefill worker sends the KV again whole only when the refusal is of its layout (what a
        # decode worker of the release before says to KV sent without its first tokens).
        assert wants_it_whole(e.value) == (words == "handle.layout_version"), change
    other = w.SequenceState(request_id="bad-handle", prompt_len=3, token_ids=[1, 2, 3, 4, 5])  # not its prompt
    for put in (
        lambda: stub.PutKV(w.PutKVRequest(sequence=other, handle=w.KVHandle(**ok)), timeout=10),
        lambda: stub.PutKVStream(
            iter([w.KVChunk(header=w.PutKVRequest(sequence=other, handle=w.KVHandle(**{**ok, "transport": "grpc"})))]),
            timeout=10,
        ),
    ):
        with pytest.raises(grpc.RpcError) as e:
            put()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sequence.prompt_len" in e.value.details()
    lacking = w.SequenceState(request_id="bad-handle", prompt_len=4, token_ids=[1, 2, 3, 4, 5])
    lacking.sampling.logprobs = 2  # asked for, but not given for the token sampled
    with pytest.raises(grpc.RpcError) as e:
        stub.PutKV(w.PutKVRequest(sequence=lacking, handle=w.KVHandle(**ok)), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sequence.logprobs" in e.value.details()
    # A sequence that its first token finished at prefill (no handle): checked as one with its KV is
    # (not: any finish reason went to the client, and tokens outside the vocabulary were decoded).
    unsized = stub.Decode(w.DecodeRequest(request_id="no-size"))  # (a prompt_tokens of 0 is not checked)
    assert next(unsized).accepted
    for rid, change, field in (
        ("bad-handle", dict(finish_reason="weird"), "sequence.finish_reason"),
        ("bad-handle", dict(finish_reason="cancelled"), "sequence.finish_reason"),
        ("bad-handle", dict(finish_reason="length", resumed_tokens=2), "sequence.resumed_tokens"),
        ("no-size", dict(finish_reason="length", prompt_len=0), "sequence.prompt_len"),
        ("no-size", dict(finish_reason="length", prompt_len=5), "sequence.prompt_len"),
        ("no-size", dict(finish_reason="length", token_ids=[1, 2, 3, 4, 10**9]), "sequence.token_ids"),
    ):
        odd = w.SequenceState(**{"request_id": rid, "prompt_len": 4, "token_ids": [1, 2, 3, 4, 5], **change})
        with pytest.raises(grpc.RpcError) as e:
            stub.PutKV(w.PutKVRequest(sequence=odd), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (change, e.value.details())
        assert e.value.details().startswith(field + ": "), (change, e.value.details())
    unsized.cancel()
    # Handoffs for a request with no open stream: NOT_FOUND once its stream has not opened in
    # time (all three at once: each waits for it up to STREAM_WAIT_S).
    nobody = [
        stub.PutKV.future(
            w.PutKVRequest(sequence=w.SequenceState(request_id="nobody", token_ids=[1, 2]), handle=w.KVHandle(**ok)),
            timeout=10,
        ),
        stub.FirstToken.future(w.FirstTokenRequest(request_id="nobody", token_ids=[5]), timeout=10),
        stub.Fail.future(w.FailRequest(request_id="nobody", code=8), timeout=10),
    ]
    assert [f.exception().code() for f in nobody] == [grpc.StatusCode.NOT_FOUND] * 3
    # FirstToken: checked like PutKV; a token is relayed once, a repeat is ignored.
    for req, field in (
        (w.FirstTokenRequest(token_ids=[5]), "request_id"),
        (w.FirstTokenRequest(request_id="bad-handle"), "token_ids"),
    ):
        with pytest.raises(grpc.RpcError) as e:
            stub.FirstToken(req, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()
    stub.FirstToken(w.FirstTokenRequest(request_id="bad-handle", token_ids=[5], text="x", prefill_ms=3.0), timeout=10)
    stub.FirstToken(w.FirstTokenRequest(request_id="bad-handle", token_ids=[6], text="y"), timeout=10)
    ev = next(decode)
    assert list(ev.token_ids) == [5] and ev.text == "x" and ev.timings.prefill_ms == 3.0 and ev.first_token_unix > 0
    # Fail: checked the same way; it ends the stream with the status the producer gives.
    for req, field in (
        (w.FailRequest(code=8), "request_id"),
        (w.FailRequest(request_id="bad-handle"), "code"),
        (w.FailRequest(request_id="bad-handle", code=99), "code"),
    ):
        with pytest.raises(grpc.RpcError) as e:
            stub.Fail(req, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()
    with pytest.raises(grpc.RpcError) as e:  # Cancel: checked the same way
        stub.Cancel(w.CancelRequest(), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in e.value.details()
    assert not stub.Cancel(w.CancelRequest(request_id="never-seen-here"), timeout=10).found
    # A Cancel that comes before its stream (Abort right after admission): the stream ends at once.
    assert not stub.Cancel(w.CancelRequest(request_id="cancelled-early"), timeout=10).found
    early = list(stub.Decode(w.DecodeRequest(request_id="cancelled-early", prompt_tokens=4), timeout=10))
    assert [e.accepted for e in early] == [True, False] and early[-1].finish_reason == "cancelled"
    # PrefillHere (a request taken back from the prefill queue): checked the same way; refused for
    # a stream whose first token came from a prefill worker, and for one with no stream here.
    for req, code, words in (
        (w.PrefillHereRequest(prompt_token_ids=[1]), grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
        (w.PrefillHereRequest(request_id="bad-handle"), grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids"),
        (
            w.PrefillHereRequest(request_id="never-seen-here", prompt_token_ids=[1]),
            grpc.StatusCode.NOT_FOUND,
            "never-seen-here",
        ),
        (
            w.PrefillHereRequest(request_id="bad-handle", prompt_token_ids=[1]),
            grpc.StatusCode.FAILED_PRECONDITION,
            "bad-handle",
        ),
    ):
        with pytest.raises(grpc.RpcError) as e:
            stub.PrefillHere(req, timeout=10)
        assert e.value.code() == code and words in e.value.details(), (req, e.value.details())
    here = stub.Decode(w.DecodeRequest(request_id="prefill-here", prompt_tokens=3))
    assert next(here).accepted
    with pytest.raises(grpc.RpcError) as e:  # the engine's own check; the stream waits on
        stub.PrefillHere(w.PrefillHereRequest(request_id="prefill-here", prompt_token_ids=[1, 10**9, 2]), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token id" in e.value.details()
    take = w.PrefillHereRequest(request_id="prefill-here", prompt_token_ids=[1, 504, 3277], queue_ms=12.5)
    take.sampling.max_tokens = 2
    take.sampling.ignore_eos = True
    stub.PrefillHere(take, timeout=10)
    events = list(here)
    assert sum(len(ev.token_ids) for ev in events) == 2 and events[-1].finish_reason == "length"
    assert events[0].timings.queue_ms == 12.5 and events[0].first_token_unix > 0
    # A message of 100 000 characters: the stream's event carries it cut as a status would be
    # (the router records and relays what it gets).
    long = "no room: " + "x" * 100_000
    assert stub.Fail(w.FailRequest(request_id="bad-handle", code=8, message=long), timeout=10).ended
    ev = next(decode)
    assert ev.error == fit_details(long) and len(ev.error) <= MAX_DETAILS_BYTES and ev.error.startswith("no room: x")
    assert ev.error_code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert next(decode, None) is None  # the stream has ended
    decode.cancel()
    ch.close()
    again = client.generate("hello", max_tokens=2)
    assert list(again.token_ids) == list(good.token_ids)
    assert all(p.popen.poll() is None for p in stack.procs)


def test_a_handoff_that_comes_before_its_decode_stream_waits_for_it(stack):
    """The router queues the prefill job while the Decode stream opens, so a first token (or KV)
    can reach the decode worker first: it is held until the stream opens, and once the stream
    has ended a late one is refused at once instead of waiting."""
    from splitserve.decode_worker.server import STREAM_WAIT_S
    from splitserve_proto.v1 import worker_pb2 as w
    from splitserve_proto.v1 import worker_pb2_grpc

    dec = workers(stack, "decode")[0]
    with grpc.insecure_channel(dec["address"]) as ch:
        stub = worker_pb2_grpc.DecodeWorkerStub(ch)
        early = stub.FirstToken.future(w.FirstTokenRequest(request_id="early", token_ids=[7], text="z"), timeout=10)
        time.sleep(STREAM_WAIT_S / 4)
        assert not early.done(), "a first token for a stream not yet open was refused instead of held"
        decode = stub.Decode(w.DecodeRequest(request_id="early", prompt_tokens=4))
        assert next(decode).accepted
        ev = next(decode)
        assert list(ev.token_ids) == [7] and ev.text == "z"
        early.result(timeout=10)
        decode.cancel()
        wait_for(lambda: scrape(dec["metrics"])["splitserve_decode_streams_open"] == 0, what="the stream closed")
        t = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            stub.FirstToken(w.FirstTokenRequest(request_id="early", token_ids=[8]), timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert time.monotonic() - t < STREAM_WAIT_S / 2, "a handoff for an ended stream was held"


def test_first_tokens_come_on_the_prefill_workers_stream_and_bad_messages_are_dropped(stack, client):
    """Prefill workers send first tokens on one FirstTokens stream per decode worker. A message
    there that is bad, or whose request has no stream, is dropped and counted (there is no status
    to answer it with: its KV handoff carries the token), and the stream and the worker go on."""
    import queue

    from splitserve.decode_worker.server import STREAM_WAIT_S
    from splitserve_proto.v1 import worker_pb2 as w
    from splitserve_proto.v1 import worker_pb2_grpc

    dec = workers(stack, "decode")[0]
    before = scrape(dec["metrics"])
    via = lambda m, how: m.get(f"splitserve_first_tokens_total{{via={how}}}", 0)  # noqa: E731
    dropped = lambda m, why: m.get(f"splitserve_first_tokens_dropped_total{{reason={why}}}", 0)  # noqa: E731
    assert len(client.generate("a first token by stream", max_tokens=3).token_ids) == 3
    after = scrape(dec["metrics"])
    if via(after, "local") == via(before, "local"):  # not prefilled by the decode worker itself
        assert via(after, "stream") == via(before, "stream") + 1, after
    with grpc.insecure_channel(dec["address"]) as ch:
        stub = worker_pb2_grpc.DecodeWorkerStub(ch)
        q: queue.SimpleQueue = queue.SimpleQueue()
        tokens = stub.FirstTokens.future(iter(q.get, None), timeout=30)
        q.put(w.FirstTokenRequest(request_id="ft-early", token_ids=[7], text="z"))  # before its stream
        q.put(w.FirstTokenRequest(token_ids=[5]))  # no request_id
        q.put(w.FirstTokenRequest(request_id="ft-early"))  # no token
        time.sleep(STREAM_WAIT_S / 4)
        decode = stub.Decode(w.DecodeRequest(request_id="ft-early", prompt_tokens=4))
        assert next(decode).accepted
        ev = next(decode)
        assert list(ev.token_ids) == [7] and ev.text == "z" and ev.first_token_unix > 0
        q.put(w.FirstTokenRequest(request_id="ft-early", token_ids=[8]))  # a repeat: ignored
        q.put(None)
        tokens.result(timeout=10)  # every message has been handled
        decode.cancel()
        wait_for(lambda: scrape(dec["metrics"])["splitserve_decode_streams_open"] == 0, what="the stream closed")
        late = stub.FirstTokens(iter([w.FirstTokenRequest(request_id="ft-early", token_ids=[9])]), timeout=10)
        assert isinstance(late, w.FirstTokenResponse)  # its stream has ended: dropped, the call is fine
    wait_for(
        lambda: dropped(scrape(dec["metrics"]), "no_stream") > dropped(before, "no_stream"),
        timeout=10,
        what="the late token dropped",
    )
    m = scrape(dec["metrics"])
    assert dropped(m, "invalid") == dropped(before, "invalid") + 2
    assert dropped(m, "no_stream") == dropped(before, "no_stream") + 1
    assert via(m, "stream") == via(after, "stream") + 1
    assert len(client.generate("still serving", max_tokens=2).token_ids) == 2


def _kv_chunks(stack, seq, num_tokens: int) -> list:
    """PutKVStream's chunks of a whole payload of num_tokens tokens' KV (zeros) for seq, for the
    stack's model: the handle as a prefill worker sends it."""
    from worker_fuzz import whole_payload

    from splitserve_proto.v1 import worker_pb2 as w

    fp = model_fingerprint(stack)
    payload = bytes(whole_payload(fp, num_tokens))
    h = w.KVHandle(
        length=len(payload), num_tokens=num_tokens, layout_version=1, dtype="float32", fingerprint=fp, transport="grpc"
    )
    return [
        w.KVChunk(header=w.PutKVRequest(sequence=seq, handle=h), data=payload[: 1 << 16]),
        w.KVChunk(data=payload[1 << 16 :]),
    ]


def _decode_0(stack) -> str:
    """The address of the stack's decode-0 (a worker whose log a test reads)."""
    return next(x["address"] for x in workers(stack, "decode") if x["worker_id"].startswith("decode-0-"))


def _sequence(rid: str, leg: int | None = None):
    """A prefilled 4-token prompt and its first token (105), to decode 12 tokens: a handoff's sequence."""
    from splitserve_proto.v1 import worker_pb2 as w

    seq = w.SequenceState(request_id=rid, prompt_len=4, token_ids=[101, 102, 103, 104, 105], leg=leg)
    seq.sampling.max_tokens, seq.sampling.ignore_eos = 12, True
    return seq


def test_kv_imported_as_its_handoff_is_cancelled_is_kept_and_a_second_handoff_of_it_is_already_exists(stack, client):
    """A handoff whose call is cancelled (its prefill worker killed) while its import is queued in
    the engine's thread: the engine imports it all the same. Guards against: the decode worker did not know
    it had it: the job's next prefill (claimed by another prefill worker) found the engine holding
    it, and its handoff failed the stream INVALID_ARGUMENT "already in this engine" (a soak). Now
    the KV is kept, the stream goes on, and a second handoff is ALREADY_EXISTS."""
    from splitserve_proto.v1 import worker_pb2 as w
    from splitserve_proto.v1 import worker_pb2_grpc

    dec = stack.proc("decode-0")
    address = _decode_0(stack)
    with grpc.insecure_channel(address) as ch:
        stub = worker_pb2_grpc.DecodeWorkerStub(ch)
        # A long prompt prefilled by the decode worker itself: its engine's steps take a while,
        # and a command (an import) waits for the step running to end.
        busy = w.DecodeRequest(
            request_id="keeps-the-engine-busy",
            prompt_tokens=2000,
            prompt_token_ids=[(17 * i) % 4000 + 100 for i in range(2000)],
        )
        busy.sampling.max_tokens, busy.sampling.ignore_eos = 2, True
        held = stub.Decode(busy, timeout=120)
        assert next(held).accepted
        decode = stub.Decode(w.DecodeRequest(request_id="adopted-as-cancelled", prompt_tokens=4), timeout=120)
        assert next(decode).accepted
        seq = _sequence("adopted-as-cancelled")
        with open(dec.log_path) as f:
            before = f.read().count("adopted all the same")
        time.sleep(0.3)  # the busy prompt's chunks are running
        put = stub.PutKVStream.future(iter(_kv_chunks(stack, seq, 4)), timeout=30)
        time.sleep(0.05)  # (it is read and its import queued: in far less than a step)
        put.cancel()

        def kept():
            with open(dec.log_path) as f:
                return f.read().count("adopted all the same") > before

        wait_for(kept, timeout=30, what="the import, done after its call was cancelled, kept")
        held.cancel()
        with pytest.raises(grpc.RpcError) as e:  # the job prefilled again, by another prefill worker
            stub.PutKVStream(iter(_kv_chunks(stack, seq, 4)), timeout=30)
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS, e.value.details()
        events = list(decode)
        tokens = [t for ev in events for t in ev.token_ids]
        assert events[-1].finish_reason == "length" and not events[-1].error, events[-1]
        assert len(tokens) == 12 and tokens[0] == 105, tokens
    wait_for(lambda: kv_idle(stack), timeout=30, what="every worker's KV free")


@pytest.mark.parametrize("recorded", [True, False], ids=["decoding-recorded", "decoding-not-yet-recorded"])
def test_a_job_claimed_after_its_handoff_went_through_leaves_its_stream_running(stack, client, recorded):
    """A job claimed from a prefill worker that died after (or as) its KV handoff went through.
    Its decode worker has recorded 'decoding' (with its leg): the pickup skips the job, not
    prefilled again. Not yet recorded (Redis slow): the job is prefilled again
    and its decode worker answers the second handoff ALREADY_EXISTS, which the prefill worker takes
    for "handed off" (not for a failed handoff, which would fail the running stream INTERNAL). Either
    way the stream runs on to its end."""
    r = stack.redis()
    rid = f"handed-off-twice-{recorded}"
    got = []
    with prefill_paused(stack):  # its job stays in the stream, to be read
        stream = client.generate_stream(
            "Count the stars one by one.", request_id=rid, max_tokens=150, ignore_eos=True, timeout=120
        )
        events = iter(stream)
        jobs = []

        def queued():
            jobs[:] = [
                (key, fields)
                for key in stack.keys.streams
                for _, fields in r.xrange(key)
                if json.loads(fields[b"job"])["request_id"] == rid
            ]
            return jobs

        wait_for(queued, what="the request's job queued")
    key, fields = jobs[0]
    while len(got) < 5:
        got.extend(next(events).token_ids)
    wait_for(lambda: r.hget(stack.keys.req(rid), "state") == b"decoding", what="its adoption recorded")
    logs = [p.log_path for p in stack.procs if p.name.startswith("prefill")]

    def says(words: str) -> bool:
        return any(words in open(path).read() for path in logs)

    if not recorded:
        r.hset(stack.keys.req(rid), "state", "prefilling")  # as its pickup left it, the adoption's write not landed
    r.xadd(key, fields)  # the same job again, as a claim of a dead prefill worker's delivers it
    skipped, again = f"request {rid}: its decode worker has its KV already", f"request {rid}: decode worker"
    wait_for(
        lambda: says(skipped) or says(again) or says(f"handoff of {rid}"),
        timeout=30,
        what="the job skipped, or prefilled and handed off again",
    )
    assert says(skipped if recorded else again) and not says(again if recorded else skipped), (
        "skipped at its pickup" if not recorded else "prefilled again"
    )
    assert not says(f"handoff of {rid}"), "its second handoff taken for a failure"
    if not recorded:
        wait_for(
            lambda: r.hget(stack.keys.req(rid), "state") in (b"decoding", b"finished"),
            what="its state back to decoding",
        )
    for ev in events:
        got.extend(ev.token_ids)
        last = ev
    assert last.finish_reason == "length" and len(got) == 150, (last.finish_reason, len(got))
    assert client.get_request(rid).state == "finished"
    wait_for(lambda: kv_idle(stack), timeout=30, what="every worker's KV free")


def test_a_handoff_first_token_or_failure_of_another_leg_is_refused_and_a_late_legs_record_dropped(stack):
    """A request that resumed (its decode worker lost) is a new leg; a job of an earlier one,
    prefilled all the same, must not feed a later leg's stream should that come back to the same
    decode worker: its first token is dropped, its failure leaves the stream alone, its handoff is
    NOT_FOUND. And a decode worker of an earlier leg (taken for lost, then adopting its KV late)
    writes nothing on the request. Guards against: its 'decoding', its name and times landed on the new
    leg's. Its 'kv_leg' is what a claim's pickup reads before it skips a job as handed off."""
    from splitserve_proto.v1 import worker_pb2 as w
    from splitserve_proto.v1 import worker_pb2_grpc

    r = stack.redis()
    address = _decode_0(stack)
    for rid, resumed in (("of-leg-2", 2), ("late-leg-0", 1)):  # the hashes as the legs' routers left them
        r.hset(stack.keys.req(rid), mapping={"state": "queued", "resumed": resumed, "decode_worker": "decode-new"})
        r.expire(stack.keys.req(rid), 120)
    with grpc.insecure_channel(address) as ch:
        stub = worker_pb2_grpc.DecodeWorkerStub(ch)
        late = stub.Decode(w.DecodeRequest(request_id="late-leg-0", prompt_tokens=4, leg=0), timeout=120)
        assert next(late).accepted
        stub.PutKVStream(iter(_kv_chunks(stack, _sequence("late-leg-0", 0), 4)), timeout=30)  # (its own leg: taken)
        decode = stub.Decode(w.DecodeRequest(request_id="of-leg-2", prompt_tokens=4, leg=2), timeout=120)
        assert next(decode).accepted
        stub.FirstToken(w.FirstTokenRequest(request_id="of-leg-2", token_ids=[7], text="x", leg=0), timeout=10)
        assert not stub.Fail(w.FailRequest(request_id="of-leg-2", code=13, message="old leg", leg=0), timeout=10).ended
        with pytest.raises(grpc.RpcError) as e:
            stub.PutKVStream(iter(_kv_chunks(stack, _sequence("of-leg-2", 0), 4)), timeout=30)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "sequence.leg" in e.value.details(), e.value.details()
        stub.PutKVStream(iter(_kv_chunks(stack, _sequence("of-leg-2", 2), 4)), timeout=30)
        events = list(decode)
        tokens = [t for ev in events for t in ev.token_ids]
        assert events[-1].finish_reason == "length" and not events[-1].error, events[-1]
        assert len(tokens) == 12 and tokens[0] == 105, tokens  # (not the old leg's first token, 7)
        assert [t for ev in late for t in ev.token_ids][0] == 105
    wait_for(lambda: r.hget(stack.keys.req("of-leg-2"), "state") == b"decoding", what="the leg's adoption recorded")
    assert r.hget(stack.keys.req("of-leg-2"), "decode_worker").startswith(b"decode-0")
    assert r.hget(stack.keys.req("of-leg-2"), "kv_leg") == b"2"  # (what a claim's pickup reads: pickup.lua)
    late_hash = r.hgetall(stack.keys.req("late-leg-0"))  # (written before the one just seen, had it been written)
    assert late_hash[b"state"] == b"queued" and late_hash[b"decode_worker"] == b"decode-new", late_hash
    assert b"t_kv_done" not in late_hash and b"kv_leg" not in late_hash
    r.delete(stack.keys.req("of-leg-2"), stack.keys.req("late-leg-0"))
    wait_for(lambda: kv_idle(stack), timeout=30, what="every worker's KV free")
