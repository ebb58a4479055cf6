"""The engine on a torch device other than the CPU, and the device setting.

The CUDA tests need a CUDA device and are skipped (and reported as skipped) without
one; CI has none. The first tests run everywhere.
"""

import pytest
import torch
from engine_helpers import drain, random_prompts

from splitserve.engine import fused
from splitserve.engine.config import EngineConfig
from splitserve.engine.sampling import SamplingParams
from splitserve.observability.metrics import EngineMetrics
from splitserve.service.settings import Settings

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "cuda:", "CPU"])
def test_a_bad_device_is_refused_naming_the_setting(device):
    with pytest.raises(ValueError, match="device"):
        EngineConfig(device=device)
    with pytest.raises(ValueError, match="device"):
        Settings.from_env({"SPLITSERVE_DEVICE": device})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_cuda_without_a_cuda_device_is_refused_at_start(tiny_loaded):
    from splitserve.engine.engine import LLMEngine

    with pytest.raises(ValueError, match="no CUDA device"):
        LLMEngine(EngineConfig(device="cuda"), loaded=tiny_loaded)


def test_batched_decode_attention_equals_one_sequence_at_a_time(tiny_engine_factory):
    """The torch backend's padded decode attention (every CUDA step uses it) against the C kernel."""
    prompts = random_prompts(9, seed=11)
    params = [SamplingParams(max_tokens=10 + 2 * i, ignore_eos=True) for i in range(9)]
    eng = tiny_engine_factory(attention_backend="torch")
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
    batched_steps = 0
    got = {}
    while eng.has_unfinished():
        for out in eng.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        batched_steps += eng.last_stats.num_decode_tokens > 1
    assert batched_steps > 5  # several decodes shared a step, with contexts of different lengths
    want = tiny_engine_factory(attention_backend="native").generate(prompts, params)
    assert [got[f"r{i}"] for i in range(9)] == want


# -- on a CUDA device ---------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("policy", ["continuous", "dynamic", "static"])
def test_cuda_engine_gives_the_cpu_engines_greedy_tokens(tiny_engine_factory, policy):
    prompts = random_prompts(10, seed=21)
    params = [SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True) for i in range(10)]
    want = tiny_engine_factory().generate(prompts, params)
    gpu = tiny_engine_factory(device="cuda", policy=policy, max_batch_size=4, static_batch_size=4, max_wait_ms=1)
    assert gpu.cache.kv.is_cuda and gpu.model.embed.is_cuda
    assert gpu.model.attn_kernel is None and gpu.model.small_gemm is None
    assert gpu.generate(prompts, params) == want


@cuda
def test_cuda_penalties_and_logit_bias_give_the_cpu_engines_tokens(tiny_engine_factory):
    """The penalties' gathers and scatters, and the logit bias, on device logits (decode steps
    replaying graphs); the same tokens as on the CPU."""
    prompts = random_prompts(4, seed=41)
    params = [
        SamplingParams(max_tokens=16, ignore_eos=True, repetition_penalty=1.8),
        SamplingParams(max_tokens=16, ignore_eos=True, frequency_penalty=-1.2, presence_penalty=-0.6),
        SamplingParams(max_tokens=16, ignore_eos=True, logit_bias={7: 5.0, 9: -100.0}),
        SamplingParams(max_tokens=16, ignore_eos=True),
    ]
    want = tiny_engine_factory().generate(prompts, params)
    assert tiny_engine_factory(device="cuda").generate(prompts, params) == want


@cuda
def test_cuda_steps_report_the_forwards_time_on_the_device(tiny_engine_factory):
    from splitserve.observability.metrics import EngineMetrics

    eng = tiny_engine_factory(device="cuda")
    m = EngineMetrics()
    for i, p in enumerate(random_prompts(4, seed=43)):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=12, ignore_eos=True))
    kinds = set()
    while eng.has_unfinished():
        eng.step()
        s = eng.last_stats
        assert 0 < s.device_time_s <= s.step_time_s, s
        kinds.add(s.graphed)
        m.observe_step(eng)
    assert True in kinds  # events around graph replays too
    assert m.registry.get_sample_value("splitserve_iteration_device_seconds_count") == m.registry.get_sample_value(
        "splitserve_engine_steps_total"
    )


@cuda
def test_cuda_chunked_prefill_and_preemption_keep_the_tokens(tiny_engine_factory):
    prompts = random_prompts(6, lo=60, hi=200, seed=5)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    want = tiny_engine_factory().generate(prompts, params)
    small = tiny_engine_factory(device="cuda", max_num_batched_tokens=40, kv_cache_bytes=24 * 16 * 2 * 2 * 2 * 16 * 4)
    for i, p in enumerate(prompts):
        small.add_request(f"r{i}", p, params)
    got, _, preempted = drain(small)
    assert preempted > 0
    assert [got[f"r{i}"] for i in range(6)] == want


@cuda
@pytest.mark.parametrize("src, dst", [("cpu", "cuda"), ("cuda", "cpu"), ("cuda", "cuda")])
def test_kv_moves_between_devices(tiny_engine_factory, src, dst):
    """A prefill engine on one device hands its KV to a decode engine on another; tokens are unchanged."""
    prompts = random_prompts(4, seed=31)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = tiny_engine_factory().generate(prompts, params)
    a, b = tiny_engine_factory(device=src), tiny_engine_factory(device=dst)
    for i, p in enumerate(prompts):
        a.add_request(f"r{i}", p, params, prefill_only=True)
    while len(a.parked) < len(prompts):
        a.step()
    first = {}
    for i in range(len(prompts)):
        rid = f"r{i}"
        buf = memoryview(bytearray(a.kv_nbytes(rid)))
        export = a.export_kv(rid, buf)
        a.release(rid)
        first[rid] = b.import_kv(export, buf).new_token_ids
    rest = drain(b).tokens
    assert [first[f"r{i}"] + rest.get(f"r{i}", []) for i in range(len(prompts))] == want


@cuda
def test_cuda_seeded_sampling_is_independent_of_the_batch(tiny_engine_factory):
    eng = tiny_engine_factory(device="cuda")
    prompt = random_prompts(1, seed=3)[0]
    seeded = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = eng.generate([prompt], seeded)[0]
    eng.add_request("seeded", prompt, seeded)
    for i, p in enumerate(random_prompts(5, seed=7)):
        eng.add_request(f"noise-{i}", p, SamplingParams(max_tokens=8 + i, temperature=0.8, ignore_eos=True))
    assert drain(eng).tokens["seeded"] == alone


@cuda
def test_cuda_real_model_matches_the_cpu_engine(smol_loaded, mixed_workload):
    from splitserve.engine.engine import LLMEngine

    picked = sorted(mixed_workload, key=lambda r: r["prompt_tokens"])
    prompts = [picked[i]["prompt_token_ids"] for i in (0, 40, 80, 120)]
    params = SamplingParams(max_tokens=16)
    cpu = LLMEngine(EngineConfig(kv_cache_bytes=256 << 20), loaded=smol_loaded).generate(prompts, params)
    gpu = LLMEngine(EngineConfig(kv_cache_bytes=256 << 20, device="cuda"), loaded=smol_loaded).generate(prompts, params)
    assert gpu == cpu


# -- CUDA graphs ----------------------------------------------------------------------------------


def test_graph_shape_buckets():
    from splitserve.engine.cuda_graphs import batch_buckets, bucket, pow2_at_least

    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(1) == [1]
    assert [bucket(batch_buckets(64), n) for n in (1, 3, 9, 64, 65)] == [1, 4, 16, 64, None]
    assert [pow2_at_least(n, 8) for n in (1, 8, 9, 100)] == [8, 8, 16, 128]


@pytest.mark.parametrize("raw, want", [("true", True), ("0", False), ("Off", False), ("yes", True)])
def test_the_cuda_graphs_setting_is_read_as_a_flag(raw, want):
    s = Settings.from_env({"SPLITSERVE_CUDA_GRAPHS": raw})
    assert s.cuda_graphs is want and s.engine_config("decode").cuda_graphs is want
    assert Settings.from_env(s.to_env()).cuda_graphs is want  # what `splitserve up` passes down


def test_a_bad_cuda_graphs_value_is_refused_naming_the_variable():
    with pytest.raises(ValueError, match="SPLITSERVE_CUDA_GRAPHS='maybe'"):
        Settings.from_env({"SPLITSERVE_CUDA_GRAPHS": "maybe"})


def test_the_cpu_engine_captures_nothing(tiny_engine_factory):
    eng = tiny_engine_factory(policy="continuous")
    assert eng.graphs is None and eng.cache.spare_block is None
    eng.generate(random_prompts(3, seed=1), SamplingParams(max_tokens=4, ignore_eos=True))
    assert not eng.last_stats.graphed


def graph_bodies_without_capture(eng):
    """Give a CPU engine the graph step bodies, run eagerly (capture=False): their math, without CUDA."""
    from splitserve.engine.cuda_graphs import DecodeGraphs, PaddedDecodeGraphs, PiecewiseGraphs
    from splitserve.engine.kv_cache import PagedKVCache
    from splitserve.engine.scheduler import ContinuousScheduler

    cfg = eng.config
    if eng.padded is not None:
        eng.padded.graphs = PaddedDecodeGraphs(eng.model, capture=False)
        return
    eng.cache = PagedKVCache(eng.model.shape, cfg.kv_cache_bytes, cfg.block_size, spare_block=True)
    eng.scheduler = ContinuousScheduler(eng.cache.pool, cfg.max_num_seqs, cfg.max_num_batched_tokens)
    eng.graphs = DecodeGraphs(eng.model, eng.cache, cfg.max_num_seqs, capture=False)
    eng.pieces = PiecewiseGraphs(eng.model, eng.cache, cfg.max_num_batched_tokens, capture=False)


@pytest.mark.parametrize("policy", ["continuous", "dynamic", "static"])
def test_graph_step_bodies_give_the_eager_tokens_on_the_cpu(tiny_engine_factory, policy):
    """Padded rows and contexts, slots and masks derived on the device: the same greedy tokens."""
    prompts = random_prompts(11, lo=3, hi=150, seed=43)
    params = [SamplingParams(max_tokens=4 + 9 * i, ignore_eos=True) for i in range(11)]
    want = tiny_engine_factory().generate(prompts, params)
    eng = tiny_engine_factory(
        policy=policy,
        attention_backend="torch",
        max_batch_size=5,
        static_batch_size=5,
        max_wait_ms=1,
        max_num_batched_tokens=100,
    )  # prefill in chunks, with decodes
    graph_bodies_without_capture(eng)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
    metrics = EngineMetrics()
    got, graphed, mixed = {}, 0, 0
    while eng.has_unfinished():
        for out in eng.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        metrics.observe_step(eng)
        st = eng.last_stats
        graphed += st.graphed
        mixed += st.graphed and st.num_prefill_tokens > 0 and st.num_decode_tokens > 0
    assert [got[f"r{i}"] for i in range(11)] == want
    assert graphed > 50
    counted = metrics.registry.get_sample_value
    assert counted("splitserve_engine_graphed_steps_total") == graphed <= counted("splitserve_engine_steps_total")
    if policy == "continuous":
        assert mixed > 3  # prefill chunks and decodes in one step went through the pieces


@cuda
@pytest.mark.parametrize("policy", ["continuous", "dynamic", "static"])
def test_cuda_graph_replays_give_the_eager_tokens(tiny_engine_factory, policy):
    """Decode steps replayed from graphs, over batch and context buckets, match eager steps and the CPU."""
    prompts = random_prompts(13, lo=3, hi=150, seed=41)
    params = [SamplingParams(max_tokens=5 + 11 * i, ignore_eos=True) for i in range(13)]  # contexts up to ~290
    want = tiny_engine_factory().generate(prompts, params)
    kw = dict(device="cuda", policy=policy, max_batch_size=5, static_batch_size=5, max_wait_ms=1)
    eager = tiny_engine_factory(cuda_graphs=False, **kw)
    assert eager.generate(prompts, params) == want
    eng = tiny_engine_factory(**kw)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
    got, graphed, eager_steps = {}, 0, 0
    while eng.has_unfinished():
        for out in eng.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        graphed += eng.last_stats.graphed
        eager_steps += eng.last_stats.num_tokens > 0 and not eng.last_stats.graphed
    assert [got[f"r{i}"] for i in range(13)] == want
    assert graphed > 100
    # continuous: every step replayed (prefill ones piecewise); padded policies prefill eagerly
    assert eager_steps == 0 if policy == "continuous" else eager_steps > 0
    shapes = (eng.graphs or eng.padded.graphs).captured.graphs
    assert len(shapes) >= 2  # several batch or context buckets


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_graph_padding_leaves_other_sequences_kv_alone(tiny_engine_factory, device):
    """Padding rows and tokens of graphed steps write only the spare block: a parked sequence's KV
    equals an eager engine's, through its own prefill and the decode and prefill steps of
    others (CPU: the graph bodies, run eagerly)."""
    prompt = random_prompts(1, lo=20, hi=40, seed=8)[0]

    def parked(eng):
        eng.add_request("parked", prompt, SamplingParams(max_tokens=4), prefill_only=True)
        while not eng.parked:
            eng.step()
        seq = eng.parked["parked"]
        return eng.cache.slots(seq.block_table, 0, seq.num_computed).to(device)

    ref = tiny_engine_factory(device=device, attention_backend="torch", cuda_graphs=False)
    ref_slots = parked(ref)
    eng = tiny_engine_factory(device=device, attention_backend="torch", max_num_batched_tokens=100)
    if device == "cpu":
        graph_bodies_without_capture(eng)
    slots = parked(eng)  # its own prefill: 20..39 tokens in a bucket of 32 or 64
    # 3 rows in a decode bucket of 4; prompts of 7..150 tokens in token buckets of 16..100
    eng.generate(random_prompts(3, lo=7, hi=150, seed=9), SamplingParams(max_tokens=20, ignore_eos=True))
    assert eng.last_stats.graphed
    want = ref.cache.kv[:, :, ref_slots]
    assert want.abs().max() > 0.1
    torch.testing.assert_close(eng.cache.kv[:, :, slots], want, rtol=1e-4, atol=1e-4)
    eng.release("parked")
    ref.release("parked")


@pytest.mark.skipif(torch.cuda.is_available(), reason="makes capture fail by asking for it on a host without CUDA")
@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_a_failed_capture_leaves_the_engine_eager_with_the_same_tokens(tiny_engine_factory, policy, caplog):
    """Graphs that cannot be captured (here: no CUDA at all) are dropped with one warning; the
    step that found out and every later one run eagerly, and the tokens do not change."""
    prompts = random_prompts(6, seed=51)
    params = [SamplingParams(max_tokens=8 + 3 * i, ignore_eos=True) for i in range(6)]
    want = tiny_engine_factory().generate(prompts, params)
    eng = tiny_engine_factory(policy=policy, attention_backend="torch", static_batch_size=4, max_wait_ms=1)
    graph_bodies_without_capture(eng)
    s = eng.model.shape
    eng.model.fused = fused.FusedOps(s.num_heads, s.num_kv_heads, s.head_dim)  # as on CUDA (interpreted here)
    for g in (eng.graphs, eng.pieces, eng.padded and eng.padded.graphs):
        if g is not None:
            g.captured.capture = True  # as on a CUDA device: capture, which fails on this host
    with caplog.at_level("WARNING", logger="splitserve.engine"):
        assert eng.generate(prompts, params) == want
    assert eng.graphs is None and eng.pieces is None and (eng.padded is None or eng.padded.graphs is None)
    assert eng.model.fused is None  # a capture that fails may be the kernels' fault: torch's ops from then on
    assert not eng.last_stats.graphed
    warned = [r.getMessage() for r in caplog.records if "capture" in r.getMessage()]
    assert len(warned) == 1 and "running every step eagerly, unfused" in warned[0], warned
