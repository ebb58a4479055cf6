"""The prefix cache: prompts that start alike share the KV blocks of what they share."""

import random

import pytest
from engine_helpers import BLOCK, BLOCK_BYTES, check_pool, drain, exported, random_prompts

from splitserve.engine.errors import InvalidRequestError, KVPrefixMissing
from splitserve.engine.kv_cache import BlockPool
from splitserve.engine.sampling import SamplingParams
from splitserve.handoff import layout as kv_layout
from splitserve.handoff.layout import payload_nbytes

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def cached(**kw):
    return {"prefix_caching": True, **kw}


def run(eng, rid, prompt, params=GREEDY, salt=""):
    """Run one request alone: (its tokens, its output's num_cached_tokens, the tokens its first
    step computed)."""
    eng.add_request(rid, prompt, params, cache_salt=salt)
    tokens, hit, computed = [], None, None
    while eng.has_unfinished():
        for out in eng.step():
            tokens.extend(out.new_token_ids)
            hit = out.num_cached_tokens
        computed = eng.last_stats.num_tokens if computed is None else computed
    return tokens, hit, computed


def test_a_shared_prefix_is_computed_once_and_gives_the_same_tokens(tiny_engine_factory):
    system = random_prompts(1, lo=100, hi=101, seed=11)[0]
    a, b = system + [5, 6, 7], system + [8, 9, 10, 11, 12]
    plain = tiny_engine_factory()
    eng = tiny_engine_factory(**cached())
    assert run(eng, "a", a) == (run(plain, "a", a)[0], 0, len(a))
    want = run(plain, "b", b)[0]
    # b's first 96 tokens (6 whole blocks of the 100 it shares with a) come from the cache
    assert run(eng, "b", b) == (want, 96, len(b) - 96)
    # the very same prompt again: all its whole blocks but the one holding its last token
    assert run(eng, "b2", b) == (want, 96, len(b) - 96)
    exact = system[:96]
    assert run(eng, "c", exact)[1:] == (80, 16)  # its last token is computed, for its logits
    # a prompt that differs in its first token shares nothing
    assert run(eng, "d", [system[0] + 1] + system[1:])[1] == 0
    check_pool(eng.cache.pool)


def test_the_cache_is_off_for_padded_policies_and_when_turned_off(tiny_engine_factory):
    prompt = random_prompts(1, lo=60, hi=61, seed=12)[0]
    for kw in ({"prefix_caching": False}, cached(policy="static"), cached(policy="dynamic")):
        eng = tiny_engine_factory(**kw)
        eng.generate([prompt], GREEDY)
        assert run(eng, "again", prompt)[1] == 0, kw


def test_shared_blocks_are_never_written(tiny_engine_factory):
    """Sequences that share a prefix decode and prefill past it, side by side: the shared
    blocks' KV stays bit for bit what the first sequence computed."""
    eng = tiny_engine_factory(**cached())
    system = random_prompts(1, lo=64, hi=65, seed=13)[0]  # exactly 4 blocks
    eng.add_request("first", system + [3, 4], SamplingParams(max_tokens=40, ignore_eos=True))
    eng.step()
    first = eng.seqs["first"].block_table[:4]
    before = eng.cache.kv[:, :, first[0] * BLOCK : (first[-1] + 1) * BLOCK].clone()
    for i, tail in enumerate(random_prompts(6, lo=1, hi=40, seed=14)):
        eng.add_request(f"other-{i}", system + tail, SamplingParams(max_tokens=30, ignore_eos=True))
    eng.step()
    assert all(eng.seqs[f"other-{i}"].block_table[:4] == first for i in range(6))
    drain(eng)
    after = eng.cache.kv[:, :, first[0] * BLOCK : (first[-1] + 1) * BLOCK]
    assert first == sorted(first) and first[-1] - first[0] == 3  # one slice holds them
    assert bool((after == before).all())


def test_sharing_preempting_cancelling_and_evicting_give_the_uncached_tokens_and_hold_nothing(tiny_engine_factory):
    """Prompts built from a few shared prefixes, in a pool far too small (preemption and
    eviction all along), with cancellations: every request that finishes gives the tokens
    of a roomy engine without the cache, and no block is held at the end."""
    rng = random.Random(15)
    stems = random_prompts(3, lo=20, hi=70, seed=16)
    prompts = [
        rng.choice(stems)[: rng.randrange(10, 70)] + random_prompts(1, lo=1, hi=30, seed=100 + i)[0] for i in range(14)
    ]
    params = [SamplingParams(max_tokens=rng.randrange(5, 30), ignore_eos=True) for _ in prompts]
    want = tiny_engine_factory().generate(prompts, params)
    small = tiny_engine_factory(**cached(kv_cache_bytes=14 * BLOCK_BYTES))
    for i, (p, sp) in enumerate(zip(prompts, params)):
        small.add_request(f"r{i}", p, sp)
    got, reasons, preempted, hits, step = {}, {}, 0, 0, 0
    while small.has_unfinished():
        if step in (3, 9) and small.abort_request(f"r{step}") is not None:
            reasons[f"r{step}"] = "cancelled"
        for out in small.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        preempted += small.last_stats.num_preempted
        hits += small.last_stats.num_cached_tokens
        step += 1
        check_pool(small.cache.pool, small.cache.pool.num_used)
    assert preempted > 0 and hits > 0
    for i in range(14):
        if reasons.get(f"r{i}") != "cancelled":
            assert got[f"r{i}"] == want[i], i
    check_pool(small.cache.pool)
    assert small.cache.pool.num_cached > 0  # what is cached stays, counted as free


def test_a_preempted_sequence_takes_what_is_left_of_its_blocks_back_from_the_cache(tiny_engine_factory):
    eng = tiny_engine_factory(**cached(kv_cache_bytes=12 * BLOCK_BYTES))
    low = random_prompts(1, lo=100, hi=101, seed=17)[0]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    want = tiny_engine_factory().generate([low], params)[0]
    eng.add_request("low", low, params, priority=1)
    for _ in range(3):
        eng.step()
    # low holds 7 blocks (102 tokens computed); urgent needs 10 at once, then 11: low is
    # preempted, its blocks go back with their entries, and urgent is handed the plain free
    # ones first, then low's from its end. Its first block is still cached when it returns.
    eng.add_request("urgent", random_prompts(1, lo=150, hi=151, seed=18)[0], params, priority=-1)
    eng.step()
    assert eng.seqs["low"].num_computed == 0 and eng.last_stats.num_preempted == 1
    got, hits, finished = {}, [], {}
    while eng.has_unfinished():
        for out in eng.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            finished[out.request_id] = out
        if eng.last_stats.request_ids == ["low"] and eng.last_stats.num_prefill_tokens:
            hits.append((eng.last_stats.num_cached_tokens, eng.last_stats.num_prefill_tokens))
    assert got["low"] == want[3:]  # its first 3 tokens came before it was preempted
    assert hits == [(16, 102 - 16 + 1)]  # its first block back; 86 tokens computed again and its next
    assert finished["low"].num_cached_tokens == 0  # a recompute's hits are not prompt tokens served
    check_pool(eng.cache.pool)


def test_the_pool_hands_out_plain_blocks_first_and_evicts_the_least_recently_freed_end_first():
    pool = BlockPool(6, 2, prefix_caching=True)
    a = pool.allocate(3)
    tokens = [1, 2, 3, 4, 5, 6]
    assert pool.register(tokens, a, 0, 3, 0) > 0 and pool.num_cached == 3
    pool.free(list(a))
    assert pool.num_free == 6 and pool.num_cached == 3
    assert pool.lookup(tokens, 6)[0] == a
    b = pool.allocate(3)
    assert not set(b) & set(a) and pool.num_cached == 3  # the three plain ones
    c = pool.allocate(1)
    assert c == [a[2]]  # then the end of the cached prefix
    assert pool.lookup(tokens, 6)[0] == a[:2]
    assert pool.lookup([1, 2, 9, 9, 5, 6], 6)[0] == a[:1]  # entries follow the whole prefix
    assert pool.lookup([9, 9, 3, 4], 4)[0] == []
    found, _ = pool.lookup(tokens, 4)
    pool.take(found)
    assert pool.num_free == 0 and not pool.can_allocate(1)
    pool.free(b), pool.free(c)
    check_pool(pool, held=2)
    pool.free(found)
    check_pool(pool)
    pool.reset_prefix_cache()
    assert pool.num_cached == 0 and pool.lookup(tokens, 6)[0] == []
    check_pool(pool)


def test_blocks_a_prefix_holds_twice_are_cached_once_and_later_blocks_follow():
    """Two sequences that computed the same prefix side by side: the second's copy stays out
    of the cache, and its next block is filed after the first's entry, so it is found."""
    pool = BlockPool(8, 2, prefix_caching=True)
    x, y = pool.allocate(2), pool.allocate(3)
    ex = pool.register([1, 2, 3, 4], x, 0, 2, 0)
    pool.register([1, 2, 3, 4, 7, 8], y, 0, 3, 0)
    assert pool.num_cached == 3  # x's two and y's third
    blocks, entry = pool.lookup([1, 2, 3, 4, 7, 8], 6)
    assert blocks == x + [y[2]] and entry != ex
    pool.free(x), pool.free(y)
    check_pool(pool)


def test_imported_kv_is_cached_and_a_cached_prefill_exports_the_whole_prompt(tiny_engine_factory):
    """A prefill engine that finds most of a prompt in its cache exports all of its KV; a
    decode engine files imported blocks in its cache, so a local prompt that starts alike
    uses them."""
    prompt = random_prompts(1, lo=90, hi=91, seed=19)[0]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want = tiny_engine_factory().generate([prompt], params)[0]
    prefill = tiny_engine_factory(**cached())
    exported(prefill, "warm", prompt[:70], params)
    export, payload = exported(prefill, "r", prompt, params)
    assert export.num_tokens == len(prompt)
    decode = tiny_engine_factory(**cached())
    decode.import_kv(export, payload)
    got = [export.token_ids[-1]] + drain(decode).tokens["r"]
    assert got == want
    tokens, hit, _ = run(decode, "local", prompt[:80] + [3, 4], params)
    assert hit == 80
    assert tokens == tiny_engine_factory().generate([prompt[:80] + [3, 4]], params)[0]


@pytest.mark.parametrize("size", [1, 4])
def test_prompts_shorter_than_a_block_or_one_block_long(tiny_engine_factory, size):
    eng = tiny_engine_factory(**cached(block_size=size))
    prompt = random_prompts(1, lo=9, hi=10, seed=20)[0]
    want = tiny_engine_factory(block_size=size).generate([prompt], GREEDY)[0]
    assert run(eng, "a", prompt)[0] == want
    assert run(eng, "b", prompt) == (want, 8 // size * size, 9 - 8 // size * size)


def test_prompts_share_cached_prefixes_only_with_prompts_of_the_same_salt(tiny_engine_factory):
    """A salt is the root of a request's prefixes: the same prompt under another salt (or none)
    finds nothing, under its own salt everything. A preempted sequence and imported KV keep
    their salt."""
    prompt = random_prompts(1, lo=100, hi=101, seed=21)[0]
    want = tiny_engine_factory().generate([prompt], GREEDY)[0]
    eng = tiny_engine_factory(**cached())
    assert run(eng, "plain", prompt) == (want, 0, 100)
    assert run(eng, "t1", prompt, salt="tenant-1") == (want, 0, 100)
    assert run(eng, "t1-again", prompt, salt="tenant-1") == (want, 96, 4)
    assert run(eng, "t2", prompt, salt="tenant-2")[1] == 0
    assert run(eng, "plain-again", prompt) == (want, 96, 4)  # no salt and "" are one root
    # A salted prefix computed after a preemption is filed under the salt again.
    small = tiny_engine_factory(**cached(kv_cache_bytes=12 * BLOCK_BYTES))
    low = random_prompts(1, lo=100, hi=101, seed=22)[0]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    small.add_request("low", low, params, priority=1, cache_salt="tenant-1")
    small.step()
    small.add_request("urgent", random_prompts(1, lo=150, hi=151, seed=23)[0], params, priority=-1)
    small.step()
    assert small.seqs["low"].num_computed == 0 and small.seqs["low"].cache_entry == "tenant-1"
    drain(small)
    assert run(small, "other", low[:40] + [1])[1] == 0
    assert run(small, "same", low[:40] + [1], salt="tenant-1")[1] == 32
    # Imported KV is filed under the salt its export carries.
    prefill = tiny_engine_factory(**cached())
    prefill.add_request("warm", prompt[:20], params, cache_salt="tenant-3")  # unrelated work first
    drain(prefill)
    prefill.add_request("r", prompt, params, prefill_only=True, cache_salt="tenant-3")
    while "r" not in prefill.parked:
        prefill.step()
    buf = memoryview(bytearray(prefill.kv_nbytes("r")))
    export = prefill.export_kv("r", buf)
    prefill.release("r")
    assert export.cache_salt == "tenant-3"
    decode = tiny_engine_factory(**cached())
    decode.import_kv(export, buf)
    drain(decode)
    assert run(decode, "local", prompt[:80] + [3, 4])[1] == 0
    assert run(decode, "local-salted", prompt[:80] + [3, 4], salt="tenant-3")[1] == 80
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        eng.add_request("bad", prompt, GREEDY, cache_salt=5)
    check_pool(eng.cache.pool)


def test_imported_kv_shares_the_blocks_of_a_prefix_already_cached_and_is_not_copied_over_them(tiny_engine_factory):
    """Two imports whose prompts share 80 tokens: the second takes the first's 5 full blocks
    (none filled again, one copy of them in the pool) and generates what it would alone."""
    a = random_prompts(1, lo=90, hi=91, seed=31)[0]
    b = a[:80] + random_prompts(1, lo=30, hi=31, seed=32)[0]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    ref = tiny_engine_factory()
    want = ref.generate([a, b], params)
    prefill = tiny_engine_factory(**cached())
    ea, pa = exported(prefill, "a", a, params)
    eb, pb = exported(prefill, "b", b, params)
    decode = tiny_engine_factory(**cached())
    decode.import_kv(ea, pa)
    blocks_a = list(decode.seqs["a"].block_table)
    used = decode.cache.pool.num_used
    per_token = 2 * 16 * 4
    for i in range(2 * 2):  # b's payload: NaN where it holds the KV of the 80 shared tokens
        at = kv_layout.HEADER_SIZE + i * 110 * per_token
        pb[at : at + 80 * per_token] = b"\xff" * (80 * per_token)
    decode.import_kv(eb, pb)
    seq_b = decode.seqs["b"]
    assert seq_b.num_shared_on_import == 80 and seq_b.block_table[:5] == blocks_a[:5]
    assert decode.cache.pool.num_used == used + 2  # 110 tokens in 7 blocks, 5 of them shared
    got = drain(decode).tokens
    assert [ea.token_ids[-1]] + got["a"] == want[0] and [eb.token_ids[-1]] + got["b"] == want[1]
    check_pool(decode.cache.pool)


def test_kv_sent_without_a_cached_prefix_is_adopted_where_the_prefix_is_cached_and_refused_where_not(
    tiny_engine_factory,
):
    """A producer sends only the KV past the first 64 tokens: a decode engine holding those 64
    (from an earlier request, under the same salt) adopts it and generates what the whole
    handoff would; one that holds fewer refuses it (KVPrefixMissing, naming both counts),
    holding nothing afterwards; and the cut-out pieces of a whole payload are the same bytes."""
    prompt = random_prompts(1, lo=100, hi=101, seed=33)[0]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    want = tiny_engine_factory().generate([prompt], params)[0]
    prefill = tiny_engine_factory()  # computes both alike
    whole, whole_payload = exported(prefill, "whole", prompt, params, salt="s")
    export, payload = exported(prefill, "r", prompt, params, start=64, salt="s")
    assert export.start == 64 and len(payload) == payload_nbytes(prefill.model.shape, 100, 64) < len(whole_payload)
    assert (export.layout_version, whole.layout_version) == (2, 1)  # a whole one is read by the release before
    pieces = kv_layout.part(prefill.model, whole_payload, 100, 64)
    assert b"".join(bytes(p) for p in pieces) == bytes(payload)

    holder = tiny_engine_factory(**cached())
    holder.add_request("earlier", prompt[:70] + [5, 6], params, cache_salt="s")
    drain(holder)
    holder.import_kv(export, payload)
    assert holder.seqs["r"].num_shared_on_import == 64
    assert [export.token_ids[-1]] + drain(holder).tokens["r"] == want

    for salt, held in (("other", 0), ("s", 48)):
        short = tiny_engine_factory(**cached())
        short.add_request("earlier", prompt[:50], params, cache_salt=salt)
        drain(short)
        with pytest.raises(KVPrefixMissing, match=f"holds {held} of the first 64") as e:
            short.import_kv(export, payload)
        assert (e.value.held, e.value.start) == (held, 64) and "r" not in short.seqs
        check_pool(short.cache.pool)
        short.import_kv(whole, whole_payload)  # the whole KV, sent after all, is adopted
        assert [whole.token_ids[-1]] + drain(short).tokens["whole"] == want
        check_pool(short.cache.pool)
