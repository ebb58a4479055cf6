"""Start a stack's processes by forking one that has imported torch and the engine already.

Each worker spends seconds importing torch before it loads the model; a stack of several, on a
machine of few cores, spends them side by side at every start and restart. A `ForkServer` is a
Python process that imports them once and forks a child for each process asked of it; the
child opens its log, takes the environment it was given and runs its role's module as
``python -m`` would (``runpy``). It is a real process of its own, with its own pid, signals and
exit status. `ForkedProcess` gives the calls of `subprocess.Popen` that a `Stack` (and its
tests) make: ``pid``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``,
``returncode``.

The server starts no thread and creates no gRPC object before it forks: a fork copies the
calling thread only, and gRPC's core must not be running in a process that forks. It imports
gRPC's Python modules, which gRPC's fork notes allow ("use after fork": no gRPC object made
before the fork); the children make their servers and channels, connect to Redis and set their
thread counts (torch's pool is not started until its first op, which the server never runs).
What is read at import time (a ``PYTHONPATH`` of another tree, for one) cannot change in a
child: `Stack` starts those processes with ``subprocess`` instead. A child's command line
(``ps``, ``/proc/PID/cmdline``) is the server's, ``python -m splitserve.forkserver``, as it
starts; it then writes its own over it (`retitle`): ``python -m splitserve.decode_worker``, for
one, as ``ps``, ``pgrep -f`` and ``/proc/PID/cmdline`` read it, and ``decode_worker`` as its name
(``ps -e``, ``top``, ``pgrep``). Once its module returns (or raises), a child flushes its logs and
output and ends with ``os._exit``: no interpreter teardown, which took a stopped worker about
0.6 s (each role's stop closes what it holds itself). Each child gets SIGTERM when the server
ends (splitserve.lifeline), and the server ends when its stdin closes: with `ForkServer.close`,
or when the process that started it ends, however it ends.

The tests start their stacks this way (tests/conftest.py); ``splitserve up`` and the images start
each process as ``python -m``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

from splitserve.lifeline import die_with_parent

# What the workers import that costs the most (torch and the engine: seconds), what the routers
# do (transformers' chat templates: 0.8 s, at their start) and what else every process imports
# that needs no thread or socket at import: gRPC's Python modules too (~0.3 s of CPU a process),
# which create no gRPC object (channel, server) and start nothing of gRPC's core when imported.
PRELOAD = (
    "torch",
    "splitserve.engine.engine",
    "transformers.utils.chat_template_utils",
    "redis.asyncio",
    "prometheus_client",
    "opentelemetry.sdk.trace",
    "grpc.aio",
    "grpc_health.v1.health",
    "grpc_reflection.v1alpha.reflection",
)


class ForkedProcess:
    """A child of a `ForkServer`, driven as a `subprocess.Popen` is."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]):
        self._server = server
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.status(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: never a signal to a pid that may have been reused
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The forking process, asked over its stdin and stdout (a JSON line each way)."""

    def __init__(self, env: dict[str, str] | None = None):
        """``env``: the server's own environment (this process's by default), which is what its
        imports see; each child gets the one it is spawned with."""
        self._lock = threading.Lock()
        self._env = dict(os.environ if env is None else env)
        self._proc: subprocess.Popen | None = None  # started at the first spawn

    def _start(self) -> subprocess.Popen:
        env = dict(self._env, PYTHONUNBUFFERED="1")  # its children's sys.stdout and stderr: unbuffered
        proc = subprocess.Popen(
            [sys.executable, "-m", "splitserve.forkserver"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            bufsize=1,
        )
        ready = proc.stdout.readline()
        if ready.strip() != "ready":
            proc.kill()
            proc.wait()
            raise RuntimeError(f"the fork server did not start: {ready!r}")
        return proc

    def _ask(self, msg: dict) -> dict:
        with self._lock:
            if self._proc is None:
                self._proc = self._start()
            if self._proc.poll() is not None:
                raise RuntimeError(f"the fork server exited with {self._proc.returncode}")
            self._proc.stdin.write(json.dumps(msg) + "\n")
            self._proc.stdin.flush()
            reply = json.loads(self._proc.stdout.readline())
        if "error" in reply:
            raise RuntimeError(f"the fork server could not {msg['op']}: {reply['error']}")
        return reply

    def spawn(self, module: str, env: dict[str, str], log_path: str) -> ForkedProcess:
        """Run ``python -m module`` in a forked child with exactly ``env``, its stdout and stderr
        to ``log_path`` (truncated), its stdin from /dev/null."""
        with open(log_path, "wb"):  # there (empty) once this returns, as with Popen(stdout=file)
            pass
        pid = self._ask({"op": "spawn", "module": module, "env": env, "log": log_path})["pid"]
        return ForkedProcess(self, pid, [sys.executable, "-m", module])

    def status(self, pid: int) -> int | None:
        """The child's exit status as `subprocess.Popen.returncode` gives it (negative: the signal),
        or None while it runs."""
        return self._ask({"op": "status", "pid": pid})["code"]

    def close(self) -> None:
        """Stop the server. Its children still running are sent SIGTERM as it exits (each drains and
        stops as when its stack stops it): close it once its stacks are stopped."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


PR_SET_NAME = 15  # <linux/prctl.h>


def retitle(argv: list[str], name: str) -> None:
    """Show this process as running ``argv``, named ``name``: its command line is written over its
    own in the memory the kernel reads ``/proc/self/cmdline`` from (the span from ``arg_start`` to
    ``arg_end`` in ``/proc/self/stat``, as setproctitle does), cut to fit there, the rest zeroed;
    its name (``comm``) is ``name``, cut to 15 bytes by the kernel. Linux only; elsewhere nothing.
    Python copied its arguments at its start, so nothing of its own reads that memory again."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_NAME, name.encode(), 0, 0, 0)
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()  # from field 3 on (the name may hold spaces)
    start, end = int(fields[48 - 3]), int(fields[49 - 3])  # proc(5): arg_start, arg_end
    if end <= start:
        return
    title = b"\0".join(a.encode() for a in argv)[: end - start - 1]
    ctypes.memmove(start, title.ljust(end - start, b"\0"), end - start)  # its last byte a NUL: read as it is


def _child(server: int, module: str, env: dict[str, str], log_path: str) -> None:
    """In the forked child of ``server`` (its pid): never returns."""
    import logging
    import runpy
    import traceback

    code = 1
    try:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        out = os.open(log_path, os.O_WRONLY | os.O_APPEND)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.close(null)
        die_with_parent(server)  # its errors to the log, not to the server's replies
        os.environ.clear()
        os.environ.update(env)
        sys.argv = [module]
        retitle(["python", "-m", module], module.rsplit(".", 1)[-1])
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:  # as the interpreter takes it: None is 0, a message is printed and 1
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, exit status 1
        traceback.print_exc()
    finally:
        logging.shutdown()
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def _serve() -> None:
    import importlib

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches its children; it ends with its stdin
    for name in PRELOAD:
        importlib.import_module(name)
    codes: dict[int, int] = {}
    children: set[int] = set()

    def reap():
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            children.discard(pid)
            codes[pid] = os.waitstatus_to_exitcode(status)

    me = os.getpid()
    reply = sys.stdout
    reply.write("ready\n")
    reply.flush()
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            if msg["op"] == "spawn":
                pid = os.fork()
                if pid == 0:
                    _child(me, msg["module"], msg["env"], msg["log"])
                children.add(pid)
                answer = {"pid": pid}
            else:
                reap()
                answer = {"code": codes.get(msg["pid"])}
        except Exception as e:  # noqa: BLE001 - said to the asker
            answer = {"error": f"{type(e).__name__}: {e}"}
        reply.write(json.dumps(answer) + "\n")
        reply.flush()


if __name__ == "__main__":
    _serve()
