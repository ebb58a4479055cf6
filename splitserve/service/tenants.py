"""Tenants of the public API: bearer tokens, kept hashed, mapped to tenants with their RPCs and quotas.

The tokens file (``SPLITSERVE_AUTH_TOKENS_FILE``; on Kubernetes a Secret mounted as a file) is JSON:

    {"tenants": [
      {"name": "team-a",
       "token_sha256": ["<sha256 hex of a token>", ...],
       "rpcs": ["Generate", "GenerateStream", "Abort", "GetRequest", ...],
       "max_queued_requests": 16,
       "max_queued_tokens": 50000,
       "best_priority": -1}
    ]}

``rpcs`` is optional (every public RPC when left out); the quotas are optional (0: only the
stack's own bounds). ``best_priority`` is the most urgent priority the tenant may ask for (lower
is sooner; below 0 also reaches the queue's high-priority headroom); a request asking for a more
urgent one is refused PERMISSION_DENIED. Left out: 0, the normal class.

A token is never stored, only its SHA-256: ``splitserve token NAME`` makes one and prints its
entry. The router reads the file again when it changes (its modification time,
size or inode, looked at once a second at most), so a token is added or revoked without a restart;
a file that no longer parses keeps the tenants read before, with a warning.

A tenant's request ids are its own: the router keeps them as ``<tenant>~<id>`` (``scoped``), so
another tenant's id is unknown to it, as an id nobody sent is. ``~`` is in no client's id nor any
tenant's name. Its prompts' prefix-cache entries are its own too: its cache salt is
``<tenant>~<salt>``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import time
from dataclasses import dataclass

from splitserve.service.errors import PermissionDenied, Unauthenticated

log = logging.getLogger(__name__)

# The router's public RPCs a tenant may be given ("rpcs"); /v1/models is ListModels over HTTP,
# the completion routes Generate and GenerateStream.
PUBLIC_RPCS = (
    "Generate",
    "GenerateStream",
    "Abort",
    "GetRequest",
    "Tokenize",
    "Detokenize",
    "ListModels",
    "GetModelInfo",
)
NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_HEX = re.compile(r"^[0-9a-f]{64}$")
SEP = "~"
RELOAD_CHECK_S = 1.0


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return "ss-" + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class Tenant:
    name: str
    rpcs: frozenset[str]
    max_queued_requests: int = 0  # 0: only the stack's bound
    max_queued_tokens: int = 0
    best_priority: int = 0  # the most urgent (lowest) priority its requests may ask for


def scoped(tenant: Tenant | None, request_id: str) -> str:
    """The id the stack keeps a tenant's request under (the client's own without tenants)."""
    return request_id if tenant is None else f"{tenant.name}{SEP}{request_id}"


def unscoped(request_id: str) -> str:
    """The id a client knows of one kept under scoped()."""
    return request_id.rpartition(SEP)[2]


def salted(tenant: Tenant | None, cache_salt: str) -> str:
    """The prefix-cache root of a tenant's request: its tenant's, split further by its own salt."""
    return cache_salt if tenant is None else f"{tenant.name}{SEP}{cache_salt}"


def parse(text: str, path: str) -> dict[str, Tenant]:
    """Tenants by token hash; ValueError naming the file and the field for anything malformed."""
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    entries = doc.get("tenants") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f'{path}: must be an object with a "tenants" list')
    by_hash: dict[str, Tenant] = {}
    names = set()
    for i, e in enumerate(entries):
        where = f"{path}: tenants[{i}]"
        if not isinstance(e, dict):
            raise ValueError(f"{where}: must be an object")
        name = e.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise ValueError(f"{where}.name: must be 1-64 letters, digits, '_', '.' or '-', got {name!r}")
        if name in names:
            raise ValueError(f"{where}.name: {name!r} appears twice")
        names.add(name)
        hashes = e.get("token_sha256")
        if not isinstance(hashes, list) or not all(isinstance(h, str) and _HEX.match(h) for h in hashes):
            raise ValueError(f"{where}.token_sha256: must be a list of SHA-256 hex digests (64 lowercase hex)")
        rpcs = e.get("rpcs", list(PUBLIC_RPCS))
        if not isinstance(rpcs, list) or not all(r in PUBLIC_RPCS for r in rpcs):
            raise ValueError(f"{where}.rpcs: must be a list of {', '.join(PUBLIC_RPCS)}")
        quotas = {}
        for q in ("max_queued_requests", "max_queued_tokens"):
            v = e.get(q, 0)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{where}.{q}: must be a whole number >= 0, got {v!r}")
            quotas[q] = v
        best = e.get("best_priority", 0)
        if not isinstance(best, int) or isinstance(best, bool) or not -(2**31) <= best < 2**31:
            raise ValueError(f"{where}.best_priority: must be a whole number in [-2^31, 2^31), got {best!r}")
        quotas["best_priority"] = best
        tenant = Tenant(name, frozenset(rpcs), **quotas)
        for h in hashes:
            if h in by_hash:
                raise ValueError(f"{where}.token_sha256: a token of tenant {by_hash[h].name!r} too")
            by_hash[h] = tenant
    return by_hash


class Tenants:
    """The tokens file, read at start (a bad one stops the start: ValueError) and again on change."""

    def __init__(self, path: str):
        self.path = path
        self.stamp = self._stamp()
        with open(path) as f:
            self.by_hash = parse(f.read(), path)
        self.checked = time.monotonic()

    def _stamp(self):
        try:
            st = os.stat(self.path)  # (follows a Secret's symlinks to the file of the current version)
        except OSError as e:
            raise ValueError(f"auth_tokens_file {self.path}: {e.strerror}") from None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def reload_if_changed(self) -> None:
        now = time.monotonic()
        if now - self.checked < RELOAD_CHECK_S:
            return
        self.checked = now
        try:
            stamp = self._stamp()
            if stamp == self.stamp:
                return
            with open(self.path) as f:
                by_hash = parse(f.read(), self.path)
        except (ValueError, OSError) as e:
            log.warning("tokens file not read again, the tenants read before stay: %s", e)
            return
        self.stamp, self.by_hash = stamp, by_hash
        log.info("tokens file read again: %d tenants", len({t.name for t in by_hash.values()}))

    def authenticate(self, metadata, rpc: str) -> Tenant:
        """The tenant of a call's ``authorization: Bearer <token>``; UNAUTHENTICATED without a known
        token, PERMISSION_DENIED for an RPC its tenant may not call."""
        self.reload_if_changed()
        values = [v for k, v in metadata or () if k == "authorization"]
        if not values:
            raise Unauthenticated("authorization: a bearer token is required", reason="TOKEN_MISSING")
        if len(values) > 1:
            raise Unauthenticated(f"authorization: one bearer token, got {len(values)}", reason="TOKEN_MALFORMED")
        value = values[0]
        scheme, _, token = str(value).partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated("authorization: must be 'Bearer <token>'", reason="TOKEN_MALFORMED")
        digest = hash_token(token.strip())
        tenant = self.by_hash.get(digest)  # (a digest's lookup time tells nothing of a token)
        if tenant is None:
            raise Unauthenticated("authorization: unknown or revoked token", reason="TOKEN_UNKNOWN")
        if rpc not in tenant.rpcs:
            raise PermissionDenied(f"tenant {tenant.name!r} may not call {rpc}", reason="RPC_NOT_ALLOWED")
        return tenant


def add_token(path: str, name: str, quotas: dict | None = None, rpcs: list[str] | None = None) -> str:
    """Make a token for tenant ``name`` in the tokens file at path (made if missing, mode 0600), its
    hash added to the tenant's (a new tenant: with rpcs and quotas, or every RPC and none), and the
    file replaced whole, at once: the router reads it again. Returns the token (kept nowhere)."""
    if not NAME.match(name):
        raise ValueError(f"tenant name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}")
    doc = {"tenants": []}
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
        parse(text, path)  # (refuses to extend a file the router would not read)
        doc = json.loads(text)
    token = new_token()
    entry = next((e for e in doc["tenants"] if e["name"] == name), None)
    if entry is None:
        entry = {"name": name, "token_sha256": []}
        if rpcs is not None:
            entry["rpcs"] = list(rpcs)
        entry.update({k: v for k, v in (quotas or {}).items() if v})
        doc["tenants"].append(entry)
    entry["token_sha256"].append(hash_token(token))
    text = json.dumps(doc, indent=2) + "\n"
    parse(text, path)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return token
