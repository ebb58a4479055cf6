"""Helpers for tests that drive an engine in-process."""

from __future__ import annotations

import os
import random
from typing import NamedTuple

BLOCK = 16
BLOCK_BYTES = BLOCK * 2 * 2 * 2 * 16 * 4  # the tiny model: 2 layers, K and V, 2 KV heads of 16, fp32


def check_pool(pool, held: int = 0) -> None:
    """Every block of a BlockPool is in exactly one place: held, free, or cached and free."""
    free, evictable = set(pool._free), set(pool._evictable)
    assert len(free) == len(pool._free) and not free & evictable
    assert sum(r > 0 for r in pool._refs) == held == pool.num_used
    assert all(pool._refs[b] == 0 for b in free | evictable)
    assert evictable <= set(pool._entry_of) and len(pool._entries) == len(pool._entry_of)


def random_prompts(n, lo=4, hi=120, seed=0) -> list[list[int]]:
    """n prompts of lo..hi-1 token ids in [3, 512) (the tiny model's vocabulary), seeded."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def mapped_from(t, path: str) -> bool:
    """Whether tensor t's data lies in a mapping of the file at path (/proc/self/maps)."""
    addr, real = t.data_ptr(), os.path.realpath(path)
    with open("/proc/self/maps") as f:
        for line in f:
            span, *rest = line.split()
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= addr < hi:
                return len(rest) >= 5 and rest[-1] == real
    return False


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


def engine_factory_of(loaded):
    """A fixture's body: yields make(**EngineConfig fields), an in-process engine on `loaded`; after
    the test, the leak check of every engine made: no KV block held, no sequence left."""
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.engine import LLMEngine

    engines = []

    def make(**kw):
        kw.setdefault("kv_cache_bytes", 64 << 20)
        kw.setdefault("num_threads", 1)
        # Off unless a test asks: tests that run the same prompts twice compare computed KV
        # (tests/test_prefix_cache.py turns it on).
        kw.setdefault("prefix_caching", False)
        eng = LLMEngine(EngineConfig(**kw), loaded=loaded)
        engines.append(eng)
        return eng

    yield make
    for eng in engines:  # leak check after every test: no KV block held
        assert eng.cache.pool.num_used == 0, f"{eng.cache.pool.num_used} KV blocks still held"
        assert not eng.seqs and not eng.parked


def hf_greedy(folder: str, dtype: str, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens for prompt, n of them, with the model in folder in dtype."""
    import torch
    from transformers import LlamaForCausalLM

    ref = LlamaForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    # n tokens as ignore_eos makes them: no end-of-sequence id, rather than min_new_tokens (which
    # takes the end-of-sequence token out of the choice: greedy picks another where it is first)
    ref.generation_config.eos_token_id = None
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()
