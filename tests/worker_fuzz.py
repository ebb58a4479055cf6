"""Random calls to a decode worker's internal API (DecodeWorker), valid and not, for tests of what
it answers each (seeded).

Each round opens a Decode stream (in one of three with a prompt to prefill there, as a colocated
router sends it) and sends it one to three of PutKVStream (bytes), PutKV (a shared-memory handle),
FirstToken or FirstTokens, Fail, Cancel and PrefillHere, each drawn as a router or a prefill worker
would send it or with one part wrong: a sequence whose prompt length, tokens, resumed tokens, log
probabilities, finish reason, generator state or salt is bad, a payload cut short, with a bad header
or with NaN in its KV, tokens outside the vocabulary, codes out of range, an unknown or empty id.
``fault`` says what is wrong with one answer."""

from __future__ import annotations

import os
import random
import struct
import threading
import time
import types

import grpc
from request_fuzz import FIELD, VOCAB, random_sampling

from splitserve.handoff import layout as kv_layout
from splitserve_proto.v1 import worker_pb2 as w

# what a call may answer besides OK (a handoff for a stream that has ended or is of another leg,
# a second handoff, a PrefillHere for a stream whose KV came already, a stream cancelled here, one
# whose deadline_unix passed; one the fuzz cut)
CLEAR = {
    "INVALID_ARGUMENT",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "FAILED_PRECONDITION",
    "CANCELLED",
    "DEADLINE_EXCEEDED",
    "cancelled by the fuzz",
}
FINISHES = {"length", "stop", "eos", "cancelled", "error"}
SHAPE = types.SimpleNamespace(  # SmolLM2 KV
    num_layers=30, num_kv_heads=3, head_dim=64, kv_dtype="float32", kv_itemsize=4
)


def _tokens(rng: random.Random, bad: bool) -> list[int]:
    if bad and rng.random() < 0.5:
        return rng.choice([[-1], [VOCAB], [2**62], [], [0] * 3000])
    return [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]


def _sequence(rng: random.Random, rid: str, prompt_len: int, bad: bool) -> w.SequenceState:
    seq = w.SequenceState(request_id=rid, prompt_len=prompt_len)
    seq.token_ids.extend(rng.randrange(VOCAB) for _ in range(prompt_len + rng.randint(1, 3)))
    if rng.random() < 0.6:
        seq.sampling.CopyFrom(random_sampling(rng, bad and rng.random() < 0.3))
    if not seq.sampling.HasField("max_tokens"):
        seq.sampling.max_tokens = rng.randint(1, 10)
    if seq.sampling.HasField("logprobs"):
        for t in seq.token_ids[prompt_len:]:
            seq.logprobs.add(token_id=t, logprob=-1.0)
    if seq.sampling.HasField("prompt_logprobs"):
        for t in seq.token_ids[1:prompt_len]:
            seq.prompt_logprobs.add(token_id=t, logprob=-1.0)
    if bad:
        kind = rng.randint(0, 9)
        if kind == 0:
            seq.prompt_len = rng.choice([-1, 0, 2**40, len(seq.token_ids)])
        elif kind == 1:
            seq.token_ids[rng.randrange(len(seq.token_ids))] = rng.choice([-1, VOCAB, 2**62])
        elif kind == 2:
            seq.generator_state = rng.choice([b"x", os.urandom(50), bytes(5056)])  # (a state is 5056 bytes)
            seq.sampling.temperature = 0.8  # (a greedy request's is not read)
        elif kind == 3:
            seq.finish_reason = rng.choice(["length", "stop", "weird", "eos", "cancelled"])
        elif kind == 4:
            seq.resumed_tokens, seq.resumed_chars = rng.choice([1, 5, 2**31]), rng.choice([0, 3, 2**31])
        elif kind == 5:
            seq.logprobs.add(token_id=-5, logprob=float("nan"))
        elif kind == 6:
            seq.cache_salt = rng.choice(["x" * 300, "\u00e9"])
        elif kind == 7:
            seq.queue_ms, seq.prefill_ms, seq.prefill_end_unix = float("nan"), -1.0, float("inf")
        elif kind == 8:
            seq.text, seq.finish_reason = rng.choice(["", "abc"]), "length"
        else:
            seq.leg = rng.choice([0, 1, 2**31])
    return seq


def whole_payload(fingerprint: str, num_tokens: int) -> bytearray:
    """A whole KV payload of num_tokens tokens for SmolLM2 (the stacks' model): its header as a prefill
    worker writes it, and a body of zeros."""
    header = kv_layout._header(types.SimpleNamespace(shape=SHAPE, fingerprint=fingerprint), num_tokens, 0)
    return bytearray(header) + bytes(kv_layout.payload_nbytes(SHAPE, num_tokens) - len(header))


def _chunks(rng: random.Random, seq: w.SequenceState, fingerprint: str, bad: bool) -> list[w.KVChunk]:
    """PutKVStream's chunks: a whole payload for seq (its body zeros but for some random bytes), or a
    broken one."""
    payload = whole_payload(fingerprint, max(1, len(seq.token_ids) - 1))
    header = kv_layout._HEADER.size
    payload[header : header + 4096] = os.urandom(4096)
    if bad and rng.random() < 0.4:  # a value that is no number, or one too big
        at = header + 4 * rng.randrange((len(payload) - header) // 4)
        payload[at : at + 4] = struct.pack("<f", rng.choice([float("nan"), float("inf"), 1e38]))
    if bad and rng.random() < 0.3:
        payload = payload[: rng.randrange(len(payload))]
    if bad and rng.random() < 0.2:
        payload[: rng.choice([4, 8, 64])] = b"\xff" * 64
    h = w.KVHandle(
        length=len(payload),
        num_tokens=len(seq.token_ids) - 1,
        layout_version=1,
        dtype="float32",
        fingerprint=fingerprint,
        transport="grpc",
    )
    data = bytes(payload)
    chunks = [w.KVChunk(header=w.PutKVRequest(sequence=seq, handle=h), data=data[: 1 << 16])]
    chunks += [w.KVChunk(data=data[i : i + (1 << 20)]) for i in range((1 << 16), len(data), 1 << 20)]
    return chunks


def fault(what: str, code: str, detail: str) -> str:
    """What is wrong with an answer to a call (code: the status's name, or a Decode event's), or ''."""
    if code == "OK" or code in CLEAR - {"INVALID_ARGUMENT"}:
        return ""
    if code == "INVALID_ARGUMENT":
        return "" if FIELD.match(detail) else f"{what}: INVALID_ARGUMENT without its field: {detail[:300]!r}"
    return f"{what}: {code} {detail[:300]!r}"


def round_of(stub, rng: random.Random, rid: str, fingerprint: str, arena: str, host_id: str) -> list[tuple]:
    """One round: a Decode stream for rid and one to three calls about it. Returns each answer as
    (what, code, detail): every call's, and the stream's (its finish reason, or its error event's
    code, or the status it ended with); "cancelled by the fuzz" for a stream it cut."""
    bad = rng.random() < 0.5
    prompt_len = rng.randint(1, 30)
    opened = w.DecodeRequest(
        request_id=rid,
        priority=rng.choice([0, 0, -1, 2**31 - 1, -(2**31)]),
        prompt_tokens=prompt_len if rng.random() < 0.9 else rng.choice([-3, 0, 2**40]),
    )
    if rng.random() < 0.2:
        opened.deadline_unix = rng.choice([time.time() + 5, 1.0, float("nan"), float("inf")])
    if rng.random() < 0.2:
        opened.leg = rng.choice([0, 1])
    if rng.random() < 0.3:  # prefilled here
        opened.prompt_token_ids.extend(_tokens(rng, bad))
        opened.sampling.CopyFrom(random_sampling(rng, bad and rng.random() < 0.5))
        if not opened.sampling.HasField("max_tokens"):
            opened.sampling.max_tokens = rng.randint(1, 10)
        if rng.random() < 0.2:
            opened.resumed_tokens, opened.resumed_chars = rng.choice([0, 1, 3, 100]), rng.choice([0, 2, 10**6])
        if rng.random() < 0.15:
            for j in range(rng.randint(1, 3)):
                opened.resumed_samples.add(
                    index=rng.choice([j, 0, 20]), token_ids=_tokens(rng, bad)[:4], chars=rng.choice([0, 1, 2**31])
                )
        if rng.random() < 0.1:
            opened.cache_salt = rng.choice(["a", "x" * 300])
    answers: list[tuple] = []
    stream = stub.Decode(opened, timeout=30)
    events: list = []
    ended = threading.Event()

    def drain():
        try:
            events.extend(stream)
        except grpc.RpcError as e:
            events.append(e)
        ended.set()

    threading.Thread(target=drain, daemon=True).start()
    time.sleep(0.05)
    failed_by_fuzz = False  # its error event then says what the fuzz's Fail said
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(["PutKVStream", "PutKVStream", "PutKV", "FirstToken", "Fail", "Cancel", "PrefillHere"])
        target = rid if rng.random() < 0.85 else rng.choice(["", "nobody-" + rid])
        try:
            if kind == "PutKVStream":
                seq = _sequence(rng, target, prompt_len, bad)
                if seq.finish_reason and rng.random() < 0.5:  # finished at prefill: no KV
                    stub.PutKVStream(iter([w.KVChunk(header=w.PutKVRequest(sequence=seq))]), timeout=30)
                else:
                    stub.PutKVStream(iter(_chunks(rng, seq, fingerprint, bad)), timeout=30)
            elif kind == "PutKV":
                seq = _sequence(rng, target, prompt_len, bad)
                h = w.KVHandle(
                    arena=rng.choice(["", "nope", arena]),
                    offset=rng.choice([0, 2**63]),
                    length=rng.choice([0, 64, 2**63]),
                    num_tokens=len(seq.token_ids) - 1,
                    layout_version=1,
                    dtype="float32",
                    fingerprint=fingerprint,
                    host_id=host_id,
                    transport="shm",
                )
                stub.PutKV(w.PutKVRequest(sequence=seq, handle=h), timeout=30)
            elif kind == "FirstToken":
                req = w.FirstTokenRequest(
                    request_id=target,
                    token_ids=_tokens(rng, bad)[: rng.choice([1, 1, 2])],
                    text=rng.choice(["", "x", "\u00e9"]),
                    queue_ms=rng.choice([0.0, float("nan")]),
                    prefill_ms=rng.choice([1.0, -1.0, float("inf")]),
                    resumed_tokens=rng.choice([0, 0, 5, 2**31]),
                )
                if rng.random() < 0.3:
                    req.logprobs.add(token_id=rng.choice([1, -1]), logprob=rng.choice([-1.0, float("nan")]))
                if rng.random() < 0.2:
                    req.leg = rng.choice([0, 3])
                if rng.random() < 0.5:
                    stub.FirstToken(req, timeout=30)
                else:  # the prefill worker's stream: a bad message there is dropped
                    kind = "FirstTokens"
                    stub.FirstTokens(iter([req]), timeout=30)
            elif kind == "Fail":
                failed_by_fuzz = True
                stub.Fail(
                    w.FailRequest(
                        request_id=target,
                        code=rng.choice([1, 3, 8, 14, 16, 0, 17, -1]),
                        message=rng.choice(["", "m", "x" * 100000]),
                        handoff_lost=rng.random() < 0.3,
                    ),
                    timeout=30,
                )
            elif kind == "Cancel":
                stub.Cancel(w.CancelRequest(request_id=target), timeout=30)
            else:
                req = w.PrefillHereRequest(
                    request_id=target,
                    prompt_token_ids=_tokens(rng, bad),
                    queue_ms=rng.choice([0.0, -5.0, float("nan")]),
                    cache_salt=rng.choice(["", "x" * 300]),
                )
                req.sampling.CopyFrom(random_sampling(rng, bad and rng.random() < 0.5))
                stub.PrefillHere(req, timeout=30)
            answers.append((kind, "OK", ""))
        except grpc.RpcError as e:
            answers.append((kind, e.code().name, e.details() or ""))
    if not ended.wait(rng.choice([0.2, 0.5, 2.0])):
        stream.cancel()
        ended.wait(10)
        answers.append(("Decode", "cancelled by the fuzz", ""))
        return answers
    for ev in events:
        if isinstance(ev, grpc.RpcError):
            answers.append(("Decode", ev.code().name, ev.details() or ""))
        elif ev.error and not failed_by_fuzz:
            code = next((c.name for c in grpc.StatusCode if c.value[0] == ev.error_code), f"code {ev.error_code}")
            answers.append(("Decode", code, ev.error))
        elif ev.finish_reason and ev.finish_reason not in FINISHES:
            answers.append(("Decode", "finish_reason", ev.finish_reason))
        elif ev.finish_reason:
            answers.append(("Decode", "OK", ev.finish_reason))
    return answers
