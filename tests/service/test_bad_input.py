"""Bad input anywhere (requests, worker calls, messages, stream entries) gets a clear error naming
the field, and leaves every other request's work alone."""

import collections
import concurrent.futures as cf
import json
import threading
import time

import grpc
import pytest
from fuzz_seeds import fuzz_seeds
from service_helpers import heartbeat, kv_idle, wait_for, workers

from splitserve.client import Client
from splitserve.service.settings import Settings

from .common import (
    admission_counts,
    admitted_by_hand,
    finish_stack,
    greedy_clients_beside,
    job_json,
    model_fingerprint,
    resume_with,
    start_stack,
)


@pytest.mark.parametrize(
    "kw, field",
    [
        ({}, "input"),
        ({"prompt": "hi", "max_tokens": 0}, "sampling.max_tokens"),
        ({"prompt": "hi", "max_tokens": 9000}, "sampling.max_tokens"),
        ({"prompt": "hi", "temperature": -0.5}, "sampling.temperature"),
        ({"prompt": "hi", "top_p": 0.0}, "sampling.top_p"),
        ({"prompt": "hi", "top_p": 1.5}, "sampling.top_p"),
        ({"prompt": "hi", "top_k": -1}, "sampling.top_k"),
        ({"prompt": "hi", "min_tokens": 20, "max_tokens": 5}, "sampling.min_tokens"),
        ({"token_ids": [1, 99999999]}, "token_ids"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "hi"}]}, "messages[1].role"),
        # a message that quotes a long input is cut to fit gRPC's trailers (not: RESOURCE_EXHAUSTED, "Stream
        # removed (received metadata size exceeds hard limit)", instead of the status)
        ({"messages": [{"role": "\u4e2d" * 30000, "content": "hi"}]}, "messages[0].role: must be one of"),
        ({"prompt": "word " * 9000}, "prompt"),
        ({"token_ids": [1] * 8192}, "token_ids"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "hi", "request_id": "bad id with spaces"}, "request_id"),
        ({"prompt": "hi", "stop": [f"s{i}" for i in range(33)]}, "sampling.stop"),
        ({"prompt": "hi", "stop": ["ok", "x" * 513]}, "sampling.stop[1]"),
        ({"prompt": "hi", "stop_token_ids": [2] * 1025}, "sampling.stop_token_ids"),
        ({"prompt": "hi", "logprobs": 21}, "sampling.logprobs"),
        ({"prompt": "hi", "logprobs": -1}, "sampling.logprobs"),
        ({"prompt": "hi", "prompt_logprobs": 21}, "sampling.prompt_logprobs"),
        ({"prompt": "hi", "presence_penalty": 2.5}, "sampling.presence_penalty"),
        ({"prompt": "hi", "frequency_penalty": -3.0}, "sampling.frequency_penalty"),
        ({"prompt": "hi", "repetition_penalty": 0.0}, "sampling.repetition_penalty"),
        ({"prompt": "hi", "min_p": 2.0}, "sampling.min_p"),
        ({"prompt": "hi", "logit_bias": {49152: 1.0}}, "sampling.logit_bias"),
        ({"prompt": "hi", "logit_bias": {5: -200.0}}, "sampling.logit_bias"),
        ({"prompt": "hi", "structured_output": {"json_schema": "{not json"}}, "sampling.structured_output.json_schema"),
        (
            {"prompt": "hi", "structured_output": {"json_schema": {"type": "objekt"}}},
            "sampling.structured_output.json_schema: Invalid type: objekt",
        ),
        ({"prompt": "hi", "structured_output": {"regex": "(ab"}}, "sampling.structured_output.regex"),
        ({"prompt": "hi", "structured_output": {"regex": "a{200000}"}}, "sampling.structured_output.regex: too costly"),
        ({"prompt": "hi", "structured_output": {"lark": "start: undefined"}}, "sampling.structured_output.lark"),
        ({"prompt": "hi", "structured_output": {"choice": []}}, "sampling.structured_output.choice"),
        ({"prompt": "hi", "truncate_prompt_tokens": 0}, "sampling.truncate_prompt_tokens: must be >= 1"),
        ({"prompt": "hi", "n": 17}, "sampling.n: must be in [1, 16]"),
        ({"prompt": "hi", "n": 0}, "sampling.n: must be in [1, 16]"),
        (
            {"prompt": "hi", "structured_output": {"choice": ["a"], "disable_any_whitespace": True}},
            "sampling.structured_output.disable_any_whitespace: applies to json_schema and json_object",
        ),
        ({"prompt": "hi", "structured_output": {"json_object": False}}, "sampling.structured_output.json_object"),
        (
            {
                "prompt": "hi",
                "structured_output": __import__(
                    "splitserve_proto.v1.generation_pb2", fromlist=["x"]
                ).StructuredOutput(),
            },
            "sampling.structured_output: set, but with none",
        ),
        ({"prompt": "word " * 200_000}, "prompt: is 1000000 characters"),  # refused before tokenizing
        ({"messages": [{"role": "user", "content": "hi"}] * 8193}, "messages: 8193 messages"),
        (
            {"prompt": "hi", "n": 2, "resume_from": ([5], 1)},
            "resume_from.token_ids: sampling.n is 2: send each sample's",
        ),
        (
            {"prompt": "hi", "resume_from": resume_with((0, [5], False))},
            "resume_from.samples: are for sampling.n > 1",
        ),
        (
            {"prompt": "hi", "n": 2, "resume_from": resume_with((2, [5], False))},
            "resume_from.samples[0].index: 2 is not below sampling.n (2)",
        ),
        (
            {"prompt": "hi", "n": 2, "resume_from": resume_with((0, [5], False), (0, [6], False))},
            "resume_from.samples[1].index: sample 0 is listed twice",
        ),
        (
            {"prompt": "hi", "n": 2, "max_tokens": 3, "resume_from": resume_with((1, [5, 6, 7, 8], False))},
            "resume_from.samples[0].token_ids: 4 tokens: more than sampling.max_tokens (3)",
        ),
        (
            {"prompt": "hi", "n": 2, "resume_from": resume_with((0, [5], True), (1, [49152], False))},
            "resume_from.samples[1].token_ids: token id 49152",
        ),
        (
            {"prompt": "hi", "n": 2, "resume_from": resume_with((0, [5], True), (1, [6], True))},
            "resume_from.samples: all 2 samples finished",
        ),
        ({"prompt": "hi", "max_tokens": 3, "resume_from": ([5, 6, 7], 3)}, "resume_from.token_ids: 3 tokens"),
        ({"prompt": "hi", "resume_from": ([5, 49152], 3)}, "resume_from.token_ids: token id 49152"),
        ({"prompt": "hi", "resume_from": ([5, 2], 3)}, "resume_from.token_ids: the last, 2, ends the request"),
        (
            {"prompt": "hi", "stop_token_ids": [7], "resume_from": ([5, 7], 3)},
            "resume_from.token_ids: the last, 7, ends the request",
        ),
        (
            {"prompt": "hi", "stop": ["Danube"], "resume_from": ([260, 37939], 11)},  # " the Danube"
            "resume_from.token_ids: their text holds the stop string 'Danube'",
        ),
        (
            {"prompt": "hi", "structured_output": {"choice": ["yes", "no"]}, "resume_from": ([10407], 3)},  # "yes"
            "resume_from.token_ids: these tokens complete sampling.structured_output.choice",
        ),
        # tokens sent again that the format does not allow ("12 pears"): refused by the router, naming them, in
        # one line (not: by the prefill worker, naming the format, with llguidance's whole parser state)
        (
            {"prompt": "hi", "structured_output": {"regex": "[0-9]+ apples"}, "resume_from": ([33, 34, 41684], 8)},
            "resume_from.token_ids: these tokens do not follow sampling.structured_output.regex: Parser Error: "
            'token " pears"',
        ),
        (
            {
                "prompt": "hi",
                "n": 2,
                "structured_output": {"choice": ["yes", "no"]},  # "maybe"; the finished one: not run
                "resume_from": resume_with((0, [27066], True), (1, [27066], False)),
            },
            "resume_from.samples[1].token_ids: these tokens do not follow sampling.structured_output.choice",
        ),
    ],
)
def test_bad_requests_are_invalid_argument_naming_the_field(client, kw, field):
    prompt = kw.pop("prompt", None)
    with pytest.raises(grpc.RpcError) as e:
        if prompt is None and not kw.get("token_ids") and "messages" not in kw:
            client.stub.Generate(__import__("splitserve_proto.v1.generation_pb2", fromlist=["x"]).GenerateRequest())
        else:
            client.generate(prompt, **kw)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details() and "<state>" not in e.value.details(), e.value.details()  # llguidance's


@pytest.mark.parametrize("seed", fuzz_seeds([11]))
def test_random_requests_get_what_they_asked_for_or_a_clear_error(stack, client, seed):
    """A seeded fuzz of GenerateRequest (request_fuzz): 240 requests, each field drawn among valid
    values and edges, four in ten with one part wrong, sent six at a time, unary or streamed (one
    stream in seven cancelled after its first message). Each ends OK with what it asked for (its
    samples, each at most max_tokens, a log probability a token), INVALID_ARGUMENT whose message
    starts with the field it names, or ALREADY_EXISTS (an id sent again while its first runs, or
    for another request); no other status, and no parser state in a message. Then 120 random calls
    of Tokenize, Detokenize, GetRequest and Abort (request_fuzz.random_side_call), about those
    requests and others, each OK, NOT_FOUND or INVALID_ARGUMENT naming the field. The stack serves
    after, and the module's leak checks find nothing held. (Found: tokens sent again that a format
    does not allow were refused by the prefill worker, naming the format, with llguidance's state.)"""
    import random

    from request_fuzz import FIELD, answer_fault, random_request, random_side_call

    rng, ids = random.Random(seed), []
    requests = [random_request(rng, ids) for _ in range(240)]

    def send(i: int) -> tuple[str, str]:
        req, got = requests[i], []
        try:
            if i % 2 == 0:
                return "OK", answer_fault(req, client.stub.Generate(req, timeout=60), unary=True)
            call = client.stub.GenerateStream(req, timeout=60)
            for m in call:
                got.append(m)
                if i % 7 == 3:
                    call.cancel()
            return "OK", answer_fault(req, got, unary=False)
        except grpc.RpcError as e:
            if i % 7 == 3 and e.code() == grpc.StatusCode.CANCELLED and got:
                return "cancelled by the client", ""
            return e.code().name, e.details() or ""

    with cf.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(send, range(len(requests))))
    wrong = [
        (code, detail, str(requests[i])[:400])
        for i, (code, detail) in enumerate(answers)
        if (code == "OK" and detail)
        or code not in ("OK", "INVALID_ARGUMENT", "ALREADY_EXISTS", "cancelled by the client")
        or (code == "INVALID_ARGUMENT" and (not FIELD.match(detail) or "<state>" in detail))
    ]
    assert wrong == [], wrong
    counts = collections.Counter(code for code, _ in answers)
    assert counts["OK"] >= 60 and counts["INVALID_ARGUMENT"] >= 60, counts  # both kinds, many of each
    # Then the router's other methods, valid or not, about those requests and others: OK with a
    # consistent answer, NOT_FOUND (an unknown id), or INVALID_ARGUMENT naming the field.
    side = [random_side_call(rng, ids) for _ in range(120)]

    def call(i: int) -> tuple[str, str, str]:
        method, req = side[i]
        try:
            got = getattr(client.stub, method)(req, timeout=30)
        except grpc.RpcError as e:
            return method, e.code().name, e.details() or ""
        if method == "Tokenize" and (got.count != len(got.token_ids) or not got.count or not got.max_model_len):
            return method, "OK", f"wrong: {got}"
        if method == "GetRequest" and (got.request_id != req.request_id or not got.state):
            return method, "OK", f"wrong: {got}"
        return method, "OK", ""

    with cf.ThreadPoolExecutor(6) as pool:
        calls = list(pool.map(call, range(len(side))))
    wrong = [
        c
        for c in calls
        if (c[1] == "OK" and c[2])
        or c[1] not in ("OK", "INVALID_ARGUMENT", "NOT_FOUND")
        or (c[1] == "INVALID_ARGUMENT" and not FIELD.match(c[2]))
        or (c[1] == "NOT_FOUND" and c[0] not in ("GetRequest", "Abort"))
    ]
    assert wrong == [], wrong
    counts = collections.Counter((method, code) for method, code, _ in calls)
    assert all(counts[m, "OK"] >= 5 for m in ("Tokenize", "Detokenize", "GetRequest", "Abort")), counts
    assert len(client.generate("still serving", max_tokens=2).token_ids) == 2


@pytest.mark.parametrize("seed", fuzz_seeds([0]))
def test_random_decode_worker_calls_get_a_clear_answer_and_leave_other_requests_alone(stack, client, seed):
    """A seeded fuzz of the decode worker's internal API (worker_fuzz): 100 rounds, six at a time,
    each a Decode stream and one to three handoffs, first tokens, failures, cancels or PrefillHere
    calls for it, half of the rounds with one part wrong, while two clients send greedy requests
    through the router. Every answer is OK, or a clear status (INVALID_ARGUMENT starting with the
    field it names, NOT_FOUND, ALREADY_EXISTS, FAILED_PRECONDITION, CANCELLED, DEADLINE_EXCEEDED);
    every stream ends with a finish reason the API has. The clients' requests all get their tokens,
    every process lives, and the module's leak checks find nothing held. (Found: a handoff's payload
    header, its resumed tokens or tokens a format does not allow were refused without naming the
    field; a sequence that finished at prefill with any finish reason, or a prompt length of none
    of its tokens, was taken.)"""
    import random

    from worker_fuzz import fault, round_of

    wait_for(lambda: kv_idle(stack), what="idle before the test")
    dec = workers(stack, "decode")[0]
    arena = workers(stack, "prefill")[0]["arena"]  # its name is random: the registry says it
    with (
        grpc.insecure_channel(dec["address"]) as ch,
        cf.ThreadPoolExecutor(6) as pool,
        greedy_clients_beside(stack, client),
    ):
        stub = __import__("splitserve_proto.v1.worker_pb2_grpc", fromlist=["x"]).DecodeWorkerStub(ch)
        rounds = list(
            pool.map(
                lambda i: round_of(stub, random.Random(i), f"wfz-{i}", model_fingerprint(stack), arena, dec["host_id"]),
                range(seed * 100, seed * 100 + 100),
            )
        )
    answers = [a for r in rounds for a in r]
    wrong = [f for a in answers if (f := fault(*a))]
    assert wrong == [], wrong
    counts = collections.Counter((what, code) for what, code, _ in answers)
    for call in ("PutKVStream", "PrefillHere"):  # each both taken and refused, many times
        assert counts[call, "OK"] >= 5 and counts[call, "INVALID_ARGUMENT"] >= 5, counts
    assert counts["Decode", "OK"] >= 20, counts
    assert all(p.popen.poll() is None for p in stack.procs)


@pytest.mark.parametrize("seed", fuzz_seeds([0]))
def test_random_prefill_jobs_in_redis_end_their_streams_clearly_and_leave_other_requests_alone(stack, client, seed):
    """A seeded fuzz of the jobs a prefill worker reads from Redis (job_fuzz): 120 rounds, six at a
    time, each a decode stream, its request hash and admission counts as a router's admission
    writes them, and one stream entry: a job as a router writes it or, in most rounds, with a field
    missing, of another type or out of range, a sampling knob a router refuses, or JSON that is no
    job (nested past Python's recursion limit, among others); meanwhile two clients send greedy
    requests through the router. A valid job's stream gets its tokens; another's ends with INTERNAL
    "malformed prefill job" or INVALID_ARGUMENT naming the field (or runs, if the value does no
    harm), except where the job names no stream to end. Every entry is acked and deleted, the
    admission counts come back, the clients' requests all get their tokens, and every process lives.
    (Found: a job of another type in deadline_unix, leg or t_received failed the pickup's Redis
    script, and the worker pulled no job again: every worker that claimed it stopped pulling; an
    infinite t_admitted, or JSON nested too deep, killed the worker, and each that claimed it after;
    a top_k of 1.5 failed in the sampler, INTERNAL; other refusals named no field.)"""
    import random

    from job_fuzz import fault, round_of

    wait_for(lambda: kv_idle(stack), what="idle before the test")
    dec = workers(stack, "decode")[0]
    before, r = admission_counts(stack), stack.redis()
    with (
        grpc.insecure_channel(dec["address"]) as ch,
        cf.ThreadPoolExecutor(6) as pool,
        greedy_clients_beside(stack, client),
    ):
        stub = __import__("splitserve_proto.v1.worker_pb2_grpc", fromlist=["x"]).DecodeWorkerStub(ch)
        rounds = list(
            pool.map(
                lambda i: round_of(stack, stub, random.Random(i), f"jfz-{i}", dec), range(seed * 120, seed * 120 + 120)
            )
        )
    wrong = [f"round {i}: {f}" for i, (what, out) in enumerate(rounds) if (f := fault(what, out))]
    assert wrong == [], wrong
    counts = collections.Counter((bool(what), out[0]) for what, out in rounds)
    assert counts[False, "OK"] >= 20 and counts[True, "INTERNAL"] >= 10 and counts[True, "INVALID_ARGUMENT"] >= 10, (
        counts
    )
    wait_for(
        lambda: all(r.xlen(s) == 0 and r.xpending(s, "prefill")["pending"] == 0 for s in stack.keys.streams),
        what="every entry acked and deleted",
    )
    wait_for(lambda: admission_counts(stack) == before, what=f"admission counts back to {before}")
    assert all(p.popen.poll() is None for p in stack.procs)


def test_the_router_tokenizes_long_inputs_off_its_event_loop():
    """Tokenizing takes ~0.7 s a MB; on the event loop that relays every stream's tokens it held
    them all (a 3.6 MB prompt: 2.2 s). Long inputs go to a thread; short ones stay in place."""
    import asyncio

    import redis.asyncio as aioredis

    from splitserve.router.frontend import Frontend
    from splitserve.router.requests import INLINE_TOKENIZE_CHARS
    from splitserve.router.server import RouterServicer
    from splitserve_proto.v1 import generation_pb2 as pb

    front = Frontend(Settings.from_env())
    on_loop_thread, encode = [], front.prompt_ids
    front.prompt_ids = lambda req: (
        on_loop_thread.append(threading.current_thread() is threading.main_thread()) or encode(req)
    )
    router = RouterServicer(Settings.from_env(), front, aioredis.Redis())  # _validate uses no Redis
    chat = pb.Messages(messages=[pb.ChatMessage(role="user", content="word " * 20)] * 50)
    requests = [
        pb.GenerateRequest(prompt="word " * 100),
        pb.GenerateRequest(prompt="word " * 2000),
        pb.GenerateRequest(messages=chat),
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 5000)),
    ]
    assert [front.check_input_size(r) > INLINE_TOKENIZE_CHARS for r in requests] == [False, True, True, False]
    ids = [asyncio.run(router._validate(r))[1] for r in requests]
    assert on_loop_thread == [True, False, False, True]
    assert ids == [encode(r) for r in requests] and len(ids[1]) > 2000

    # What is refused unread is refused rightly: no text has fewer tokens than characters / the bound.
    tok = front.tokenizer
    longest = max(tok.rust.get_vocab(with_added_tokens=True), key=len)
    text = tok.rust.decoder.decode([longest]) * 50
    assert len(text) <= 50 * tok.max_token_chars and len(tok.encode(text)) >= len(text) / tok.max_token_chars


def test_the_router_refuses_a_message_larger_than_any_request_that_can_fit_before_reading_it(stack, client):
    from splitserve_proto.v1 import generation_pb2 as pb
    from splitserve_proto.v1 import generation_pb2_grpc

    with grpc.insecure_channel(stack.router_address, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        with pytest.raises(grpc.RpcError) as e:  # 6 MB: 6M token ids (not: read, parsed, then refused)
            stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 6_000_000)), timeout=30)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
        assert "larger than max" in e.value.details() and str(4 << 20) in e.value.details()
        with pytest.raises(grpc.RpcError) as e:  # 3 MB of text is read, and refused by its length
            stub.Generate(pb.GenerateRequest(prompt="word " * 600_000), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "3000000 characters" in e.value.details()
    assert len(client.generate("still serving", max_tokens=2).token_ids) == 2


def test_abort_and_get_request_refuse_ids_that_generate_refuses_and_store_nothing(stack, client):
    from splitserve_proto.v1 import generation_pb2 as pb

    before = set(stack.redis().keys("*"))
    for rid in ("", "x" * 129, "has space", "{tag}", "a\nb", "\u00e9"):
        for call in (
            lambda: client.stub.Abort(pb.AbortRequest(request_id=rid), timeout=10),
            lambda: client.stub.GetRequest(pb.GetRequestRequest(request_id=rid), timeout=10),
        ):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (rid, e.value.details())
            assert e.value.details().startswith("request_id:"), e.value.details()
    # not: an Abort for any string, up to the 4 MB a message may carry, left a key for 60 s.
    assert set(stack.redis().keys("*")) - before == set()
    # The longest id Generate accepts is still one Abort may name before it arrives.
    rid = "y" * 128
    with pytest.raises(grpc.RpcError) as e:
        client.stub.Abort(pb.AbortRequest(request_id=rid), timeout=10)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND, e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        client.generate("hi", max_tokens=2, request_id=rid)
    assert e.value.code() == grpc.StatusCode.CANCELLED, e.value.details()


def test_requests_that_can_never_fit_fail_at_once_naming_the_field():
    # Decode pool 1024 tokens, prefill pool 256: each side's limit is reached on its own.
    kv_per_token = 30 * 2 * 3 * 64 * 4
    stack = start_stack(kv_cache_bytes=64 * 16 * kv_per_token, prefill_kv_cache_bytes=16 * 16 * kv_per_token)
    try:
        with Client(stack.router_address) as c:
            wait_for(
                lambda: all(w["kv_capacity_tokens"] == "1024" for w in workers(stack, "decode")),
                what="the decode worker's capacity in the registry",
            )
            # Refused by the router, from the registry: the decode worker can never hold it.
            with pytest.raises(grpc.RpcError) as e:
                c.generate(token_ids=list(range(100, 120)), max_tokens=2000, timeout=60)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "sampling.max_tokens" in e.value.details() and "1024" in e.value.details()
            # Refused by the prefill worker, whose pool is smaller; relayed through the decode worker (Fail)
            # rather than left waiting for a KV that will never come.
            with pytest.raises(grpc.RpcError) as e:
                c.generate(token_ids=list(range(100, 500)), max_tokens=4, timeout=60, request_id="too-long")
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
            assert e.value.details().startswith("prompt:") and "400 tokens" in e.value.details()
            assert c.get_request("too-long").state == "failed"
            # Prefill needs room for the prompt only; the decode side holds the whole completion.
            ok = c.generate(token_ids=list(range(100, 300)), max_tokens=100, ignore_eos=True, timeout=120)
            assert len(ok.token_ids) == 100
        assert all(p.popen.poll() is None for p in stack.procs)
    finally:
        finish_stack(stack)


def test_messages_that_do_not_parse_are_invalid_argument_naming_the_type(stack, client):
    f = __import__("splitserve_proto.v1.generation_pb2", fromlist=["x"]).GenerateRequest.DESCRIPTOR
    bad_utf8 = bytes([(f.fields_by_name["prompt"].number << 3) | 2, 3]) + b"\xff\xfe\x80"
    corrupt = b"\xff\xff\xff\xff"
    dec = workers(stack, "decode")[0]["address"]
    calls = [  # every kind of handler: unary, server streaming, client streaming
        (
            stack.router_address,
            "/splitserve.v1.Generation/Generate",
            "unary",
            bad_utf8,
            "splitserve.v1.GenerateRequest",
        ),
        (
            stack.router_address,
            "/splitserve.v1.Generation/GenerateStream",
            "stream",
            corrupt,
            "splitserve.v1.GenerateRequest",
        ),
        (dec, "/splitserve.v1.DecodeWorker/PutKV", "unary", corrupt, "splitserve.v1.PutKVRequest"),
        (dec, "/splitserve.v1.DecodeWorker/PutKVStream", "client-stream", corrupt, "splitserve.v1.KVChunk"),
        (dec, "/splitserve.v1.DecodeWorker/FirstTokens", "client-stream", corrupt, "splitserve.v1.FirstTokenRequest"),
    ]
    for address, method, kind, payload, type_name in calls:
        with grpc.insecure_channel(address) as ch, pytest.raises(grpc.RpcError) as e:
            raw = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)
            if kind == "unary":
                ch.unary_unary(method, **raw)(payload, timeout=10)
            elif kind == "stream":
                list(ch.unary_stream(method, **raw)(payload, timeout=10))
            else:
                ch.stream_unary(method, **raw)(iter([payload]), timeout=10)
        # not: UNKNOWN "Unexpected <class 'google.protobuf.message.DecodeError'>"
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, e.value)
        assert f"does not parse as {type_name}" in e.value.details()
    assert len(client.generate("still serving", max_tokens=2).token_ids) == 2


def test_malformed_stream_entries_are_dropped_and_a_newer_routers_job_is_served(stack, client):
    from splitserve_proto.v1 import worker_pb2_grpc

    r = stack.redis()
    p = stack.keys.prefix
    stream = f"{p}:prefill"
    dec = workers(stack, "decode")[0]
    job = job_json(dec, "newer", [1, 504, 3277, 28, 8296, 30])
    ch = grpc.insecure_channel(dec["address"])
    stub = worker_pb2_grpc.DecodeWorkerStub(ch)
    before = admission_counts(stack)
    typo = admitted_by_hand(stack, stub, "typo", 3)  # its token_ids are a string: dropped, and its stream must end now
    salt = admitted_by_hand(stack, stub, "salt", 3)  # its cache_salt is a number, which could pass for a cache entry
    r.hincrby(f"{p}:admission", "requests", 2)  # two unreadable entries that admission counted
    r.hincrby(f"{p}:admission", "tokens", 7 + 5)
    for fields in (
        {"job": "{not json", "tokens": "7"},
        {"job": "[1, 2]"},
        {"job": json.dumps({"request_id": "half"}), "tokens": "5"},
        {"something": "else", "tokens": "-4"},
        {"job": "{}", "tokens": "lots"},
        {"job": json.dumps(job | {"request_id": "typo", "token_ids": "1 2 3"}), "tokens": "3"},
        {"job": json.dumps(job | {"request_id": "salt", "token_ids": [1, 2, 3], "cache_salt": 7}), "tokens": "3"},
    ):
        r.xadd(stream, fields)
    for call, field in ((typo, "token_ids"), (salt, "cache_salt")):
        ended = list(call)
        assert len(ended) == 1 and ended[0].error_code == grpc.StatusCode.INTERNAL.value[0], ended
        assert "malformed prefill job" in ended[0].error and field in ended[0].error
    assert r.hmget(f"{p}:req:typo", "state", "code") == [b"failed", str(grpc.StatusCode.INTERNAL.value[0]).encode()]
    # A job from a newer router: fields this version does not know, in the job and in its
    # sampling. Queued as the router would.
    ids = job["token_ids"]
    decode = admitted_by_hand(stack, stub, "newer", len(ids))
    newer = job | {"a_field_from_the_future": {"x": 1}, "sampling": job["sampling"] | {"a_future_knob": 0.5}}
    r.xadd(stream, {"job": json.dumps(newer), "tokens": str(len(ids))})
    events = list(decode)
    ch.close()
    assert sum(len(e.token_ids) for e in events) == 3 and events[-1].finish_reason == "length", events
    assert list(client.generate(token_ids=ids, max_tokens=3, ignore_eos=True).token_ids) == [
        t for e in events for t in e.token_ids
    ]
    wait_for(
        lambda: r.xlen(stream) == 0 and r.xpending(stream, "prefill")["pending"] == 0,
        what="every entry acked and deleted",
    )
    # every count admission took came back, and the entries admission never counted took none
    wait_for(lambda: admission_counts(stack) == before, what=f"admission counts back to {before}")
    assert all(pr.popen.poll() is None for pr in stack.procs)


def test_an_entry_whose_count_is_not_its_prompts_is_dropped_and_leaves_the_counts_as_admission_left_them(stack):
    """A stream entry's 'tokens' (the prompt tokens admission counted) and its job's token_ids agree
    in every entry a router writes. One where they differ, or with no count, is dropped as
    malformed, naming both, and its stream ends. Guards against: it was served, and its pickup took
    len(token_ids) out of the counts, leaving the difference there for good (a seed of the job
    fuzz left 26 tokens counted after one such entry), or taking out what admission never put in."""
    from splitserve_proto.v1 import worker_pb2_grpc

    r, p = stack.redis(), stack.keys.prefix
    dec = workers(stack, "decode")[0]
    ids = [1, 504, 3277, 28, 8296, 30]
    before = admission_counts(stack)
    with grpc.insecure_channel(dec["address"]) as ch:
        stub = worker_pb2_grpc.DecodeWorkerStub(ch)
        more = admitted_by_hand(stack, stub, "counted-more", 27)  # admission counted 27; the job has 6
        r.xadd(f"{p}:prefill", {"job": json.dumps(job_json(dec, "counted-more", ids)), "tokens": "27"})
        uncounted = admitted_by_hand(stack, stub, "uncounted", 0)  # no count: admission took none
        r.hincrby(f"{p}:admission", "requests", -1)
        r.xadd(f"{p}:prefill", {"job": json.dumps(job_json(dec, "uncounted", ids))})
        for call in (more, uncounted):
            ended = list(call)
            assert len(ended) == 1 and ended[0].error_code == grpc.StatusCode.INTERNAL.value[0], ended
            assert "malformed prefill job" in ended[0].error, ended
            assert "tokens" in ended[0].error and "token_ids (6)" in ended[0].error, ended
    wait_for(lambda: admission_counts(stack) == before, what=f"admission counts back to {before}")


def test_a_decode_worker_that_leaves_out_prompt_logprobs_fails_the_request_internal():
    """A decode worker of a release without prompt log probabilities sends a first token without
    them. The router fails that request INTERNAL, naming why, rather than answer without them;
    a request that asked for none goes through the same worker; nothing is left counted."""
    from splitserve.service.grpc_server import options
    from splitserve.service.redis_state import WorkerInfo
    from splitserve_proto.v1 import worker_pb2 as w
    from splitserve_proto.v1 import worker_pb2_grpc

    class Older(worker_pb2_grpc.DecodeWorkerServicer):
        def __init__(self):
            self.asked = []
            self.opened = 0

        def Decode(self, request, context):
            self.asked.append((request.request_id, list(request.prompt_token_ids)))
            self.opened += 1
            yield w.DecodeEvent(accepted=True, open_seq=self.opened, epoch="older")
            yield w.DecodeEvent(token_ids=[28], text="x", first_token_unix=time.time(), completion_tokens=1)
            yield w.DecodeEvent(finish_reason="length", completion_tokens=1, close_seq=self.opened)

        def Cancel(self, request, context):
            return w.CancelResponse(found=False)

    older = Older()
    server = grpc.server(cf.ThreadPoolExecutor(4), options=options())
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(older, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    stack = start_stack(prefill=0, decode=0, mode="colocated")  # a router alone; the older worker is its decode worker
    try:
        r = stack.redis()
        info = WorkerInfo(
            worker_id="older-0",
            role="decode",
            address=address,
            host_id="elsewhere",
            free_kv_tokens=1 << 16,
            kv_capacity_tokens=1 << 16,
            epoch="older",
        )
        heartbeat(r, stack.keys, info, lease_s=120)
        time.sleep(2 * stack.settings.heartbeat_s)  # read by the router
        with Client(stack.router_address) as c:
            with pytest.raises(grpc.RpcError) as e:
                c.generate("The capital of France is", max_tokens=1, prompt_logprobs=1, timeout=30)
            assert e.value.code() == grpc.StatusCode.INTERNAL, e.value
            assert "prompt log probabilities: 0 came for a" in e.value.details(), e.value.details()
            done = c.generate("The capital of France is", max_tokens=1, timeout=30)
            assert list(done.token_ids) == [28] and done.finish_reason == "length"
        assert len(older.asked) == 2 and all(ids for _, ids in older.asked)  # colocated: each prompt sent along
        r.delete(stack.keys.worker("decode", "older-0"))
    finally:
        try:
            finish_stack(stack)
        finally:
            server.stop(None)
