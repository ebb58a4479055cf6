"""The engine against transformers on the real SmolLM2-135M-Instruct."""

import pytest
import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.sampling import SamplingParams

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def engine(smol_loaded):
    # fp32 tiles: the engine's own equality tests hold it to transformers on the weights it is given
    eng = LLMEngine(EngineConfig(kv_cache_bytes=512 << 20, weights="fp32"), loaded=smol_loaded)
    yield eng
    assert eng.cache.pool.num_used == 0


@pytest.fixture(scope="module")
def native_engine(smol_loaded):
    eng = LLMEngine(EngineConfig(kv_cache_bytes=256 << 20, weights="native"), loaded=smol_loaded)
    yield eng
    assert eng.cache.pool.num_used == 0


@pytest.fixture(scope="module")
def prompts(mixed_workload, smol_loaded):
    # 8 prompts of different lengths, some over 300 tokens, plus a short chat one.
    picked = sorted(mixed_workload, key=lambda r: r["prompt_tokens"])
    chosen = [picked[i]["prompt_token_ids"] for i in (0, 20, 45, 70, 95, 110, 120, 127)]
    assert sum(len(p) > 300 for p in chosen) >= 3
    assert len({len(p) for p in chosen}) == 8
    return chosen


@pytest.fixture(scope="module")
def reference(prompts, smol_folder):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smol_folder, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)
            out.append(ids[0, len(p) :].tolist())
    return out


def test_greedy_matches_transformers_one_at_a_time(engine, prompts, reference):
    params = SamplingParams(max_tokens=NEW_TOKENS)
    for p, ref in zip(prompts, reference):
        assert engine.generate([p], params)[0] == ref


def test_greedy_matches_transformers_batched_with_staggered_joins(engine, prompts, reference):
    engine.reset_prefix_cache()  # the last test ran these prompts: compute them again
    params = SamplingParams(max_tokens=NEW_TOKENS)
    got = {i: [] for i in range(len(prompts))}
    pending = list(range(len(prompts)))
    step = 0
    while pending or engine.has_unfinished():
        # one or two requests join every third step, while others are mid-decode
        if pending and step % 3 == 0:
            for _ in range(min(2 if step % 2 else 1, len(pending))):
                i = pending.pop(0)
                engine.add_request(f"stagger-{i}", prompts[i], params)
        for out in engine.step():
            got[int(out.request_id.split("-")[1])].extend(out.new_token_ids)
        step += 1
    assert [got[i] for i in range(len(prompts))] == reference


def test_prompts_that_start_alike_reuse_the_cached_kv_and_give_the_same_tokens(engine, prompts, reference):
    engine.reset_prefix_cache()
    params = SamplingParams(max_tokens=NEW_TOKENS)
    long = prompts[-1]
    assert engine.generate([long], params)[0] == reference[-1]
    other = long[:200] + prompts[0]  # shares 12 whole blocks (192 tokens) with it
    engine.add_request("again", long, params)
    engine.add_request("other", other, params)
    got, hits = {"again": [], "other": []}, {}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
            hits[out.request_id] = out.num_cached_tokens
    assert hits == {"again": (len(long) - 1) // 16 * 16, "other": 192}
    assert got["again"] == reference[-1]
    engine.reset_prefix_cache()
    assert engine.generate([other], params)[0] == got["other"]


def test_chunked_prefill_matches_transformers(smol_loaded, prompts, reference):
    eng = LLMEngine(EngineConfig(kv_cache_bytes=256 << 20, max_num_batched_tokens=64), loaded=smol_loaded)
    got = eng.generate(prompts[-3:], SamplingParams(max_tokens=NEW_TOKENS))
    assert got == reference[-3:]
    assert eng.cache.pool.num_used == 0


def test_export_import_continues_exactly(smol_loaded, prompts):
    params = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=7)
    a = LLMEngine(EngineConfig(kv_cache_bytes=128 << 20), loaded=smol_loaded)
    b = LLMEngine(EngineConfig(kv_cache_bytes=128 << 20), loaded=smol_loaded)
    never_moved = a.generate([prompts[4]], params)[0]

    a.add_request("moving", prompts[4], params, prefill_only=True)
    first = []
    while "moving" not in a.parked:
        for out in a.step():
            first.extend(out.new_token_ids)
            assert out.finish_reason == "prefilled"
    payload = memoryview(bytearray(a.kv_nbytes("moving")))
    export = a.export_kv("moving", payload)
    a.release("moving")
    assert a.cache.pool.num_used == 0
    already = b.import_kv(export, bytes(payload))
    moved = list(already.new_token_ids)  # the importer hands out the first token at once
    while b.has_unfinished():
        for out in b.step():
            moved.extend(out.new_token_ids)
    assert first == never_moved[:1]
    assert moved == never_moved
    assert len(never_moved) == 20
    assert b.cache.pool.num_used == 0


def test_streamed_text_is_the_decoded_output(engine):
    tok = engine.tokenizer
    prompt = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "Say hello in Japanese and add an emoji 🎉."}])
    )
    engine.add_request("text", prompt, SamplingParams(max_tokens=40))
    ids, text = [], ""
    while engine.has_unfinished():
        for out in engine.step():
            ids.extend(out.new_token_ids)
            text += out.new_text
            assert out.finished or "\ufffd" not in out.new_text  # only the final flush may be partial
    assert text == tok.decode(ids)
    assert text.strip()


def test_the_streaming_detokenizer_gives_the_window_detokenizers_deltas(smol_folder, mixed_workload):
    """The fast tokenizer's DecodeStream path hands out the same deltas as decoding windows,
    multi-byte characters split across tokens and a flush of incomplete bytes included."""
    import random

    from splitserve.engine.tokenizer import load_tokenizer

    fast, window = load_tokenizer(smol_folder), load_tokenizer(smol_folder)
    assert fast.streams
    window.streams = False
    rng = random.Random(3)
    emoji = fast.encode("Party 🎉🎉, 日本語, naïve café.")
    cases = [r["prompt_token_ids"] for r in mixed_workload[:40]] + [emoji]
    for ids in cases:
        cut = rng.randrange(1, len(ids) - 1)
        a, b = fast.detokenizer(ids[:cut]), window.detokenizer(ids[:cut])
        assert [a.push(t) for t in ids[cut:]] + [a.flush()] == [b.push(t) for t in ids[cut:]] + [b.flush()]
    split = next(i for i in range(1, len(emoji)) if "\ufffd" in fast.decode(emoji[:i]))  # inside a character
    a, b = fast.detokenizer(emoji[:1]), window.detokenizer(emoji[:1])
    got = [[d.push(t) for t in emoji[1:split]] + [d.flush()] for d in (a, b)]
    assert got[0] == got[1] and got[0][-1].endswith("\ufffd")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_truncates_and_reports_stop(engine, prompts, reference, include):
    tok = engine.tokenizer
    full = tok.decode(reference[0])
    stop = full.split()[2]  # a word that appears in the greedy output
    later = full.split()[4]  # one found after it: the first found ends the text, whatever the list's order
    assert full.index(later) > full.index(stop)
    engine.add_request(
        "stop",
        prompts[0],
        SamplingParams(max_tokens=NEW_TOKENS, stop=(later, stop), include_stop_str_in_output=include),
    )
    text, outs = "", []
    while engine.has_unfinished():
        for out in engine.step():
            text += out.new_text
            outs.append(out)
    assert outs[-1].finish_reason == "stop"
    assert text == full[: full.index(stop) + (len(stop) if include else 0)]


def test_skip_special_tokens_false_keeps_their_text(engine):
    tok = engine.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": "Say hi in two words."}])
    texts = {}
    for skip in (True, False):
        engine.add_request("sp", ids, SamplingParams(max_tokens=30, ignore_eos=True, skip_special_tokens=skip))
        tokens, text = [], ""
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
                text += out.new_text
        texts[skip] = text
        assert text == tok.rust.decode(tokens, skip_special_tokens=skip)
    assert "<|im_end|>" in texts[False] and "<|im_end|>" not in texts[True]  # (the model says it, and goes on)


def test_held_stop_text_is_sent_once_across_a_handoff(engine, prompts, reference):
    """The first token's text that may start a stop string is held back by the prefill engine as
    by the decode engine: the two engines' texts together are the one engine's (the prefill
    engine sent it with the first token, and the decode engine again with its next)."""
    full = engine.tokenizer.decode(reference[0])
    stop = max(full.split()[2:6], key=len)  # long: more of the first token's text is held
    sp = SamplingParams(max_tokens=NEW_TOKENS, stop=(stop,))
    engine.add_request("h", prompts[0], sp, prefill_only=True)
    texts = []
    while "h" not in engine.parked:
        texts += [out.new_text for out in engine.step()]
    buf = memoryview(bytearray(engine.kv_nbytes("h")))
    export = engine.export_kv("h", buf)
    engine.release("h")
    texts.append(engine.import_kv(export, buf).new_text)  # what a decode worker sends if FirstToken came late
    first, texts = texts[0], texts[1:]
    while engine.has_unfinished():
        texts += [out.new_text for out in engine.step()]
    assert first + "".join(texts[1:]) == full[: full.index(stop)]  # the import's own output is not sent
    assert first == texts[0]  # both engines held the same back: either may send the first token


def test_eos_and_stop_token_and_min_tokens(engine):
    tok = engine.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}]))
    outs = _run(engine, "eos", prompt, SamplingParams(max_tokens=64))
    assert outs[-1].finish_reason == "eos"
    n = outs[-1].num_output_tokens
    assert n < 64
    longer = _run(engine, "min", prompt, SamplingParams(max_tokens=64, min_tokens=n + 5))
    assert longer[-1].num_output_tokens >= n + 5
    first_two = [t for o in _run(engine, "ref", prompt, SamplingParams(max_tokens=2)) for t in o.new_token_ids]
    stopped = _run(engine, "stopid", prompt, SamplingParams(max_tokens=64, stop_token_ids=(first_two[1],)))
    assert stopped[-1].finish_reason == "stop"
    assert [t for o in stopped for t in o.new_token_ids] == first_two
    ignored = _run(engine, "ign", prompt, SamplingParams(max_tokens=n + 3, ignore_eos=True))
    assert ignored[-1].finish_reason == "length" and ignored[-1].num_output_tokens == n + 3


def _run(engine, rid, prompt, params):
    engine.add_request(rid, prompt, params)
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    return outs


def test_native_weights_are_the_files_blocks_and_fp32_ones_are_tiles(engine, native_engine):
    """weights native: every projection is read from the file's Q4_1 blocks and the (tied) lm_head
    from its Q8_0 ones, none from fp32 tiles; weights fp32: tiles only."""
    model = native_engine.model
    assert model.small_gemm is not None
    assert {(p.fmt, p.tiles) for layer in model.layers for p in layer.packed.values()} == {("q4_1", None)}
    assert model.lm_head_packed.fmt == "q8_0" and model.lm_head_packed.tiles is None
    assert {p.fmt for layer in engine.model.layers for p in layer.packed.values()} == {""}
    assert engine.model.lm_head_packed.blocks is None


def test_greedy_on_the_files_own_blocks_matches_transformers(native_engine, engine, prompts, reference):
    """The equality prompts through weights native: transformers' tokens, one prompt at a time and
    all at once, and log probabilities bit for bit those of the fp32 tiles (the same floats)."""
    params = SamplingParams(max_tokens=NEW_TOKENS, logprobs=0)
    for i, (p, ref) in enumerate(zip(prompts, reference)):
        got = native_engine.generate([p], params)[0]
        first = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), None)
        assert got == ref, f"prompt {i}: first divergence at token {first}"
    native_engine.reset_prefix_cache()
    assert native_engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS)) == reference
    for p in prompts[:3]:
        native_engine.reset_prefix_cache()  # (both compute the whole prompt)
        engine.reset_prefix_cache()
        a = _run(native_engine, "n", p, params)
        b = _run(engine, "f", p, params)
        assert [lp.logprob for o in a for lp in o.new_logprobs] == [lp.logprob for o in b for lp in o.new_logprobs]


def _seeded(eng, prompt, *, before=(), join_at=-1, join=()) -> tuple[list[int], list[float], int]:
    """A seeded request's tokens, log probabilities and cached prompt tokens, with requests queued
    before it (before) or joining it at a step (join_at, join)."""
    for i, p in enumerate(before):
        eng.add_request(f"before{i}", p, SamplingParams(max_tokens=4))
    eng.add_request(
        "seeded", prompt, SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True, logprobs=0)
    )
    tokens, logprobs, cached, step = [], [], 0, 0
    while eng.has_unfinished():
        if step == join_at:
            for i, p in enumerate(join):
                eng.add_request(f"join{i}", p, SamplingParams(max_tokens=4))
        for out in eng.step():
            if out.request_id == "seeded":
                tokens += out.new_token_ids
                logprobs += [lp.logprob for lp in out.new_logprobs or ()]
                cached = max(cached, out.num_cached_tokens)
        step += 1
    return tokens, logprobs, cached


def test_batch_invariant_gives_a_request_the_same_logits_whatever_shares_its_steps(smol_loaded, prompts):
    """batch_invariant: a seeded request's tokens and log probabilities are the same bit for bit
    alone; with its prompt cut into other chunks beside another prompt (a 256-token budget); with
    prompts joining while it decodes; and starting from a cached prefix. (Without it, the last
    three differed within float error when measured: MKL rounds a row with the rows beside it, and
    a fresh prompt's attention is torch's, a later chunk's the paged kernel's.) Only for
    continuous batching on the CPU."""

    def engine(budget: int = 2048) -> LLMEngine:
        return LLMEngine(
            EngineConfig(kv_cache_bytes=128 << 20, max_num_batched_tokens=budget, batch_invariant=True),
            loaded=smol_loaded,
        )

    prompt = min((p for p in prompts if len(p) > 256), key=len)
    other = prompts[0]
    eng = engine()
    alone = _seeded(eng, prompt)[:2]
    assert len(alone[0]) == len(alone[1]) == 24
    eng.reset_prefix_cache()
    assert _seeded(eng, prompt, join_at=6, join=[other, prompt[:140]])[:2] == alone
    *got, cached = _seeded(eng, prompt)  # its prompt's blocks cached now
    assert cached >= len(prompt) - 16 and got == list(alone)
    assert _seeded(engine(256), prompt, before=[other])[:2] == alone
    with pytest.raises(ValueError, match="batch_invariant needs continuous batching"):
        EngineConfig(batch_invariant=True, policy="static")
    from splitserve.service.settings import Settings

    with pytest.raises(ValueError, match="SPLITSERVE_BATCH_INVARIANT: batch_invariant needs policy continuous"):
        Settings.from_env(
            {"SPLITSERVE_BATCH_INVARIANT": "true", "SPLITSERVE_POLICY": "dynamic", "SPLITSERVE_MODE": "colocated"}
        )
    assert Settings.from_env({"SPLITSERVE_BATCH_INVARIANT": "1"}).engine_config("prefill").batch_invariant
