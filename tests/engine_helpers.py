"""Helpers for tests that drive an engine in-process."""

from __future__ import annotations

import random
from typing import NamedTuple


def random_prompts(n, lo=4, hi=120, seed=0) -> list[list[int]]:
    """n prompts of lo..hi-1 token ids in [3, 512) (the tiny model's vocabulary), seeded."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


class Drained(NamedTuple):
    tokens: dict[str, list[int]]  # request id -> every token it produced
    reasons: dict[str, str]  # request id -> finish reason
    preempted: int  # preemptions over all steps


def drain(engine) -> Drained:
    """Step until nothing is left; collect what each request produced."""
    got, reasons, preempted = {}, {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        preempted += engine.last_stats.num_preempted
    return Drained(got, reasons, preempted)


def exported(engine, request_id: str, prompt: list[int], params, start: int = 0, salt: str = ""):
    """Prefill prompt in engine and export its KV, as a prefill worker does: (KVExport, payload);
    the KV of tokens start on. The engine's own blocks are released; the payload holds the KV."""
    engine.add_request(request_id, prompt, params, prefill_only=True, cache_salt=salt)
    while request_id not in engine.parked:
        engine.step()
    buf = memoryview(bytearray(engine.kv_nbytes(request_id, start)))
    export = engine.export_kv(request_id, buf, start)
    engine.release(request_id)
    return export, buf
