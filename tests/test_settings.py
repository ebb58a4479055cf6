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
    assert run.returncode == 2  # before: a traceback and exit code 1
    assert run.stderr.strip() == "splitserve up: error: SPLITSERVE_HEARTBEAT_S: heartbeat_s must be > 0, got 0.0"


@pytest.mark.parametrize(
    "argv, message",
    [
        # before: `up` started a stack of no decode worker, or no router, that could serve nothing
        (["up", "--decode", "0"], "argument --decode: must be >= 1, got 0"),
        (["up", "--routers", "0"], "argument --routers: must be >= 1, got 0"),
        (["up", "--prefill", "-1"], "argument --prefill: must be >= 0, got -1"),
        (["up", "--decode", "two"], "argument --decode: takes a whole number, got 'two'"),
        # before: a traceback (the client's ValueError), or a call past its deadline before it was sent
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
    assert cli.main(["status", "--redis-url", "notaurl"]) == 2  # before: redis-py's ValueError, a traceback
    assert "--redis-url 'notaurl' is not a Redis URL" in capsys.readouterr().err
    monkeypatch.setenv("REDIS_URL", "localhost:6379")
    assert cli.main(["status"]) == 2
    assert "REDIS_URL 'localhost:6379' is not a Redis URL" in capsys.readouterr().err
