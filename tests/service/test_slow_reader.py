"""A client that stops reading its stream: its decode worker pauses the sequence (KV kept, nothing
computed), the router holds a bounded window of it, and after slow_reader_timeout_s the request
ends RESOURCE_EXHAUSTED (SLOW_READER) and its KV is freed. A tiny model: prompts as token ids."""

import time

import grpc
import pytest
from engine_helpers import random_prompts
from service_helpers import scrape, wait_for

from splitserve_proto.v1 import generation_pb2 as pb
from splitserve_proto.v1 import generation_pb2_grpc

from .common import free_port, start_stack

TIMEOUT_S = 10.0


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.fixture(scope="module")
def slow_stack(tiny_model_dir):
    s = start_stack(
        model=tiny_model_dir, kv_cache_bytes=16 << 20, slow_reader_timeout_s=TIMEOUT_S, http_port=free_port()
    )
    try:
        yield s
    finally:
        s.stop()
    assert s.shm_segments() == []


def blocks_used(s) -> float:
    return scrape(s.proc("decode-0").metrics_address)["splitserve_kv_cache_blocks_used"]


def test_a_stream_nobody_reads_is_paused_bounded_then_ended_and_its_kv_freed(slow_stack):
    s = slow_stack
    decode, router = s.proc("decode-0"), s.proc("router")
    # the client's own window small too, so that the router's writes are held back soon
    opts = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 16384)]
    with grpc.insecure_channel(s.router_address, options=opts) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        calls = [
            stub.GenerateStream(
                pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=p),
                    sampling=pb.SamplingParams(max_tokens=1000, ignore_eos=True, logprobs=20),
                ),
                timeout=120,
            )
            for p in random_prompts(4, lo=8, hi=12, seed=5)
        ]
        for c in calls:
            next(c)  # admitted and streaming; then nobody reads
        wait_for(
            lambda: scrape(decode.metrics_address).get("splitserve_decode_streams_paused") == 4,
            timeout=TIMEOUT_S - 2,
            what="all four sequences paused",
        )
        t_paused = time.monotonic()
        tokens = scrape(decode.metrics_address)["splitserve_engine_decode_tokens_total"]
        rss = rss_kb(router.popen.pid)
        time.sleep(3)
        assert scrape(decode.metrics_address)["splitserve_engine_decode_tokens_total"] == tokens  # none computed
        assert rss_kb(router.popen.pid) - rss < 4096  # the router holds no more of them (KB)
        assert blocks_used(s) > 0  # paused, their KV kept
        wait_for(lambda: blocks_used(s) == 0, timeout=TIMEOUT_S + 10, what="their KV freed once the timeout passed")
        assert time.monotonic() - t_paused < TIMEOUT_S + 8
        for c in calls:  # what was sent before, then the status
            got = 0
            with pytest.raises(grpc.RpcError) as e:
                for resp in c:
                    got += len(resp.token_ids)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
            assert "slow_reader_timeout_s" in e.value.details() and 0 < got < 1000
    metrics = scrape(decode.metrics_address)
    assert metrics["splitserve_decode_streams_paused"] == 0 and metrics["splitserve_decode_stream_pauses_total"] >= 4


def test_an_http_stream_nobody_reads_is_closed_and_its_kv_freed(slow_stack):
    """The same over OpenAI HTTP (server-sent events): the connection is closed after
    slow_reader_timeout_s, and the KV freed."""
    import json
    import socket

    s = slow_stack
    host, port = s.router_http_address.rsplit(":", 1)
    body = json.dumps(
        {"prompt": random_prompts(1, lo=8, hi=9, seed=6)[0], "max_tokens": 1000, "ignore_eos": True,
         "logprobs": 20, "stream": True}
    ).encode()  # fmt: skip
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, int(port)))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_for(lambda: blocks_used(s) > 0, timeout=10, what="the request running")
        t0 = time.monotonic()
        wait_for(lambda: blocks_used(s) == 0, timeout=TIMEOUT_S + 10, what="its KV freed once the timeout passed")
        assert time.monotonic() - t0 > TIMEOUT_S / 2  # (paused meanwhile: not ended at once)
        sock.settimeout(10)
        while sock.recv(1 << 16):  # what was sent, then the end: the router closed it
            pass
