"""TLS: the router's public ports (gRPC and HTTP) serve TLS, every internal hop is mutual TLS, and
a caller without a certificate the stack's CA signed never reaches an internal server."""

import os
import ssl
import subprocess
import sys
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.client import Client
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.sampling import SamplingParams
from splitserve.service.settings import Settings
from splitserve.service.tls import make_local_ca

from .common import finish_stack, free_port, start_stack


@pytest.fixture(scope="module")
def tls_stack():
    ports = {"router": free_port(), "prefill-0": free_port(), "decode-0": free_port()}  # each one's health port
    env = {name: {"SPLITSERVE_HEALTH_PORT": str(port)} for name, port in ports.items()}
    roles = dict(router_env=env["router"], prefill_env=env["prefill-0"], decode_env=env["decode-0"])
    s = start_stack(tls=True, http_port=free_port(), **roles)
    s.health_ports = ports
    yield s
    finish_stack(s)
    # each stopped itself on SIGTERM, its health-only server with it (not killed at the drain's end)
    assert {p.name: p.popen.returncode for p in s.procs} == {name: 0 for name in ports}


def test_each_process_serves_health_alone_in_plaintext_on_its_health_port(tls_stack):
    """What kubelet's gRPC probes call (they cannot speak TLS): SERVING on each process's
    health port, where no other service is (a Generate there is UNIMPLEMENTED)."""
    from splitserve_proto.v1 import generation_pb2, generation_pb2_grpc

    for name, port in tls_stack.health_ports.items():
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            check = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert check.status == health_pb2.HealthCheckResponse.SERVING, name
            with pytest.raises(grpc.RpcError) as e:
                generation_pb2_grpc.GenerationStub(ch).ListModels(generation_pb2.ListModelsRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED, (name, e.value)


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory):
    """A CA of another stack, and the certificate it signs for this host."""
    return make_local_ca(str(tmp_path_factory.mktemp("other-ca")))


def test_a_client_trusting_the_stacks_ca_gets_the_same_tokens_and_others_are_refused(tls_stack, smol_loaded, other_ca):
    """Guards against a hop left in plaintext or a broken handshake on one of them: the request goes
    router -> decode worker, prefill worker -> decode worker (KV and first token) over mTLS and its
    greedy tokens equal the in-process engine's; a plaintext client and one trusting another CA
    are refused UNAVAILABLE."""
    ids = smol_loaded.tokenizer.encode("The capital of France is")
    (want,) = LLMEngine(EngineConfig(kv_cache_bytes=64 << 20), loaded=smol_loaded).generate(
        [ids], [SamplingParams(max_tokens=8, ignore_eos=True)]
    )
    with Client(tls_stack.router_address, tls_ca=tls_stack.settings.tls_ca) as c:
        got = c.generate(token_ids=ids, max_tokens=8, ignore_eos=True, timeout=120)
    assert list(got.token_ids) == want
    for refused in (Client(tls_stack.router_address), Client(tls_stack.router_address, tls_ca=other_ca.ca)):
        with refused as c, pytest.raises(grpc.RpcError) as e:
            c.generate(token_ids=ids, max_tokens=2, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value


def _health(address: str, creds: grpc.ChannelCredentials) -> grpc.StatusCode | str:
    with grpc.secure_channel(address, creds) as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        except grpc.RpcError as e:
            return e.code()


def test_internal_servers_admit_only_callers_with_a_certificate_the_ca_signed(tls_stack, other_ca):
    """Guards against an internal port (PutKV, FirstTokens, Decode) open to whoever reaches it: a
    caller with no client certificate, or one another CA signed, fails the handshake; the stack's
    own certificate is let in."""
    s = tls_stack.settings
    ca, own = (open(p, "rb").read() for p in (s.tls_ca, s.tls_cert))
    key = open(s.tls_key, "rb").read()
    other = [open(p, "rb").read() for p in (other_ca.key, other_ca.cert)]
    for name in ("decode-0", "prefill-0"):
        address = tls_stack.proc(name).address
        assert _health(address, grpc.ssl_channel_credentials(ca)) == grpc.StatusCode.UNAVAILABLE, name
        assert _health(address, grpc.ssl_channel_credentials(ca, *other)) == grpc.StatusCode.UNAVAILABLE, name
        assert _health(address, grpc.ssl_channel_credentials(ca, key, own)) == health_pb2.HealthCheckResponse.SERVING
    # a first token injected into another caller's request (it set a tenant's completion's start in plaintext)
    from splitserve_proto.v1 import worker_pb2, worker_pb2_grpc

    options = [("grpc.ssl_target_name_override", s.tls_server_name)] if s.tls_server_name else []
    with grpc.secure_channel(tls_stack.proc("decode-0").address, grpc.ssl_channel_credentials(ca), options) as ch:
        with pytest.raises(grpc.RpcError) as e:
            worker_pb2_grpc.DecodeWorkerStub(ch).FirstToken(
                worker_pb2.FirstTokenRequest(request_id="a~x", token_ids=[42], text=" INJECTED "), timeout=10
            )
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_http_port_serves_https_only(tls_stack):
    url = f"https://{tls_stack.router_http_address}/v1/models"
    context = ssl.create_default_context(cafile=tls_stack.settings.tls_ca)
    with urllib.request.urlopen(url, timeout=10, context=context) as resp:
        assert resp.status == 200 and b'"object":"list"' in resp.read()
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=10, context=ssl.create_default_context())  # not trusted
    with pytest.raises((OSError, __import__("http.client").client.HTTPException)):
        urllib.request.urlopen(url.replace("https:", "http:"), timeout=10)


def test_tls_settings_come_together_and_a_file_that_cannot_be_read_is_named(tmp_path):
    with pytest.raises(ValueError, match="tls_key, tls_ca: TLS needs"):
        Settings(tls_cert="cert.pem")
    env = {
        **os.environ,
        "SPLITSERVE_TLS_CERT": str(tmp_path / "missing.pem"),
        "SPLITSERVE_TLS_KEY": str(tmp_path / "missing.key"),
        "SPLITSERVE_TLS_CA": str(tmp_path / "ca.pem"),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "splitserve.router", "--port", "0", "--http-port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"tls_cert: cannot read {tmp_path / 'missing.pem'}" in proc.stderr, proc.stderr
