"""A grpc.aio server with health, reflection and the error interceptor."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from splitserve.service import tls
from splitserve.service.errors import ErrorInterceptor
from splitserve.wire import keepalive_options

MAX_MESSAGE = 64 << 20
OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.so_reuseport", 0),
    # A peer that went away is tried again at most 2 s apart (gRPC's default backs off to 120 s),
    # so a worker restarted at its address is connected again within about that.
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
    # Each channel has its own connections: by default channels to one address share them, and a
    # new channel opened to a worker restarted there would wait out the old one's backoff.
    ("grpc.use_local_subchannel_pool", 1),
]


# Accept a peer's keepalive pings as often as once a second, and never answer them with GOAWAY
# (by default gRPC allows one every 5 minutes on a quiet connection and then drops it): the
# clients' and the other processes' keepalives must not cost a stream that is quietly waiting.
PING_POLICY = [("grpc.http2.min_recv_ping_interval_without_data_ms", 1000), ("grpc.http2.max_ping_strikes", 0)]


def options(keepalive_s: float = 0.0, max_receive: int = MAX_MESSAGE) -> list[tuple[str, int]]:
    """Channel and server options. With keepalive_s > 0, each end of a connection pings the other
    when the connection has been quiet for keepalive_s and drops it when no answer comes within
    keepalive_s more: a peer that hangs (stopped, its host gone, a partition) fails its calls with
    UNAVAILABLE instead of leaving them waiting for their deadlines, even a stream with nothing to
    send yet (a decode stream waiting for a long prefill)."""
    return [
        *OPTIONS,
        ("grpc.max_receive_message_length", max_receive),
        *PING_POLICY,
        *keepalive_options(keepalive_s, when_idle=True),
    ]


def new_server(
    keepalive_s: float = 0.0, max_receive: int = MAX_MESSAGE, write_timeout_s: float = 0.0
) -> grpc.aio.Server:
    """max_receive: the largest message accepted; a larger one is refused by gRPC itself
    (RESOURCE_EXHAUSTED, "Received message larger than max") before it is read or parsed.
    write_timeout_s: a streamed message the client does not take for that long ends its RPC."""
    return grpc.aio.server(interceptors=[ErrorInterceptor(write_timeout_s)], options=options(keepalive_s, max_receive))


async def start(
    server: grpc.aio.Server,
    host: str,
    port: int,
    service_names: list[str],
    tls_files: tls.TLSFiles | None = None,
    client_auth: bool = True,
    reflection_on: bool = True,
    health_port: int = 0,
) -> tuple[int, health_aio.HealthServicer]:
    """Serve on host:port, over TLS with tls_files (asking callers for a client certificate the
    CA signed with client_auth: every internal server), plaintext without. Health is always
    served (probes need it); reflection unless reflection_on is False (Settings.reflection).
    health_port: the health service alone, in plaintext, on host:health_port as well (probes that
    cannot speak TLS: Settings.health_port)."""
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    if reflection_on:
        add_reflection(server, service_names)
    try:
        bound = tls.bind(server, f"{host}:{port}", tls_files, client_auth)
    except RuntimeError:  # (gRPC raises, or gives 0, by version)
        bound = 0
    if bound == 0:  # a ValueError: the process says so in one line and exits 2 (process.run)
        raise ValueError(f"cannot listen on {host}:{port} (--port): the port is in use, or the address is not here")
    await server.start()
    if health_port:
        probes = grpc.aio.server(options=options())
        health_pb2_grpc.add_HealthServicer_to_server(health, probes)
        bind_probes(probes, host, health_port)
        await probes.start()
        server.probes = probes  # (lives as long as the server: stop() ends both)
    for name in ["", *service_names]:
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    return bound, health


async def stop(server: grpc.aio.Server, grace: float | None) -> None:
    """Stop the server (calls get `grace` seconds to end), then its health-only server, which
    answers probes (NOT_SERVING) until then: one left running keeps the process from exiting."""
    await server.stop(grace)
    probes = getattr(server, "probes", None)
    if probes is not None:
        await probes.stop(None)


def bind_probes(probes, host: str, port: int) -> None:
    """The plaintext health-only server's port, or ValueError naming it."""
    try:
        bound = probes.add_insecure_port(f"{host}:{port}")
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise ValueError(f"cannot listen on {host}:{port} (health_port): the port is in use, or not an address here")


def add_reflection(server, service_names: list[str]) -> None:
    names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)


async def set_not_serving(health, service_names: list[str]) -> None:
    for name in ["", *service_names]:
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)


def channel(
    address: str, keepalive_s: float = 0.0, tls_files: tls.TLSFiles | None = None, stream_window: int = 0
) -> grpc.aio.Channel:
    """A channel to another process of the stack (mTLS with tls_files). stream_window: the most
    bytes a stream's peer may send ahead of what this process has read (HTTP/2 flow control,
    with gRPC's window growth, BDP probing, off); 0 = gRPC's own, which grows to megabytes."""
    extra = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", stream_window)] if stream_window else []
    return tls.aio_channel(address, tls_files, options(keepalive_s) + extra)
