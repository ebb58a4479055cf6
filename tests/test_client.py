"""The Python client's keepalive, against a real gRPC server process that never answers, and its
retries, against a real server that refuses every request as a full queue does.

The keepalive server is the stack's own aio server (`grpc_server.new_server`: the router's options
and interceptor) with a Generation service whose streams stay open and silent, as a router's do
while a long prompt waits for prefill.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent import futures

import grpc
import pytest

from splitserve.client import AsyncClient, Client, channel_options
from splitserve.service import grpc_server
from splitserve_proto.v1 import generation_pb2, generation_pb2_grpc

SILENT_SERVER = textwrap.dedent("""
    import asyncio, sys
    from splitserve.service import grpc_server
    from splitserve_proto.v1 import generation_pb2_grpc

    class Silent(generation_pb2_grpc.GenerationServicer):
        async def GenerateStream(self, request, context):
            await asyncio.Event().wait()
            yield

    async def main():
        server = grpc_server.new_server(float(sys.argv[1]))
        generation_pb2_grpc.add_GenerationServicer_to_server(Silent(), server)
        port, _ = await grpc_server.start(server, "127.0.0.1", 0, ["splitserve.v1.Generation"])
        print(port, flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
""")


@pytest.fixture
def silent_server():
    """A server process (its own keepalive off, as with SPLITSERVE_KEEPALIVE_S=0) and its address."""
    proc = subprocess.Popen([sys.executable, "-c", SILENT_SERVER, "0"], stdout=subprocess.PIPE, text=True)
    try:
        port = proc.stdout.readline().strip()
        assert port.isdigit(), f"the server did not start: {port!r}"
        yield proc, f"127.0.0.1:{port}"
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(timeout=10)


def _first_error(stream) -> tuple[grpc.StatusCode, float]:
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        next(iter(stream))
    return e.value.code(), time.monotonic() - t0


def test_keepalive_ends_a_stream_to_a_hung_router(silent_server):
    proc, address = silent_server
    with Client(address, keepalive_s=1) as quiet, Client(address, keepalive_s=1) as hung:
        # A server that answers pings but sends nothing: the stream stays open until its deadline.
        # The server's ping policy must accept a ping a second on a stream that sends no data
        # (gRPC's default policy answers the client's fourth or fifth ping with GOAWAY, ~5 s in).
        code, took = _first_error(quiet.generate_stream("hi", max_tokens=4, timeout=8))
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED and took > 7.5, (code, took)

        stream = hung.generate_stream("hi", max_tokens=4, timeout=30)
        time.sleep(0.5)  # the call is open
        os.kill(proc.pid, signal.SIGSTOP)
        code, took = _first_error(stream)
    # About two keepalives after the last sign of life; without keepalive it waits 30 s.
    assert code == grpc.StatusCode.UNAVAILABLE and took < 10, (code, took)


def test_async_client_keepalive(silent_server):
    proc, address = silent_server

    async def run() -> tuple[grpc.StatusCode, float]:
        async with AsyncClient(address, keepalive_s=1) as c:
            stream = c.generate_stream("hi", max_tokens=4, timeout=30)
            first = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0.5)
            os.kill(proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                await first
            return e.value.code(), time.monotonic() - t0

    code, took = asyncio.run(run())
    assert code == grpc.StatusCode.UNAVAILABLE and took < 10, (code, took)


def test_a_stream_cancelled_while_it_is_read_raises_cancelled(silent_server):
    """Guards against the typed error waiting forever for the debug string gRPC never gives a call
    it cancelled itself: the reader, blocked on the stream, must get Cancelled at once."""
    from splitserve.client import Cancelled

    _, address = silent_server
    got = []
    with Client(address) as c:
        stream = c.generate_stream("hi", max_tokens=4, timeout=60)

        def read():
            try:
                got.extend(stream)
            except grpc.RpcError as e:
                got.append(e)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        time.sleep(0.5)  # the reader waits on the open, silent call
        stream.cancel()
        reader.join(10)
        assert not reader.is_alive(), "the reader still waits after cancel()"
    assert len(got) == 1 and isinstance(got[0], Cancelled) and got[0].code() == grpc.StatusCode.CANCELLED, got


def test_keepalive_option_checked():
    assert not any(k.startswith("grpc.keepalive") for k, _ in channel_options(keepalive_s=0))
    assert ("grpc.keepalive_time_ms", 2500) in channel_options(keepalive_s=2.5)
    with pytest.raises(ValueError, match="keepalive_s"):
        Client("127.0.0.1:1", keepalive_s=-1)


class _CountCalls(grpc.ServerInterceptor):
    def __init__(self):
        self.calls = 0

    def intercept_service(self, continuation, handler_call_details):
        self.calls += 1  # each attempt, before its message is read (so a refused oversized one too)
        return continuation(handler_call_details)


class _QueueFull(generation_pb2_grpc.GenerationServicer):
    def Generate(self, request, context):
        context.set_trailing_metadata((("grpc-retry-pushback-ms", "1"),))
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the queue is full")


def test_retries_repeat_a_full_queue_but_not_a_message_too_large_to_read():
    """Both are RESOURCE_EXHAUSTED. A queue-full refusal is retried as many times as asked; a
    message over the server's receive limit is sent once: gRPC keeps at most 256 KB of a call to
    send again, and any such message is larger than that."""
    counter = _CountCalls()
    server = grpc.server(
        futures.ThreadPoolExecutor(4), interceptors=[counter], options=grpc_server.options(max_receive=4 << 20)
    )
    generation_pb2_grpc.add_GenerationServicer_to_server(_QueueFull(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with Client(f"127.0.0.1:{port}", retries=4) as c:
            for prompt, attempts, details in (("hi", 5, "queue is full"), ("x" * (5 << 20), 1, "larger than max")):
                counter.calls = 0
                with pytest.raises(grpc.RpcError) as e:
                    c.generate(prompt, max_tokens=4, timeout=30)
                assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert details in e.value.details() and counter.calls == attempts, (e.value.details(), counter.calls)
    finally:
        server.stop(0)


class _Named(generation_pb2_grpc.GenerationServicer):
    def __init__(self, name: str):
        self.name = name

    def Generate(self, request, context):
        return generation_pb2.GenerateResponse(request_id=self.name)


def test_calls_are_spread_round_robin_over_every_address_of_the_target():
    """With balance, a target naming two routers (as a headless Service's DNS name resolves to its
    ready pods) gets calls on both, from the sync and the asyncio client; a stopped one gets none,
    without an error. Without it, every call goes to one."""
    servers, ports = [], []
    for name in ("a", "b"):
        server = grpc.server(futures.ThreadPoolExecutor(4))
        generation_pb2_grpc.add_GenerationServicer_to_server(_Named(name), server)
        ports.append(server.add_insecure_port("127.0.0.1:0"))
        server.start()
        servers.append(server)
    target = "ipv4:" + ",".join(f"127.0.0.1:{p}" for p in ports)
    try:
        with Client(target) as c:
            assert {c.generate("hi", timeout=10).request_id for _ in range(8)} in ({"a"}, {"b"})
        with Client(target, balance=True) as c:
            grpc.channel_ready_future(c.channel).result(timeout=10)
            time.sleep(0.5)  # both subchannels connected
            assert {c.generate("hi", timeout=10).request_id for _ in range(8)} == {"a", "b"}

            async def run():
                async with AsyncClient(target, balance=True) as ac:
                    await ac.channel.channel_ready()
                    await asyncio.sleep(0.5)
                    return {(await ac.generate("hi", timeout=10)).request_id for _ in range(8)}

            assert asyncio.run(run()) == {"a", "b"}

            servers[0].stop(None).wait()
            time.sleep(0.5)
            assert {c.generate("hi", timeout=10).request_id for _ in range(8)} == {"b"}
    finally:
        for server in servers:
            server.stop(0)


class _CutOff(generation_pb2_grpc.GenerationServicer):
    """A router that is lost after each call's first tokens (UNAVAILABLE), and whose first re-send
    finds the earlier attempt still held (ALREADY_EXISTS); with lost_resend, the next re-send fails
    UNAVAILABLE before any message (sent to the lost router). It records what each call carried."""

    WORDS = ["a", "b", "c", "d", "e", "f", "g"]

    def __init__(self):
        self.carried: list[tuple[list[int], int]] = []
        self.refused_once = False
        self.lost_resend = False

    def GenerateStream(self, request, context):
        if request.sampling.n == 2:  # sample 1: two tokens, then its end; sample 0 as below
            yield from self._samples(request, context)
            return
        have = list(request.resume_from.token_ids)
        if request.prompt == "lost at once":
            self.carried.append((have, request.resume_from.text_chars))
            context.abort(grpc.StatusCode.UNAVAILABLE, "router stopping")
        if have and (self.lost_resend or request.prompt == "no router left"):
            self.lost_resend = False
            self.carried.append((have, -1))
            context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")
        if have and request.prompt == "finished meanwhile":
            self.carried.append((have, request.resume_from.text_chars))
            context.abort(
                grpc.StatusCode.ALREADY_EXISTS,
                f"request_id {request.request_id!r} already exists and finished, and its result was not kept",
            )
        if have and not self.refused_once:
            self.refused_once = True
            context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id {request.request_id!r} already exists")
        self.carried.append((have, request.resume_from.text_chars))
        for i in range(len(have), min(len(have) + 3, len(self.WORDS))):
            last = i == len(self.WORDS) - 1
            yield generation_pb2.GenerateResponse(
                token_ids=[100 + i], text=self.WORDS[i], finish_reason="length" if last else ""
            )
        if len(have) + 3 < len(self.WORDS) or request.prompt == "cut after its end":
            context.abort(grpc.StatusCode.UNAVAILABLE, "router stopping: its drain time is over")

    def _samples(self, request, context):
        have = {s.index: (list(s.token_ids), s.text_chars, s.finished) for s in request.resume_from.samples}
        self.carried.append(sorted(have.items()))
        done1 = have.get(1, ([], 0, False))
        for j in range(len(done1[0]), 2) if not done1[2] else ():
            yield generation_pb2.GenerateResponse(
                index=1, token_ids=[200 + j], text="xy"[j], finish_reason="stop" if j == 1 else ""
            )
        h0 = have.get(0, ([], 0, False))[0]
        for i in range(len(h0), min(len(h0) + 3, len(self.WORDS))):
            yield generation_pb2.GenerateResponse(
                index=0,
                token_ids=[100 + i],
                text=self.WORDS[i],
                finish_reason="length" if i == len(self.WORDS) - 1 else "",
            )
        if len(h0) + 3 < len(self.WORDS):
            context.abort(grpc.StatusCode.UNAVAILABLE, "router stopping: its drain time is over")


def test_a_stream_cut_off_after_tokens_is_sent_again_with_them_and_goes_on(monkeypatch, capsys):
    """generate_stream(resumes=N), sync and asyncio: each cut (UNAVAILABLE after tokens) sends the
    request again with the tokens and text length the client has (resume_from), and the caller
    sees one unbroken stream; a re-send refused ALREADY_EXISTS (the earlier attempt still held) is
    tried again, and so is one that fails UNAVAILABLE before any message, not counted as a resume.
    n > 1: each sample's own tokens go, and which finished. Past N resumes, without them, or before
    any token, the cut is the caller's. generate(resumes=N) streams so, and returns Generate's one
    response (with n > 1, every sample in choices). So for
    `splitserve generate --resumes N`, which prints the unbroken text."""
    monkeypatch.setattr("splitserve.client.RESEND_WAIT_S", 0.05)
    server = grpc.server(futures.ThreadPoolExecutor(4))
    router = _CutOff()
    generation_pb2_grpc.add_GenerationServicer_to_server(router, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    whole = [100 + i for i in range(7)]
    try:
        with Client(f"127.0.0.1:{port}") as c:
            chunks = list(c.generate_stream("hi", request_id="r", max_tokens=7, resumes=2, timeout=30))
            assert [t for ch in chunks for t in ch.token_ids] == whole and "".join(
                ch.text for ch in chunks
            ) == "abcdefg"
            assert router.carried == [([], 0), (whole[:3], 3), (whole[:6], 6)]
            router.carried = []  # generate(resumes=N): streamed, and collected into Generate's one response
            one = c.generate("hi", max_tokens=7, resumes=2, timeout=30)
            assert (list(one.token_ids), one.text, one.finish_reason) == (whole, "abcdefg", "length")
            assert not one.choices and router.carried == [([], 0), (whole[:3], 3), (whole[:6], 6)]
            router.carried, router.lost_resend = [], True  # two resumes, one of whose re-sends is lost too
            chunks = list(c.generate_stream("hi", request_id="r", max_tokens=7, resumes=2, timeout=30))
            assert [t for ch in chunks for t in ch.token_ids] == whole
            assert router.carried == [([], 0), (whole[:3], -1), (whole[:3], 3), (whole[:6], 6)]
            router.carried = []  # cut after its last message: nothing is lost, nothing sent again
            chunks = list(c.generate_stream("cut after its end", max_tokens=7, resumes=2, timeout=30))
            assert [t for ch in chunks for t in ch.token_ids] == whole and len(router.carried) == 3
            monkeypatch.setattr("splitserve.client.RESEND_FOR_S", 0.5)
            router.carried = []
            with pytest.raises(grpc.RpcError) as e:  # every re-send lost: tried again until RESEND_FOR_S
                list(c.generate_stream("no router left", max_tokens=7, resumes=1, timeout=30))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and e.value.details() == "Socket closed"
            assert 4 <= len(router.carried) <= 12
            assert router.carried[1:] == [(whole[:3], -1)] * (len(router.carried) - 1)
            router.carried, router.refused_once = [], True
            with pytest.raises(grpc.RpcError) as e:  # one resume allowed, two needed
                list(c.generate_stream("hi", max_tokens=7, resumes=1, timeout=30))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and len(router.carried) == 2
            with pytest.raises(grpc.RpcError) as e:
                list(c.generate_stream("hi", max_tokens=7, timeout=30))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            router.carried = []
            with pytest.raises(grpc.RpcError) as e:  # it finished meanwhile, its result not kept: not tried again
                list(c.generate_stream("finished meanwhile", request_id="f", max_tokens=7, resumes=2, timeout=30))
            assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and router.carried == [([], 0), (whole[:3], 3)]
            router.carried = []
            with pytest.raises(grpc.RpcError) as e:  # nothing came: nothing to go on from (a retry's case)
                list(c.generate_stream("lost at once", max_tokens=7, resumes=2, timeout=30))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and router.carried == [([], 0)]
            # n > 1: each sample's tokens go, and which finished (sample 1, not run again)
            router.carried = []
            chunks = list(c.generate_stream("hi", n=2, max_tokens=7, resumes=2, timeout=30))
            assert [t for ch in chunks if ch.index == 0 for t in ch.token_ids] == whole
            assert [t for ch in chunks if ch.index == 1 for t in ch.token_ids] == [200, 201]
            assert router.carried == [
                [],
                [(0, (whole[:3], 3, False)), (1, ([200, 201], 2, True))],
                [(0, (whole[:6], 6, False)), (1, ([200, 201], 2, True))],
            ]
            one = c.generate("hi", n=2, max_tokens=7, resumes=2, timeout=30)
            assert [(list(ch.token_ids), ch.text, ch.finish_reason, ch.index) for ch in one.choices] == [
                (whole, "abcdefg", "length", 0),
                ([200, 201], "xy", "stop", 1),
            ]
            assert list(one.token_ids) == whole and one.text == "abcdefg"

        async def run():
            router.carried, router.refused_once, router.lost_resend = [], False, True
            async with AsyncClient(f"127.0.0.1:{port}") as ac:
                streamed = [
                    t
                    async for ch in ac.generate_stream("hi", request_id="r", max_tokens=7, resumes=2, timeout=30)
                    for t in ch.token_ids
                ]
                return streamed, await ac.generate("hi", max_tokens=7, resumes=2, timeout=30)

        streamed, one = asyncio.run(run())
        assert streamed == whole and (list(one.token_ids), one.text) == (whole, "abcdefg")
        assert router.carried == [
            ([], 0),
            (whole[:3], -1),
            (whole[:3], 3),
            (whole[:6], 6),
            ([], 0),
            (whole[:3], 3),
            (whole[:6], 6),
        ]

        from splitserve import cli

        capsys.readouterr()
        router.carried, router.lost_resend = [], True
        generate = ["generate", "hi", "--address", f"127.0.0.1:{port}", "--max-tokens", "7", "--timeout", "30"]
        assert cli.main([*generate, "--resumes", "2"]) == 0
        out = capsys.readouterr()
        assert out.out.startswith("abcdefg") and "[length, 0 tokens" in out.err, out
        assert router.carried == [([], 0), (whole[:3], -1), (whole[:3], 3), (whole[:6], 6)]
        assert cli.main([*generate, "--resumes", "1"]) == 1  # one resume allowed, two needed
        out = capsys.readouterr()
        assert out.out.startswith("abcdef") and "UNAVAILABLE: router stopping" in out.err, out
    finally:
        server.stop(0)
