"""Settings from the environment: a bad value is refused naming the variable to fix."""

import os
import subprocess
import sys

import pytest

from splitserve.service.settings import Settings


@pytest.mark.parametrize(
    "env, message",
    [
        ({"SPLITSERVE_KV_CACHE_BYTES": "abc"}, "SPLITSERVE_KV_CACHE_BYTES='abc' is not a valid int"),
        (
            {"SPLITSERVE_MAX_QUEUE_REQUESTS": "-5"},
            "SPLITSERVE_MAX_QUEUE_REQUESTS: max_queue_requests must be >= 1, got -5",
        ),
        ({"SPLITSERVE_ADMIT_FRACTION": "2"}, "SPLITSERVE_ADMIT_FRACTION: admit_fraction must be in (0, 1], got 2.0"),
        ({"SPLITSERVE_POLICY": "fast"}, "SPLITSERVE_POLICY: policy must be one of"),
    ],
)
def test_a_bad_variable_is_named(env, message):
    with pytest.raises(ValueError) as e:
        Settings.from_env(env)
    assert str(e.value).startswith(message), str(e.value)


def test_a_bad_value_given_in_code_is_named_by_its_field():
    with pytest.raises(ValueError) as e:  # an override is not from the environment: no variable to name
        Settings.from_env({"SPLITSERVE_MAX_QUEUE_REQUESTS": "8"}, max_queue_requests=-1)
    assert str(e.value) == "max_queue_requests must be >= 1, got -1"


def test_splitserve_up_with_a_bad_variable_prints_one_line_and_exits_2():
    env = {**os.environ, "SPLITSERVE_HEARTBEAT_S": "0"}
    run = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "up"], capture_output=True, text=True, env=env, timeout=120
    )
    assert run.returncode == 2  # not: a traceback and exit code 1
    assert run.stderr.strip() == "splitserve up: error: SPLITSERVE_HEARTBEAT_S: heartbeat_s must be > 0, got 0.0"


@pytest.mark.parametrize(
    "argv, message",
    [
        # not: `up` started a stack of no decode worker, or no router, that could serve nothing
        (["up", "--decode", "0"], "argument --decode: must be >= 1, got 0"),
        (["up", "--routers", "0"], "argument --routers: must be >= 1, got 0"),
        (["up", "--prefill", "-1"], "argument --prefill: must be >= 0, got -1"),
        (["up", "--decode", "two"], "argument --decode: takes a whole number, got 'two'"),
        # not: a traceback (the client's ValueError), or a call past its deadline before it was sent
        (["generate", "hi", "--resumes", "-1"], "argument --resumes: must be >= 0, got -1"),
        (["generate", "hi", "--timeout", "0"], "argument --timeout: must be a number of seconds > 0, got 0"),
        (["request", "some-id", "--timeout", "nan"], "argument --timeout: must be a number of seconds > 0, got nan"),
        (["traces", "--last", "0"], "argument --last: must be >= 1, got 0"),
    ],
)
def test_cli_flags_out_of_range_are_refused_naming_the_flag(argv, message, capsys):
    from splitserve import cli

    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_splitserve_status_with_a_redis_url_that_is_not_one_says_so(capsys, monkeypatch, tmp_path):
    from splitserve import cli

    monkeypatch.setenv("HOME", str(tmp_path))  # no running stack's state to read
    assert cli.main(["status", "--redis-url", "notaurl"]) == 2  # not: redis-py's ValueError, a traceback
    assert "--redis-url 'notaurl' is not a Redis URL" in capsys.readouterr().err
    monkeypatch.setenv("REDIS_URL", "localhost:6379")
    assert cli.main(["status"]) == 2
    assert "REDIS_URL 'localhost:6379' is not a Redis URL" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["-m", "splitserve.cli", "up", "--port", "{port}"], "--port"),
        (["-m", "splitserve.cli", "up", "--port", "0", "--http-port", "{port}"], "--http-port"),
        (["-m", "splitserve.router", "--port", "{port}"], "--port"),
        (["-m", "splitserve.router", "--port", "0", "--http-port", "{port}"], "--http-port"),
        (["-m", "splitserve.decode_worker", "--port", "{port}"], "--port"),
    ],
)
def test_a_port_in_use_is_one_line_naming_it_and_exit_2(argv, flag):
    """Before anything is loaded or started: no traceback, no stack half up."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        run = subprocess.run(
            [sys.executable, *(a.format(port=port) for a in argv)], capture_output=True, text=True, timeout=120
        )
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith(f"cannot listen on 127.0.0.1:{port} ({flag}): Address already in use")


def test_the_router_listens_on_the_known_ports_unless_told_otherwise(monkeypatch):
    from splitserve.service import process
    from splitserve.service.process import parse_settings

    monkeypatch.setattr(process, "check_port_free", lambda *a: None)  # whatever this machine runs there
    monkeypatch.delenv("SPLITSERVE_PORT", raising=False)
    monkeypatch.delenv("SPLITSERVE_HTTP_PORT", raising=False)
    s = parse_settings("router", [])
    assert (s.port, s.http_port) == (50051, 8000)
    assert parse_settings("decode_worker", []).port == 0  # workers: free ports, registered in Redis
    monkeypatch.setenv("SPLITSERVE_PORT", "0")
    monkeypatch.setenv("SPLITSERVE_HTTP_PORT", "0")  # a stack's own processes: free ports, HTTP off
    assert (parse_settings("router", []).port, parse_settings("router", []).http_port) == (0, 0)
    assert parse_settings("router", ["--port", "6000", "--http-port", "0"]).port == 6000
