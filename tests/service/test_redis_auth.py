"""Redis with ACL users: the stack serves through a user and password in the URL, and credentials
Redis refuses stop each process at start with one line that does not repeat the password."""

import subprocess
import sys

import redis
from service_helpers import wait_for

from splitserve.client import Client
from splitserve.stack import redis_server_binary

from .common import finish_stack, free_port, start_stack


def test_a_redis_acl_user_is_served_and_refused_credentials_are_one_line(tmp_path):
    port = free_port()
    server = subprocess.Popen(
        [
            redis_server_binary(),
            "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(tmp_path),
            "--user", "default", "off",
            "--user", "splitserve", "on", ">s3cret-acl", "~*", "&*", "+@all",
        ],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:

        def up():
            try:
                return redis.Redis(port=port, username="splitserve", password="s3cret-acl").ping()
            except redis.ConnectionError:
                return False

        wait_for(up, timeout=10, what="redis-server up")
        stack = start_stack(redis_url=f"redis://splitserve:s3cret-acl@127.0.0.1:{port}")
        try:
            with Client(stack.router_address) as c:
                assert len(c.generate("hi", max_tokens=4, ignore_eos=True, timeout=120).token_ids) == 4
        finally:
            finish_stack(stack)
        for role in ("router", "decode_worker", "prefill_worker"):
            refused = subprocess.run(
                [sys.executable, "-m", f"splitserve.{role}", "--port", "0"]
                + (["--http-port", "0"] if role == "router" else []),
                env={
                    "PATH": "/usr/bin:/bin",
                    "SPLITSERVE_REDIS_URL": f"redis://splitserve:not-it-7f3a@127.0.0.1:{port}",
                },
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert refused.returncode == 2 and "Traceback" not in refused.stderr, (role, refused.stderr)
            assert f"splitserve {role}: error: redis_url: Redis refused its user and password" in refused.stderr
            assert "not-it-7f3a" not in refused.stderr, (role, refused.stderr)
    finally:
        server.terminate()
        server.wait(10)
