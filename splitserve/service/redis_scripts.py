"""The Redis protocol's scripts: each in a ``lua/<name>.lua`` file, loaded once, and called through
one Python function with named arguments.

Each function below builds a `Call` (the script's name, KEYS and ARGV, in the order its file
documents); `Scripts` registers every script once on a client and runs calls, one at a time
(``scripts.run(call)``: awaitable on an asyncio client) or several in one round trip
(``scripts.run_all(calls)``, sync clients). Nothing else builds KEYS or ARGV lists.

A script's file may start with ``-- include: NAME`` lines: ``lua/lib/NAME.lua`` (a local
function shared by several scripts) is put before its body when it is loaded.

Who calls what:
  router          admit, resume, abort, reap, progress, take_back, dequeue
  prefill worker  pull, pickup, drop, update, restore, own_stream, forget_stream, heartbeat
  decode worker   update, heartbeat
"""

from __future__ import annotations

import pathlib
import time
from dataclasses import dataclass

import grpc

from splitserve.service.errors import fit_details
from splitserve.service.redis_state import GROUP, Keys, WorkerInfo

LUA_DIR = pathlib.Path(__file__).resolve().parent / "lua"
# A request whose deadline passed in the queue ends with this status (pickup.lua writes its number).
DEADLINE_CODE = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]


def load_source(name: str) -> str:
    """The script ``lua/<name>.lua`` with its includes put before it."""
    text = (LUA_DIR / f"{name}.lua").read_text()
    libs = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("-- include:")]
    return "".join((LUA_DIR / "lib" / f"{lib}.lua").read_text() for lib in libs) + text


NAMES = tuple(sorted(p.stem for p in LUA_DIR.glob("*.lua")))
SOURCES = {name: load_source(name) for name in NAMES}


@dataclass(frozen=True)
class Call:
    """One run of a script: its name and its KEYS and ARGV, as its file documents them."""

    script: str
    keys: list
    args: list


class Scripts:
    """Every script registered once on one Redis client (sync or asyncio); ``sources``: name ->
    Lua source, the protocol's own by default."""

    def __init__(self, r, sources: dict[str, str] | None = None):
        self.r = r
        self._registered = {name: r.register_script(source) for name, source in (sources or SOURCES).items()}

    def run(self, call: Call):
        """The script's answer (an awaitable one on an asyncio client)."""
        return self._registered[call.script](keys=call.keys, args=call.args)

    def run_all(self, calls: list[Call]) -> list:
        """Sync client: several calls in one round trip, their answers in order.

        A pipeline of EVALSHA: redis-py's own pipelined scripts cost one more round trip (SCRIPT
        EXISTS) each time. A script the server has lost (it restarted) is loaded and run again, only
        that one: the others have run. Any other error is raised after all have been sent. A Redis
        Cluster client cannot pipeline EVALSHA: there they run one after another.
        """
        from redis.cluster import RedisCluster
        from redis.exceptions import NoScriptError

        if len(calls) == 1 or isinstance(self.r, RedisCluster):
            return [self.run(call) for call in calls]
        with self.r.pipeline(transaction=False) as p:
            for call in calls:
                p.evalsha(self._registered[call.script].sha, len(call.keys), *call.keys, *call.args)
            results = p.execute(raise_on_error=False)
        out = []
        for call, result in zip(calls, results):
            if isinstance(result, NoScriptError):
                result = self.run(call)
            elif isinstance(result, Exception):
                raise result
            out.append(result)
        return out


def field_args(mapping: dict) -> list:
    """A mapping as Redis arguments: field, value, ..."""
    return [x for kv in mapping.items() for x in kv]


# -- router ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Attempt:
    """A request sent with a client-chosen id: what admit.lua checks of it. ``seen``: the attempts
    its first hash counted when the router read it (0 for a first attempt); ``fingerprint``: the
    request's, kept in its hash. A new attempt (the id ran before and ended unfinished) names its
    first attempt's id and its latest attempt's."""

    seen: int
    fingerprint: str
    first_id: str = ""
    latest_id: str = ""


def admit(
    keys: Keys,
    *,
    request_id: str,
    job_json: str,
    priority: int,
    tokens: int,
    max_requests: int,
    max_tokens: int,
    fraction: float,
    ttl_s: int,
    queue: bool,
    router_id: str,
    attempt: Attempt | None = None,
    directed_to: str = "",
    directed_bound: int = 0,
    supersede: bool = False,
    tenant_quotas: tuple[int, int] = (0, 0),
) -> Call:
    """Admit a request, record its hash and queue its job, in one step (admit.lua). ``queue`` False:
    its decode worker prefills it. ``directed_to``: a prefill worker whose own stream takes the job
    while it holds fewer than ``directed_bound`` entries (prefill affinity). ``supersede``: a new
    attempt of a request sent again to go on replaces a latest attempt still running.
    ``tenant_quotas``: its tenant's bounds on its own queued requests and tokens (0: none; a
    tenant's request has an id of the form <tenant>~<id>)."""
    new_attempt = attempt is not None and bool(attempt.first_id)
    return Call(
        "admit",
        [
            keys.admission,
            keys.stream_for(priority),
            keys.req(request_id),
            keys.router_requests(router_id),
            *((keys.req(attempt.first_id), keys.req(attempt.latest_id)) if new_attempt else ()),
            *((keys.stream_to(directed_to), keys.worker("prefill", directed_to)) if directed_to else ()),
        ],
        [
            tokens,
            max_requests,
            max_tokens,
            fraction,
            ttl_s,
            job_json,
            1 if queue else 0,
            router_id,
            attempt.seen if attempt else "",
            attempt.fingerprint if attempt else "",
            directed_bound if directed_to else "",
            1 if supersede and new_attempt else 0,
            *tenant_quotas,
        ],
    )


def resume(
    keys: Keys,
    *,
    request_id: str,
    job_json: str,
    priority: int,
    tokens: int,
    max_requests: int,
    max_tokens: int,
    ttl_s: int,
    queue: bool,
    lost_worker: str,
) -> Call:
    """A request whose decode worker was lost goes on as a new leg (resume.lua)."""
    return Call(
        "resume",
        [keys.admission, keys.stream_for(priority), keys.req(request_id)],
        [tokens, max_requests, max_tokens, ttl_s, job_json, 1 if queue else 0, lost_worker],
    )


def abort(keys: Keys, *, request_id: str, now: float, finished_ttl_s: int, early_ttl_s: int) -> Call:
    """Mark a request cancelled by an Abort (abort.lua): {its state before, its decode worker}."""
    return Call("abort", [keys.req(request_id)], [now, finished_ttl_s, early_ttl_s])


def reap(keys: Keys, *, router_id: str, request_ids: list[str], now: float, finished_ttl_s: int, force: bool) -> Call:
    """Fail the requests of a router past its lease (reap.lua); ``force``: whatever its lease."""
    return Call(
        "reap",
        [keys.routers, keys.router_requests(router_id), keys.admission, *(keys.req(rid) for rid in request_ids)],
        [router_id, now, finished_ttl_s, 1 if force else 0],
    )


def progress(keys: Keys, *, running: list[tuple[str, int, float]]) -> Call:
    """Record running requests' progress (progress.lua): (request id, completion tokens so far,
    unix time of the first token) each."""
    return Call("progress", [keys.req(rid) for rid, _, _ in running], [x for _, n, t in running for x in (n, t)])


def take_back(keys: Keys, *, request_id: str, prompt_tokens: int, now: float) -> Call:
    """Take a queued request back for its decode worker to prefill (take_back.lua)."""
    return Call("take_back", [keys.admission, keys.req(request_id)], [prompt_tokens, now])


def dequeue(keys: Keys, *, request_id: str, prompt_tokens: int) -> Call:
    """Return the queue counts of a request its decode worker prefills, once (dequeue.lua)."""
    return Call("dequeue", [keys.admission, keys.req(request_id)], [prompt_tokens])


# -- prefill worker -------------------------------------------------------------------------


def pull(keys: Keys, *, streams: list[str], consumer: str, jobs: int, tokens: int) -> Call:
    """New entries from ``streams`` in order, up to ``jobs`` jobs or ``tokens`` tokens (pull.lua)."""
    return Call("pull", list(streams), [GROUP, consumer, jobs, tokens])


def pickup(
    keys: Keys, *, request_id: str, prompt_tokens: int, first_delivery: bool, now: float, worker: str,
    deadline_unix: float, leg: int,
) -> Call:  # fmt: skip
    """Pick a job up (pickup.lua): its outcome, "prefilling" when it is to be prefilled."""
    return Call(
        "pickup",
        [keys.admission, keys.req(request_id)],
        [prompt_tokens, int(first_delivery), now, worker, deadline_unix or 0, leg],
    )


def drop(keys: Keys, *, request_key: str, tokens: int, error: str, code: grpc.StatusCode | None = None) -> Call:
    """Drop a job that cannot be read (drop.lua); ``request_key``: its request hash (one no request
    has, when its id cannot be read), ``tokens``: as admission counted it (-1: not counted)."""
    return Call(
        "drop", [keys.admission, request_key], [tokens, 1, error, *((code.value[0],) if code is not None else ())]
    )


def own_stream(keys: Keys, *, worker_id: str) -> Call:
    """Make a prefill worker's own stream and its group if they are not there (own_stream.lua)."""
    return Call("own_stream", [keys.stream_to(worker_id), keys.directed], [GROUP, worker_id])


def forget_stream(keys: Keys, *, worker_id: str) -> Call:
    """Remove a departed prefill worker's own stream once it is empty (forget_stream.lua): the
    entries left (0: removed), -1 while the worker is registered."""
    return Call(
        "forget_stream", [keys.stream_to(worker_id), keys.worker("prefill", worker_id), keys.directed], [worker_id]
    )


def restore(keys: Keys, *, request_id: str, ttl_s: int, fields: dict) -> Call:
    """Put back a request's hash that Redis lost, only where there is none (restore.lua)."""
    return Call("restore", [keys.req(request_id)], [ttl_s, *field_args(fields)])


# -- both workers ---------------------------------------------------------------------------


def update(keys: Keys, *, request_id: str, fields: dict, leg: int | None = None) -> Call:
    """Record fields on a request that exists and has not ended (update.lua); with ``leg``, only
    while the request has not resumed past it."""
    return Call("update", [keys.req(request_id)], field_args(({"_leg": leg} if leg is not None else {}) | fields))


def failed(code: grpc.StatusCode, error: str) -> dict:
    """The fields of a request a worker failed, for `update`: with the status its client gets,
    which its router reads there if the decode worker cannot be told."""
    return {"state": "failed", "error": fit_details(error), "code": code.value[0]}


def heartbeat(keys: Keys, *, info: WorkerInfo, lease_s: float) -> Call:
    """This worker's registry entry, now, with a lease of ``lease_s`` (heartbeat.lua)."""
    info.updated = time.time()
    return Call(
        "heartbeat",
        [keys.worker(info.role, info.worker_id)],
        [str(int(lease_s * 1000)), *field_args(info.to_mapping())],
    )
