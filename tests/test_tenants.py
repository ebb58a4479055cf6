"""The tokens file (service/tenants.py): what it accepts, what it refuses naming the field, and the
tenant a call's authorization header maps to."""

import json
import os
import subprocess
import sys

import pytest

from splitserve.service.errors import PermissionDenied, Unauthenticated
from splitserve.service.tenants import PUBLIC_RPCS, Tenants, add_token, hash_token, parse, salted, scoped, unscoped


def test_a_token_maps_to_its_tenant_and_only_its_hash_is_kept(tmp_path):
    path = str(tmp_path / "tokens.json")
    a = add_token(path, "team-a", {"max_queued_requests": 4})
    a2 = add_token(path, "team-a")  # a second token of the same tenant
    r = add_token(path, "reader", rpcs=["ListModels"])
    text = open(path).read()
    assert a not in text and hash_token(a) in text and oct(os.stat(path).st_mode & 0o777) == "0o600"
    t = Tenants(path)
    for token in (a, a2):
        tenant = t.authenticate((("authorization", f"Bearer {token}"),), "Generate")
        assert tenant.name == "team-a" and tenant.max_queued_requests == 4 and tenant.rpcs == frozenset(PUBLIC_RPCS)
    assert t.authenticate((("authorization", f"bearer {r}"),), "ListModels").name == "reader"
    with pytest.raises(PermissionDenied, match="tenant 'reader' may not call Abort"):
        t.authenticate((("authorization", f"Bearer {r}"),), "Abort")
    for metadata, words in (
        ((), "a bearer token is required"),
        ((("authorization", a),), "must be 'Bearer <token>'"),
        ((("authorization", "Bearer "),), "must be 'Bearer <token>'"),
        ((("authorization", "Bearer ss-other"),), "unknown or revoked token"),
        ((("authorization", f"Bearer {a}"), ("authorization", "Bearer x")), "one bearer token, got 2"),
    ):
        with pytest.raises(Unauthenticated, match=f"^authorization: {words}"):
            t.authenticate(metadata, "Generate")
    assert scoped(None, "x") == "x" and unscoped(scoped(tenant, "x")) == "x" and scoped(tenant, "x") == "team-a~x"
    assert salted(None, "s") == "s" and salted(tenant, "") != salted(tenant, "s") != "s"


@pytest.mark.parametrize(
    "doc, words",
    [
        ("not json", "not JSON"),
        ({"tenant": []}, 'an object with a "tenants" list'),
        ({"tenants": [{"name": "a b", "token_sha256": []}]}, r"tenants\[0\].name: must be 1-64"),
        ({"tenants": [{"name": "a~b", "token_sha256": []}]}, r"tenants\[0\].name"),
        ({"tenants": [{"name": "a", "token_sha256": ["abc"]}]}, r"tenants\[0\].token_sha256: must be a list"),
        ({"tenants": [{"name": "a", "token_sha256": [], "rpcs": ["PutKV"]}]}, r"tenants\[0\].rpcs"),
        ({"tenants": [{"name": "a", "token_sha256": [], "max_queued_tokens": -1}]}, "max_queued_tokens"),
        ({"tenants": [{"name": "a", "token_sha256": []}, {"name": "a", "token_sha256": []}]}, "appears twice"),
        (
            {"tenants": [{"name": "a", "token_sha256": ["0" * 64]}, {"name": "b", "token_sha256": ["0" * 64]}]},
            "a token of tenant 'a' too",
        ),
    ],
)
def test_a_malformed_tokens_file_is_refused_naming_the_field(doc, words):
    text = doc if isinstance(doc, str) else json.dumps(doc)
    with pytest.raises(ValueError, match=words):
        parse(text, "tokens.json")


def test_a_router_with_a_bad_tokens_file_stops_at_once_in_one_line(tmp_path):
    bad = tmp_path / "tokens.json"
    bad.write_text(json.dumps({"tenants": [{"name": "a", "token_sha256": ["nope"]}]}))
    env = {**os.environ, "SPLITSERVE_AUTH_TOKENS_FILE": str(bad)}
    run = subprocess.run(
        [sys.executable, "-m", "splitserve.router", "--port", "0", "--http-port", "0"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "tenants[0].token_sha256: must be a list" in lines[0], lines


def test_a_changed_file_is_read_again_and_a_broken_one_keeps_the_tenants_before(tmp_path, monkeypatch):
    from splitserve.service import tenants as mod

    monkeypatch.setattr(mod, "RELOAD_CHECK_S", 0.0)
    path = str(tmp_path / "tokens.json")
    a = add_token(path, "a")
    t = Tenants(path)
    b = add_token(path, "b")
    assert t.authenticate((("authorization", f"Bearer {b}"),), "Generate").name == "b"
    good = open(path).read()
    with open(path, "w") as f:
        f.write("{broken")
    assert t.authenticate((("authorization", f"Bearer {a}"),), "Generate").name == "a"  # kept
    with open(path, "w") as f:
        f.write(good.replace(hash_token(a), "0" * 64))
    with pytest.raises(Unauthenticated):
        t.authenticate((("authorization", f"Bearer {a}"),), "Generate")
