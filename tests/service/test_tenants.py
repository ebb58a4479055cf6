"""Tenants of the public API: bearer tokens, request ids and prefix-cache entries of their own, and
queue quotas, over gRPC and OpenAI HTTP, on a real stack (tiny model: prompts as token ids)."""

import json
import os
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from engine_helpers import random_prompts
from service_helpers import scrape, wait_for

from splitserve.client import Client, NotFound, PermissionDenied, ResourceExhausted, Unauthenticated
from splitserve.service.tenants import add_token

from .common import free_port, prefill_paused, start_stack, state_of

PROMPT = random_prompts(1, lo=40, hi=41, seed=9)[0]


@pytest.fixture(scope="module")
def tenants(tmp_path_factory, tiny_model_dir):
    """(stack, tokens file, {tenant: token}): a (best priority -1), b (quota of 1 queued request, the
    normal class at best) and reader (ListModels only)."""
    path = str(tmp_path_factory.mktemp("auth") / "tokens.json")
    tokens = {
        "a": add_token(path, "a", {"best_priority": -1}),
        "b": add_token(path, "b", {"max_queued_requests": 1}),
        "reader": add_token(path, "reader", rpcs=["ListModels"]),
    }
    s = start_stack(
        model=tiny_model_dir,
        auth_tokens_file=path,
        allow_plaintext_internal=True,  # (the refusal without it: test_plaintext_internal_ports_are_refused...)
        kv_cache_bytes=16 << 20,
        http_port=free_port(),
    )
    try:
        yield s, path, tokens
    finally:
        s.stop()
    assert s.shm_segments() == []


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


def test_a_call_without_a_known_token_is_unauthenticated_and_health_stays_open(tenants):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    s, _, tokens = tenants
    for token, words in ((None, "a bearer token is required"), ("ss-wrong", "unknown or revoked token")):
        with Client(s.router_address, token=token) as c:
            for call in (
                lambda: c.generate(token_ids=PROMPT, max_tokens=2),
                lambda: c.get_request("x"),
                lambda: c.abort("x"),
                c.list_models,
            ):
                e = code_of(call)
                assert e.code() == grpc.StatusCode.UNAUTHENTICATED and words in e.details(), e.details()
    with Client(s.router_address) as c:
        with pytest.raises(Unauthenticated) as e:
            c.generate(token_ids=PROMPT, max_tokens=2)
        assert e.value.reason == "TOKEN_MISSING"
    with grpc.insecure_channel(s.router_address) as ch:
        check = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
    base = f"http://{s.router_http_address}"
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{base}/v1/models", timeout=10)
    assert e.value.code == 401 and e.value.headers["WWW-Authenticate"] == "Bearer"
    assert json.loads(e.value.read())["error"]["type"] == "authentication_error"
    assert urllib.request.urlopen(f"{base}/health", timeout=10).status == 200
    import openai

    for key, ok in ((tokens["a"], True), ("ss-wrong", False)):
        with openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0) as oai:
            if ok:
                got = oai.completions.create(model=oai.models.list().data[0].id, prompt=PROMPT, max_tokens=2)
                assert got.usage.completion_tokens == 2
            else:
                with pytest.raises(openai.AuthenticationError):
                    oai.completions.create(model="x", prompt=PROMPT, max_tokens=2)
    with Client(s.router_address, token=tokens["reader"]) as c:
        assert len(c.list_models()) == 1
        with pytest.raises(PermissionDenied) as e:
            c.generate(token_ids=PROMPT, max_tokens=2)
        assert "tenant 'reader' may not call Generate" in e.value.details()


def test_odd_authorization_metadata_gets_clear_refusals_and_the_router_serves_on(tenants):
    """Empty, huge, binary-keyed and repeated authorization values: each call ends in
    UNAUTHENTICATED (or gRPC's own RESOURCE_EXHAUSTED for metadata over its limit), never another
    status, and a good token still works after them. (Control characters and non-ASCII values gRPC
    refuses to send at the client.)"""
    from splitserve_proto.v1 import generation_pb2, generation_pb2_grpc

    s, _, tokens = tenants
    good = ("authorization", f"Bearer {tokens['a']}")
    cases = [
        (("authorization", ""),),
        (("authorization", "Bearer"),),
        (("authorization", "Basic " + tokens["a"]),),
        (("authorization", "Bearer " + "x" * 6000),),
        (("authorization", "Bearer " + "x" * 20000),),
        (("authorization-bin", b"\x00\xff" + tokens["a"].encode()),),
        (good, ("authorization", "Bearer ss-other")),
        tuple(("authorization", f"Bearer ss-{i}") for i in range(50)),
    ]
    with grpc.insecure_channel(s.router_address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        for metadata in cases:
            with pytest.raises(grpc.RpcError) as e:
                stub.ListModels(generation_pb2.ListModelsRequest(), metadata=metadata, timeout=10)
            code = e.value.code()
            assert code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED), (metadata, code)
            if code == grpc.StatusCode.UNAUTHENTICATED:
                assert e.value.details().startswith("authorization: "), e.value.details()
        assert len(stub.ListModels(generation_pb2.ListModelsRequest(), metadata=(good,), timeout=10).models) == 1


def test_a_tenants_request_ids_and_prefix_cache_are_its_own(tenants):
    """b's GetRequest and Abort of a's id answer as for an id nobody sent; b may use the same id for
    a request of its own; a's repeated prompt finds its KV cached, b's same prompt does not."""
    s, _, tokens = tenants
    with Client(s.router_address, token=tokens["a"]) as a, Client(s.router_address, token=tokens["b"]) as b:
        got = a.generate(token_ids=PROMPT, max_tokens=4, ignore_eos=True, request_id="job-1", timeout=60)
        assert got.request_id == "job-1" and a.get_request("job-1").state == "finished"
        unknown = code_of(lambda: b.get_request("nobody-sent-this"))
        for call, other in (
            (lambda: b.get_request("job-1"), unknown),
            (lambda: b.abort("job-1"), code_of(lambda: b.abort("nobody-sent-this"))),
        ):
            e = code_of(call)
            assert e.code() == grpc.StatusCode.NOT_FOUND
            assert e.details() == other.details().replace("nobody-sent-this", "job-1")
        # b's Abort of an id it has not sent holds for its own request of that id, as for any id
        e = code_of(lambda: b.generate(token_ids=PROMPT, max_tokens=4, request_id="job-1", timeout=60))
        assert e.code() == grpc.StatusCode.CANCELLED and "'job-1' was aborted before it arrived" in e.details()
        mine = b.generate(token_ids=PROMPT, max_tokens=4, ignore_eos=True, request_id="job-7", timeout=60)
        assert mine.request_id == "job-7" and list(mine.token_ids) == list(got.token_ids)
        again = a.generate(token_ids=PROMPT, max_tokens=4, ignore_eos=True, request_id="job-2", timeout=60)
        assert a.get_request("job-2").cached_tokens >= 32  # its two whole blocks of 16
        assert b.get_request("job-7").cached_tokens == 0  # a's entries are not b's
        assert list(again.token_ids) == list(got.token_ids)
        replay = a.generate(token_ids=PROMPT, max_tokens=4, ignore_eos=True, request_id="job-1", timeout=60)
        assert replay.replayed and replay.request_id == "job-1"
        with pytest.raises(NotFound):
            b.generate(token_ids=PROMPT, max_tokens=2, model="other-model")


def test_a_tenant_over_its_quota_is_refused_while_another_is_admitted(tenants):
    """b may have 1 request queued: with the prefill worker stopped its first waits in the queue,
    its second is RESOURCE_EXHAUSTED naming the quota, with a retry hint; a's is admitted."""
    s, _, tokens = tenants
    results = {}
    with Client(s.router_address, token=tokens["a"]) as a, Client(s.router_address, token=tokens["b"]) as b:
        with prefill_paused(s):

            def send(name, client, rid):
                try:
                    results[rid] = client.generate(token_ids=PROMPT, max_tokens=2, request_id=rid, timeout=60)
                except grpc.RpcError as e:
                    results[rid] = e

            first = threading.Thread(target=send, args=("b", b, "q-b1"))
            first.start()
            wait_for(lambda: state_of(b, "q-b1") == "queued", what="b's first request queued")
            with pytest.raises(ResourceExhausted) as e:
                b.generate(token_ids=PROMPT, max_tokens=2, request_id="q-b2", timeout=30)
            assert e.value.reason == "TENANT_QUOTA" and e.value.retry_after_s is not None
            assert "tenant 'b' is over its quota (1 requests" in e.value.details()
            assert "max_queued_requests 1" in e.value.details()
            other = threading.Thread(target=send, args=("a", a, "q-a1"))
            other.start()
            wait_for(lambda: state_of(a, "q-a1") == "queued", what="a's request admitted")
        first.join(60)
        other.join(60)
    assert all(not isinstance(results[r], grpc.RpcError) for r in ("q-b1", "q-a1")), results
    router = scrape(s.proc("router").metrics_address)
    assert router["splitserve_tenant_quota_refusals_total{tenant=b}"] == 1
    assert router["splitserve_tenant_calls_total{rpc=Generate,tenant=a}"] >= 1


def test_a_tenant_flooding_at_ten_times_its_quota_leaves_another_admitted_and_complete(tenants):
    """b (1 queued request allowed) sends 10 at once while a sends 4, with nothing leaving the
    queue: one of b's is admitted and nine are refused TENANT_QUOTA; all four of a's are admitted.
    Once the queue moves, every admitted request completes."""
    s, _, tokens = tenants
    before = scrape(s.proc("router").metrics_address).get("splitserve_tenant_quota_refusals_total{tenant=b}", 0)
    with Client(s.router_address, token=tokens["a"]) as a, Client(s.router_address, token=tokens["b"]) as b:

        def send(client, rid):
            try:
                return client.generate(token_ids=PROMPT, max_tokens=3, ignore_eos=True, request_id=rid, timeout=120)
            except grpc.RpcError as e:
                return e

        with ThreadPoolExecutor(14) as pool:
            with prefill_paused(s):
                flood = [pool.submit(send, b, f"f-b{i}") for i in range(10)]
                mine = [pool.submit(send, a, f"f-a{i}") for i in range(4)]
                wait_for(lambda: sum(f.done() for f in flood) >= 9, timeout=60, what="b's refusals")
                refused = [f.result() for f in flood if f.done()]
                assert len(refused) == 9 and all(isinstance(e, grpc.RpcError) for e in refused), refused
                assert all(e.reason == "TENANT_QUOTA" for e in refused), refused
                wait_for(lambda: all(state_of(a, f"f-a{i}") == "queued" for i in range(4)), what="a's four queued")
            done = [f.result(120) for f in flood + mine]
    completed = [r for r in done if not isinstance(r, grpc.RpcError)]
    assert len(completed) == 5 and all(len(r.token_ids) == 3 for r in completed), done
    router = scrape(s.proc("router").metrics_address)
    assert router["splitserve_tenant_quota_refusals_total{tenant=b}"] - before == 9


def test_tokens_are_revoked_and_added_without_a_restart_and_never_recorded(tenants):
    s, path, tokens = tenants
    with Client(s.router_address, token=tokens["a"]) as a:
        assert a.generate(token_ids=PROMPT, max_tokens=2, timeout=60).usage.completion_tokens == 2
    doc = json.load(open(path))
    for e in doc["tenants"]:
        if e["name"] == "reader":
            e["token_sha256"] = []  # revoked
    tmp = path + ".new"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)
    newcomer = add_token(path, "c")
    with Client(s.router_address, token=tokens["reader"]) as r, Client(s.router_address, token=newcomer) as c:

        def revoked():
            try:
                r.list_models()
                return False
            except grpc.RpcError as e:
                return e.code() == grpc.StatusCode.UNAUTHENTICATED

        wait_for(revoked, timeout=10, what="the revoked token refused")
        assert c.generate(token_ids=PROMPT, max_tokens=2, timeout=60).usage.completion_tokens == 2
    time.sleep(0.5)  # the spans of the calls above written
    text = open(s.settings.trace_file).read() if os.path.exists(s.settings.trace_file) else ""
    metrics = urllib.request.urlopen(f"http://{s.proc('router').metrics_address}/metrics", timeout=5).read().decode()
    assert '"splitserve.tenant"' in text or "splitserve.tenant" in text
    for token in [*tokens.values(), newcomer]:
        assert token not in text and token not in metrics


def test_the_token_is_checked_before_the_body_is_read(tenants):
    """Without a known token, a body that is not JSON, or one announced at 400 MB and never sent,
    is 401 at once: the body is not read (nor parsed) for a caller who may send none."""
    import http.client

    s, _, tokens = tenants
    host, port = s.router_http_address.rsplit(":", 1)
    for auth, length, body in ((None, None, b"{not json"), ("Bearer ss-wrong", str(400 << 20), b"{")):
        c = http.client.HTTPConnection(host, int(port), timeout=10)
        headers = {"Content-Type": "application/json"} | ({"Authorization": auth} if auth else {})
        c.putrequest("POST", "/v1/completions")
        for k, v in (headers | {"Content-Length": length or str(len(body))}).items():
            c.putheader(k, v)
        c.endheaders(body)
        r = c.getresponse()
        assert r.status == 401, (r.status, r.read())
        assert json.loads(r.read())["error"]["type"] == "authentication_error"
        c.close()
    c = http.client.HTTPConnection(host, int(port), timeout=10)
    c.request("POST", "/v1/completions", body=b"{not json", headers={"Authorization": f"Bearer {tokens['a']}"})
    assert c.getresponse().status == 400  # with its token: the body is read, and it is not JSON
    c.close()


def test_a_tenant_asks_for_no_more_urgent_priority_than_its_best(tenants):
    """a may ask for -1, b for 0 (the default): b's -1 and a's -2^31 are PERMISSION_DENIED naming
    the priority, over gRPC and HTTP (403); each one's own best is served."""
    import openai

    s, _, tokens = tenants
    with Client(s.router_address, token=tokens["a"]) as a, Client(s.router_address, token=tokens["b"]) as b:
        assert a.generate(token_ids=PROMPT, max_tokens=2, priority=-1).usage.completion_tokens == 2
        assert b.generate(token_ids=PROMPT, max_tokens=2, priority=0).usage.completion_tokens == 2
        for client, priority, best in ((a, -(2**31), -1), (b, -1, 0)):
            with pytest.raises(PermissionDenied) as e:
                client.generate(token_ids=PROMPT, max_tokens=2, priority=priority)
            assert e.value.reason == "PRIORITY_NOT_ALLOWED"
            assert f"may ask for {best} at most urgent" in e.value.details() and str(priority) in e.value.details()
    with openai.OpenAI(base_url=f"http://{s.router_http_address}/v1", api_key=tokens["b"], max_retries=0) as oai:
        with pytest.raises(openai.PermissionDeniedError):
            oai.completions.create(model="tiny-llama0", prompt=PROMPT, max_tokens=2, extra_body={"priority": -5})


def test_plaintext_internal_ports_are_refused_with_tenants_or_beyond_loopback(tmp_path):
    """With tenants, `splitserve up` without --tls is refused in one line naming the setting that
    allows it; a worker bound beyond loopback without TLS is too. Guards against: any local
    process could call a decode worker's FirstToken and set a tenant's first token."""
    import subprocess
    import sys

    tokens = str(tmp_path / "tokens.json")
    add_token(tokens, "a")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSERVE_")}
    runs = [
        ([sys.executable, "-m", "splitserve.cli", "up", "--port", "0", "--http-port", "0"],
         {"SPLITSERVE_AUTH_TOKENS_FILE": tokens}, "tenants are set"),
        ([sys.executable, "-m", "splitserve.decode_worker"], {"SPLITSERVE_HOST": "0.0.0.0"}, "binds 0.0.0.0"),
        ([sys.executable, "-m", "splitserve.prefill_worker"], {"SPLITSERVE_AUTH_TOKENS_FILE": tokens}, "tenants"),
    ]  # fmt: skip
    for argv, extra, why in runs:
        p = subprocess.run(argv, env=env | extra, capture_output=True, text=True, timeout=60)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1, (argv, p.returncode, p.stderr)
        assert why in lines[0] and "allow_plaintext_internal" in lines[0], lines
