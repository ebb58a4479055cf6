"""The fork server that starts the tests' stack processes (splitserve.forkserver): its children
are processes of their own, driven as subprocess.Popen's are."""

import contextlib
import os
import signal
import subprocess
import sys

import pytest
from service_helpers import wait_for

from splitserve.forkserver import ForkServer

PROBE = """
import os, sys, time
print("PID", os.getpid(), "ENV", sorted(os.environ), "ARGV", sys.argv[1:], "TORCH", "torch" in sys.modules)
mode = os.environ["PROBE"]
if mode == "exit":
    sys.exit(3)
if mode == "raise":
    raise RuntimeError("the probe failed")
if mode == "sleep":
    print("SLEEPING", flush=True)
    time.sleep(60)
if mode == "term":
    import signal
    signal.signal(signal.SIGTERM, lambda *_: (print("GOT SIGTERM", flush=True), os._exit(0)))
    print("SLEEPING", flush=True)
    time.sleep(60)
"""

# A process that starts a fork server, has it fork a probe, and waits to be killed.
OWNER = """
import sys, time
from splitserve.forkserver import ForkServer
s = ForkServer()
p = s.spawn("forked_probe", {"PROBE": "term"}, sys.argv[1])
print(p.pid, s._proc.pid, flush=True)
time.sleep(120)
"""


@pytest.fixture(scope="module")
def probe_env(tmp_path_factory):
    d = tmp_path_factory.mktemp("probe")
    (d / "forked_probe.py").write_text(PROBE)
    return {**os.environ, "PYTHONPATH": str(d)}  # where a server imports the probe from


@pytest.fixture(scope="module")
def server(probe_env):
    s = ForkServer(env=probe_env)
    yield s
    s.close()


def _log(path) -> str:
    with open(path) as f:
        return f.read()


def test_a_child_runs_its_module_with_exactly_its_environment_after_the_preloaded_imports(server, tmp_path):
    log = tmp_path / "exit.log"
    p = server.spawn("forked_probe", {"PROBE": "exit", "OTHER": "1"}, str(log))
    assert p.wait(30) == 3 and p.poll() == 3 and p.returncode == 3
    assert f"PID {p.pid} ENV ['OTHER', 'PROBE'] ARGV [] TORCH True" in _log(log)
    assert p.pid not in (os.getpid(), server._proc.pid)


def test_an_exception_is_exit_status_1_with_its_traceback_in_the_log(server, tmp_path):
    log = tmp_path / "raise.log"
    p = server.spawn("forked_probe", {"PROBE": "raise"}, str(log))
    assert p.wait(30) == 1
    assert "RuntimeError: the probe failed" in _log(log) and "Traceback" in _log(log)


def test_signals_reach_the_child_and_its_status_names_them_as_popens_does(server, tmp_path):
    for sig in (signal.SIGTERM, signal.SIGKILL):
        log = tmp_path / f"sleep-{sig}.log"
        p = server.spawn("forked_probe", {"PROBE": "sleep"}, str(log))
        wait_for(lambda: log.exists() and "SLEEPING" in _log(log), timeout=30, what="the child running")
        assert p.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            p.wait(0.1)
        p.send_signal(sig) if sig == signal.SIGTERM else p.kill()
        assert p.wait(30) == -sig
        p.kill()  # once it has exited: nothing sent, no error


def test_a_child_shows_its_own_command_line_and_name_not_the_servers(server, tmp_path):
    """ps, pgrep -f and /proc/PID/cmdline show the module a child runs (guards against: every child showed the
    server's `python -m splitserve.forkserver`), and its name (comm) is the module's too."""
    log = tmp_path / "title.log"
    p = server.spawn("forked_probe", {"PROBE": "sleep"}, str(log))
    try:
        wait_for(lambda: log.exists() and "SLEEPING" in _log(log), timeout=30, what="the child running")
        with open(f"/proc/{p.pid}/cmdline", "rb") as f:
            assert [a for a in f.read().split(b"\0") if a] == [b"python", b"-m", b"forked_probe"]
        with open(f"/proc/{p.pid}/comm") as f:
            assert f.read() == "forked_probe\n"
        ps = subprocess.run(["ps", "-o", "args=", "-p", str(p.pid)], capture_output=True, text=True, check=True)
        assert ps.stdout.strip() == "python -m forked_probe", ps.stdout
        with open(f"/proc/{server._proc.pid}/cmdline", "rb") as f:  # the server's own: as it was
            assert f.read().split(b"\0")[1:3] == [b"-m", b"splitserve.forkserver"]
        assert "ARGV []" in _log(log)  # the module's sys.argv: as before
    finally:
        p.kill()
        p.wait(30)


def test_a_module_that_cannot_be_found_fails_like_python_dash_m(server, tmp_path):
    log = tmp_path / "missing.log"
    p = server.spawn("no_such_module_here", {}, str(log))
    assert p.wait(30) == 1 and "No module named no_such_module_here" in _log(log)


def test_the_server_exits_once_closed_and_a_new_one_starts_at_its_first_spawn(tmp_path):
    s = ForkServer()
    assert s._proc is None  # nothing started yet
    p = s.spawn("json.tool", {}, str(tmp_path / "json.log"))  # reads /dev/null: "Expecting value"
    assert p.wait(30) == 1 and "Expecting value" in _log(tmp_path / "json.log")
    proc = s._proc
    s.close()
    assert proc.wait(10) == 0 and s._proc is None
    assert sys.executable in p.args


def test_a_child_is_sent_sigterm_when_the_process_that_started_its_server_is_killed(probe_env, tmp_path):
    """The server ends when its stdin closes (its starter gone, however it went) and each of its
    children is then sent SIGTERM (splitserve.lifeline): a killed test run leaves no stack behind."""
    log = tmp_path / "term.log"
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(log)], env=probe_env, stdout=subprocess.PIPE, text=True)
    child = server = 0
    try:
        child, server = map(int, owner.stdout.readline().split())
        wait_for(lambda: log.exists() and "SLEEPING" in _log(log), timeout=60, what="the child running")
        owner.kill()
        owner.wait(10)
        wait_for(lambda: "GOT SIGTERM" in _log(log), timeout=30, what="SIGTERM at the child")
    finally:
        owner.kill()
        owner.wait(10)
        for pid in (child, server):
            with contextlib.suppress(ProcessLookupError):
                if pid:
                    os.kill(pid, signal.SIGKILL)
