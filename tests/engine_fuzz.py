"""A seeded fuzz of an in-process engine's calls on a tiny model (round_of), for tests.

Each round draws an engine (policy, KV pool of 4-40 blocks, prefix cache, token budget, sequence
slots, batch sizes, batch-invariant or not) and 6-16 requests: prompts of shared stems or not, some
ending at a block's end, greedy or seeded sampling, n samples, stop tokens, min_tokens, log
probabilities of tokens and of the prompt, penalties, min_p, logit biases (the end-of-sequence
token's too), priorities, cache salts; with a tokenizer, stop strings (kept in the text or not),
formats (structured output) and special tokens' text too. A quarter of them are prefilled by
another engine and their KV imported; some are resumed as a client left them after a lost decode
worker (add_request's resumed, or resume_samples for n > 1: each sample's first tokens and
characters of text at one of its outputs, or ended; one of n = 1 with all its tokens, which end it,
is refused: nothing is left to generate). It adds them, aborts some, forgets the prefix cache now
and then, and steps, in a random interleaving (a few calls at a time between steps). Checked: the
pool's bookkeeping after every step, no run of steps without work, every request ended once,
refused only when it can never fit (or resumed so), nothing held at the end; and each request not
aborted gets the tokens, text, finish reason and counts of log probabilities it gets alone, from
where its client was (seeded sampling only when batch-invariant: otherwise a draw may land on the
next token over with another batch's rounding, and only its count is checked)."""

from __future__ import annotations

import random

from engine_helpers import BLOCK, BLOCK_BYTES, check_pool, random_prompts

from splitserve.engine.errors import CapacityError, InvalidRequestError
from splitserve.engine.sampling import SamplingParams

EOS = 2
# With a tokenizer (round_of's formats): stop strings, some of which a random model's noise holds often
STOPS = ["e", "an", " the", ".", "\n", "ing", "zq"]


def _params(rng: random.Random, policy: str, formats: list | None, knobs: random.Random) -> SamplingParams:
    """knobs: draws the knobs added to the fuzz later (presence penalty, min_p, logit bias), apart
    from rng, so that a seed draws the same engine, requests and calls as before they were."""
    kw: dict = dict(max_tokens=rng.randint(1, 40), ignore_eos=rng.random() < 0.8)
    if rng.random() < 0.4:
        kw.update(
            temperature=rng.choice([0.7, 1.0, 1.5]),
            seed=rng.randrange(1000),
            top_k=rng.choice([0, 5, 50]),
            top_p=rng.choice([1.0, 0.9]),
        )
    if policy == "continuous" and rng.random() < 0.2:
        kw.update(n=rng.randint(2, 3), temperature=1.0, seed=rng.randrange(1000))
    if rng.random() < 0.15:
        kw["stop_token_ids"] = tuple(rng.sample(range(3, 512), 3))
    if rng.random() < 0.15:
        kw["min_tokens"] = rng.randint(0, kw["max_tokens"])
    if rng.random() < 0.2:
        kw["logprobs"] = rng.randint(0, 3)
    if policy == "continuous" and rng.random() < 0.15:
        kw["prompt_logprobs"] = rng.randint(0, 2)
    if rng.random() < 0.1:
        kw["repetition_penalty"] = 1.3
    if rng.random() < 0.1:
        kw["frequency_penalty"] = 0.5
    if knobs.random() < 0.1:
        kw["presence_penalty"] = knobs.choice([-1.0, 1.5])
    if knobs.random() < 0.1:
        kw["min_p"] = knobs.choice([0.05, 0.5])
    if knobs.random() < 0.1:  # two tokens made likely or unlikely (now and then the end-of-sequence token)
        kw["logit_bias"] = tuple(
            sorted((t, knobs.choice([-100.0, -5.0, 3.0, 100.0])) for t in knobs.sample(range(64), 2))
        )
    if formats is not None:
        if rng.random() < 0.3:
            kw.update(stop=tuple(rng.sample(STOPS, rng.randint(1, 2))), include_stop_str_in_output=rng.random() < 0.5)
        if rng.random() < 0.2:
            kw["structured_output"] = rng.choice(formats)
        if rng.random() < 0.1:
            kw["skip_special_tokens"] = False
    return SamplingParams(**kw)


class Log:
    """What the outputs said, by (request id, sample index): tokens, text, end, counts of log
    probabilities and of prompt log probabilities; and marks, {tokens: characters of text} a
    client had after each output (where a resumed request can start)."""

    def __init__(self):
        self.tokens: dict = {}
        self.text: dict = {}
        self.marks: dict = {}
        self.reasons: dict = {}
        self.logprobs: dict = {}
        self.prompt_logprobs: dict = {}

    def take(self, outs) -> None:
        for out in outs:
            key = (out.request_id, out.index)
            self.tokens.setdefault(key, []).extend(out.new_token_ids)
            self.text[key] = self.text.get(key, "") + out.new_text
            self.marks.setdefault(key, {}).setdefault(len(self.tokens[key]), len(self.text[key]))
            self.logprobs[key] = self.logprobs.get(key, 0) + len(out.new_logprobs or ())
            self.prompt_logprobs[key] = self.prompt_logprobs.get(key, 0) + len(out.prompt_logprobs or ())
            if out.finished:
                assert key not in self.reasons, f"{key} ended twice"
                self.reasons[key] = out.finish_reason


def _alone(factory, prompt, params, invariant: bool) -> Log:
    eng, log = factory(batch_invariant=invariant), Log()
    eng.add_request("alone", prompt, params)
    while eng.has_unfinished():
        log.take(eng.step())
    return log


def _imported(pre, eng, rid, prompt, params, prio, log: Log) -> bool:
    """Prefill in pre, then import into eng as a decode worker does (stepping eng while its blocks
    are short). False if the first token ended the request at prefill (no KV to hand over)."""
    pre.add_request(rid, prompt, params, prefill_only=True)
    while rid not in pre.parked and rid in pre.seqs:
        log.take([o for o in pre.step() if o.finish_reason != "prefilled"])
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
            log.take(eng.step())
    else:
        raise AssertionError(
            f"{rid}: no room for its {export.num_tokens} tokens' import in 3000 steps: "
            f"{eng.cache.pool.num_free} of {eng.cache.pool.num_blocks} blocks free, "
            f"{[(k, q.status.name, q.priority, len(q.block_table)) for k, q in eng.seqs.items()]}"
        )
    if out is not None:
        log.take([out])
    return True


def _had(alone: Log, i: int, n: int) -> tuple[list[int], int]:
    """What the client of sample i run alone had after its output holding its n-th token (or the
    last before it): its tokens and the characters of its text."""
    marks = alone.marks.get(("alone", i), {})
    n = max([m for m in marks if m <= n], default=0)
    return alone.tokens.get(("alone", i), [])[:n], marks.get(n, 0)


def _resume_samples(eng, rid, prompt, params, prio, salt, alone: Log, rng: random.Random, log: Log) -> dict:
    """Resume a request of n > 1 samples (resume_samples) as its client left it: of each sample some
    first tokens (none, or all: its end's message was lost), or it ended there (left out). Returns
    {index: (tokens, characters) its client had} of those resumed."""
    samples = []
    for i in rng.sample(range(params.n), params.n):
        n = len(alone.tokens.get(("alone", i), []))
        if samples and rng.random() < 0.3:
            continue  # its client had it all, and its end
        samples.append((i, *_had(alone, i, rng.choice([0, n, rng.randint(0, n)]))))
    log.take(eng.resume_samples(rid, prompt, params, samples, priority=prio, cache_salt=salt))
    return {i: (len(tokens), chars) for i, tokens, chars in samples}


def round_of(factory, rng: random.Random, formats: list | None = None) -> None:
    """One round (module docstring); factory is tiny_engine_factory. formats: its model has a
    tokenizer, and requests draw stop strings and these formats (StructuredOutput) too. Raises
    AssertionError."""
    policy = rng.choices(["continuous", "dynamic", "static"], [6, 2, 2])[0]
    cfg = dict(
        policy=policy,
        kv_cache_bytes=rng.randint(4, 40) * BLOCK_BYTES,
        block_size=BLOCK,
        prefix_caching=policy == "continuous" and rng.random() < 0.6,
        max_num_batched_tokens=rng.choice([16, 33, 64, 2048]),
        max_num_seqs=rng.choice([1, 2, 4, 64]),
        max_batch_size=rng.choice([1, 3, 8]),
        static_batch_size=rng.choice([1, 3, 8]),
        max_wait_ms=0.0,
        batch_invariant=policy == "continuous" and rng.random() < 0.5,
    )
    invariant = cfg["batch_invariant"]
    eng = factory(**cfg)
    pre = factory(kv_cache_bytes=64 * BLOCK_BYTES, block_size=BLOCK, batch_invariant=invariant)
    base = rng.randrange(10**6)
    knobs = random.Random(-base - 1)  # _params' later knobs: a seed apart from the prompts' (base, base + 1 + i)
    stems = random_prompts(3, lo=16, hi=80, seed=base)
    reqs = []  # (id, prompt, params, priority, how: "add", "import" or "resume", salt)
    for i in range(rng.randint(6, 16)):
        tail = random_prompts(1, lo=1, hi=40, seed=base + 1 + i)[0]
        prompt = (rng.choice(stems)[: rng.randrange(0, 80)] + tail) if rng.random() < 0.6 else tail
        if rng.random() < 0.3:  # its KV ends at a block's end
            prompt = (prompt * 8)[: BLOCK * rng.randint(1, 4)]
        params = _params(rng, policy, formats, knobs)
        how = "add"
        if policy == "continuous" and rng.random() < 0.25:
            how = "import"
        elif params.max_tokens > 1 and rng.random() < (0.15 if params.n == 1 else 0.5):
            how = "resume"  # its client has its first tokens (its decode worker was lost)
        reqs.append(
            (
                f"r{i}",
                prompt,
                params,
                rng.choice([-1, 0, 0, 1]),
                how,
                rng.choice(["", "", "salt"]) if cfg["prefix_caching"] else "",
            )
        )
    alone = {rid: _alone(factory, prompt, params, invariant) for rid, prompt, params, *_ in reqs}
    log, aborted, refused, live, resumed, ended_had = Log(), set(), {}, [], {}, set()
    pending, steps, idle = list(reqs), 0, 0
    while pending or eng.has_unfinished():
        if pending and rng.random() < 0.5:
            rid, prompt, params, prio, how, salt = pending.pop(0)
            try:
                if how == "import":
                    _imported(pre, eng, rid, prompt, params, prio, log)
                elif how == "resume" and params.n > 1:
                    resumed[rid] = _resume_samples(eng, rid, prompt, params, prio, salt, alone[rid], rng, log)
                elif (
                    how == "resume"
                    and (n := len(alone[rid].tokens.get(("alone", 0), [])) - 1) > 0
                    and (had := _had(alone[rid], 0, rng.randint(1, n) if rng.random() < 0.8 else n + 1))[0]
                ):
                    if len(had[0]) == n + 1:  # all its tokens (its end's message lost): refused
                        ended_had.add(rid)
                    eng.add_request(
                        rid,
                        prompt + had[0],
                        params,
                        priority=prio,
                        cache_salt=salt,
                        resumed=len(had[0]),
                        resumed_chars=had[1],
                    )
                    resumed[rid] = {0: (len(had[0]), had[1])}
                else:
                    eng.add_request(rid, prompt, params, priority=prio, cache_salt=salt)
                live.append(rid)
            except InvalidRequestError as e:
                refused[rid] = str(e)
        if live and rng.random() < 0.05:
            rid = rng.choice(live)
            n = next(p.n for r, _, p, *_ in reqs if r == rid)
            if any((rid, i) not in log.reasons for i in resumed.get(rid, range(n))):
                aborted.add(rid)
            if (out := eng.abort_request(rid)) is not None:
                log.take([out])
        if cfg["prefix_caching"] and rng.random() < 0.02:
            eng.reset_prefix_cache()
        if eng.has_unfinished() and not (pending and rng.random() < 0.4):
            outs = eng.step()
            log.take(outs)
            check_pool(eng.cache.pool, eng.cache.pool.num_used)
            idle = 0 if (outs or eng.last_stats.num_tokens) else idle + 1
            assert idle < 50, (
                f"50 steps without work, {cfg}: {[(k, q.status.name, len(q.block_table)) for k, q in eng.seqs.items()]}"
            )
            steps += 1
            assert steps < 5000, f"no end after 5000 steps, {cfg}"
    check_pool(eng.cache.pool)
    check_pool(pre.cache.pool)
    assert not eng.seqs and not eng.parked and not pre.seqs and not pre.parked, cfg
    for rid, prompt, params, *_ in reqs:
        if rid in refused:
            assert "can never fit" in refused[rid] or (
                rid in ended_had and "nothing is left to generate" in refused[rid]
            ), (rid, refused[rid])
            continue
        assert rid not in ended_had, f"{rid}: resumed with all its tokens, which end it, and not refused"
        if rid in aborted:
            continue
        for i in resumed.get(rid, range(params.n)):
            k, chars = resumed.get(rid, {}).get(i, (0, 0))
            key, mine = (rid, i), ("alone", i)
            want, reason, tokens = alone[rid], log.reasons.get(key), log.tokens.get(key, [])
            whole = want.tokens.get(mine, [])[:k] + tokens  # (a resumed one's first k: its client's)
            assert reason in ("length", "eos", "stop"), (key, reason, cfg)
            assert len(whole) <= params.max_tokens and (reason != "length" or len(whole) == params.max_tokens)
            assert reason != "eos" or (whole[-1] == EOS and len(whole) >= params.min_tokens), (key, whole)
            if params.logprobs is not None:
                assert log.logprobs[key] == len(tokens), (key, log.logprobs[key], len(tokens))
            if params.prompt_logprobs is not None and i == 0:  # (a resumed request's client has them: they
                # came with sample 0's first token, which comes before any other sample's)
                assert log.prompt_logprobs[key] == (0 if rid in resumed else len(prompt) - 1), (
                    key,
                    log.prompt_logprobs[key],
                )
            if params.temperature > 0 and not invariant:
                continue
            assert (tokens, reason) == (want.tokens[mine][k:], want.reasons[mine]), (key, k, cfg, params)
            assert log.text.get(key, "") == want.text[mine][chars:], (key, k, chars, log.text.get(key), want.text[mine])
