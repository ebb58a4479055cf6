"""Channels to decode workers (service/peers.py), with real channels to a real gRPC server."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from splitserve.service.grpc_server import options
from splitserve.service.peers import Peers


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
