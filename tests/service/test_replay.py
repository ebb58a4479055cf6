"""Request ids: a reused id refused, an Abort that overtakes its request, and a request sent again
with its id run as a new attempt or answered with its recorded result."""

import threading
import time

import grpc
import pytest
from service_helpers import kv_idle, scrape, wait_for

from splitserve.client import Client, collect

from .common import consume_in_thread, resume_with, state_of


def test_an_abort_that_overtakes_its_request_refuses_it_as_cancelled(stack, client, other_router):
    """An Abort that reaches a router before its request reached any (it overtook its Generate,
    sent to another router) is NOT_FOUND, and is remembered: the request, when it comes, is
    refused CANCELLED naming the Abort instead of running. Guards against: it ran to its end."""
    with pytest.raises(grpc.RpcError) as e:
        other_router.abort("overtaken")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "refused as cancelled" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:  # a second Abort: the same
        client.abort("overtaken")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    before = scrape(stack.proc("router").metrics_address)
    for call in (
        lambda: client.generate("Count to one thousand:", max_tokens=50, request_id="overtaken"),
        lambda: list(client.generate_stream("Count to one thousand:", max_tokens=50, request_id="overtaken")),
    ):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.CANCELLED and "aborted before it arrived" in e.value.details()
    after = scrape(stack.proc("router").metrics_address)
    key = "splitserve_requests_cancelled_total{reason=abort}"
    assert after.get(key, 0) - before.get(key, 0) == 2
    with pytest.raises(grpc.RpcError) as e:
        client.get_request("overtaken")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "Abort" in e.value.details()
    assert 0 < stack.redis().ttl(stack.keys.req("overtaken")) <= 60
    assert (
        client.generate("Count to one thousand:", max_tokens=4, request_id="not-overtaken").usage.completion_tokens == 4
    )
    wait_for(lambda: kv_idle(stack), what="KV idle")


def test_a_reused_request_id_is_refused_and_leaves_the_first_request_alone(stack, client):
    got = []
    t = consume_in_thread(
        client.generate_stream("Tell me about rivers.", max_tokens=40, ignore_eos=True, request_id="twice"), got
    )
    wait_for(lambda: got, what="first tokens")
    with pytest.raises(grpc.RpcError) as e:
        client.generate("Something else.", max_tokens=4, request_id="twice")
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and "different request" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:  # the same request while it runs: not twice either
        client.generate("Tell me about rivers.", max_tokens=40, ignore_eos=True, request_id="twice")
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and "already exists" in e.value.details()
    t.join(60)
    assert got[-1].finish_reason == "length" and sum(len(c.token_ids) for c in got) == 40
    tm = got[-1].timings  # the first request's TTFT parts were not dropped by the refused one
    assert tm.admission_ms > 0 and tm.first_token_ms > 0
    assert client.get_request("twice").state == "finished"


def test_only_requests_of_at_most_replay_max_tokens_keep_their_result(small_queue_stack):
    """What Redis holds per finished request is bounded: with replay_max_tokens 8, a request for 8
    tokens is replayed; one for 9 is not kept, and sent again it is refused, saying why."""
    with Client(small_queue_stack.router_address) as c:
        kept = c.generate("Rivers.", max_tokens=8, ignore_eos=True, request_id="eight", timeout=60)
        assert c.generate("Rivers.", max_tokens=8, ignore_eos=True, request_id="eight", timeout=60).replayed
        c.generate("Rivers.", max_tokens=9, ignore_eos=True, request_id="nine", timeout=60)
        r = small_queue_stack.redis()
        assert r.hget(small_queue_stack.keys.req("nine"), "result_tokens") is None
        assert (
            r.hget(small_queue_stack.keys.req("eight"), "result_tokens") == ",".join(map(str, kept.token_ids)).encode()
        )
        with pytest.raises(grpc.RpcError) as e:
            c.generate("Rivers.", max_tokens=9, ignore_eos=True, request_id="nine", timeout=60)
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and "replay_max_tokens = 8" in e.value.details()


def test_a_request_a_prefill_worker_recorded_as_failed_ends_with_its_status_though_no_worker_ends_it(stack, client):
    """A prefill worker that fails a request records the status in its hash and tells the decode
    worker, which ends the stream; if that worker is out of its reach, the router reads the hash
    (each half heartbeat, for the requests waiting for a first token) and ends the call with the
    recorded status and message. Here the record is written while the prefill forward runs, as a
    prefill worker would write it, and nothing tells the decode worker."""
    wait_for(lambda: kv_idle(stack), what="idle before the test")
    got = []

    def long_one():
        try:
            # a first word of its own: no other test's prompt is in the prefix cache for it
            client.generate("recorded " + "word " * 1500, max_tokens=4, request_id="recorded-failure", timeout=60)
        except grpc.RpcError as e:
            got.append((e.code(), e.details(), time.monotonic()))

    t = threading.Thread(target=long_one)
    t.start()
    wait_for(
        lambda: state_of(client, "recorded-failure") == "prefilling",
        timeout=30,
        interval=0.02,
        what="the long prompt in its prefill forward",
    )
    stack.redis().hset(
        stack.keys.req("recorded-failure"),
        mapping={
            "state": "failed",
            "error": "KV handoff to decode worker decode-0 failed: UNAVAILABLE: unreachable",
            "code": grpc.StatusCode.UNAVAILABLE.value[0],
        },
    )
    t_written = time.monotonic()
    t.join(60)
    assert [(code, details) for code, details, _ in got] == [
        (grpc.StatusCode.UNAVAILABLE, "KV handoff to decode worker decode-0 failed: UNAVAILABLE: unreachable")
    ]
    assert got[0][2] - t_written < 5 * stack.settings.heartbeat_s  # not at the end of the forward, nor the deadline
    assert client.get_request("recorded-failure").state == "failed"
    wait_for(lambda: kv_idle(stack), timeout=30, what="the KV of the failed request freed")


def test_a_request_that_failed_is_sent_again_with_its_id_by_a_retrying_client_and_runs_as_a_new_attempt(stack, client):
    """A client with retries on (gRPC's retry policy) whose request fails UNAVAILABLE after it was
    admitted sends it again with the same request_id: it runs as a new attempt under its own id,
    untouched by what is left of the failed one (its prefill forward still running), and gives
    the right output. Guards against: the retry was refused ALREADY_EXISTS. Once it finished, the same
    request sent again gets that result without running; a different one under its id is refused,
    and GetRequest and Abort find the latest attempt."""
    wait_for(lambda: kv_idle(stack), what="idle before the test")
    prompt = "retried " + "word " * 1500  # a first word of its own: nothing cached makes its prefill short
    got = []
    with Client(stack.router_address, retries=2) as retrying:
        t = threading.Thread(
            target=lambda: got.append(
                retrying.generate(prompt, max_tokens=4, ignore_eos=True, request_id="retried", timeout=120)
            )
        )
        t.start()
        wait_for(
            lambda: state_of(client, "retried") == "prefilling",
            timeout=30,
            interval=0.02,
            what="the first attempt in its prefill forward",
        )
        stack.redis().hset(
            stack.keys.req("retried"),
            mapping={  # as a prefill worker records a failed handoff
                "state": "failed",
                "error": "KV handoff to decode worker decode-0 failed: UNAVAILABLE: unreachable",
                "code": grpc.StatusCode.UNAVAILABLE.value[0],
            },
        )
        t.join(120)
    ref = list(client.generate(prompt, max_tokens=4, ignore_eos=True, timeout=120).token_ids)  # from the cache
    assert len(got) == 1 and list(got[0].token_ids) == ref and got[0].request_id == "retried"
    info = client.get_request("retried")
    assert (info.state, info.attempts, info.finish_reason) == ("finished", 2, "length")
    assert stack.redis().hget(stack.keys.req("retried"), "state") == b"failed"  # the first attempt's own record
    again = client.generate(prompt, max_tokens=4, ignore_eos=True, request_id="retried")  # finished: never run twice
    assert again.replayed and list(again.token_ids) == ref and client.get_request("retried").attempts == 2
    with pytest.raises(grpc.RpcError) as e:  # not the same request (ignore_eos differs)
        client.generate(prompt, max_tokens=4, request_id="retried")
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and "different request" in e.value.details()
    assert client.abort("retried").state == "finished"
    wait_for(lambda: kv_idle(stack), timeout=30, what="the KV of both attempts freed")


def test_a_request_cancelled_by_its_deadline_or_its_client_runs_again_with_its_id_but_not_after_an_abort(stack, client):
    """A client whose deadline passed, or that cancelled its call (a dropped connection looks the
    same to the router), sends the request again with its request_id: it runs as a new attempt
    and gives the right output. Guards against: it was refused ALREADY_EXISTS. One ended by an Abort is
    refused, with a message that says so."""
    wait_for(lambda: kv_idle(stack), what="idle before the test")
    prompt = "Tell me everything about the ocean."
    # 120 tokens take 0.9 s and more here, far past the 0.3 s deadline below (40 once fitted in it,
    # the prompt's KV cached and handed over in part)
    n = 120
    ref = list(client.generate(prompt, max_tokens=n, ignore_eos=True, timeout=60).token_ids)

    def sent_again(rid: str) -> None:  # the same request, with a deadline it meets
        got = client.generate(prompt, max_tokens=n, ignore_eos=True, timeout=60, request_id=rid)
        assert list(got.token_ids) == ref and got.request_id == rid and not got.replayed
        info = client.get_request(rid)
        assert (info.state, info.attempts, info.finish_reason) == ("finished", 2, "length")

    with pytest.raises(grpc.RpcError) as e:
        client.generate(prompt, max_tokens=n, ignore_eos=True, timeout=0.3, request_id="past-deadline")
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: state_of(client, "past-deadline") == "cancelled", what="the deadline's cancellation recorded")
    sent_again("past-deadline")

    stream = client.generate_stream(prompt, max_tokens=n, ignore_eos=True, request_id="client-cancelled")
    assert next(stream).token_ids
    stream.cancel()
    wait_for(lambda: state_of(client, "client-cancelled") == "cancelled", what="the client's cancellation recorded")
    sent_again("client-cancelled")

    got = []
    t = consume_in_thread(client.generate_stream(prompt, max_tokens=400, ignore_eos=True, request_id="aborted"), got)
    wait_for(lambda: got, what="first tokens")
    assert client.abort("aborted").state in ("prefilling", "decoding")
    t.join(60)
    assert got[-1].finish_reason == "cancelled"
    with pytest.raises(grpc.RpcError) as e:
        client.generate(prompt, max_tokens=400, ignore_eos=True, request_id="aborted")
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and "aborted" in e.value.details()
    assert client.get_request("aborted").attempts == 1
    wait_for(lambda: kv_idle(stack), timeout=30, what="the KV of every attempt freed")


def test_a_finished_request_sent_again_with_its_id_gets_its_recorded_result_without_running(
    stack, client, other_router
):
    """request_id is idempotent: a client that lost the answer to a finished request (its
    connection dropped after the last message) sends it again and gets the same result, whole,
    marked replayed, from any router, without a second run; streamed, in one message. A
    different request under that id is refused ALREADY_EXISTS."""
    prompt = "Name three rivers."
    first = client.generate(prompt, max_tokens=12, ignore_eos=True, request_id="kept", timeout=60)
    assert not first.replayed and len(first.token_ids) == 12
    steps = scrape(stack.proc("decode-0").metrics_address)["splitserve_engine_steps_total"]

    def replays() -> float:  # at both routers
        return sum(
            scrape(p.metrics_address).get("splitserve_requests_replayed_total", 0)
            for p in stack.procs
            if p.name.startswith("router")
        )

    before = replays()
    again = client.generate(prompt, max_tokens=12, ignore_eos=True, request_id="kept", timeout=60)
    assert again.replayed and again.request_id == "kept"
    assert (list(again.token_ids), again.text, again.finish_reason) == (list(first.token_ids), first.text, "length")
    assert (again.usage.prompt_tokens, again.usage.completion_tokens) == (first.usage.prompt_tokens, 12)
    chunks = list(other_router.generate_stream(prompt, max_tokens=12, ignore_eos=True, request_id="kept", timeout=60))
    assert len(chunks) == 1 and chunks[0].replayed and list(chunks[0].token_ids) == list(first.token_ids)
    assert scrape(stack.proc("decode-0").metrics_address)["splitserve_engine_steps_total"] == steps  # no run
    # Streamed: the end is recorded before the last message goes out, so a re-send right after it is a replay.
    streamed = list(client.generate_stream(prompt, max_tokens=5, ignore_eos=True, request_id="kept-streamed"))
    assert not streamed[-1].replayed and streamed[-1].finish_reason == "length"
    assert client.generate(prompt, max_tokens=5, ignore_eos=True, request_id="kept-streamed").replayed
    wait_for(lambda: kv_idle(stack), what="the streamed request's KV freed")
    steps = scrape(stack.proc("decode-0").metrics_address)["splitserve_engine_steps_total"]
    assert client.generate(prompt, max_tokens=5, ignore_eos=True, request_id="kept-streamed").replayed
    assert scrape(stack.proc("decode-0").metrics_address)["splitserve_engine_steps_total"] == steps  # no run
    assert client.get_request("kept").attempts == 1
    assert replays() - before == 4


def test_a_finished_request_sent_again_to_go_on_gets_only_the_rest_of_its_recorded_result(stack, client):
    """A stream whose router was lost after the end was recorded, before its last message reached
    the client (resumes): the re-send, with the tokens the client has (resume_from), is replayed
    only what it does not have, so the stream goes on unbroken. A resumed attempt keeps what it
    sent after the tokens it went on from: replayed to a re-send that has at least those, refused
    ALREADY_EXISTS to one without them (the router never had them whole). Tokens other than the
    recorded ones are refused too."""
    prompt, kw = "Name three rivers.", dict(max_tokens=6, ignore_eos=True, logprobs=2)
    whole = list(client.generate_stream(prompt, request_id="kept-cut", **kw))
    ids = [t for c in whole for t in c.token_ids]
    text = "".join(c.text for c in whole)
    lps = [lp.logprob for c in whole for lp in c.logprobs]
    assert len(ids) == 6 and len(whole) >= 3
    had = [t for c in whole[:2] for t in c.token_ids]
    chars = sum(len(c.text) for c in whole[:2])
    rest = list(client.generate_stream(prompt, request_id="kept-cut", resume_from=(had, chars), **kw))
    assert len(rest) == 1 and rest[0].replayed and rest[0].finish_reason == "length"
    assert list(rest[0].token_ids) == ids[len(had) :] and rest[0].text == text[chars:]
    assert [lp.logprob for lp in rest[0].logprobs] == lps[len(had) :]
    assert rest[0].usage.completion_tokens == 6
    with pytest.raises(grpc.RpcError) as e:
        client.generate(prompt, request_id="kept-cut", resume_from=([ids[0] - 1 if ids[0] else 1, ids[1]], chars), **kw)
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and "other tokens than resume_from" in e.value.details()

    # A resumed attempt (it went on from 2 tokens) finishes, and is sent again to go on from 4.
    went_on = client.generate(prompt, request_id="kept-resumed", resume_from=(ids[:2], len(text)), **kw)
    assert not went_on.replayed and list(went_on.token_ids) == ids[2:]
    again = client.generate(prompt, request_id="kept-resumed", resume_from=(ids[:4], len(text) + 3), **kw)
    assert again.replayed and list(again.token_ids) == ids[4:] and again.text == went_on.text[3:]
    assert [lp.logprob for lp in again.logprobs] == [lp.logprob for lp in went_on.logprobs][2:]
    with pytest.raises(grpc.RpcError) as e:
        client.generate(prompt, request_id="kept-resumed", **kw)
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and "going on from 2 tokens" in e.value.details()
    assert client.get_request("kept-resumed").attempts == 1
    for changed in (
        {"max_tokens": 11, "ignore_eos": True},
        {"max_tokens": 12, "ignore_eos": True, "priority": 1},
        {"max_tokens": 12},
    ):
        with pytest.raises(grpc.RpcError) as e:
            client.generate(prompt, request_id="kept", timeout=60, **changed)
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and "different request" in e.value.details(), changed


def test_a_finished_request_of_n_samples_is_replayed_sample_by_sample(stack, client):
    """n > 1 keeps every sample's result (n x max_tokens within replay_max_tokens). Sent again:
    Generate gets every sample in choices, GenerateStream a message a sample, each replayed with
    its tokens, text, log probabilities, finish and usage. Sent again to go on (resume_from
    .samples): only what the client does not have of each sample, nothing of one it has finished.
    A resumed attempt keeps what came after: refused to a re-send without what it went on from."""
    from splitserve_proto.v1 import generation_pb2 as pb

    prompt, kw = "Name three rivers.", dict(n=2, max_tokens=6, ignore_eos=True, temperature=1.0, seed=3, logprobs=1)
    chunks = list(client.generate_stream(prompt, request_id="n-kept", **kw))
    first = collect(chunks, 2)
    a, b = first.choices
    assert not first.replayed and [len(c.token_ids) for c in first.choices] == [6, 6] and a.token_ids != b.token_ids

    def same(got, want):
        assert [(c.index, list(c.token_ids), c.text, c.finish_reason, c.usage.completion_tokens) for c in got] == [
            (c.index, list(c.token_ids), c.text, c.finish_reason, c.usage.completion_tokens) for c in want
        ]
        assert [[lp.logprob for lp in c.logprobs] for c in got] == [[lp.logprob for lp in c.logprobs] for c in want]

    again = client.generate(prompt, request_id="n-kept", **kw)
    assert again.replayed and all(c.replayed for c in again.choices) and list(again.token_ids) == list(a.token_ids)
    same(again.choices, first.choices)
    streamed = list(client.generate_stream(prompt, request_id="n-kept", **kw))
    assert len(streamed) == 2 and all(c.replayed for c in streamed)
    same(streamed, first.choices)

    # the client has sample 0 whole and sample 1's first message: replayed the rest of sample 1
    b_first = next(c for c in chunks if c.index == 1)
    assert 0 < len(b_first.token_ids) < 6
    cont = pb.Continuation(
        samples=[
            pb.SampleContinuation(index=0, token_ids=a.token_ids, text_chars=len(a.text), finished=True),
            pb.SampleContinuation(index=1, token_ids=b_first.token_ids, text_chars=len(b_first.text)),
        ]
    )
    rest = list(client.generate_stream(prompt, request_id="n-kept", resume_from=cont, **kw))
    assert len(rest) == 1 and rest[0].replayed and rest[0].index == 1 and rest[0].finish_reason == "length"
    assert list(b_first.token_ids) + list(rest[0].token_ids) == list(b.token_ids)
    assert b_first.text + rest[0].text == b.text
    assert [lp.logprob for lp in rest[0].logprobs] == [lp.logprob for lp in b.logprobs][len(b_first.token_ids) :]
    cont.samples[1].token_ids[0] += 1
    with pytest.raises(grpc.RpcError) as e:
        client.generate(prompt, request_id="n-kept", resume_from=cont, **kw)
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and "other tokens than resume_from" in e.value.details()

    # a resumed attempt: sample 0 had finished, sample 1 went on from its first message
    cont.samples[1].token_ids[0] -= 1
    went_on = list(client.generate_stream(prompt, request_id="n-resumed", resume_from=cont, **kw))
    assert {c.index for c in went_on} == {1} and not any(c.replayed for c in went_on)
    replay = list(client.generate_stream(prompt, request_id="n-resumed", resume_from=cont, **kw))
    assert len(replay) == 1 and replay[0].replayed
    same(replay, [collect(went_on, 2).choices[0]])
    for other in (None, resume_with((0, list(a.token_ids[:5]), False), (1, list(b_first.token_ids), False))):
        with pytest.raises(grpc.RpcError) as e:
            client.generate(prompt, request_id="n-resumed", resume_from=other, **kw)
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and "sample 0 had finished before" in e.value.details()
    wait_for(lambda: kv_idle(stack), what="every sample's KV freed")


def test_a_re_send_holding_a_samples_last_token_but_not_its_end_gets_that_end(stack, client):
    """n > 1: sample 0's first token goes out ahead of its KV, and the message of its end (here
    max_tokens 1) comes after. A client whose router was lost between the two has every token of
    that sample but not its end, and sends it again so (resume_from.samples, not finished): it gets
    that end, replayed from the finished attempt or from a new one, in which the sample is not run
    on and the others go on (not: INVALID_ARGUMENT, "leaves none to generate")."""
    prompt, kw = "Name a colour.", dict(n=2, max_tokens=1, ignore_eos=True, temperature=1.0, seed=5)
    whole = collect(list(client.generate_stream(prompt, request_id="n-last", **kw)), 2)
    a, b = whole.choices
    assert [len(c.token_ids) for c in whole.choices] == [1, 1]

    def seen(msgs):
        return [(m.index, list(m.token_ids), m.finish_reason, m.usage.completion_tokens, m.replayed) for m in msgs]

    held = resume_with((0, list(a.token_ids), False), (1, list(b.token_ids), True))
    assert seen(client.generate_stream(prompt, request_id="n-last", resume_from=held, **kw)) == [
        (0, [], "length", 1, True)
    ]
    # a new attempt: sample 0 ends at once, sample 1 (not started) is run
    held = resume_with((0, list(a.token_ids), False))
    got = seen(client.generate_stream(prompt, request_id="n-last-again", resume_from=held, **kw))
    assert sorted(got) == [(0, [], "length", 1, False), (1, list(b.token_ids), "length", 1, False)]
    info = client.get_request("n-last-again")
    assert info.state == "finished" and info.completion_tokens == 2
    # every sample so: none is run, and the request finishes
    held = resume_with((0, list(a.token_ids), False), (1, list(b.token_ids), False))
    got = seen(client.generate_stream(prompt, request_id="n-last-both", resume_from=held, **kw))
    assert sorted(got) == [(0, [], "length", 1, False), (1, [], "length", 1, False)]
    assert client.get_request("n-last-both").state == "finished"
    wait_for(lambda: kv_idle(stack), what="every sample's KV freed")
