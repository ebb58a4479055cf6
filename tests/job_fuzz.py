"""Random prefill jobs in Redis, valid and not, for tests of what a prefill worker does with each
(seeded). A job is what a router queues (redis_state.Job, as JSON in a stream entry); a router of
another release, or a bug, may write one this release cannot serve.

Each round opens the request's decode stream and writes its request hash and admission counts, as
a router's admission does, then queues one entry: a job as a router writes it, or (most rounds)
with one part wrong: a field missing, of another type or out of range, a sampling knob a router
would refuse, JSON that is not a job (cut short, an array, nested past Python's recursion limit,
NaN), or an entry's other fields wrong; it goes to the stream of its priority's class (any, for a
priority that has none). ``fault`` says what is wrong with one round's outcome."""

from __future__ import annotations

import json
import random
import time

import grpc
from request_fuzz import FIELD, VOCAB, random_sampling

from splitserve.engine.errors import InvalidRequestError
from splitserve.engine.sampling import SamplingParams
from splitserve.service import convert
from splitserve.service.redis_state import sampling_to_dict
from splitserve_proto.v1 import worker_pb2 as w

NAN, INF = float("nan"), float("inf")
# a field's wrong values: of another type, out of range, or edges a router never writes
BAD_FIELDS = {
    "request_id": ["", 5, None, ["a"], "x" * 5000],
    "token_ids": [[], "1 2 3", [1.5], [-1], [VOCAB], [2**62], [2**70], [True], [[1]], None, [7] * 9000],
    "sampling": ["x", [], None, 5],
    "decode_worker": [5, None, ""],
    "decode_address": ["", 5, None, "x" * 300, "nowhere:1", "127.0.0.1:1"],
    "decode_host_id": [5, None],
    "deadline_unix": ["soon", None, -1, 1.0, 1e30, NAN, INF, [1]],
    "traceparent": ["garbage", 5, None, "00-" + "0" * 32 + "-" + "0" * 16 + "-01", "x" * 10000],
    "t_received": ["x", None, -1, 1e30, NAN],
    "t_admitted": ["x", None, -1, 1e30, NAN, INF],
    "priority": [1.5, "x", 10**30, -(10**30), True, None],
    "decode_epoch": [5, None, ["x"]],
    "cache_salt": [5, None, "x" * 257, "x" * 100_000],
    "decode_cached_tokens": [-1, "x", 10**9, 1.5],
    "resumed": [-1, 10**9, "x", 1.5],
    "resumed_chars": [-1, 10**12, "x"],
    "leg": [-1, 10**9, "x", 1.5],
}
# sampling knobs as a router never writes them (it checks them first)
BAD_SAMPLING = {
    "temperature": ["hot", -1, NAN, INF, None],
    "top_p": [2, -0.5, "x", NAN],
    "top_k": [-5, "x", 1.5, 10**30],
    "min_p": [2, -1, NAN],
    "max_tokens": [0, -1, "x", 10**12, 1.5],
    "min_tokens": [-1, 10**9, "x"],
    "stop": ["abc", [1], [None], [""], ["x" * 10000]],
    "stop_token_ids": ["x", [VOCAB], [-1], ["a"], [2**62]],
    "logit_bias": [[[1]], {"1": 2}, [["a", 1]], [[VOCAB, 1]], [[1, "x"]], "x", [[1, NAN]], [[-1, 5]]],
    "seed": ["x", -1, 2**80, 1.5],
    "n": [0, 10**6, "x"],
    "logprobs": [-1, 10**6, "x"],
    "prompt_logprobs": [-1, "x"],
    "structured_output": [
        "x",
        {"kind": 5},
        {"kind": "json_schema", "value": "{"},
        {"kind": "regex", "value": "("},
        {"kind": "nope", "value": ""},
        {"kind": "regex"},
        {"kind": "regex", "value": 5},
    ],
    "presence_penalty": [NAN, 10**9, "x"],
    "frequency_penalty": [-(10**9)],
    "repetition_penalty": [0, -1, NAN],
    "ignore_eos": ["yes", None],
    "include_stop_str_in_output": [2, "x"],
    "skip_special_tokens": ["x"],
}
RAW = [
    "{not json",
    "[1, 2]",
    "null",
    "5",
    '"a job"',
    "[" * 100_000,
    "{" * 50_000,
    '{"request_id": "half"}',
    "",
    "\udc80",
    json.dumps({"x": 1}) * 3,
]


def valid_job(rng: random.Random, rid: str, dec: dict, ids: list[int]) -> dict:
    """A job as a router writes it, its sampling drawn among valid values (request_fuzz)."""
    while True:  # (random_sampling's valid fields may still not go together: min_tokens > max_tokens)
        try:
            params = convert.sampling_from_pb(random_sampling(rng, False), 8)
            break
        except InvalidRequestError:
            pass
    if params.max_tokens > 12 or params.n > 2:  # short rounds
        params = SamplingParams(
            **{
                **params.__dict__,
                "max_tokens": min(params.max_tokens, 12),
                "n": min(params.n, 2),
                "min_tokens": min(params.min_tokens, 12),
            }
        )
    now = time.time()
    return dict(
        request_id=rid,
        token_ids=ids,
        sampling=sampling_to_dict(params),
        decode_worker=dec["worker_id"],
        decode_address=dec["address"],
        decode_host_id=dec["host_id"],
        deadline_unix=rng.choice([0, now + 120]),
        traceparent="",
        t_received=now,
        t_admitted=now,
        priority=rng.choice([0, 0, 0, -1, 1]),
        cache_salt=rng.choice(["", "", "tenant-a"]),
    )


def random_entry(rng: random.Random, rid: str, dec: dict, ids: list[int]) -> tuple[dict, str]:
    """(the stream entry's fields, what is wrong with it: "" when nothing is)."""
    job = valid_job(rng, rid, dec, ids)
    tokens, what = str(len(ids)), ""
    kind = rng.random()
    if kind < 0.3:
        pass
    elif kind < 0.55:
        name = rng.choice(list(BAD_FIELDS))
        job[name] = rng.choice(BAD_FIELDS[name])
        what = f"{name}={_short(job[name])}"
    elif kind < 0.8:
        name = rng.choice(list(BAD_SAMPLING))
        job["sampling"][name] = rng.choice(BAD_SAMPLING[name])
        what = f"sampling.{name}={_short(job['sampling'][name])}"
    elif kind < 0.88:
        name = rng.choice(
            [
                "request_id",
                "token_ids",
                "sampling",
                "decode_worker",
                "decode_address",
                "decode_host_id",
                "deadline_unix",
                "traceparent",
                "t_received",
                "t_admitted",
            ]
        )
        del job[name]
        what = f"no {name}"
    elif kind < 0.95:
        raw = rng.choice(RAW)
        what = f"raw {_short(raw)}"
        return {"job": raw.encode("utf-8", "surrogatepass"), "tokens": tokens}, what
    else:
        tokens = rng.choice(["lots", "-4", "1e9", "", str(10**30)])
        what = f"tokens={_short(tokens)}"
    if "resumed" in what and isinstance(job.get("resumed"), int) and 0 < job["resumed"] < len(ids):
        what = ""  # a count of resumed tokens within the prompt is a job a router may write
    return {"job": json.dumps(job), "tokens": tokens}, what


def _short(v) -> str:
    s = repr(v)
    return s if len(s) <= 40 else f"{s[:30]}... ({len(s)} characters)"


def counted(fields: dict) -> int | None:
    """The prompt tokens admission counted for this entry, as the prefill worker reads them back
    (None: admission did not count it)."""
    try:
        n = int(fields.get("tokens", ""))
    except ValueError:
        return None
    return n if 0 <= n < 2**31 else None  # (a count no prompt has: admission could not have counted it)


def round_of(stack, stub, rng: random.Random, rid: str, dec: dict, wait_s: float = 30.0) -> tuple:
    """Queue one random entry for a decode stream opened here, as admission does; read the stream
    until it ends (or wait_s; 2 s for an entry that cannot end it: MAY_NOT_END). (what is wrong with
    the entry, its outcome: ("OK", finish reason, tokens), (status code name, message) or ("no end",
    "")). The request hash and admission counts are written as a router would for the entry's
    "tokens" (counted())."""
    r, p = stack.redis(), stack.keys.prefix
    ids = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]
    fields, what = random_entry(rng, rid, dec, ids)
    n = counted(fields)
    wait_s = 2.0 if what.startswith(MAY_NOT_END) else wait_s
    try:  # a job's deadline is its router's call's too, which ends the stream then
        job = json.loads(fields["job"])
        deadline, priority = job.get("deadline_unix", 0), job.get("priority", 0)
        late = type(deadline) in (int, float) and 0 < deadline < time.time() + wait_s
    except (ValueError, AttributeError, RecursionError):
        late, priority = False, None
    if not (type(priority) is int and -(2**31) <= priority < 2**31):  # (no class: a stream of any)
        priority = rng.choice([-1, 0, 1])
    if late:
        wait_s = max(0.05, deadline - time.time())
    stream = stub.Decode(w.DecodeRequest(request_id=rid, prompt_tokens=len(ids)), timeout=wait_s)
    try:
        first = next(stream)
        assert first.accepted, first
        r.hset(f"{p}:req:{rid}", mapping={"state": "queued", "prompt_tokens": len(ids)})
        r.expire(f"{p}:req:{rid}", 600)
        if n is not None:
            r.hincrby(f"{p}:admission", "requests", 1)
            r.hincrby(f"{p}:admission", "tokens", n)
        r.xadd(stack.keys.stream_for(priority), fields)  # the stream of its priority's class, as a router's
        tokens, finish = 0, ""
        for ev in stream:
            if ev.error:
                return what, (grpc.StatusCode(_code(ev.error_code)).name, ev.error)
            tokens += len(ev.token_ids)
            finish = ev.finish_reason or finish
            if ev.finish_reason and not ev.more:
                break
        return what, ("OK", finish, tokens)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return what, ("DEADLINE_EXCEEDED", "the job's deadline") if late else ("no end", "")
        return what, (e.code().name, e.details())
    finally:
        stream.cancel()


def _code(value: int):
    return next((c for c in grpc.StatusCode if c.value[0] == value), grpc.StatusCode.UNKNOWN)


# What a stream may end with: tokens, or a failure that says why: a job the worker cannot read
# (INTERNAL "malformed prefill job: ..."), a request the engine refuses (INVALID_ARGUMENT naming the
# field), one that can never fit (RESOURCE_EXHAUSTED), one whose deadline passed.
CLEAR = {
    "INTERNAL": "malformed prefill job: ",
    "INVALID_ARGUMENT": "",
    "RESOURCE_EXHAUSTED": "",
    "DEADLINE_EXCEEDED": "",
}
# a job that names another request or decode worker than the stream's, or none, cannot end it
MAY_NOT_END = ("request_id=", "no request_id", "decode_address=", "no decode_address", "raw ")
# values a prefill worker must refuse, not serve (a router refuses them: a salt over 256 characters)
MUST_REFUSE = ("cache_salt='xxx",)


# the words a refusal names a field by (a job's token_ids are its client's prompt)
NAMED = {"token_ids": ("token_ids", "prompt")}


def fault(what: str, outcome: tuple) -> str | None:
    """What is wrong with a round's outcome, or None."""
    code = outcome[0]
    if code == "OK":
        if outcome[1] not in {"length", "stop", "eos"}:
            return f"{what or 'a valid job'}: finished {outcome[1]!r}"
        return f"{what}: served, not refused" if what.startswith(MUST_REFUSE) else None
    if not what:
        return f"a valid job: {outcome}"
    if code == "no end":
        return None if what.startswith(MAY_NOT_END) else f"{what}: its stream never ended"
    if code not in CLEAR:
        return f"{what}: {code} {outcome[1][:300]!r}"
    if code == "INVALID_ARGUMENT" and not FIELD.match(outcome[1]):
        return f"{what}: INVALID_ARGUMENT names no field: {outcome[1][:300]!r}"
    if not outcome[1].startswith(CLEAR[code]):
        return f"{what}: {code} {outcome[1][:300]!r}"
    field = what.removeprefix("no ").split("=")[0]
    if code in ("INTERNAL", "INVALID_ARGUMENT") and not any(f in outcome[1] for f in NAMED.get(field, (field,))):
        return f"{what}: {code} does not name {field}: {outcome[1][:300]!r}"
    return None
