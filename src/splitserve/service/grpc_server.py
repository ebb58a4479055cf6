"""A grpc.aio server with health, reflection and the error interceptor."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from splitserve.service.errors import ErrorInterceptor

MAX_MESSAGE = 64 << 20
OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.so_reuseport", 0),
]


def new_server() -> grpc.aio.Server:
    return grpc.aio.server(interceptors=[ErrorInterceptor()], options=OPTIONS)


async def start(server: grpc.aio.Server, host: str, port: int, service_names: list[str]) -> tuple[int, "health_aio.HealthServicer"]:
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"cannot bind {host}:{port}")
    await server.start()
    for name in ["", *service_names]:
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    return bound, health


async def set_not_serving(health, service_names: list[str]) -> None:
    for name in ["", *service_names]:
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)


def channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=OPTIONS)
