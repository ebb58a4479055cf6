"""The Redis protocol's key schema and records: the prefill streams, request hashes, admission,
worker registry; the jobs and registry entries written there; and the connection. The scripts
that change them atomically are in redis_scripts.py (one ``lua/<name>.lua`` file each).

Keys (all under one prefix, in braces: a Redis Cluster hash tag, so every key is in one slot
and the scripts, which touch several keys at once, run on a cluster too):
  {p}:prefill            stream of prefill jobs, consumer group "prefill"  (persistent)
  {p}:prefill:high       the same for priority < 0 (pulled first)            (persistent)
  {p}:prefill:low        the same for priority > 0 (pulled last)             (persistent)
  {p}:prefill:to:{id}    the same for the normal-priority jobs sent to one prefill worker (prefill
                         affinity: its prefix cache holds the start of their prompts); read by it,
                         and by any worker once it has left the registry; deleted when left empty
  {p}:prefill:directed   set: the prefill workers that have such a stream           (persistent)
  {p}:admission          hash: requests, tokens queued (admitted, not yet pulled, or prefilled by their
                         decode worker and not yet at their first token), local_tokens: those
                         prefilled by their decode worker (persistent)
  {p}:req:{id}           hash per request; TTL while active, shorter TTL after completion
  {p}:worker:{role}:{id} registry entry; TTL = heartbeat lease
  {p}:routers            sorted set: router id -> its lease's end (unix); a router past it is dead  (persistent)
  {p}:router:{id}:requests  set: that router's requests that have not ended; TTL refreshed by its heartbeat
Payload bulk (KV) never goes through Redis.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import MISSING, asdict, dataclass, fields

from splitserve.engine.params import SamplingParams
from splitserve.engine.structured import StructuredOutput
from splitserve.service.convert import CACHE_SALT_MAX_CHARS

log = logging.getLogger(__name__)

GROUP = "prefill"

ACTIVE_STATES = ("queued", "prefilling", "decoding")
FINAL_STATES = ("finished", "cancelled", "failed")

# A request_id may be sent again (as a new attempt) once its latest attempt has ended without
# finishing and without an Abort: it failed, or it was cancelled by its client going away or by
# its deadline. A nil state is an attempt whose hash expired: it has ended. An aborted one stays
# ended, and a finished one never runs twice (the router answers with its recorded result).
MAY_RUN_AGAIN = ("failed", "cancelled")


QUEUE_FIELDS = ("requests", "tokens")  # the admission hash: queued requests and prompt tokens, all routers together
LOCAL_FIELD = "local_tokens"  # ... and of those, the prompt tokens that their decode workers prefill


def queue_counts(values) -> tuple[int, int]:
    """(requests, tokens) from ``HMGET <admission> *QUEUE_FIELDS``; a missing field counts 0."""
    q, t = (int(x or 0) for x in values)
    return q, t


PRIORITY_CLASSES = ("high", "normal", "low")  # the order prefill workers pull in


def priority_class(priority: int) -> str:
    """Lower values are served first (vLLM's convention): < 0 high, 0 normal, > 0 low."""
    return "high" if priority < 0 else "low" if priority > 0 else "normal"


class Keys:
    def __init__(self, prefix: str):
        # A prefix with a hash tag of its own ("a{b}") is kept; any other is the tag: "{splitserve}".
        prefix = prefix if "{" in prefix and "}" in prefix.split("{", 1)[1] else "{" + prefix + "}"
        self.prefix = prefix
        self.stream = f"{prefix}:prefill"  # normal priority
        self.by_class = {c: self.stream if c == "normal" else f"{self.stream}:{c}" for c in PRIORITY_CLASSES}
        self.streams = tuple(self.by_class.values())  # in PRIORITY_CLASSES order: the order workers pull in
        self.admission = f"{prefix}:admission"
        self.routers = f"{prefix}:routers"
        self.prefix_records = f"{prefix}:prefix-records"  # routers' prefix records, shared (router/prefix_share.py)
        self.directed = f"{self.stream}:directed"  # the prefill workers with a stream of their own

    def stream_to(self, worker_id: str) -> str:
        """A prefill worker's own stream: the normal-priority jobs sent to it (prefill affinity)."""
        return f"{self.stream}:to:{worker_id}"

    def stream_for(self, priority: int) -> str:
        return self.by_class[priority_class(priority)]

    def req(self, request_id: str) -> str:
        return f"{self.prefix}:req:{request_id}"

    def router_requests(self, router_id: str) -> str:
        return f"{self.prefix}:router:{router_id}:requests"

    def worker(self, role: str, worker_id: str) -> str:
        return f"{self.prefix}:worker:{role}:{worker_id}"

    def worker_pattern(self, role: str) -> str:
        return f"{self.prefix}:worker:{role}:*"

    def draining_arena(self, arena: str) -> str:
        """A draining prefill worker's arena -> its host: out of the registry, it still hands over."""
        return f"{self.prefix}:arena:{arena}"


def _real(lo: float, hi: float):
    return lambda v: type(v) in (int, float) and lo <= v < hi  # (NaN is in no range)


def _count(hi: int):
    return lambda v: type(v) is int and 0 <= v < hi


_UNIX_MAX = 1e10  # seconds: the year 2286 (a time made nanoseconds for a span fits in 64 bits)
# A job's fields as a router writes them: (check, what the field is). A value of another type or
# out of range, from a router of another release or a bug, failed the pickup's Redis script or a
# span's time, and a worker stopped pulling any job or died; the next to claim the job did too.
_JOB_FIELDS = {
    "request_id": (lambda v: isinstance(v, str) and 0 < len(v) <= 4096, "a request id"),
    "token_ids": (
        lambda v: isinstance(v, list) and len(v) > 0 and all(type(t) is int for t in v),
        "a list of token ids",
    ),
    "sampling": (lambda v: isinstance(v, dict), "an object"),
    **{
        name: (lambda v: isinstance(v, str), "a string")
        for name in ("decode_worker", "decode_address", "decode_host_id", "traceparent", "decode_epoch")
    },
    "cache_salt": (
        lambda v: isinstance(v, str) and len(v) <= CACHE_SALT_MAX_CHARS,
        f"a string of at most {CACHE_SALT_MAX_CHARS} characters",
    ),
    **{
        name: (_real(0, _UNIX_MAX), "a time (seconds since 1970)")
        for name in ("deadline_unix", "t_received", "t_admitted")
    },
    "priority": (lambda v: type(v) is int and -(2**31) <= v < 2**31, "an int32"),
    **{name: (_count(2**32), "a count") for name in ("decode_cached_tokens", "resumed", "resumed_chars", "leg")},
}


@dataclass
class Job:
    """A prefill job as it travels through the stream."""

    request_id: str
    token_ids: list[int]
    sampling: dict  # SamplingParams fields
    decode_worker: str
    decode_address: str
    decode_host_id: str
    deadline_unix: float  # 0 = none
    traceparent: str
    t_received: float
    t_admitted: float
    priority: int = 0  # < 0 high, 0 normal, > 0 low: picks the stream (Keys.stream_for)
    decode_epoch: str = ""  # the decode worker's run, as the router found it registered
    cache_salt: str = ""  # GenerateRequest.cache_salt
    # prefix affinity: the prompt tokens the router expects the decode worker to hold in its prefix
    # cache; the KV handed over leaves them out (KVHandle.start_token), as bytes or in the region
    decode_cached_tokens: int = 0
    # A request resumed after its decode worker was lost: the last `resumed` of token_ids are
    # completion tokens its client has (with `resumed_chars` characters of their text); the prompt
    # is the rest (LLMEngine.add_request)
    resumed: int = 0
    resumed_chars: int = 0
    leg: int = 0  # the request's resumes when it was queued (resume.lua): an earlier leg's job is superseded

    @property
    def prompt_len(self) -> int:
        return len(self.token_ids) - self.resumed

    def to_json(self) -> str:
        # vars, not asdict: asdict deep-copies token_ids first (~0.2 ms at 300 tokens, on the TTFT path)
        return json.dumps(vars(self), separators=(",", ":"))

    @classmethod
    def from_dict(cls, d) -> Job:
        """A job from its decoded JSON. Fields this version does not know are ignored (a newer
        router may add some); ValueError if malformed."""
        if not isinstance(d, dict):
            raise ValueError(f"a job is a JSON object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        missing = sorted(f.name for f in fields(cls) if f.default is MISSING and f.name not in d)
        if missing:
            raise ValueError(f"job is missing {', '.join(missing)}")
        for name, (ok, what) in _JOB_FIELDS.items():  # each one a router writes as it writes it
            if name in d and not ok(d[name]):
                raise ValueError(f"job's {name} is not {what}")
        return cls(**{k: v for k, v in d.items() if k in known})

    def params(self) -> SamplingParams:
        """Sampling fields this version does not know are left out (a newer router may add some)."""
        known = {f.name for f in fields(SamplingParams)}
        d = {k: v for k, v in self.sampling.items() if k in known}  # (lists: SamplingParams checks and makes tuples)
        fmt = d.get("structured_output")
        if fmt is not None:
            if not (isinstance(fmt, dict) and isinstance(fmt.get("kind"), str)):
                raise ValueError("job's sampling.structured_output is not a format")
            d["structured_output"] = StructuredOutput(
                fmt["kind"], fmt.get("value", ""), bool(fmt.get("disable_any_whitespace", False))
            )
        return SamplingParams(**d)


def sampling_to_dict(p: SamplingParams) -> dict:
    d = asdict(p)
    d["stop"] = list(p.stop)
    d["stop_token_ids"] = list(p.stop_token_ids)
    return d


@dataclass
class WorkerInfo:
    worker_id: str
    role: str
    address: str
    host_id: str
    running: int = 0
    waiting: int = 0
    free_kv_tokens: int = 0
    kv_capacity_tokens: int = 0  # decode: the most tokens one sequence can ever hold here (0 = unknown)
    pending: int = 0  # decode: streams waiting for their KV
    # decode: streams opened and closed by this run (epoch) of the worker; opened - closed are open
    opened: int = 0
    closed: int = 0
    epoch: str = ""
    updated: float = 0.0
    metrics: str = ""  # host:port of its /metrics
    arena: str = ""  # prefill: its shared-memory arena (decode workers on its host map it ahead)
    fingerprint: str = ""  # decode: its model's weights' fingerprint (ListModels)
    dtype: str = ""  # decode: its engine's dtype

    def to_mapping(self) -> dict:
        return {k: str(v) for k, v in asdict(self).items()}

    @classmethod
    def from_mapping(cls, m: dict) -> WorkerInfo:
        """An entry as a worker writes it (to_mapping); ValueError naming the field for one that is
        not (a worker of another release, or a hand, may write any hash under the key)."""
        try:
            m = {
                (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
                for k, v in m.items()
            }
        except UnicodeDecodeError:
            raise ValueError("registry entry is not UTF-8") from None
        for name in ("worker_id", "role", "address", "host_id"):
            if not m.get(name):
                raise ValueError(f"registry entry has no {name}")
        counts = {name: _registry_count(m, name) for name in _REGISTRY_COUNTS}
        try:
            updated = float(m.get("updated", 0))
        except ValueError:
            updated = math.nan
        if not 0 <= updated < _UNIX_MAX:
            raise ValueError(f"registry entry's updated is not a time: {m.get('updated', '')[:40]!r}")
        return cls(
            worker_id=m["worker_id"],
            role=m["role"],
            address=m["address"],
            host_id=m["host_id"],
            **counts,
            epoch=m.get("epoch", ""),
            updated=updated,
            metrics=m.get("metrics", ""),
            arena=m.get("arena", ""),
            fingerprint=m.get("fingerprint", ""),
            dtype=m.get("dtype", ""),
        )


_REGISTRY_COUNTS = ("running", "waiting", "free_kv_tokens", "kv_capacity_tokens", "pending", "opened", "closed")


def _registry_count(m: dict, name: str) -> int:
    value = m.get(name, "0")
    try:
        n = int(value)
    except ValueError:
        n = -1
    if not 0 <= n < 2**63:
        raise ValueError(f"registry entry's {name} is not a count: {value[:40]!r}")
    return n


def ensure_group(r, keys: Keys) -> None:
    import redis

    for stream in keys.streams:
        try:
            r.xgroup_create(stream, GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise


CLUSTER_MODES = ("auto", "on", "off")
# A call to a Redis that does not answer (stopped, its host lost) fails after this, as
# UNAVAILABLE for a client, instead of holding a request or a worker's loop until Redis is back.
# No call the stack makes blocks in Redis for longer (a prefill worker's pull: 0.2 s).
CALL_TIMEOUT_S = 5.0


# connections an asyncio client opens to one Redis at most (connect)
ASYNC_POOL_CONNECTIONS = 128


def is_cluster(url: str, cluster: str = "auto", **kwargs) -> bool:
    """Whether `url` is a Redis Cluster node: `cluster` on or off says so; auto asks the server
    (`kwargs`: the TLS files). A server that cannot be reached is taken as not a cluster (with a
    warning)."""
    if cluster not in CLUSTER_MODES:
        raise ValueError(f"redis_cluster must be one of {', '.join(CLUSTER_MODES)}, got {cluster!r}")
    if cluster != "auto":
        return cluster == "on"
    if url.startswith("unix://"):  # cluster nodes are reached over TCP: nothing to ask (the embedded Redis)
        return False
    import redis

    try:
        with redis.Redis.from_url(url, socket_timeout=CALL_TIMEOUT_S, **kwargs) as r:
            return bool(r.info("cluster").get("cluster_enabled"))
    except (redis.RedisError, OSError) as e:
        log.warning(
            "could not ask Redis at %s whether it is a cluster (%s): taken as not one; "
            "set SPLITSERVE_REDIS_CLUSTER=on for a cluster",
            redacted(url),
            e,
        )
        return False


def _driver_info():
    import redis
    from redis.driver_info import DriverInfo

    return DriverInfo(lib_version=redis.__version__)


def connect(url: str, cluster: str = "auto", *, asyncio: bool = False, **kwargs):
    """A client for the Redis at `url`, sync or asyncio: a cluster client for a Redis Cluster node
    (any node: it finds the others). `kwargs` go to the client (socket_timeout, ...)."""
    kwargs.setdefault("socket_timeout", CALL_TIMEOUT_S)
    # The version each new connection names to the server (CLIENT SETINFO): given, redis-py does not
    # read its package metadata from disk for every connection it opens (0.3 ms each, in a burst
    # that grows the pool, on the event loop).
    kwargs.setdefault("driver_info", _driver_info())
    if asyncio:  # redis-py writes each command under asyncio.wait_for, which loses cancels on 3.11
        from splitserve.service.aio import use_fixed_wait_for

        use_fixed_wait_for()
    tls = {k: v for k, v in kwargs.items() if k.startswith("ssl_")}
    if is_cluster(url, cluster, **tls):
        if asyncio:
            from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

            return AsyncRedisCluster.from_url(url, **kwargs)
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(url, **kwargs)
    if asyncio:
        import redis.asyncio as aioredis

        # A burst holds more commands in flight than the pool has connections: they wait for one
        # (up to a call's timeout), where the default pool would fail them ("Too many connections").
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=ASYNC_POOL_CONNECTIONS, timeout=CALL_TIMEOUT_S, **kwargs
        )
        return aioredis.Redis.from_pool(pool)
    import redis

    return redis.Redis.from_url(url, **kwargs)


# the redis_tls_* settings -> redis-py's TLS arguments
REDIS_TLS_ARGS = {"redis_tls_ca": "ssl_ca_certs", "redis_tls_cert": "ssl_certfile", "redis_tls_key": "ssl_keyfile"}


def tls_files(settings) -> dict[str, str]:
    """redis-py's TLS arguments from the redis_tls_* settings (for a rediss:// URL)."""
    return {arg: getattr(settings, f) for f, arg in REDIS_TLS_ARGS.items() if getattr(settings, f)}


def open_redis(settings, *, asyncio: bool = False, **kwargs):
    """connect() to the Redis the settings name (redis_url, redis_cluster, redis_tls_*)."""
    return connect(settings.redis_url, settings.redis_cluster, asyncio=asyncio, **tls_files(settings), **kwargs)


def redacted(url: str) -> str:
    """url without its password (redis://user:***@host:port/db), for logs and messages."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def check_credentials(settings) -> None:
    """Refuse, as a bad setting, a Redis that rejects the URL's user and password (ACL AUTH) or
    whose TLS certificate the settings do not trust: a process would otherwise fail at its first
    command with a traceback, or wait for ever. A Redis not answering is not refused here:
    processes wait for one that comes up later."""
    import ssl

    import redis

    try:
        client = open_redis(settings, socket_timeout=5, socket_connect_timeout=5)
        try:
            client.ping()
        finally:
            client.close()
    except redis.AuthenticationError as e:  # the URL holds the password: it is not repeated
        raise ValueError(f"redis_url: Redis refused its user and password ({e})") from None
    except redis.RedisError as e:
        if isinstance(e.__context__, ssl.SSLError) or "SSL" in str(e):
            raise ValueError(f"redis_url: the TLS handshake with Redis failed ({e})") from None


def now() -> float:
    return time.time()
