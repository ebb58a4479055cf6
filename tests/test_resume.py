"""A request resumed after its decode worker was lost: the engine takes the prompt and the tokens its
client already has, recomputes their KV (prefill), and goes on where the stream left off, handing
out only what the client lacks. Real model, greedy: the tokens and the text put together equal an
unbroken run's."""

from __future__ import annotations

import pytest
from engine_helpers import engine_factory_of

from splitserve.engine.errors import InvalidRequestError, KVImportError
from splitserve.engine.sampling import SamplingParams

PROMPT = (
    "<|im_start|>user\nName three rivers of Europe and say one thing about each.<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture
def engine_factory(smol_loaded):
    yield from engine_factory_of(smol_loaded)


def streamed(eng, rid: str) -> list[tuple[list[int], str, object]]:
    """Every output of rid until it ends: (its new tokens, its new text, the output)."""
    got = []
    while eng.has_unfinished():
        for out in eng.step():
            if out.request_id == rid:
                got.append((list(out.new_token_ids), out.new_text, out))
    return got


def so_far(events, k: int) -> tuple[list[int], str]:
    """The tokens and text a client had once it held k tokens (an output of one token a step)."""
    tokens, text = [], ""
    for ids, t, _ in events:
        tokens += ids
        text += t
        if len(tokens) == k:
            return tokens, text
    raise AssertionError(f"no point where the client held {k} tokens")


def whole(events) -> tuple[list[int], str, str]:
    return ([t for ids, _, _ in events for t in ids], "".join(t for _, t, _ in events), events[-1][2].finish_reason)


@pytest.mark.parametrize("k", [1, 9])
@pytest.mark.parametrize("seed", [None, 11])
def test_a_resumed_request_goes_on_where_its_client_left_off(engine_factory, smol_loaded, k, seed):
    """Greedy, and sampled with a seed (its generator goes on where it was: one draw a token)."""
    prompt = smol_loaded.tokenizer.encode(PROMPT)
    # a stop string holds text back while it may be starting: the client's text lags its tokens
    sp = SamplingParams(
        max_tokens=40, stop=["Danube flows"], logprobs=1, **({} if seed is None else {"temperature": 0.9, "seed": seed})
    )
    ref = engine_factory()
    ref.add_request("r", prompt, sp)
    events = streamed(ref, "r")
    want, want_text, reason = whole(events)
    assert len(want) > k + 5
    have, have_text = so_far(events, k)

    # in one engine
    eng = engine_factory()
    eng.add_request("r", prompt + have, sp, resumed=k, resumed_chars=len(have_text))
    rest = streamed(eng, "r")
    tokens, text, got_reason = whole(rest)
    assert have + tokens == want and have_text + text == want_text and got_reason == reason
    assert rest[-1][2].num_output_tokens == len(want) and rest[-1][2].num_prompt_tokens == len(prompt)
    ref_logprobs = [lp for _, _, out in events for lp in out.new_logprobs]
    got_logprobs = [lp for _, _, out in rest for lp in out.new_logprobs]
    assert len(got_logprobs) == len(tokens)  # the placeholders of the tokens it came with stay in
    assert [lp.token_id for lp in got_logprobs] == want[k:]
    # (the KV computed by a prefill rather than step by step: equal within float error)
    assert [lp.logprob for lp in got_logprobs] == pytest.approx([lp.logprob for lp in ref_logprobs[k:]], abs=2e-3)

    # prefilled in one engine, its KV handed to another, as a prefill worker and a decode worker do
    prefill, decode = engine_factory(), engine_factory()
    prefill.add_request("h", prompt + have, sp, prefill_only=True, resumed=k, resumed_chars=len(have_text))
    while "h" not in prefill.parked:
        prefill.step()
    buf = memoryview(bytearray(prefill.kv_nbytes("h")))
    export = prefill.export_kv("h", buf)
    prefill.release("h")
    assert export.resumed == k and export.prompt_len == len(prompt) and export.num_tokens == len(prompt) + k
    first = decode.import_kv(export, buf)
    assert first.new_token_ids == want[k : k + 1]
    rest = [(list(first.new_token_ids), first.new_text, first)] + streamed(decode, "h")
    tokens, text, got_reason = whole(rest)
    assert have + tokens == want and have_text + text == want_text and got_reason == reason


def by_sample(eng, rid: str) -> dict[int, list[tuple[list[int], str, object]]]:
    """Every output of rid until it ends, by sample index."""
    got: dict[int, list] = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.request_id == rid:
                got.setdefault(out.index, []).append((list(out.new_token_ids), out.new_text, out))
    return got


@pytest.mark.parametrize("cuts", [{0: 9, 2: 4}, {0: 1, 1: 0, 2: 0}])
def test_samples_of_a_resumed_request_go_on_each_where_its_client_left_off(engine_factory, smol_loaded, cuts):
    """sampling.n = 3, seeded: each sample not finished (here, sample 1 of the first case counts as
    finished) goes on from its own tokens, sample 0 with the request's generator and sample i with
    seed + i, as if never stopped; a sample not yet started (0 tokens) starts as it would have."""
    prompt = smol_loaded.tokenizer.encode(PROMPT)
    sp = SamplingParams(
        max_tokens=30, n=3, temperature=0.9, seed=5, stop=["Danube flows"], logprobs=1, prompt_logprobs=0
    )
    ref = engine_factory()
    ref.add_request("r", prompt, sp)
    events = by_sample(ref, "r")
    assert sorted(events) == [0, 1, 2]
    wants = {i: whole(ev) for i, ev in events.items()}
    assert len({tuple(w[0]) for w in wants.values()}) == 3  # (three samples, not one three times)
    samples = []
    for i, k in cuts.items():
        tokens, text = so_far(events[i], k) if k else ([], "")
        samples.append((i, tokens, len(text)))

    eng = engine_factory()
    eng.resume_samples("r", prompt, sp, samples)
    got = by_sample(eng, "r")
    assert sorted(got) == sorted(cuts)  # a sample left out (finished) runs no more
    for i, tokens, chars in samples:
        rest = got[i]
        new, text, reason = whole(rest)
        want, want_text, want_reason = wants[i]
        assert (tokens + new, want_text[:chars] + text, reason) == (want, want_text, want_reason), i
        assert rest[-1][2].num_output_tokens == len(want)
        assert all(not out.prompt_logprobs for _, _, out in rest)  # they went with sample 0's first token
        ref_logprobs = [lp.logprob for _, _, out in events[i] for lp in out.new_logprobs]
        got_logprobs = [lp.logprob for _, _, out in rest for lp in out.new_logprobs]
        assert got_logprobs == pytest.approx(ref_logprobs[len(tokens) :], abs=2e-3)
    assert not eng.seqs and not eng.children and eng.cache.pool.num_used == 0


def test_a_resumed_sample_whose_tokens_end_it_hands_out_only_the_text_its_client_lacks(engine_factory, smol_loaded):
    """A sample resumed with tokens that already end it (max_tokens of them) whose last token is
    bytes short of a character: its end flushes them as text ("\ufffd"). Its client had that text
    (it counts it), or had the token without it; the end hands out only what it lacks."""
    tok = smol_loaded.tokenizer
    prompt = tok.encode(PROMPT)
    cut = next(t for t in tok.encode("Earth \U0001f30d and \u4e16\u754c") if tok.decode([t]).endswith("\ufffd"))
    text = tok.decode([cut])
    sp = SamplingParams(max_tokens=1, n=3)
    eng = engine_factory()
    outs = eng.resume_samples("r", prompt, sp, [(0, [cut], len(text)), (1, [cut], 0), (2, [cut], len(text) - 1)])
    got = {o.index: (list(o.new_token_ids), o.new_text, o.finished, o.finish_reason) for o in outs}
    assert got == {0: ([], "", True, "length"), 1: ([], text, True, "length"), 2: ([], text[-1], True, "length")}
    assert not eng.seqs and not eng.children and eng.cache.pool.num_used == 0


def test_abort_stops_every_resumed_sample(engine_factory, smol_loaded):
    prompt = smol_loaded.tokenizer.encode(PROMPT)
    eng = engine_factory()
    eng.resume_samples(
        "r", prompt, SamplingParams(max_tokens=30, n=3, seed=1, temperature=1.0), [(1, [11, 12], 2), (2, [], 0)]
    )  # sample 0 had finished
    eng.step()
    eng.abort_request("r")
    assert not eng.seqs and not eng.children and eng.cache.pool.num_used == 0


def test_a_request_that_cannot_resume_is_refused_naming_the_field(engine_factory, smol_loaded):
    prompt = smol_loaded.tokenizer.encode(PROMPT)
    eng = engine_factory()
    for resumed, params, ids in (
        (len(prompt), SamplingParams(), prompt),
        (-1, SamplingParams(), prompt),
        (2, SamplingParams(n=2), prompt),
        (1, SamplingParams(), prompt + [10**6]),
    ):
        with pytest.raises(InvalidRequestError) as e:
            eng.add_request("r", ids, params, resumed=resumed)
        assert e.value.field == "resumed"
    assert not eng.seqs
    # tokens that already end it: max_tokens of them, a last eos or stop token, a stop string in their text
    tok = smol_loaded.tokenizer
    eos = next(iter(eng.eos_token_ids))
    said = tok.encode(" the Rhine and the Danube")
    for tail, params, reason in (
        ([11, 12], SamplingParams(max_tokens=2), "length"),
        ([11, eos], SamplingParams(), "eos"),
        ([11, 12], SamplingParams(stop_token_ids=[12]), "stop"),
        (said, SamplingParams(stop=["Danube"]), "stop"),
    ):
        with pytest.raises(InvalidRequestError) as e:
            eng.add_request("r", prompt + tail, params, resumed=len(tail), resumed_chars=3)
        assert e.value.field == "resumed" and f"end it ({reason})" in str(e.value), tail
        assert not eng.seqs
    for tail, params in (
        ([11, eos], SamplingParams(ignore_eos=True)),
        ([11, eos], SamplingParams(min_tokens=3)),
        ([11, 12], SamplingParams(max_tokens=3)),
    ):  # these go on
        eng.add_request("r", prompt + tail, params, resumed=2, resumed_chars=0)
        eng.abort_request("r")
    assert not eng.seqs and eng.cache.pool.num_used == 0
    n3 = SamplingParams(n=3)
    for samples, params in (
        ([], n3),
        ([(0, [], 0), (0, [], 0)], n3),
        ([(3, [], 0)], n3),
        ([(0, [5], 1)], SamplingParams()),
        ([(0, [5], 1), (1, [7], -1)], n3),
        ([(0, [5], 1), (1, [10**6], 1)], n3),
    ):
        with pytest.raises(InvalidRequestError) as e:
            eng.resume_samples("r", prompt, params, samples)
        assert e.value.field == "resumed_samples", samples
        assert not eng.seqs and not eng.children
    # an export that says more tokens were resumed than it holds
    prefill = engine_factory()
    prefill.add_request("h", prompt, SamplingParams(), prefill_only=True, resumed=3)
    while "h" not in prefill.parked:
        prefill.step()
    buf = memoryview(bytearray(prefill.kv_nbytes("h")))
    export = prefill.export_kv("h", buf)
    prefill.release("h")
    export.resumed = 4  # it holds 3 and the one sampled since
    with pytest.raises(KVImportError, match="resumed"):
        eng.import_kv(export, buf)
    assert not eng.seqs
