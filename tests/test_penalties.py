"""Penalties on tokens seen before (presence, frequency, repetition): on hand-made logits, and in
the engine against a reference loop over transformers' forward, under every policy and across a
KV handoff."""

import pytest
import torch
from engine_helpers import exported, random_prompts

from splitserve.engine.errors import InvalidRequestError
from splitserve.engine.sampling import SampleRow, SamplingParams, Seen, penalize, sample


def test_penalties_on_hand_made_logits():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0])
    p = SamplingParams(presence_penalty=0.25, frequency_penalty=0.5, repetition_penalty=2.0)
    # output so far: token 0 twice, token 1 once; the prompt holds 0 (in both: penalized once), 4 and 5
    seen = Seen(torch.tensor([0, 1]), torch.tensor([2.0, 1.0]), torch.tensor([0, 4, 5]))
    # three rows: those penalties; only a frequency penalty (the prompt is not looked at); none
    rows = logits.repeat(3, 1)
    penalize(
        rows,
        [
            SampleRow(p, None, seen=seen),
            SampleRow(SamplingParams(frequency_penalty=-1.0), None, seen=Seen(torch.tensor([2]), torch.tensor([3.0]))),
            SampleRow(SamplingParams(), None),
        ],
    )
    assert rows[0].tolist() == pytest.approx([2.0 / 2 - 0.5 * 2 - 0.25, -1.0 * 2 - 0.5 - 0.25, 0.5, 3.0, -4.0, 0.5])
    assert rows[1].tolist() == pytest.approx([2.0, -1.0, 3.5, 3.0, -2.0, 1.0])
    assert rows[2].tolist() == logits.tolist()
    # in sample(): greedy takes the penalized row's best, an unpenalized row beside it is untouched
    two = torch.stack([logits, logits])
    got = sample(
        two,
        [
            SampleRow(SamplingParams(repetition_penalty=4.0), None, seen=Seen(torch.tensor([3]), torch.tensor([1.0]))),
            SampleRow(SamplingParams(), None),
        ],
    )
    assert got == [0, 3]  # 3.0 / 4 < 2.0


@pytest.mark.parametrize(
    "field,kw",
    [
        ("sampling.presence_penalty", {"presence_penalty": 2.5}),
        ("sampling.presence_penalty", {"presence_penalty": float("nan")}),
        ("sampling.frequency_penalty", {"frequency_penalty": -2.01}),
        ("sampling.repetition_penalty", {"repetition_penalty": 0.0}),
        ("sampling.repetition_penalty", {"repetition_penalty": 11.0}),
        ("sampling.repetition_penalty", {"repetition_penalty": float("inf")}),
    ],
)
def test_penalties_out_of_range_name_the_field(field, kw):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kw)
    assert e.value.field == field


@pytest.fixture(scope="module")
def greedy_reference(tiny_model_dir):
    """prompt, n, penalties -> the n greedy tokens, each step's logits from transformers' forward
    over the whole sequence, penalized by the book."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()

    def run(prompt: list[int], n: int, presence=0.0, frequency=0.0, repetition=1.0) -> list[int]:
        out: list[int] = []
        for _ in range(n):
            with torch.no_grad():
                row = model(torch.tensor([prompt + out])).logits[0, -1].double()
            for t in set(prompt + out):
                row[t] = row[t] / repetition if row[t] > 0 else row[t] * repetition
            for t in set(out):
                row[t] -= frequency * out.count(t) + presence
            out.append(int(row.argmax()))
        return out

    return run


# The tiny random model seldom repeats a token within 16: negative frequency and presence
# penalties (which favour repeats) are what change its output.
PENALTIES = [
    dict(repetition_penalty=1.8),
    dict(frequency_penalty=-1.2, presence_penalty=-0.6),
    dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=-0.3),
]


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_greedy_tokens_under_penalties_are_the_references(tiny_engine_factory, greedy_reference, policy):
    eng = tiny_engine_factory(policy=policy, max_num_batched_tokens=32)
    prompts = random_prompts(4, seed=71, lo=10, hi=50)
    params = [SamplingParams(max_tokens=16, ignore_eos=True, **kw) for kw in PENALTIES]
    params.append(SamplingParams(max_tokens=16, ignore_eos=True))  # none, beside them
    got = eng.generate(prompts, params)
    for p, sp, tokens in zip(prompts, params, got):
        want = greedy_reference(p, 16, sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty)
        assert tokens == want, sp
    # the penalties change what it says
    plain = eng.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    assert all(a != b for a, b in zip(got[:3], plain[:3])) and got[3] == plain[3]


def test_penalties_count_the_tokens_sampled_before_a_handoff(tiny_engine_factory, greedy_reference):
    """The prefill engine samples the first tokens, the decode engine the rest: it counts those it
    came with (and the prompt, for repetition_penalty), as one engine would."""
    prefill, decode = tiny_engine_factory(), tiny_engine_factory()
    prompt = random_prompts(1, seed=72, lo=30, hi=31)[0]
    # favouring repeats strongly: the token sampled before the handoff shapes the rest
    sp = SamplingParams(
        max_tokens=20, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=-1.0, presence_penalty=-2.0
    )
    export, payload = exported(prefill, "h", prompt, sp)
    tokens = decode.import_kv(export, payload).new_token_ids
    seen = decode._sample_row(decode.seqs["h"]).seen  # what its next sample looks at
    assert seen.output_ids.tolist() == tokens and seen.output_counts.tolist() == [1.0]
    assert sorted(seen.prompt_ids.tolist()) == sorted(set(prompt))
    while decode.has_unfinished():
        for out in decode.step():
            tokens += out.new_token_ids
    assert tokens == greedy_reference(prompt, 20, -2.0, -1.0, 1.3)
