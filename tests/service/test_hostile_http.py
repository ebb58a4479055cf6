"""Hostile and careless HTTP clients: every bad input is a 4xx naming its field, never a 500; a
body over the limit is refused before it is read whole; headers that never finish are cut off."""

import asyncio
import json
import socket
import time

import grpc
import pytest

from splitserve.service.settings import Settings
from splitserve_proto.v1 import generation_pb2 as pb

DEEP_ITEMS = json.loads('{"type":"array","items":' * 200 + '{"type":"string"}' + "}" * 200)
# (route, raw body, the parameter the 400 must name)
BAD = [
    ("completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
    (
        "chat/completions",
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
        "messages[0].content[0].text",
    ),
    ("completions", '{"prompt": "ab", "stop": "a\\ud800b"}', "stop"),
    ("completions", '{"prompt": "ab", "cache_salt": "\\ud800"}', "cache_salt"),
    ("completions", '{"prompt": "ab", "max_tokens": 1e30}', "max_tokens"),
    ("completions", f'{{"prompt": "ab", "max_tokens": {2**70}}}', "max_tokens"),
    (
        "chat/completions",
        f'{{"messages": [{{"role": "user", "content": "x"}}], "max_completion_tokens": {2**70}}}',
        "max_completion_tokens",
    ),
    ("completions", f'{{"prompt": "ab", "seed": {2**64}}}', "seed"),
    ("completions", f'{{"prompt": "ab", "priority": {2**40}}}', "priority"),
    ("completions", f'{{"prompt": [{2**70}]}}', "prompt"),
    ("completions", f'{{"prompt": "ab", "stop_token_ids": [{2**70}]}}', "stop_token_ids"),
    (
        "completions",
        json.dumps({"prompt": "ab", "response_format": {"type": "json_schema", "json_schema": {"schema": DEEP_ITEMS}}}),
        "response_format",
    ),
    ("completions", "[" * 100_000, "body"),
    ("completions", '{"prompt": ' + "[" * 50 + "]" * 50 + "}", "prompt"),
]


def post(address: str, route: str, raw: bytes, headers: dict | None = None) -> tuple[int, dict, dict]:
    import http.client

    host, port = address.rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        c.request("POST", f"/v1/{route}", body=raw, headers={"Content-Type": "application/json", **(headers or {})})
        r = c.getresponse()
        return r.status, json.loads(r.read() or b"{}"), dict(r.getheaders())
    finally:
        c.close()


def test_every_bad_input_is_400_naming_its_field_and_the_router_serves_on(stack, client):
    """Lone surrogates, integers past their field's range, a schema 200 deep, a body 100,000 deep:
    each was a 500 (UnicodeEncodeError, "Value out of range", RecursionError) with a traceback."""
    got = []
    for route, raw, param in BAD:
        status, body, _ = post(stack.router_http_address, route, raw.encode())
        got.append((param, status, body["error"]["param"], body["error"]["type"]))
    assert got == [(param, 400, param, "invalid_request_error") for _, _, param in BAD]
    assert client.generate("The capital of France is", max_tokens=3, ignore_eos=True).usage.completion_tokens == 3


@pytest.mark.parametrize(
    "schema",
    ["[" * 10_000 + "]" * 10_000, '{"type":"array","items":' * 200 + '{"type":"string"}' + "}" * 200],
    ids=["brackets", "items"],
)
def test_a_json_schema_nested_too_deep_is_invalid_argument_over_grpc(client, schema):
    req = pb.GenerateRequest(
        prompt="ab", sampling=pb.SamplingParams(max_tokens=2, structured_output=pb.StructuredOutput(json_schema=schema))
    )
    with pytest.raises(grpc.RpcError) as e:
        client.stub.Generate(req, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.structured_output.json_schema: nested" in e.value.details()


def test_a_body_over_the_limit_is_413_before_it_is_read_whole(stack, client):
    """By Content-Length, before a byte of the body is read; and a chunked body as it streams in:
    the router reads at most the limit (4 MB here: the gRPC port's bound) and closes the connection."""
    host, port = stack.router_http_address.rsplit(":", 1)
    status, body, headers = post(stack.router_http_address, "completions", b"{", {"Content-Length": str(400 << 20)})
    assert status == 413 and "http_max_body_bytes" in body["error"]["message"]
    assert headers.get("connection") == "close"
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        sent = 0
        with pytest.raises(OSError):  # the router stops reading and closes: a send fails
            while sent < 256 << 20:
                s.sendall(b"100000\r\n" + b"a" * 0x100000 + b"\r\n")
                sent += 0x100000
        assert sent < 64 << 20
    assert client.generate("The capital of France is", max_tokens=3, ignore_eos=True).usage.completion_tokens == 3


def test_headers_that_never_finish_are_408_and_closed():
    """The router's HTTP server (uvicorn on a real socket, in this process) with a 1 s header
    timeout: a client that sends a header line now and then is answered 408 and cut off, on a new
    connection and on a kept-alive one's next request; one that sends its headers in time is not."""
    from router.http_api import HttpServer, OpenAIApi

    async def main():
        settings = Settings(http_port=0, http_header_timeout_s=1.0, http_keep_alive_s=30.0)
        server = HttpServer(OpenAIApi(None, "m", 16, 1 << 20), settings)
        server.start()
        port = server.port
        try:

            async def drip(first: bytes = b"") -> tuple[float, bytes]:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                t0 = time.monotonic()
                if first:  # a whole request first, then a next one that never ends
                    writer.write(first)
                    await reader.readuntil(b'"ok"}')
                    t0 = time.monotonic()
                got = b""
                for _ in range(10):  # a header line every 0.3 s, for up to 3 s
                    if writer.is_closing():
                        break
                    writer.write(b"GET /health HTTP/1.1\r\n" if not got else b"X-A: b\r\n")
                    try:
                        got += await asyncio.wait_for(reader.read(1000), 0.3)
                    except TimeoutError:
                        continue
                    if got:
                        break
                writer.close()
                return time.monotonic() - t0, got

            fresh, kept = await asyncio.gather(drip(), drip(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"))
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            ok = await asyncio.wait_for(reader.read(1000), 5)
            writer.close()
            return fresh, kept, ok
        finally:
            server.stop_accepting()
            await server.stopped()

    fresh, kept, ok = asyncio.run(main())
    for took, got in (fresh, kept):
        assert got.startswith(b"HTTP/1.1 408"), got
        assert 0.9 < took < 4.0, took  # (its 1 s deadline, on a busy machine)
    assert ok.startswith(b"HTTP/1.1 200")
