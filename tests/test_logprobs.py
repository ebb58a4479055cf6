"""Log probabilities of generated tokens (SamplingParams.logprobs), in the engine, checked against
transformers' own forward over the whole sequence."""

import math

import pytest
import torch
from engine_helpers import exported, random_prompts

from splitserve.engine.errors import InvalidRequestError, KVImportError
from splitserve.engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """prompt, output -> the model's log probabilities at each output position ([len(output), vocab])."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()

    def dist(prompt: list[int], output: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + output])).logits[0]
        return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + len(output) - 1].float(), dim=-1)

    return dist


def collect(engine, outs=()) -> tuple[dict, dict, int]:
    """Step until done (outs: those of steps already taken): request id -> its tokens, and -> its
    TokenLogprobs (None: none were sent); and the preemptions."""
    tokens, logprobs, preempted = {}, {}, 0
    while True:
        for out in outs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.new_logprobs is None:
                logprobs.setdefault(out.request_id, None)
            else:
                assert len(out.new_logprobs) == len(out.new_token_ids)
                logprobs[out.request_id] = (logprobs.get(out.request_id) or []) + out.new_logprobs
        if not engine.has_unfinished():
            return tokens, logprobs, preempted
        outs = engine.step()
        preempted += engine.last_stats.num_preempted


def check(dist: torch.Tensor, tokens: list[int], logprobs: list, k: int) -> None:
    """Each TokenLogprob is its token's entry of the reference row, with its rank and the k most likely."""
    assert [lp.token_id for lp in logprobs] == tokens
    for row, lp in zip(dist, logprobs):
        assert lp.logprob == pytest.approx(float(row[lp.token_id]), abs=1e-4)
        assert lp.rank == int((row > row[lp.token_id] + 1e-5).sum()) + 1
        assert len(lp.top) == k
        values, ids = torch.topk(row, k)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)
        assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:]))
        if k and lp.rank == 1:
            assert lp.top[0][0] == lp.token_id


@pytest.mark.parametrize("policy", ["continuous", "static", "dynamic"])
def test_logprobs_are_the_models_distribution_under_every_policy(tiny_engine_factory, reference, policy):
    eng = tiny_engine_factory(policy=policy)
    prompts = random_prompts(5, seed=11)
    # Greedy, random (temperature and top_k do not change what is reported: the model's own
    # distribution), min_tokens masking EOS, a request without logprobs beside them.
    params = [
        SamplingParams(max_tokens=12, ignore_eos=True, logprobs=5),
        SamplingParams(max_tokens=10, temperature=1.5, top_k=7, seed=3, ignore_eos=True, logprobs=3),
        SamplingParams(max_tokens=9, min_tokens=9, logprobs=0),
        SamplingParams(max_tokens=8, ignore_eos=True),
        SamplingParams(max_tokens=11, temperature=0.7, top_p=0.8, seed=5, ignore_eos=True, logprobs=20),
    ]
    early = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
        if policy == "continuous" and i == 2:
            early = eng.step()  # the rest join a running batch
    tokens, logprobs, _ = collect(eng, early)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        if sp.logprobs is None:
            assert logprobs[f"r{i}"] is None
            continue
        check(reference(p, tokens[f"r{i}"]), tokens[f"r{i}"], logprobs[f"r{i}"], sp.logprobs)
    # a random row's logprobs are not its tempered distribution's: some sampled tokens were not the most likely
    assert any(lp.rank > 1 for lp in logprobs["r1"])


def test_logprobs_travel_with_the_kv_and_survive_preemption(tiny_engine_factory, reference):
    prefill = tiny_engine_factory()
    decode = tiny_engine_factory(kv_cache_bytes=96 << 10)  # a handful of blocks: running sequences get preempted
    prompt = random_prompts(1, seed=21, lo=40, hi=41)[0]
    sp = SamplingParams(max_tokens=30, ignore_eos=True, logprobs=2)
    export, payload = exported(prefill, "h", prompt, sp)
    assert len(export.logprobs) == 1 and export.logprobs[0].token_id == export.token_ids[-1]
    first = decode.import_kv(export, payload)
    assert first.new_logprobs == export.logprobs  # the producer's, sent on as the first token's
    for i, p in enumerate(random_prompts(3, seed=22, lo=30, hi=40)):
        decode.add_request(f"other-{i}", p, SamplingParams(max_tokens=30, ignore_eos=True, logprobs=1))
    tokens, logprobs, preempted = collect(decode)
    assert preempted  # recomputed sequences keep the log probabilities of the tokens they had
    full = first.new_token_ids + tokens["h"]
    check(reference(prompt, full), full, first.new_logprobs + logprobs["h"], 2)
    for i, p in enumerate(random_prompts(3, seed=22, lo=30, hi=40)):
        check(reference(p, tokens[f"other-{i}"]), tokens[f"other-{i}"], logprobs[f"other-{i}"], 1)


def test_kv_whose_logprobs_do_not_match_its_tokens_is_refused(tiny_engine_factory):
    prefill, decode = tiny_engine_factory(), tiny_engine_factory()
    export, payload = exported(prefill, "h", random_prompts(1, seed=4)[0], SamplingParams(max_tokens=4, logprobs=1))
    export.logprobs = []
    with pytest.raises(KVImportError, match="log probabilities"):
        decode.import_kv(export, payload)
    assert not decode.seqs


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, 21])
def test_logprobs_out_of_range_name_the_field(name, value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{name: value})
    assert e.value.field == f"sampling.{name}" and "20" in str(e.value)


def test_logprobs_are_log_probabilities():
    from splitserve.engine.sampling import SampleRow, sample_with_logprobs

    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [5.0, 5.0, 0.0, -1.0]])
    rows = [SampleRow(SamplingParams(logprobs=2), None), SampleRow(SamplingParams(logprobs=0), None, banned=(0,))]
    tokens, lps = sample_with_logprobs(logits, rows)
    assert tokens == [3, 1]  # the second row's best is banned (min_tokens): token 1
    z = math.log(sum(math.exp(v) for v in (0.0, 1.0, 2.0, 3.0)))
    assert lps[0].logprob == pytest.approx(3.0 - z) and lps[0].rank == 1
    assert [t for t, _ in lps[0].top] == [3, 2] and lps[0].top[1][1] == pytest.approx(2.0 - z)
    # reported from the unmasked row: token 0 ties token 1 for the best, so 1 ranks first too
    assert lps[1].logprob == pytest.approx(math.log(math.exp(5) / (2 * math.exp(5) + 1 + math.exp(-1))))
    assert lps[1].rank == 1 and lps[1].top == ()


def prompt_logprobs_of(engine, outs=()) -> tuple[dict, dict]:
    """Step until done: request id -> its tokens, and -> the prompt log probabilities it was sent
    (each output's, checked to come once, with the request's first token)."""
    tokens, prompt = {}, {}
    while True:
        for out in outs:
            if out.prompt_logprobs is not None:
                assert out.request_id not in prompt and out.new_token_ids and out.request_id not in tokens
                prompt[out.request_id] = out.prompt_logprobs
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if not engine.has_unfinished():
            return tokens, prompt
        outs = engine.step()


def test_prompt_logprobs_are_the_models_distribution_over_chunks(tiny_engine_factory, reference):
    # 32 tokens a step: the prompts are prefilled in chunks, beside other requests' decodes.
    eng = tiny_engine_factory(max_num_batched_tokens=32)
    prompts = random_prompts(5, seed=31, lo=20, hi=90) + [[7]]
    params = [
        SamplingParams(max_tokens=6, ignore_eos=True, prompt_logprobs=3),
        SamplingParams(max_tokens=5, ignore_eos=True, prompt_logprobs=0, logprobs=2),
        SamplingParams(max_tokens=4, ignore_eos=True),
        SamplingParams(max_tokens=3, temperature=1.2, seed=2, ignore_eos=True, prompt_logprobs=20),
        SamplingParams(max_tokens=1, ignore_eos=True, prompt_logprobs=1),  # finished by its first token
        SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=2),  # one token: nothing before it
    ]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
    tokens, prompt = prompt_logprobs_of(eng)
    assert set(prompt) == {f"r{i}" for i, sp in enumerate(params) if sp.prompt_logprobs is not None}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        if sp.prompt_logprobs is not None:
            assert len(prompt[f"r{i}"]) == len(p) - 1
            if len(p) > 1:
                check(reference(p[:1], p[1:]), p[1:], prompt[f"r{i}"], sp.prompt_logprobs)
        assert len(tokens[f"r{i}"]) == sp.max_tokens
    assert prompt["r5"] == []
    # asking for them changes no token: the same prompts alone, without
    plain = tiny_engine_factory().generate(
        prompts[:2], [SamplingParams(max_tokens=6, ignore_eos=True), SamplingParams(max_tokens=5, ignore_eos=True)]
    )
    assert plain == [tokens["r0"], tokens["r1"]]


def test_prompt_logprobs_compute_the_prompt_the_prefix_cache_holds(tiny_engine_factory, reference):
    eng = tiny_engine_factory(prefix_caching=True, max_num_batched_tokens=48)
    p = random_prompts(1, seed=41, lo=70, hi=71)[0]
    eng.add_request("warm", p, SamplingParams(max_tokens=2, ignore_eos=True))
    prompt_logprobs_of(eng)
    eng.add_request("scored", p, SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=1))
    outs = eng.step()
    assert eng.last_stats.num_cached_tokens == 0  # a cached block's KV holds no logits
    _, prompt = prompt_logprobs_of(eng, outs)
    check(reference(p[:1], p[1:]), p[1:], prompt["scored"], 1)
    eng.add_request("again", p, SamplingParams(max_tokens=2, ignore_eos=True))
    outs = eng.step()
    assert eng.last_stats.num_cached_tokens == 64  # without them, the cache serves the prompt again
    prompt_logprobs_of(eng, outs)


def test_prompt_logprobs_survive_preemption_and_travel_with_the_kv(tiny_engine_factory, reference):
    # A handful of blocks: sequences are preempted and recomputed, the prompt log probabilities
    # neither lost nor counted twice.
    eng = tiny_engine_factory(kv_cache_bytes=96 << 10, max_num_batched_tokens=24)
    prompts = random_prompts(4, seed=51, lo=30, hi=45)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=30, ignore_eos=True, prompt_logprobs=2))
    preempted = 0
    outs, prompt = [], {}
    while eng.has_unfinished() or outs:
        for out in outs:
            if out.prompt_logprobs is not None:
                assert out.request_id not in prompt
                prompt[out.request_id] = out.prompt_logprobs
        outs = eng.step() if eng.has_unfinished() else []
        preempted += eng.last_stats.num_preempted
    assert preempted
    for i, p in enumerate(prompts):
        check(reference(p[:1], p[1:]), p[1:], prompt[f"r{i}"], 2)
    # Prefilled by one engine, decoded by another: the decode side sends the producer's on.
    prefill, decode = tiny_engine_factory(max_num_batched_tokens=16), tiny_engine_factory()
    sp = SamplingParams(max_tokens=5, ignore_eos=True, prompt_logprobs=4)
    export, payload = exported(prefill, "h", prompts[0], sp)
    check(reference(prompts[0][:1], prompts[0][1:]), prompts[0][1:], export.prompt_logprobs, 4)
    first = decode.import_kv(export, payload)
    assert first.prompt_logprobs == export.prompt_logprobs and first.new_token_ids == export.token_ids[-1:]
    assert decode.seqs["h"].prompt_logprobs == []  # handed out: not held for the rest of its decode
    _, later = prompt_logprobs_of(decode)
    assert later == {}  # sent once, with the first token
    export, payload = exported(prefill, "short", prompts[1], sp)
    export.prompt_logprobs = export.prompt_logprobs[:-1]
    with pytest.raises(KVImportError, match="prompt log probabilities"):
        decode.import_kv(export, payload)
    assert not decode.seqs


@pytest.mark.parametrize("policy", ["static", "dynamic"])
def test_prompt_logprobs_need_the_continuous_policy(tiny_engine_factory, policy):
    eng = tiny_engine_factory(policy=policy)
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request("r", [5, 6, 7], SamplingParams(prompt_logprobs=1))
    assert e.value.field == "sampling.prompt_logprobs" and policy in str(e.value)
    assert not eng.has_unfinished()


def check_within(dist: torch.Tensor, tokens: list[int], logprobs: list, k: int, tol: float) -> None:
    """check() for a device whose arithmetic differs from the CPU's in the last digits: each value
    within tol of the reference, each rank and each top list right up to ties closer than tol."""
    assert [lp.token_id for lp in logprobs] == tokens
    for row, lp in zip(dist, logprobs):
        x = float(row[lp.token_id])
        assert lp.logprob == pytest.approx(x, abs=tol)
        assert int((row > x + tol).sum()) + 1 <= lp.rank <= int((row > x - tol).sum()) + 1
        assert len(lp.top) == k
        for token, value in lp.top:
            assert value == pytest.approx(float(row[token]), abs=tol)
        assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:]))
        if k:  # nothing left out beats the k-th by more than tol
            kth = lp.top[-1][1]
            left_out = torch.ones_like(row, dtype=torch.bool)
            left_out[[t for t, _ in lp.top]] = False
            assert float(row[left_out].max()) <= kth + tol


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")
@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_cuda_logprobs_are_the_models_distribution(tiny_engine_factory, reference, policy):
    """On CUDA (graph replays included) the values come from device logits; checked against the
    CPU reference forward."""
    eng = tiny_engine_factory(device="cuda", policy=policy)
    prompts = random_prompts(4, seed=31)
    params = [
        SamplingParams(max_tokens=12, ignore_eos=True, logprobs=5),
        SamplingParams(max_tokens=10, temperature=1.5, top_k=7, seed=3, ignore_eos=True, logprobs=3),
        SamplingParams(max_tokens=8, ignore_eos=True),
        SamplingParams(max_tokens=11, temperature=0.7, seed=5, ignore_eos=True, logprobs=20),
    ]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
    tokens, logprobs, _ = collect(eng)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        if sp.logprobs is None:
            assert logprobs[f"r{i}"] is None
            continue
        check_within(reference(p, tokens[f"r{i}"]), tokens[f"r{i}"], logprobs[f"r{i}"], sp.logprobs, 2e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")
def test_cuda_prompt_logprobs_are_the_models_distribution(tiny_engine_factory, reference):
    """On CUDA the prompt's chunks run as piecewise graph replays, their rows' logits read after the
    replay; checked against the CPU reference forward."""
    eng = tiny_engine_factory(device="cuda", max_num_batched_tokens=32)
    prompts = random_prompts(3, seed=61, lo=20, hi=90)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=3))
    _, prompt = prompt_logprobs_of(eng)
    for i, p in enumerate(prompts):
        check_within(reference(p[:1], p[1:]), p[1:], prompt[f"r{i}"], 3, 2e-3)
