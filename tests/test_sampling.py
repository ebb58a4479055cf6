"""The sampler on hand-made logits: each draw follows the distribution it was asked for."""

import math

import pytest
import torch

from splitserve.engine.sampling import SampleRow, SamplingParams, _sample_one, new_generator, sample

VOCAB = 49152  # SmolLM2's: large enough that top_p passes the 256 and 8192 candidates


def _reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution by the book, in float64 over the whole sorted vocabulary: temperature, then
    the top_k set, then the smallest prefix of it whose mass reaches top_p."""
    probs = torch.softmax(logits.double() / p.temperature, 0)
    values, order = torch.sort(probs, descending=True, stable=True)
    if p.top_k:
        values = values[: p.top_k]
    values = values / values.sum()
    if p.top_p < 1.0:
        keep = int((torch.cumsum(values, 0) < p.top_p).sum()) + 1
        values = values[:keep] / values[:keep].sum()
    if p.min_p > 0:
        values = values[values >= p.min_p * values[0]]
        values = values / values.sum()
    out = torch.zeros_like(probs)
    out[order[: values.numel()]] = values
    return out


def _draws(logits: torch.Tensor, p: SamplingParams, n: int) -> torch.Tensor:
    gen = new_generator(p)
    return torch.bincount(torch.tensor([_sample_one(logits, p, gen) for _ in range(n)]), minlength=logits.numel())


def _flat(live: int) -> torch.Tensor:
    """`live` nearly equally likely tokens at scattered ids (no two alike: ties would make the top_p
    set ambiguous), a few likelier ones, the rest ~e^-40 each."""
    logits = torch.full((VOCAB,), -40.0)
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(live))[:live]
    logits[ids] = -torch.arange(live) / live
    logits[ids[:3]] = torch.tensor([3.0, 2.0, 1.0])
    return logits


@pytest.mark.parametrize(
    "logits, kw",
    [
        (torch.tensor([2.0, 1.0, 0.0, -1.0, -50.0, 1.0]), dict(temperature=1.0)),
        (torch.tensor([2.0, 1.0, 0.0, -1.0, -50.0, 1.0]), dict(temperature=0.5, top_k=3)),
        (torch.tensor([2.0, 1.0, 0.0, -1.0, -50.0, 1.0]), dict(temperature=2.0, top_k=4, top_p=0.7)),
        (_flat(40), dict(temperature=1.0, top_p=0.9)),  # kept among the first 256 candidates
        (_flat(600), dict(temperature=1.0, top_p=0.9)),  # past them: among the 8192
        (_flat(12000), dict(temperature=1.0, top_p=0.5)),  # past those: the whole vocabulary sorted
        (_flat(600), dict(temperature=1.0, top_k=500, top_p=0.9)),  # top_k larger than 256
        (_flat(600), dict(temperature=0.7)),
        (torch.randn(100, generator=torch.Generator().manual_seed(5)), dict(temperature=1.0, top_p=0.9)),  # < 256
        # min_p: unsorted over the whole vocabulary, after top_k, after top_p (among the 256 and the 8192)
        (torch.tensor([2.0, 1.0, 0.0, -1.0, -50.0, 1.0]), dict(temperature=1.0, min_p=0.3)),
        (torch.tensor([2.0, 1.0, 0.0, -1.0, -50.0, 1.0]), dict(temperature=2.0, top_k=5, min_p=0.5)),
        (_flat(40), dict(temperature=1.0, top_p=0.95, min_p=0.1)),
        (_flat(600), dict(temperature=0.8, top_p=0.95, min_p=0.02)),
    ],
)
def test_draws_follow_the_distribution_and_only_kept_tokens_are_drawn(logits, kw):
    p = SamplingParams(seed=7, **kw)
    want = _reference(logits, p)
    n = 3000
    got = _draws(logits, p, n)
    assert got[want == 0].sum() == 0, "a token outside the top_k / top_p set was drawn"
    # Each token's count is within 5 standard deviations of n * its probability, and so is the total
    # mass of the tokens beyond the three likeliest (where a wrong cut or weight would show).
    sd = torch.sqrt(n * want * (1 - want)) + 1
    assert ((got - n * want).abs() <= 5 * sd).all(), (got[want > 0][:8], (n * want)[want > 0][:8])
    rest = want.clone()
    rest[torch.topk(want, 3).indices] = 0
    q = float(rest.sum())
    assert abs(float(got[rest > 0].sum()) - n * q) <= 5 * math.sqrt(n * q * (1 - q)) + 1


def test_logit_bias_moves_greedy_and_random_rows_and_adds_to_penalties():
    from splitserve.engine.sampling import Seen

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [2.0, 1.0, 0.0, -1.0], [2.0, 1.0, 0.0, -1.0]])
    rows = [
        SampleRow(SamplingParams(logit_bias={3: 3.5}), None),  # -1 + 3.5 beats 2
        SampleRow(SamplingParams(logit_bias={0: -100.0, 1: -100.0}), None),  # all but banned
        SampleRow(
            SamplingParams(logit_bias={2: 2.5}, frequency_penalty=1.0),
            None,
            seen=Seen(torch.tensor([2]), torch.tensor([1.0])),
        ),
    ]  # 0 + 2.5 - 1: not enough
    assert sample(logits.clone(), rows) == [3, 2, 0]
    p = SamplingParams(temperature=1.0, seed=3, logit_bias={1: -100.0})
    gen = new_generator(p)
    assert 1 not in {sample(logits[:1].clone(), [SampleRow(p, gen)])[0] for _ in range(200)}


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(min_p=1.5), "sampling.min_p"),
        (dict(min_p=-0.1), "sampling.min_p"),
        (dict(logit_bias={5: 101.0}), "sampling.logit_bias"),
        (dict(logit_bias={-1: 1.0}), "sampling.logit_bias"),
        (dict(logit_bias={5: float("nan")}), "sampling.logit_bias"),
        (dict(logit_bias={i: 1.0 for i in range(1025)}), "sampling.logit_bias"),
    ],
)
def test_min_p_and_logit_bias_out_of_range_name_the_field(kw, field):
    from splitserve.engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kw)
    assert e.value.field == field


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=1e-39),
        dict(temperature=1e-300),
        dict(temperature=5e-324),
        dict(temperature=1.0, top_p=1e-300),
        dict(temperature=1e-300, top_k=5, top_p=1e-9),
    ],
)
def test_temperatures_and_top_p_below_float32s_range_draw_the_most_likely_token(kw):
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(1))
    best = int(logits.argmax())
    assert best != 0
    # not: the temperature rounded to 0 in float32, the row became NaN, and token 0 was drawn every time
    assert set(_draws(logits, SamplingParams(seed=3, **kw), 50).nonzero().flatten().tolist()) == {best}


def test_a_seeded_draw_is_the_same_alone_and_in_a_batch_and_greedy_rows_take_the_argmax():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    params = [
        SamplingParams(temperature=0.9, top_p=0.95, seed=11),
        SamplingParams(),
        SamplingParams(temperature=1.3, top_k=40, seed=12),
        SamplingParams(temperature=0.6, seed=13),
    ]

    def run(rows_of):
        gens = [new_generator(p) for p in params]
        return [sample(logits[rows_of].clone(), [SampleRow(params[i], gens[i]) for i in rows_of]) for _ in range(20)]

    together = run([0, 1, 2, 3])
    alone = {i: run([i]) for i in range(4)}
    for i in range(4):
        assert [step[i] for step in together] == [step[0] for step in alone[i]]
    assert {step[1] for step in together} == {int(logits[1].argmax())}
    assert len({step[3] for step in together}) > 1  # random rows do vary
