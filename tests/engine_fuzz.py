"""A seeded fuzz of an in-process engine's calls on the tiny model (round_of), for tests.

Each round draws an engine (policy, KV pool of 4-40 blocks, prefix cache, token budget, sequence
slots, batch sizes, batch-invariant or not) and 6-16 requests: prompts of shared stems or not,
some ending at a block's end, greedy or seeded sampling, n samples, stop tokens, min_tokens, log
probabilities, penalties, priorities, and in a quarter of them the prompt prefilled by another
engine and its KV imported. It adds them, aborts some, and steps, in a random interleaving (a
few calls at a time between steps). Checked: the pool's bookkeeping after every step, no run of
steps without work, every request ended once, refused only when it can never fit, nothing held
at the end; and each request not aborted gets the tokens and finish reason a roomy engine gives
it alone (seeded sampling only when batch-invariant: otherwise a draw may land on the next token
over with another batch's rounding, and only its count is checked)."""

from __future__ import annotations

import random

from engine_helpers import random_prompts

from splitserve.engine.errors import CapacityError, InvalidRequestError
from splitserve.engine.sampling import SamplingParams

BLOCK = 16
BLOCK_BYTES = BLOCK * 2 * 2 * 2 * 16 * 4  # the tiny model: 2 layers, K and V, 2 KV heads of 16, fp32
EOS = 2


def _params(rng: random.Random, policy: str) -> SamplingParams:
    kw: dict = dict(max_tokens=rng.randint(1, 40), ignore_eos=rng.random() < 0.8)
    if rng.random() < 0.4:
        kw.update(temperature=rng.choice([0.7, 1.0, 1.5]), seed=rng.randrange(1000),
                  top_k=rng.choice([0, 5, 50]), top_p=rng.choice([1.0, 0.9]))
    if policy == "continuous" and rng.random() < 0.2:
        kw.update(n=rng.randint(2, 3), temperature=1.0, seed=rng.randrange(1000))
    if rng.random() < 0.15:
        kw["stop_token_ids"] = tuple(rng.sample(range(3, 512), 3))
    if rng.random() < 0.15:
        kw["min_tokens"] = rng.randint(0, kw["max_tokens"])
    if rng.random() < 0.2:
        kw["logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.1:
        kw["repetition_penalty"] = 1.3
    if rng.random() < 0.1:
        kw["frequency_penalty"] = 0.5
    return SamplingParams(**kw)


def _collect(outs, got: dict, reasons: dict) -> None:
    for out in outs:
        key = (out.request_id, out.index)
        got.setdefault(key, []).extend(out.new_token_ids)
        if out.finished:
            assert key not in reasons, f"{key} ended twice"
            reasons[key] = out.finish_reason


def _alone(factory, prompt, params, invariant: bool) -> tuple[dict, dict]:
    eng = factory(batch_invariant=invariant)
    eng.add_request("alone", prompt, params)
    got, reasons = {}, {}
    while eng.has_unfinished():
        _collect(eng.step(), got, reasons)
    return got, reasons


def _imported(pre, eng, rid, prompt, params, prio, got, reasons) -> bool:
    """Prefill in pre, then import into eng as a decode worker does (stepping eng while its blocks
    are short). False if the first token ended the request at prefill (no KV to hand over)."""
    pre.add_request(rid, prompt, params, prefill_only=True)
    while rid not in pre.parked and rid in pre.seqs:
        _collect([o for o in pre.step() if o.finish_reason != "prefilled"], got, reasons)
    if rid not in pre.parked:
        return False
    buf = memoryview(bytearray(pre.kv_nbytes(rid)))
    export = pre.export_kv(rid, buf)
    pre.release(rid)
    for _ in range(3000):
        try:
            out = eng.import_kv(export, buf, priority=prio)
            break
        except CapacityError:
            _collect(eng.step(), got, reasons)
    else:
        raise AssertionError(f"{rid}: no room for its import in 3000 steps")
    if out is not None:
        _collect([out], got, reasons)
    return True


def round_of(factory, rng: random.Random) -> None:
    """One round (module docstring); factory is tiny_engine_factory. Raises AssertionError."""
    policy = rng.choices(["continuous", "dynamic", "static"], [6, 2, 2])[0]
    cfg = dict(policy=policy, kv_cache_bytes=rng.randint(4, 40) * BLOCK_BYTES, block_size=BLOCK,
               prefix_caching=policy == "continuous" and rng.random() < 0.6,
               max_num_batched_tokens=rng.choice([16, 33, 64, 2048]), max_num_seqs=rng.choice([1, 2, 4, 64]),
               max_batch_size=rng.choice([1, 3, 8]), static_batch_size=rng.choice([1, 3, 8]), max_wait_ms=0.0,
               batch_invariant=policy == "continuous" and rng.random() < 0.5)
    eng = factory(**cfg)
    pre = factory(kv_cache_bytes=64 * BLOCK_BYTES, block_size=BLOCK, batch_invariant=cfg["batch_invariant"])
    base = rng.randrange(10**6)
    stems = random_prompts(3, lo=16, hi=80, seed=base)
    reqs = []
    for i in range(rng.randint(6, 16)):
        tail = random_prompts(1, lo=1, hi=40, seed=base + 1 + i)[0]
        prompt = (rng.choice(stems)[: rng.randrange(0, 80)] + tail) if rng.random() < 0.6 else tail
        if rng.random() < 0.3:  # its KV ends at a block's end
            prompt = (prompt * 8)[: BLOCK * rng.randint(1, 4)]
        reqs.append((f"r{i}", prompt, _params(rng, policy), rng.choice([-1, 0, 0, 1]),
                     policy == "continuous" and rng.random() < 0.25))
    got, reasons, aborted, refused, live = {}, {}, set(), {}, []
    pending, steps, idle = list(reqs), 0, 0
    while pending or eng.has_unfinished():
        if pending and rng.random() < 0.5:
            rid, prompt, params, prio, imported = pending.pop(0)
            try:
                if not imported:
                    eng.add_request(rid, prompt, params, priority=prio)
                else:
                    _imported(pre, eng, rid, prompt, params, prio, got, reasons)
                live.append(rid)
            except InvalidRequestError as e:
                refused[rid] = str(e)
        if live and rng.random() < 0.05:
            rid = rng.choice(live)
            n = next(p.n for r, _, p, _, _ in reqs if r == rid)
            if any((rid, i) not in reasons for i in range(n)):
                aborted.add(rid)
            if (out := eng.abort_request(rid)) is not None:
                _collect([out], got, reasons)
        if eng.has_unfinished() and not (pending and rng.random() < 0.4):
            outs = eng.step()
            _collect(outs, got, reasons)
            pool = eng.cache.pool
            free, evictable = set(pool._free), set(pool._evictable)
            assert len(free) == len(pool._free) and not free & evictable, cfg
            assert sum(r > 0 for r in pool._refs) == pool.num_used, cfg
            idle = 0 if (outs or eng.last_stats.num_tokens) else idle + 1
            assert idle < 50, f"50 steps without work, {cfg}: " \
                              f"{[(k, q.status.name, len(q.block_table)) for k, q in eng.seqs.items()]}"
            steps += 1
            assert steps < 5000, f"no end after 5000 steps, {cfg}"
    assert eng.cache.pool.num_used == 0 and not eng.seqs and not eng.parked, cfg
    assert not pre.seqs and not pre.parked and pre.cache.pool.num_used == 0
    for rid, prompt, params, _, _ in reqs:
        if rid in refused:
            assert "can never fit" in refused[rid], (rid, refused[rid])
            continue
        if rid in aborted:
            continue
        want, want_reasons = _alone(factory, prompt, params, cfg["batch_invariant"])
        for i in range(params.n):
            key, mine = (rid, i), ("alone", i)
            reason, tokens = reasons.get(key), got.get(key, [])
            assert reason in ("length", "eos", "stop"), (key, reason, cfg)
            assert len(tokens) <= params.max_tokens and (reason != "length" or len(tokens) == params.max_tokens)
            assert reason != "eos" or (tokens[-1] == EOS and len(tokens) >= params.min_tokens), (key, tokens)
            if params.temperature > 0 and not cfg["batch_invariant"]:
                continue
            assert (tokens, reason) == (want[mine], want_reasons[mine]), (key, cfg, params)
