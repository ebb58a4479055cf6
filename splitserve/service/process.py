"""Start-up and shutdown shared by the router and the workers."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys

from splitserve.engine.config import DTYPES, WEIGHTS
from splitserve.engine.errors import EngineError
from splitserve.observability.logs import LOG_FORMATS, setup_logging
from splitserve.observability.tracing import setup_tracing, shutdown_tracing
from splitserve.service.errors import REDIS_UNREACHABLE, quiet_ended_calls
from splitserve.service.redis_state import check_credentials
from splitserve.service.settings import Settings
from splitserve.service.tenants import Tenants
from splitserve.service.tls import check_internal_plaintext

log = logging.getLogger(__name__)


class Background:
    """Coroutines left running off a request's path (bookkeeping), held until they finish: the
    event loop keeps only weak references to its tasks."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task] = set()

    def start(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


async def settled(aw):
    """aw's result, awaited to its end even if this task is cancelled meanwhile (its client went,
    its deadline passed): the cancel is then delivered at the task's next await, once the caller
    has its result. For the Redis calls whose effect the request's cleanup must know of: a script
    that admitted a request, cut off unanswered, left counts nothing would return."""
    task = asyncio.ensure_future(aw)
    cancelled = False
    try:
        while True:
            try:
                return await asyncio.shield(task)
            except asyncio.CancelledError:
                if task.cancelled():  # (the call itself was: not this task)
                    cancelled = False
                    raise
                cancelled = True
    finally:  # its answer or its error is the caller's; the cancel comes after, either way
        if cancelled:
            asyncio.current_task().cancel()


async def until_answered(call, what: str, every_s: float, for_s: float, at_once: bool = False) -> None:
    """Run call (a Redis write that no request waits for) until Redis answers it: first at once
    (at_once), then every every_s, for up to for_s (past it, what it writes has expired anyway)."""
    t_end = asyncio.get_running_loop().time() + for_s
    first = at_once
    while True:
        if not first:
            await asyncio.sleep(every_s)
        try:
            await call()
            if not first:
                log.info("recorded %s once Redis answered", what)
            return
        except REDIS_UNREACHABLE as e:
            if first:
                log.warning("could not record %s (again once Redis answers): %s", what, e)
            elif asyncio.get_running_loop().time() >= t_end:
                log.warning("gave up recording %s: Redis did not answer for %d s (%s)", what, for_s, e)
                return
        except Exception:  # noqa: BLE001
            log.exception("could not record %s", what)
            return
        first = False


async def end_tasks(rounds: int = 20, wait_s: float = 0.25) -> list[asyncio.Task]:
    """Cancel every other task of the running loop until each has ended, `rounds` times at most,
    `wait_s` apart; the tasks left (named in an ERROR line) are returned. asyncio.run cancels
    them once at its end and waits for them without limit: a task that lost that cancel (as
    3.11's wait_for loses one: splitserve.service.aio) would keep the process from exiting."""
    me = asyncio.current_task()
    left: list[asyncio.Task] = []
    for _ in range(rounds):
        left = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
        if not left:
            return []
        for t in left:
            t.cancel()
        await asyncio.wait(left, timeout=wait_s)
    left = [t for t in left if not t.done()]
    if left:
        log.error(
            "%d task(s) still running after %d cancels each: %s",
            len(left),
            rounds,
            ", ".join(f"{t.get_name()} ({t.get_coro()!r})" for t in left),
        )
    return left


DEFAULT_GRPC_PORT = 50051  # gRPC's usual port
DEFAULT_HTTP_PORT = 8000  # the usual port of an OpenAI-compatible server (vLLM's)


def check_port_free(host: str, port: int, flag: str) -> None:
    """A port this process is told to listen on must be free: one clear line if not (ValueError),
    before anything is loaded. 0 (a free one, or off) passes."""
    if not port:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        # as the servers bind: a port left in TIME_WAIT by a process just stopped is free, one a
        # process listens on is not
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port} ({flag}): {e.strerror or e}") from None


def parse_settings(role: str, argv: list[str] | None) -> Settings:
    ap = argparse.ArgumentParser(prog=f"python -m splitserve.{role}", description=f"splitserve {role}")
    router = role == "router"
    ap.add_argument("--host", help="bind address (default 127.0.0.1)")
    ap.add_argument("--port", type=int, help="gRPC port" + (" (default 50051)" if router else " (default: a free one)"))
    if router:
        ap.add_argument("--http-port", dest="http_port", type=int, help="OpenAI HTTP port (default 8000; 0: off)")
        ap.add_argument("--served-model-name", dest="served_model_name", help="the model's name in the API")
    ap.add_argument("--redis-url", dest="redis_url")
    ap.add_argument("--model")
    if not router:
        ap.add_argument("--dtype", choices=DTYPES, help="the engine's dtype (default auto)")
        ap.add_argument(
            "--weights",
            choices=WEIGHTS,
            help="what the CPU's small-GEMM kernel reads: native blocks or fp32 (default native)",
        )
    ap.add_argument("--worker-id", dest="worker_id")
    ap.add_argument("--log-format", dest="log_format", choices=LOG_FORMATS, help="stderr logs: text or json lines")
    args = ap.parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if v is not None}
    env = os.environ
    if router:  # the router's known ports, unless the environment names others (a stack's own: free ones)
        if "SPLITSERVE_PORT" not in env:
            overrides.setdefault("port", DEFAULT_GRPC_PORT)
        if "SPLITSERVE_HTTP_PORT" not in env:
            overrides.setdefault("http_port", DEFAULT_HTTP_PORT)
    settings = Settings.from_env(**overrides)
    check_port_free(settings.host, settings.port, "--port")
    check_port_free(settings.host, settings.health_port, "health_port")
    if router:
        check_port_free(settings.host, settings.http_port, "--http-port")
    else:  # a worker's server is internal
        check_internal_plaintext(settings)
        be_nice(settings)
    settings.check_core_share_names_a_board()
    if settings.redis_url:
        check_credentials(settings)
    if router and settings.auth_tokens_file:  # a file that does not parse stops the start, naming what is wrong
        Tenants(settings.auth_tokens_file)
    return settings


def be_nice(settings) -> None:
    """A worker's threads (this one, and every one started after it: the engine's, torch's)
    yield the cores to the router and Redis on the same host (worker_nice): their work is a
    small, latency-bound share, which the engines' steps would otherwise delay."""
    if settings.worker_nice:
        try:
            os.nice(settings.worker_nice)
        except OSError as e:  # (a container that forbids it: the worker runs as it is)
            log.warning("worker_nice %d not applied: %s", settings.worker_nice, e)


def run(role: str, main_coro, argv: list[str] | None = None) -> int:
    """Parse settings, run ``main_coro(settings, stop_event)`` until SIGTERM/SIGINT."""
    setup_logging(role)
    quiet_ended_calls()
    try:
        settings = parse_settings(role, argv)
    except ValueError as e:
        print(f"splitserve {role}: error: {e}", file=sys.stderr)
        return 2
    setup_logging(role, settings.log_format)

    async def runner():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await main_coro(settings, stop)
        await end_tasks()

    setup_tracing(
        role.split("_")[0], settings.worker_name(role.split("_")[0]), settings.trace_file, settings.trace_file_max_bytes
    )
    try:
        asyncio.run(runner())
    except (EngineError, ValueError) as e:  # a setting the engine refuses at start-up (device, core_share, ...)
        print(f"splitserve {role}: error: {e}", file=sys.stderr)
        return 2
    finally:
        shutdown_tracing()
    return 0
