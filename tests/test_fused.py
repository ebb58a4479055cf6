"""The fused kernels (engine/fused.py) against torch's ops.

Without a CUDA device, Triton's interpreter runs them on CPU tensors (conftest sets
TRITON_INTERPRET): the same kernel source, the same indexing and masks. With one, they
run compiled on it.
"""

import pytest
import torch
from engine_helpers import random_prompts
from test_device import graph_bodies_without_capture

from splitserve.engine import fused
from splitserve.engine.sampling import SamplingParams

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def rnd(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE)


@pytest.mark.parametrize("hq, hkv, d", [(9, 3, 64), (4, 2, 16), (4, 4, 32)])
@pytest.mark.parametrize("write", [True, False])
def test_rope_qkv_rotates_q_and_k_and_writes_the_cache(hq, hkv, d, write):
    ops = fused.FusedOps(hq, hkv, d)
    T, slots_n = 7, 64
    qkv = rnd(T, (hq + 2 * hkv) * d, seed=1)
    cos, sin = rnd(T, 1, d, seed=2), rnd(T, 1, d, seed=3)
    kc, vc = torch.zeros(slots_n, hkv, d, device=DEVICE), torch.zeros(slots_n, hkv, d, device=DEVICE)
    slots = torch.tensor([5, 0, 63, 17, 18, 40, 2], device=DEVICE)
    q, k, v = ops.rope_qkv(qkv, cos, sin, *((slots, kc, vc) if write else ()))
    x = qkv.view(T, hq + 2 * hkv, d)
    want = x[:, : hq + hkv] * cos + torch.roll(x[:, : hq + hkv], d // 2, dims=-1) * sin
    torch.testing.assert_close(q, want[:, :hq])
    torch.testing.assert_close(k, want[:, hq:])
    assert torch.equal(v, x[:, hq + hkv :])
    if write:
        assert torch.equal(kc[slots], k) and torch.equal(vc[slots], v)
        untouched = torch.ones(slots_n, dtype=torch.bool, device=DEVICE)
        untouched[slots] = False
        assert kc[untouched].abs().max() == 0 and vc[untouched].abs().max() == 0
    else:
        assert kc.abs().max() == 0 and vc.abs().max() == 0


@pytest.mark.parametrize("hq, hkv, d", [(9, 3, 64), (4, 2, 16), (4, 4, 32)])
def test_paged_decode_equals_sdpa_over_each_context(hq, hkv, d):
    """Contexts of 1 token to several splits (a split reads 128), not whole blocks, through
    shuffled block tables; the split and the one-program kernels alike."""
    bs, blocks = 16, 40
    ops = fused.FusedOps(hq, hkv, d)
    kc, vc = rnd(blocks * bs, hkv, d, seed=4), rnd(blocks * bs, hkv, d, seed=5)
    for width, lens in ((8, [1, 15, 16, 17, 100, 128]), (24, [1, 129, 300, 384, 257, 33])):
        S = len(lens)
        g = torch.Generator().manual_seed(width)
        tables = torch.stack([torch.randperm(blocks, generator=g)[:width] for _ in range(S)]).to(DEVICE)
        lens_t = torch.tensor(lens, device=DEVICE)
        q = rnd(S, hq, d, seed=6)
        got = ops.paged_decode(q, kc, vc, tables, lens_t, bs, d**-0.5)
        torch.testing.assert_close(got, fused.reference_decode(q, kc, vc, tables, lens_t, bs, d**-0.5))
        out = torch.full((S + 2, hq * d), 7.0, device=DEVICE)
        ops.paged_decode(q, kc, vc, tables, lens_t, bs, d**-0.5, out=out[1 : S + 1])
        torch.testing.assert_close(out[1 : S + 1], got, rtol=0, atol=0)
        assert (out[0] == 7).all() and (out[-1] == 7).all()


def test_silu_mul_equals_torchs():
    ops = fused.FusedOps(4, 2, 16)
    for T, inter in ((1, 40), (5, 1536), (3, 1025)):
        gu = rnd(T, 2 * inter, seed=T)
        torch.testing.assert_close(ops.silu_mul(gu), torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:])


def test_the_self_check_passes_and_names_what_differs(monkeypatch):
    ops = fused.FusedOps(9, 3, 64)
    assert fused.self_check(ops, DEVICE) == ""
    # half precision too: an engine's dtype (exp() takes only fp32: each kernel widens what it loads)
    assert fused.self_check(ops, DEVICE, dtype=torch.bfloat16) == ""
    assert fused.self_check(ops, DEVICE, dtype=torch.float16) == ""
    monkeypatch.setattr(ops, "silu_mul", lambda gu: torch.zeros(gu.shape[0], gu.shape[1] // 2, device=gu.device))
    assert fused.self_check(ops, DEVICE) == "SiLU and product"


def test_the_self_check_runs_each_variant_the_engine_uses(monkeypatch):
    """The decode kernel has a variant per block size, and past 2048 tokens the combine kernel
    one per power of two of splits: the check runs those of the engine's block size and of its
    longest context (so none compiles inside a step), and finds a kernel wrong past 16 splits.
    (Interpreted, the check up to 4096 tokens takes ~8 s, and one up to 8192 ~22 s: it is run to
    3000, the spans it takes past that are combine_spans', checked above.)"""
    assert fused.combine_spans(2048) == []
    assert fused.combine_spans(2049) == [4096]  # 32 splits of 128 tokens
    assert fused.combine_spans(8192) == [4096, 8192]
    ops = fused.FusedOps(4, 2, 16)
    seen = []

    def spy(name, key):
        real = getattr(fused, name)

        class Spy:
            def __getitem__(self, grid):
                def launch(*args, **kw):
                    seen.append((key, kw[key]))
                    return real[grid](*args, **kw)

                return launch

        monkeypatch.setattr(fused, name, Spy())

    spy("_combine_kernel", "SP")
    spy("_paged_decode_kernel", "BS")
    for bs, max_context, want in (
        (16, 3000, {("SP", 16), ("SP", 32), ("BS", 16)}),
        (32, 2048, {("SP", 16), ("BS", 32)}),
    ):
        seen.clear()
        assert fused.self_check(ops, DEVICE, block_size=bs, max_context=max_context) == ""
        assert set(seen) == want, (bs, seen)
    monkeypatch.setattr(
        ops,
        "paged_decode",
        lambda q, kc, vc, t, n, bs, scale: (  # wrong past 16 splits
            torch.zeros(q.shape[0], q.shape[1] * q.shape[2], device=q.device)
            if t.shape[1] > 16
            else fused.reference_decode(q, kc, vc, t, n, bs, scale)
        ),
    )
    assert fused.self_check(ops, DEVICE, max_context=2048) == ""
    assert fused.self_check(ops, DEVICE, max_context=4100) == "paged decode attention (32 splits)"


def test_kernels_that_fail_their_check_or_do_not_suit_are_not_used(monkeypatch, caplog):
    """load() gives None, with a warning naming why, and the engine runs torch's ops."""
    with caplog.at_level("WARNING", logger="splitserve.engine.fused"):
        assert isinstance(fused.load(9, 3, 64, DEVICE), fused.FusedOps)
        assert not caplog.records
        assert fused.load(9, 3, 48, DEVICE) is None  # head size not a power of two
        assert fused.load(9, 2, 64, DEVICE) is None  # query heads not in groups of the KV heads
        monkeypatch.setattr(fused, "self_check", lambda ops, device, bs, max_context, dtype: "paged decode attention")
        assert fused.load(9, 3, 64, DEVICE) is None

        def broken(ops, device, bs, max_context, dtype):
            raise RuntimeError("no kernel image is available for execution on the device")

        monkeypatch.setattr(fused, "self_check", broken)
        assert fused.load(9, 3, 64, DEVICE) is None
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 4 and "power-of-two head size (got 48)" in warned[0], warned
    assert "query heads (9) to be a multiple of the KV heads (2)" in warned[1], warned
    assert "(paged decode attention)" in warned[2] and "no kernel image" in warned[3], warned
    assert all("torch's ops" in w for w in warned)


@pytest.mark.parametrize("raw, want", [("false", False), ("on", True)])
def test_the_fused_kernels_setting_is_read_as_a_flag(raw, want):
    from splitserve.service.settings import Settings

    s = Settings.from_env({"SPLITSERVE_FUSED_KERNELS": raw})
    assert s.fused_kernels is want
    assert s.engine_config("decode").fused_kernels is want and s.engine_config("prefill").fused_kernels is want
    assert Settings.from_env(s.to_env()).fused_kernels is want  # what `splitserve up` passes down
    with pytest.raises(ValueError, match="SPLITSERVE_FUSED_KERNELS='sometimes'"):
        Settings.from_env({"SPLITSERVE_FUSED_KERNELS": "sometimes"})


def test_the_cpu_engine_loads_no_fused_kernels(tiny_engine_factory):
    assert tiny_engine_factory().model.fused is None  # CPU steps run the C kernels and torch's ops


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_the_model_with_fused_kernels_gives_the_same_tokens(tiny_engine_factory, policy):
    """Decode steps through block tables, prefill chunks beside decodes, static decode steps, with
    the fused kernels: the CPU engine's greedy tokens. On CUDA the engine loads the kernels and its
    graphs replay them; on the CPU the graph step bodies run eagerly with the kernels interpreted."""
    # (interpreted, each kernel call costs a program's Python per row and head: few, short rows)
    prompts = random_prompts(5, lo=3, hi=48, seed=45)
    params = [SamplingParams(max_tokens=3 + 2 * i, ignore_eos=True) for i in range(5)]
    want = tiny_engine_factory().generate(prompts, params)
    kw = dict(policy=policy, attention_backend="torch", static_batch_size=4, max_wait_ms=1, max_num_batched_tokens=64)
    if DEVICE.type == "cuda":
        eng = tiny_engine_factory(device="cuda", **kw)
        assert eng.model.fused is not None
    else:
        eng = tiny_engine_factory(**kw)
        graph_bodies_without_capture(eng)
        s = eng.model.shape
        eng.model.fused = fused.FusedOps(s.num_heads, s.num_kv_heads, s.head_dim)
    calls = {"rope": 0, "decode": 0, "silu": 0}
    for name, key in (("rope_qkv", "rope"), ("paged_decode", "decode"), ("silu_mul", "silu")):
        real = getattr(eng.model.fused, name)

        def counted(*a, real=real, key=key, **kw):
            calls[key] += 1
            return real(*a, **kw)

        setattr(eng.model.fused, name, counted)
    assert eng.generate(prompts, params) == want
    assert calls["rope"] > 0 and calls["silu"] > 0
    assert (calls["decode"] > 0) == (policy == "continuous")  # static decodes read their own rectangle
