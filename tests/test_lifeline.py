"""A stack's processes end with the process that started them (splitserve.lifeline): killed or
hung up on, ``splitserve up`` leaves no worker, no Redis and no shared-memory segment behind."""

import glob
import os
import signal
import socket
import subprocess
import sys
import uuid

import pytest
from service_helpers import wait_for

from splitserve.handoff.arena import SHM_DIR


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie not yet reaped by whoever adopted it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def children(pid: int) -> list[int]:
    out = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(stat.split("/")[2]))
    return out


def read(path) -> str:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return ""


# A child that says which signals it ignores, then waits for SIGTERM.
CHILD = [
    "/bin/sh",
    "-c",
    'grep SigIgn /proc/$$/status; trap "echo GOT SIGTERM; exit 0" TERM; echo WAITING; while :; do sleep 0.05; done',
]

OWNER = """
import subprocess, sys, threading, time
from splitserve.lifeline import tied
child = {child!r}
main = subprocess.Popen(tied(child), stdout=open(sys.argv[1], "w"))
other = []
t = threading.Thread(target=lambda: other.append(subprocess.Popen(tied(child), stdout=open(sys.argv[2], "w"))))
t.start()
t.join()
print(main.pid, other[0].pid, flush=True)
time.sleep(120)
"""


def test_a_process_started_from_the_main_thread_gets_sigterm_when_its_starter_is_killed(tmp_path):
    main_log, thread_log = tmp_path / "main.log", tmp_path / "thread.log"
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER.format(child=CHILD), str(main_log), str(thread_log)],
        stdout=subprocess.PIPE,
        text=True,
    )
    main = other = None
    try:
        main, other = map(int, owner.stdout.readline().split())
        for log in (main_log, thread_log):
            wait_for(lambda: "WAITING" in read(log), timeout=30, what=f"{log.name}: the child waiting")
        # The program run is the child's own (exec'd: same pid), with SIGPIPE not ignored (the tie is made by
        # a Python, which ignores it; subprocess gives a child its default back, and so does the tie).
        sig_ign = int(read(main_log).split()[1], 16)
        assert not sig_ign & (1 << (signal.SIGPIPE - 1)), read(main_log)
        with open(f"/proc/{main}/cmdline", "rb") as f:
            assert f.read().split(b"\0")[0] == b"/bin/sh"
        owner.kill()
        owner.wait(10)
        wait_for(lambda: "GOT SIGTERM" in read(main_log), timeout=10, what="SIGTERM at the child")
        wait_for(lambda: gone(main), timeout=10, what="the child exiting")
        # Started from a thread (which ended long before the owner): not tied, as the lifeline says.
        assert not gone(other) and "GOT SIGTERM" not in read(thread_log)
    finally:
        owner.kill()
        owner.wait(10)
        for pid in (main, other):
            if pid and not gone(pid):
                os.kill(pid, signal.SIGKILL)


# `splitserve up` as started from a terminal: SIGHUP at its default, even where this test runs with it
# ignored (under nohup), which `up` leaves so. Its router on free ports (gRPC, and HTTP: drained too).
UP = (
    "import signal, sys; signal.signal(signal.SIGHUP, signal.SIG_DFL); from splitserve.cli import main; "
    "sys.exit(main(['up', '--port', '0', '--http-port', sys.argv[1]]))"
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("how", ["SIGKILL", "SIGHUP", "Ctrl-C"])
def test_splitserve_up_killed_hung_up_on_or_interrupted_leaves_no_process_and_no_segment(tiny_model_dir, tmp_path, how):
    """Killed, ``up`` cannot stop its stack: each of its processes is sent SIGTERM by the kernel, and
    drains and exits as when stopped. Hung up on (its terminal closed), it drains and stops it.
    Ctrl-C in a terminal sends SIGINT to the whole foreground process group: the workers and the
    router drain while Redis, in a process group of its own, serves until they have left the
    registry, so no log holds a warning."""
    prefix = f"splitserve-up{uuid.uuid4().hex[:6]}-"
    env = {
        **os.environ,
        "SPLITSERVE_MODEL": tiny_model_dir,
        "SPLITSERVE_SHM_PREFIX": prefix,
        "SPLITSERVE_CACHE_DIR": str(tmp_path / "cache"),
        "SPLITSERVE_KV_CACHE_BYTES": str(64 << 20),
        "SPLITSERVE_PREFILL_KV_CACHE_BYTES": str(64 << 20),
        "SPLITSERVE_ARENA_BYTES": str(32 << 20),
        "SPLITSERVE_HEARTBEAT_S": "0.25",
        "SPLITSERVE_DRAIN_S": "3",
    }
    env.pop("REDIS_URL", None)
    # Ctrl-C: `up` leads a process group of its own, as a shell's foreground job does.
    up = subprocess.Popen(
        [sys.executable, "-c", UP, str(free_port())],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=how == "Ctrl-C",
    )
    procs, lines = [], []
    try:
        for line in up.stdout:
            lines.append(line)
            if line.startswith("serving"):
                break
        assert lines and lines[-1].startswith("serving"), "".join(lines)
        run_dir = next(line for line in lines if "logs in " in line).split("logs in ")[1].rstrip(")\n ")
        procs = children(up.pid)
        assert len(procs) == 4, procs  # redis, a decode worker, a prefill worker, a router
        assert glob.glob(os.path.join(SHM_DIR, prefix + "*")), "no segment to leave behind"
        if how == "Ctrl-C":
            os.killpg(up.pid, signal.SIGINT)
        else:
            up.send_signal(getattr(signal, how))
        rest = up.communicate(timeout=60)[0]
        assert up.returncode == (-signal.SIGKILL if how == "SIGKILL" else 0), rest
        if how != "SIGKILL":
            assert "stopped; shared-memory segments left: 0" in rest, rest
        for pid in procs:
            wait_for(lambda: gone(pid), timeout=30, what=f"process {pid} of the stack exiting")
        assert glob.glob(os.path.join(SHM_DIR, prefix + "*")) == []
        for name in ("router", "prefill-0", "decode-0"):  # drained and stopped, not killed
            log = read(os.path.join(run_dir, f"{name}.log"))
            assert " stopped" in log.splitlines()[-1], name
            if how == "Ctrl-C":
                assert [line for line in log.splitlines() if "WARNING" in line or "ERROR" in line] == [], name
        # The state file a killed `up` could not remove names no running stack (not: its dead router's address).
        gen = subprocess.run(
            [sys.executable, "-m", "splitserve.cli", "generate", "hello"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert gen.returncode == 2 and "no running stack" in gen.stderr, gen.stderr
        assert os.path.isfile(tmp_path / "cache" / "stack.json") == (how == "SIGKILL")
    finally:
        for pid in [up.pid, *procs]:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
        up.wait(10)
        for path in glob.glob(os.path.join(SHM_DIR, prefix + "*")):
            os.unlink(path)
