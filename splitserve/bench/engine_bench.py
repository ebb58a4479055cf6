"""In-process engine benchmark (issue: engine targets).

    python -m splitserve.bench.engine_bench [--quick] [--out results.json]
    python -m splitserve.bench.engine_bench --decode-only --decode-context 128,768 [--device cuda]

Every request generates exactly max_tokens (greedy, EOS ignored), all submitted at once.
Reports, per policy: output tok/s, requests/s, e2e p50/p99; single-stream decode tok/s;
decode tok/s at 1/8/32/64 running sequences (at each --decode-context length); and the
whole mixed workload's achieved GFLOP/s against a large fp32 GEMM measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

from splitserve.bench.peers_bench import cpu_model, vector_flags
from splitserve.bench.workload import WorkItem, default_workload_dir, load_workload, percentile, write_results
from splitserve.engine.config import EngineConfig, ModelSpec
from splitserve.engine.engine import LLMEngine
from splitserve.engine.loader import load_model
from splitserve.engine.model import ModelShape
from splitserve.engine.sampling import SampleRow, SamplingParams, sample
from splitserve.engine.structured import StructuredOutput


def run_workload(engine: LLMEngine, items: list[WorkItem], max_tokens: int | None = None, **sampling) -> dict:
    """items through engine, all added at once; max_tokens, if given, instead of each item's;
    `sampling`: more SamplingParams fields for every request (logprobs=5, ...)."""
    items = [dataclasses.replace(it, max_tokens=max_tokens) for it in items] if max_tokens else items
    start = time.perf_counter()
    for it in items:
        engine.add_request(
            it.id, it.prompt_token_ids, SamplingParams(max_tokens=it.max_tokens, ignore_eos=True, **sampling)
        )
    done: dict[str, float] = {}
    first: dict[str, float] = {}
    tokens = 0
    padding = cached = computed = 0
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter() - start
            first.setdefault(out.request_id, now)
            tokens += len(out.new_token_ids)
            if out.finished:
                done[out.request_id] = now
        padding += engine.last_stats.padding_tokens
        cached += engine.last_stats.num_cached_tokens
        computed += engine.last_stats.num_prefill_tokens
    wall = time.perf_counter() - start
    e2e = list(done.values())
    assert tokens == sum(it.max_tokens for it in items), "every request must generate exactly max_tokens"
    return {
        "requests": len(items),
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tok_per_s": tokens / wall,
        "prompt_tok_per_s": sum(len(it.prompt_token_ids) for it in items) / wall,
        "requests_per_s": len(items) / wall,
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p99_s": percentile(e2e, 99),
        "ttft_p50_s": percentile(list(first.values()), 50),
        "padding_tokens": padding,
        "prefix_cache_tokens": cached,  # prompt tokens that prompts of the same run shared (continuous)
        "prefill_tokens_computed": computed,
    }


def light_ttft(engine: LLMEngine, items: list[WorkItem]) -> list[float]:
    """TTFT in ms of each request sent alone, one after another."""
    out = []
    for i, it in enumerate(items):
        t = time.perf_counter()
        engine.add_request(f"light-{i}", it.prompt_token_ids, SamplingParams(max_tokens=2, ignore_eos=True))
        while True:
            outs = engine.step()
            if any(o.new_token_ids for o in outs):
                out.append((time.perf_counter() - t) * 1000)
                break
        engine.abort_request(f"light-{i}")
    return out


def context_prompt(items: list[WorkItem], i: int, context: int) -> list[int]:
    """A prompt of exactly `context` tokens: item i's, then the next items', cut there."""
    ids: list[int] = []
    j = i
    while len(ids) < context:
        ids += items[j % len(items)].prompt_token_ids
        j += 1
    return ids[:context]


DECODE_STEPS = 16


def decode_max_tokens(config: EngineConfig, running: int, context: int, steps: int = DECODE_STEPS) -> int:
    """Enough tokens that no sequence finishes before the measured steps: the first to finish its
    prefill decodes while the others' chunks run (one step each), then `steps` more."""
    return steps + 8 + -(-running * context // config.max_num_batched_tokens)


def decode_rate(
    engine: LLMEngine, items: list[WorkItem], running: int, steps: int = DECODE_STEPS, context: int = 128
) -> tuple[float, float]:
    """Decode tok/s with exactly `running` sequences decoding, each `context` tokens long, and the
    median step's forward on the device in ms (CUDA; 0 elsewhere)."""
    for i in range(running):
        engine.add_request(
            f"dec-{running}-{i}",
            context_prompt(items, i, context),
            SamplingParams(max_tokens=decode_max_tokens(engine.config, running, context, steps), ignore_eos=True),
        )
    while any(s.num_computed < s.prompt_len for s in engine.seqs.values()):
        engine.step()
    times, on_device = [], []
    for _ in range(steps):
        engine.step()
        assert engine.last_stats.num_decode_tokens == running, engine.last_stats
        times.append(engine.last_stats.step_time_s)
        on_device.append(engine.last_stats.device_time_s)
    for rid in list(engine.seqs):
        engine.abort_request(rid)
    return running / percentile(times, 50), percentile(on_device, 50) * 1000


# --<name>-cost runs: what is asked for, the rate compared, max_tokens instead of the items' own
PENALTIES = {"repetition_penalty": 1.2, "frequency_penalty": 0.5, "presence_penalty": 0.3}
COSTS = {
    "logprobs": ("output_tok_per_s", None),
    "prompt logprobs": ("prompt_tok_per_s", 1),  # one output token each: the prefill's rate
    "penalties": ("output_tok_per_s", None),
    "batch invariance": ("output_tok_per_s", None),  # (an engine of EngineConfig.batch_invariant, not sampling)
    "batch-invariant prefill": ("prompt_tok_per_s", 1),
}


def alternated(rounds: int, sides: dict, show) -> dict[str, list]:
    """Each of two runs (sides: name -> run()) once a round, their order swapped every round so that
    neither gets the machine's quieter minutes; each result printed as round r, show(name, result)."""
    runs: dict[str, list] = {side: [] for side in sides}
    order = list(sides)
    for r in range(rounds):
        for side in order if r % 2 == 0 else order[::-1]:
            runs[side].append(sides[side]())
            print(f"round {r + 1}, {show(side, runs[side][-1])}", flush=True)
    return runs


def cost(
    engine: LLMEngine,
    items: list[WorkItem],
    what: str,
    sampling: dict,
    rounds: int,
    engine_with: LLMEngine | None = None,
) -> dict:
    """The same requests without and with `sampling` (SamplingParams fields: COSTS[what] says
    which rate is compared), or through `engine` and through `engine_with` (another config),
    alternated so that neither side gets the machine's quieter minutes; the rate of each run, and
    per-round ratios. The engines have no prefix cache, so every run computes its prompts."""
    rate, max_tokens = COSTS[what]

    def run(on: bool) -> float:
        return run_workload(
            engine_with if on and engine_with else engine, items, max_tokens, **(sampling if on else {})
        )[rate]

    for eng in (engine,) if engine_with is None else (engine, engine_with):
        run_workload(eng, items[:4])  # warm-up
    runs = alternated(
        rounds,
        {"without": lambda: run(False), "with": lambda: run(True)},
        lambda side, got: f"{side:>7} {what}: {got:6.1f} {rate.replace('_per_', '/')}",
    )
    ratios = [a / b for a, b in zip(runs["with"], runs["without"])]
    return {
        "sampling": sampling,
        "requests": len(items),
        rate: runs,
        "ratios": ratios,
        "median_ratio": percentile(ratios, 50),
    }


# --structured-cost: formats of each kind, each held to by the rows of a sampler call
CITIES_SCHEMA = {
    "type": "object",
    "properties": {
        "cities": {
            "type": "array",
            "minItems": 3,
            "maxItems": 3,
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["name", "country", "population", "summary"],
                "properties": {
                    "name": {"type": "string"},
                    "country": {"type": "string"},
                    "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
                    "summary": {"type": "string", "maxLength": 120},
                },
            },
        }
    },
    "required": ["cities"],
    "additionalProperties": False,
}
STRUCTURED = {
    "json_schema": StructuredOutput("json_schema", json.dumps(CITIES_SCHEMA)),
    "regex": StructuredOutput("regex", r"[A-Za-z ,.]{1,400}"),
    "choice": StructuredOutput("choice", tuple(f"option {i}" for i in range(100))),
}


def structured_sample_cost(engine: LLMEngine, rows: int = 32, repeats: int = 30) -> dict:
    """The sampler's time for `rows` greedy rows, each held to a format (STRUCTURED) at positions
    along the model's own output under it, against the same rows without: medians of `repeats`
    alternated calls on the same random logits. A decode step of the same rows is the scale."""
    ask = "Describe three cities as JSON: name, country, population, and a one-sentence summary."
    tok = engine.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": ask}]) if tok.chat_template else tok.encode(ask)
    vocab = engine.model.shape.vocab_size
    out = {}
    for kind, fmt in STRUCTURED.items():
        tokens = engine.generate([prompt], SamplingParams(max_tokens=300, structured_output=fmt))[0]
        held = [
            SampleRow(SamplingParams(), None, matcher=engine.grammars.matcher(fmt, tokens[: i * 7 % len(tokens)]))
            for i in range(rows)
        ]
        plain = [SampleRow(SamplingParams(), None) for _ in range(rows)]
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
        times: dict[str, list[float]] = {"with": [], "without": []}
        for _ in range(repeats):
            for side, batch in (("with", held), ("without", plain)):
                x = logits.clone()
                t = time.perf_counter()
                sample(x, batch)
                times[side].append(time.perf_counter() - t)
        out[kind] = {
            "output_tokens": len(tokens),
            **{f"{side}_ms": percentile(v, 50) * 1e3 for side, v in times.items()},
        }
        print(
            f"{kind:>11}: sampling {rows} rows {out[kind]['with_ms']:.2f} ms held to it, "
            f"{out[kind]['without_ms']:.2f} ms without (its output: {len(tokens)} tokens)",
            flush=True,
        )
    return out


def dtype_cost(engines: dict[str, LLMEngine], rounds: int, prompt_len: int = 128, max_tokens: int = 32) -> dict:
    """Each dtype's engine (the same weights) in turn, every round: a prompt's prefill (one output
    token) and one stream's decode rate after it (prefix caching off on each)."""
    prompt = [100 + i for i in range(prompt_len)]
    got: dict = {dt: {"prefill_ms": [], "decode_tok_per_s": []} for dt in engines}
    for r in range(rounds):
        for dt, engine in engines.items():
            engine.generate([prompt], [SamplingParams(max_tokens=2, ignore_eos=True)])  # warm
            t = time.perf_counter()
            engine.generate([prompt], [SamplingParams(max_tokens=1, ignore_eos=True)])
            prefill = time.perf_counter() - t
            t = time.perf_counter()
            engine.generate([prompt], [SamplingParams(max_tokens=max_tokens, ignore_eos=True)])
            rate = (max_tokens - 1) / (time.perf_counter() - t - prefill)
            got[dt]["prefill_ms"].append(round(prefill * 1000, 1))
            got[dt]["decode_tok_per_s"].append(round(rate, 1))
            print(f"round {r} {dt}: prefill {prefill * 1000:.0f} ms, decode {rate:.1f} tok/s", flush=True)
    return {"prompt_len": prompt_len, "max_tokens": max_tokens, "rounds": rounds, "dtypes": got}


RESIDENT = """
import json, sys, time
t = time.perf_counter()
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.sampling import SamplingParams
eng = LLMEngine(EngineConfig(weights=sys.argv[1], kv_cache_bytes=256 << 20, prefix_caching=False))
ready = time.perf_counter() - t
params = SamplingParams(max_tokens=32, ignore_eos=True)
eng.generate([[100 + i % 900 for i in range(8 * j, 8 * j + 40)] for j in range(8)], params)  # decode, 8 rows
after_decode = int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) // 1024
eng.generate([[100 + i % 900 for i in range(512)]], SamplingParams(max_tokens=1))  # a 512-token prefill (MKL)
status = open("/proc/self/status").read()
mb = lambda key: int(status.split(key + ":")[1].split()[0]) // 1024
got = {"ready_s": ready, "rss_after_decode_mb": after_decode, "rss_mb": mb("VmRSS"), "peak_rss_mb": mb("VmHWM")}
print(json.dumps(got))
"""


def weights_cost(loaded, base: EngineConfig, mixed: list[WorkItem], short: list[WorkItem], rounds: int) -> dict:
    """The small-GEMM kernel's weights (EngineConfig.weights), native blocks against fp32 tiles, on
    the same model: decode tok/s at 1, 8, 32 and 64 running sequences (contexts of 128 tokens), then
    the mixed and short requests all at once, each setting in turn, the order swapped every round;
    each setting's packing from nothing (no cache) in this process; and in a fresh process each
    (its caches kept), the time to a ready engine and its resident memory after decode steps and
    after a 512-token prefill. Also what de-quantizing every layer's blocks with gguf-py takes,
    against a 512-token prefill: the cost of prefilling from the blocks instead of fp32 weights."""
    import subprocess

    from splitserve.engine.gguf_convert import GGUFFile
    from splitserve.engine.loader import native_blocks

    sides = ("native", "fp32")
    need = (
        64
        * (128 + decode_max_tokens(base, 64, 128) + base.block_size)
        * ModelShape.of(loaded.config).kv_bytes_per_token
    )
    engines = {
        w: LLMEngine(base.replace(prefix_caching=False, weights=w, kv_cache_bytes=max(need, 1 << 30)), loaded=loaded)
        for w in sides
    }
    out: dict = {"rounds": rounds, "mixed_requests": len(mixed), "short_requests": len(short)}
    for w, eng in engines.items():  # packing from nothing: what a first start on a new file does
        blocks = None
        t = time.perf_counter()
        if w == "native":
            blocks = native_blocks(loaded)
        eng.model.use_small_gemm(eng.model.small_gemm, cache={}, known=None, blocks=blocks)
        out.setdefault("pack_s", {})[w] = time.perf_counter() - t
        run_workload(eng, mixed[:4])  # warm-up
    print(f"packing from nothing: {out['pack_s']}", flush=True)

    def run(w: str) -> dict:
        eng = engines[w]
        got = {f"decode_{n}": decode_rate(eng, mixed, n)[0] for n in (1, 8, 32, 64)}
        got["mixed"] = run_workload(eng, mixed)["output_tok_per_s"]
        got["short"] = run_workload(eng, short)["output_tok_per_s"]
        return got

    out["runs"] = alternated(
        rounds,
        {w: (lambda w=w: run(w)) for w in sides},
        lambda w, got: f"{w:>6}: " + " ".join(f"{k} {v:.1f}" for k, v in got.items()),
    )
    out["native_over_fp32"] = {
        k: [a[k] / b[k] for a, b in zip(out["runs"]["native"], out["runs"]["fp32"])] for k in out["runs"]["native"][0]
    }
    for k, v in out["native_over_fp32"].items():
        print(f"native / fp32, {k}: {', '.join(f'{r:.2f}' for r in v)}", flush=True)
    engines.clear()
    for w in sides * 2:  # a fresh process each, twice, alternated
        proc = subprocess.run([sys.executable, "-c", RESIDENT, w], capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"the resident-memory run of weights {w} failed: {proc.stderr[-2000:]}")
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        out.setdefault("fresh_process", {}).setdefault(w, []).append(got)
        print(f"fresh process, weights {w}: {got}", flush=True)
    if loaded.gguf_path:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        gguf = GGUFFile(loaded.gguf_path)
        t = time.perf_counter()
        for name, tensor in gguf.tensors.items():
            if name.startswith("blk.") and len(tensor.shape) == 2:
                dequantize(gguf.raw(name), GGMLQuantizationType(tensor.ggml_type))
        out["dequantize_layers_s"] = time.perf_counter() - t
        eng = LLMEngine(base.replace(prefix_caching=False, kv_cache_bytes=256 << 20), loaded=loaded)
        prompt = [100 + i % 900 for i in range(512)]
        eng.generate([prompt], SamplingParams(max_tokens=1))
        t = time.perf_counter()
        eng.generate([prompt], SamplingParams(max_tokens=1))
        out["prefill_512_s"] = time.perf_counter() - t
        print(
            f"de-quantizing every layer's blocks (gguf-py): {out['dequantize_layers_s']:.2f} s; "
            f"a 512-token prefill on fp32 weights: {out['prefill_512_s']:.2f} s",
            flush=True,
        )
    return out


def samples_cost(engine: LLMEngine, items: list[WorkItem], n: int, rounds: int, max_tokens: int = 32) -> dict:
    """Each prompt's n samples as one request (sampling.n) against n requests of it (seeded seed + i:
    the same tokens), all submitted at once, alternated over rounds: wall time, output tok/s and
    the prompt tokens computed. The engine has no prefix cache, so the n requests compute their
    prompt each, and the samples after the first of one request at most a block of it."""

    def run(as_one: bool) -> dict:
        start = time.perf_counter()
        tokens = computed = 0
        for k, it in enumerate(items):
            sp = dict(max_tokens=max_tokens, ignore_eos=True, temperature=1.0)
            if as_one:
                engine.add_request(it.id, it.prompt_token_ids, SamplingParams(n=n, seed=100 * k, **sp))
            for i in range(0 if as_one else n):
                engine.add_request(f"{it.id}-{i}", it.prompt_token_ids, SamplingParams(seed=100 * k + i, **sp))
        while engine.has_unfinished():
            tokens += sum(len(out.new_token_ids) for out in engine.step())
            computed += engine.last_stats.num_prefill_tokens
        wall = time.perf_counter() - start
        assert tokens == len(items) * n * max_tokens
        return {"wall_s": wall, "output_tok_per_s": tokens / wall, "prefill_tokens_computed": computed}

    run(True)  # warm-up
    runs = alternated(
        rounds,
        {"n": lambda: run(True), "separate": lambda: run(False)},
        lambda side, got: (
            f"{side:>8}: {got['wall_s']:5.1f} s, {got['output_tok_per_s']:6.1f} out tok/s, "
            f"{got['prefill_tokens_computed']} prompt tokens computed"
        ),
    )
    ratios = [b["wall_s"] / a["wall_s"] for a, b in zip(runs["n"], runs["separate"])]
    return {
        "n": n,
        "requests": len(items),
        "max_tokens": max_tokens,
        "runs": runs,
        "speedups": ratios,
        "median_speedup": percentile(ratios, 50),
    }


def gemm_gflops(device: str = "cpu", n: int = 2048, reps: int = 10) -> float:
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    sync = torch.cuda.synchronize if a.is_cuda else (lambda: None)
    a @ b
    sync()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        sync()
        times.append(time.perf_counter() - t)
    return 2 * n**3 / percentile(times, 50) / 1e9


def workload_flops(engine: LLMEngine, items: list[WorkItem]) -> float:
    """Model FLOPs of a workload: linear layers, attention (QK and PV), and lm_head per sample."""
    s = engine.model.shape
    layer = engine.model.layers[0]
    linear = sum(w.numel() for w in (layer.w_qkv, layer.w_o, layer.w_gate_up, layer.w_down))
    total = 0.0
    for it in items:
        computed = len(it.prompt_token_ids) + it.max_tokens - 1
        total += 2.0 * s.num_layers * linear * computed
        total += 4.0 * s.num_layers * s.num_heads * s.head_dim * computed * (computed + 1) / 2
        total += 2.0 * s.hidden_size * s.vocab_size * it.max_tokens
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=default_workload_dir())
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--eager", action="store_true", help="CUDA: run every step eagerly, no CUDA graphs")
    ap.add_argument("--unfused", action="store_true", help="CUDA: torch's ops instead of the fused Triton kernels")
    ap.add_argument("--quick", action="store_true", help="smaller subsets, for a smoke run")
    ap.add_argument("--skip-full", action="store_true", help="skip the whole-mixed-workload FLOP efficiency run")
    ap.add_argument(
        "--logprobs-cost",
        type=int,
        default=None,
        metavar="K",
        help="only measure the cost of asking for log probabilities (K most likely), continuous policy, "
        "the first 32 mixed requests with and without, alternated over --rounds",
    )
    ap.add_argument(
        "--prompt-logprobs-cost",
        type=int,
        default=None,
        metavar="K",
        help="only measure the cost of asking for the prompt's log probabilities (K most likely): the "
        "same prompts prefilled (one output token each) with and without, prompt tok/s",
    )
    ap.add_argument(
        "--penalties-cost",
        action="store_true",
        help=f"only measure the cost of penalties ({', '.join(f'{k}={v}' for k, v in PENALTIES.items())}): "
        "the first 32 mixed requests with and without, output tok/s",
    )
    ap.add_argument(
        "--samples-cost",
        type=int,
        default=None,
        metavar="N",
        help="only measure N samples of each of 8 prompts as one request each (sampling.n) against N requests of each",
    )
    ap.add_argument(
        "--structured-cost",
        action="store_true",
        help="only measure the sampler's time for 32 rows held to structured output formats",
    )
    ap.add_argument(
        "--invariant-cost",
        action="store_true",
        help="only measure the cost of batch_invariant (SPLITSERVE_BATCH_INVARIANT): the first 32 mixed "
        "requests through an engine with and one without, output tok/s, then their prompts alone "
        "(one output token each), prompt tok/s",
    )
    ap.add_argument(
        "--dtype-cost",
        action="store_true",
        help="only measure each dtype (float32, bfloat16, float16) on the same weights: a 128-token "
        "prompt's prefill and one stream's decode rate, the dtypes alternated each round",
    )
    ap.add_argument(
        "--weights-cost",
        action="store_true",
        help="only measure weights native against fp32 (decode at 1/8/32/64 running, the mixed and short "
        "requests, packing time, a fresh process's start and resident memory), alternated over --rounds",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--decode-context",
        default="128",
        metavar="N[,N...]",
        help="context lengths (tokens) of the decode-rate runs; the first is reported as decode_tok_per_s",
    )
    ap.add_argument(
        "--decode-only",
        action="store_true",
        help="only the decode rates (at each --decode-context), not the policies or the whole workload",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    print(
        "engine benchmark: prefix cache on in the policy runs (a workload's prompts are all distinct, "
        "and nothing warms the cache up), off in the cost and decode-rate runs",
        flush=True,
    )
    try:
        contexts = [int(c) for c in args.decode_context.split(",")]
    except ValueError:
        contexts = []
    if not contexts or min(contexts) < 1:
        ap.error(f"--decode-context takes whole numbers >= 1, comma-separated; got {args.decode_context!r}")

    loaded = load_model(ModelSpec(path=args.model))
    base = EngineConfig(
        model=ModelSpec(path=args.model),
        num_threads=args.threads,
        kv_cache_bytes=2 << 30,
        device=args.device,
        cuda_graphs=not args.eager,
        fused_kernels=not args.unfused,
    )
    mixed = load_workload(os.path.join(args.workloads, "workload_mixed.jsonl"))
    short = load_workload(os.path.join(args.workloads, "workload_short.jsonl"))
    n_mixed, n_short = (8, 16) if args.quick else (32, 64)
    results: dict = {
        "command": " ".join(["python", "-m", "splitserve.bench.engine_bench", *(argv or sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "cpu": cpu_model(),
        "vector_flags": vector_flags(),
        "threads": base.threads(),
        "torch": torch.__version__,
        "device": args.device,
        "cuda_graphs": args.device != "cpu" and not args.eager,
        "policies": {},
    }
    torch.set_num_threads(base.threads())
    costs = [
        (what, sampling)
        for what, sampling, on in (
            ("logprobs", {"logprobs": args.logprobs_cost}, args.logprobs_cost is not None),
            ("prompt logprobs", {"prompt_logprobs": args.prompt_logprobs_cost}, args.prompt_logprobs_cost is not None),
            ("penalties", PENALTIES, args.penalties_cost),
            ("batch invariance", {}, args.invariant_cost),
            ("batch-invariant prefill", {}, args.invariant_cost),
        )
        if on
    ]
    uncached = LLMEngine(base.replace(prefix_caching=False), loaded=loaded) if costs else None
    invariant = (
        LLMEngine(base.replace(prefix_caching=False, batch_invariant=True), loaded=loaded)
        if args.invariant_cost
        else None
    )
    for what, sampling in costs:
        got = results[what.replace(" ", "_").replace("-", "_") + "_cost"] = cost(
            uncached,
            mixed[:n_mixed],
            what,
            sampling,
            args.rounds,
            engine_with=invariant if "invariant" in what else None,
        )
        print(
            f"with / without {what}, per round: {', '.join(f'{r:.3f}' for r in got['ratios'])}; "
            f"median {got['median_ratio']:.3f}",
            flush=True,
        )
    if args.structured_cost:
        results["structured_sample_cost"] = structured_sample_cost(LLMEngine(base, loaded=loaded))
    if args.samples_cost:
        got = results["samples_cost"] = samples_cost(
            LLMEngine(base.replace(prefix_caching=False), loaded=loaded), mixed[:8], args.samples_cost, args.rounds
        )
        print(
            f"separate / as one request, wall time per round: {', '.join(f'{r:.2f}' for r in got['speedups'])}; "
            f"median {got['median_speedup']:.2f}",
            flush=True,
        )
    if args.dtype_cost:
        engines = {
            dt: LLMEngine(base.replace(prefix_caching=False, dtype=dt, kv_cache_bytes=256 << 20), loaded=loaded)
            for dt in ("float32", "bfloat16", "float16")
        }
        results["dtype_cost"] = dtype_cost(engines, args.rounds)
    if args.weights_cost:
        results["weights_cost"] = weights_cost(loaded, base, mixed[:n_mixed], short[:n_short], args.rounds)
    if costs or args.structured_cost or args.samples_cost or args.dtype_cost or args.weights_cost:
        write_results(args.out, results)
        return 0

    policies = {
        "continuous": base,
        "dynamic": base.replace(policy="dynamic", max_batch_size=8, max_wait_ms=50),
        "static": base.replace(policy="static", static_batch_size=8, max_wait_ms=50),
    }
    for name, cfg in ({} if args.decode_only else policies).items():
        eng = LLMEngine(cfg, loaded=loaded)
        results["policies"][name] = {
            "mixed": run_workload(eng, mixed[:n_mixed]),
            "short": run_workload(eng, short[:n_short]),
        }
        r = results["policies"][name]
        print(
            f"{name:>10}: mixed {r['mixed']['output_tok_per_s']:6.1f} tok/s {r['mixed']['requests_per_s']:.2f} req/s "
            f"p50 {r['mixed']['e2e_p50_s']:.1f}s p99 {r['mixed']['e2e_p99_s']:.1f}s | "
            f"short {r['short']['output_tok_per_s']:6.1f} tok/s {r['short']['requests_per_s']:.2f} req/s "
            f"p50 {r['short']['e2e_p50_s']:.1f}s p99 {r['short']['e2e_p99_s']:.1f}s",
            flush=True,
        )
        del eng

    # The decode rates and the whole workload send prompts already sent: no prefix cache here, so
    # the FLOPs counted are the FLOPs computed.
    # A pool that holds 64 sequences of the longest context with their decode steps: none is
    # preempted while measured.
    longest = max(contexts)
    need = (
        64
        * (longest + decode_max_tokens(base, 64, longest) + base.block_size)
        * ModelShape.of(loaded.config).kv_bytes_per_token
    )
    eng = LLMEngine(base.replace(prefix_caching=False, kv_cache_bytes=max(base.kv_cache_bytes, need)), loaded=loaded)
    # Decode steps at each context length: attention reads every running sequence's context, so
    # a step's time grows with it (the service's contexts are its prompts plus their outputs).
    results["decode_by_context"] = {}
    results["decode_device_ms_by_context"] = {}
    results["fused_kernels"] = eng.model.fused is not None
    for context in contexts:
        rates = results["decode_by_context"][context] = {}
        device = results["decode_device_ms_by_context"][context] = {}
        for running in (1, 8, 32, 64):
            rates[running], device[running] = decode_rate(eng, mixed, running, context=context)
            shown = f", {device[running]:.2f} ms of it on the device" if device[running] else ""
            print(
                f"decode with {running:>2} running, contexts of {context} tokens: {rates[running]:6.1f} tok/s, "
                f"{running / rates[running] * 1000:.2f} ms a step{shown}",
                flush=True,
            )
    results["decode_tok_per_s"] = results["decode_by_context"][contexts[0]]
    results["single_stream_tok_per_s"] = results["decode_tok_per_s"][1]
    if eng.graphs is not None:
        cap = eng.graphs.captured
        results["cuda_graphs_captured"] = {"graphs": len(cap.graphs), "capture_s": cap.capture_s}
        print(f"decode graphs: {len(cap.graphs)} captured in {cap.capture_s:.2f} s", flush=True)

    if not (args.skip_full or args.decode_only):
        items = mixed[:16] if args.quick else mixed
        gemm_before = gemm_gflops(args.device)
        full = run_workload(eng, items)
        gemm_after = gemm_gflops(args.device)
        flops = workload_flops(eng, items)
        achieved = flops / full["wall_s"] / 1e9
        gemm = (gemm_before + gemm_after) / 2
        results["flops"] = {
            "requests": len(items),
            "workload_tflop": flops / 1e12,
            "wall_s": full["wall_s"],
            "achieved_gflops": achieved,
            "gemm_gflops": gemm,
            "fraction_of_gemm": achieved / gemm,
            "output_tok_per_s": full["output_tok_per_s"],
        }
        print(
            f"whole mixed workload ({len(items)} requests): {flops / 1e12:.2f} TFLOP in {full['wall_s']:.1f}s = "
            f"{achieved:.1f} GFLOP/s; 2048^3 fp32 GEMM {gemm:.1f} GFLOP/s -> {100 * achieved / gemm:.0f}%",
            flush=True,
        )
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
