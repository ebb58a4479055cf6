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
        ({"SPLITSERVE_MAX_QUEUE_REQUESTS": "-5"},
         "SPLITSERVE_MAX_QUEUE_REQUESTS: max_queue_requests must be >= 1, got -5"),
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
    run = subprocess.run([sys.executable, "-m", "splitserve.cli", "up"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert run.returncode == 2  # before: a traceback and exit code 1
    assert run.stderr.strip() == "splitserve up: error: SPLITSERVE_HEARTBEAT_S: heartbeat_s must be > 0, got 0.0"
