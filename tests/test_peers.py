"""Channels to decode workers (service/peers.py) and the prefill worker's first-token streams, with
real channels to real gRPC servers."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from service_helpers import wait_for

from splitserve.prefill_worker.worker import TokenStreams
from splitserve.service.grpc_server import options
from splitserve.service.peers import Peers
from splitserve_proto.v1 import worker_pb2 as w
from splitserve_proto.v1 import worker_pb2_grpc


@pytest.fixture
def two_servers():
    servers, addresses = [], []
    for _ in range(2):
        server = grpc.server(cf.ThreadPoolExecutor(2), options=options())
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
        addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        server.start()
        servers.append(server)
    yield addresses
    for server in servers:
        server.stop(None)


def _check(peer) -> int:
    return health_pb2_grpc.HealthStub(peer.channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_a_new_run_at_an_address_gets_a_new_channel_that_connects_at_once():
    """A server restarted at its address (a new run) is reached through a new channel at once,
    where the channel that saw it die fails every call until gRPC's next reconnection attempt;
    a run seen before the current one (placed before the restart) changes nothing."""

    def serve(port: int = 0):
        server = grpc.server(cf.ThreadPoolExecutor(2), options=options())
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
        port = server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        return server, port

    server, port = serve()
    address = f"127.0.0.1:{port}"
    peers = Peers(lambda a: grpc.insecure_channel(a, options=options()))
    try:
        assert peers.follow(address, "") is None and address not in peers  # no run: nothing to follow
        assert peers.follow(address, "run-1") is None
        first = peers.get(address)
        assert first.run == "run-1" and _check(first) == health_pb2.HealthCheckResponse.SERVING
        server.stop(None)
        end = time.monotonic() + 1.5
        while time.monotonic() < end:  # refused, again and again: its attempts back off to ~1 s apart
            with pytest.raises(grpc.RpcError) as e:
                _check(first)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            time.sleep(0.05)
        server, _ = serve(port)
        with pytest.raises(grpc.RpcError):  # still backing off: fails without trying
            _check(first)
        assert peers.follow(address, "run-1") is None and peers.get(address) is first
        old = peers.follow(address, "run-2")
        assert old is first
        fresh = peers.get(address)
        assert fresh is not first and fresh.run == "run-2" and fresh.earlier == ("run-1",)
        assert _check(fresh) == health_pb2.HealthCheckResponse.SERVING
        assert peers.follow(address, "run-1") is None and peers.get(address) is fresh  # an earlier run
        assert fresh.run == "run-2"
        old.channel.close()
    finally:
        for p in peers.clear():
            p.channel.close()
        server.stop(None)


def test_idle_channels_are_closed_unless_kept(two_servers):
    a, b = two_servers
    peers = Peers(lambda address: grpc.insecure_channel(address), idle_s=0.3)
    pa, pb = peers.get(a), peers.get(b)
    assert _check(pa) == _check(pb) == health_pb2.HealthCheckResponse.SERVING
    assert peers.prune(set()) == []  # both used just now
    assert peers.get(a) is pa  # one channel per address

    time.sleep(0.4)
    gone = peers.prune({b})  # b: still registered, or a call open to it
    assert [p.address for p in gone] == [a] and a not in peers and b in peers
    for p in gone:
        p.channel.close()
    with pytest.raises(ValueError):  # really closed
        _check(pa)
    fresh = peers.get(a)  # used again: a new channel
    assert fresh is not pa and _check(fresh) == health_pb2.HealthCheckResponse.SERVING
    assert len(peers) == 2
    for p in peers.clear():
        p.channel.close()
    assert len(peers) == 0


def test_a_blocked_peer_holds_only_its_own_threads(two_servers):
    a, b = two_servers
    peers = Peers(lambda address: grpc.insecure_channel(address), pools={"handoff": 2})
    release = threading.Event()
    stuck = [peers.submit(a, "handoff", release.wait, 30) for _ in range(4)]  # more than a's pool holds
    try:
        done = peers.submit(b, "handoff", _check, peers.get(b)).result(timeout=5)  # b's work does not queue behind a's
        assert done == health_pb2.HealthCheckResponse.SERVING
        assert not any(f.done() for f in stuck)
    finally:
        release.set()
    assert all(f.result(timeout=5) for f in stuck)
    assert peers.get(a).pools["handoff"] is not peers.get(b).pools["handoff"]
    for p in peers.clear(wait=True):
        p.channel.close()


class _Decode(worker_pb2_grpc.DecodeWorkerServicer):
    """FirstTokens as a decode worker serves it: records each stream's messages; a stream that
    gets request_id "break" ends with UNAVAILABLE."""

    def __init__(self):
        self.streams: list[list[str]] = []
        self.closed = threading.Event()

    def FirstTokens(self, request_iterator, context):
        got: list[str] = []
        self.streams.append(got)
        for req in request_iterator:
            got.append(req.request_id)
            if req.request_id == "break":
                context.abort(grpc.StatusCode.UNAVAILABLE, "went away")
        self.closed.set()
        return w.FirstTokenResponse()


class _OlderDecode(worker_pb2_grpc.DecodeWorkerServicer):
    """A decode worker from before FirstTokens: UNIMPLEMENTED (the generated base class)."""


def _serve(servicer):
    server = grpc.server(cf.ThreadPoolExecutor(4), options=options())
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    return server, address


def test_first_tokens_share_one_stream_per_decode_worker_and_fall_back_to_calls():
    new, old = _Decode(), _OlderDecode()
    (s1, a1), (s2, a2) = _serve(new), _serve(old)
    peers = Peers(lambda address: grpc.insecure_channel(address))
    streams = TokenStreams()
    try:

        def send(address, rid):
            return streams.send(address, peers.get(address).stub, w.FirstTokenRequest(request_id=rid, token_ids=[1]), 5)

        assert all(send(a1, rid) for rid in ("a", "b", "c"))
        wait_for(lambda: new.streams and new.streams[0] == ["a", "b", "c"], what="three messages on one stream")
        assert len(new.streams) == 1
        # A stream that broke is opened again on the next token; what it lost is not resent.
        assert send(a1, "break")
        wait_for(lambda: streams._streams[a1].ended, what="the broken stream ended")
        assert send(a1, "d")
        wait_for(lambda: len(new.streams) == 2 and new.streams[1] == ["d"], what="a second stream")
        # Closing a worker's stream ends its call cleanly on the server.
        streams.drop([a1])
        assert new.closed.wait(5)
        # An older worker: the first token is lost with its stream (UNIMPLEMENTED), then the caller
        # is told to use FirstToken calls, and no stream is opened again.
        assert send(a2, "x")
        wait_for(lambda: streams._streams[a2].ended, what="UNIMPLEMENTED")
        assert streams._streams[a2].unsupported
        first = streams._streams[a2]
        assert not send(a2, "y") and streams._streams[a2] is first
    finally:
        streams.close()
        for peer in peers.clear():
            peer.channel.close()
        s1.stop(None)
        s2.stop(None)
