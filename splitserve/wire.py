"""What the client and the servers agree on about the wire: keepalive options for their gRPC
channels and servers, and how one Generate response is joined from each sample's. Both sides
import it from here, so a server never imports the client library.
"""

from __future__ import annotations

from splitserve_proto.v1 import generation_pb2 as pb


def keepalive_options(keepalive_s: float, when_idle: bool = False) -> list[tuple]:
    """Options that ping the peer once a connection has been quiet keepalive_s, and drop it when
    no answer comes within keepalive_s more; when_idle pings connections with no call open too."""
    if keepalive_s < 0:
        raise ValueError(f"keepalive_s must be >= 0, got {keepalive_s}")
    if not keepalive_s:
        return []
    ms = max(1, int(keepalive_s * 1000))
    return [
        ("grpc.keepalive_time_ms", ms),
        ("grpc.keepalive_timeout_ms", ms),
        ("grpc.http2.ping_timeout_ms", ms),  # what bounds an unanswered ping in gRPC 1.85
        ("grpc.keepalive_permit_without_calls", int(when_idle)),
        ("grpc.http2.max_pings_without_data", 0),
    ]  # a stream waiting for its first token is pinged too


def joined(samples: dict[int, pb.GenerateResponse], n: int) -> pb.GenerateResponse:
    """Generate's one response from each sample's (by index): sample 0's in the fields, and with
    n > 1 every sample, in order, in choices (the router's Generate makes it so too)."""
    resp = pb.GenerateResponse()
    if 0 in samples:
        resp.CopyFrom(samples[0])
    if len(samples) > 1 or n > 1:
        resp.choices.extend(samples[i] for i in sorted(samples))
    return resp
