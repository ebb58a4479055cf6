"""splitserve against vLLM's CPU server, side by side in one run, over the same OpenAI HTTP client.

    python -m splitserve.bench.peers_bench --vllm-python .venv-vllm/bin/python [--rounds 2] [--short 64]
        [--mixed 32] [--rate 1.6] [--poisson 64] [--out bench-results/peers.json]

Both servers serve the same model (SmolLM2-135M-Instruct, converted from the GGUF to float32
safetensors; vLLM gets a copy of the folder without the GGUF `quantization_config`, which it
refuses), in float32, prefix caching off. splitserve runs as `splitserve up` does (router, one
prefill and one decode worker); vLLM as its OpenAI server with the flags in VLLM_ARGS and the
environment in VLLM_ENV. Both stay up for the whole run and take turns; each load runs on one
while the other idles, the order alternating each round.

Loads, every request greedy with `ignore_eos` and exactly its workload's max_tokens, streamed
from `/v1/completions` with the prompt as token ids:
  short   the first --short requests of workload_short.jsonl, all at once (closed loop)
  mixed   the first --mixed of workload_mixed.jsonl, all at once
  poisson the first --poisson of workload_short.jsonl arriving as a Poisson process at --rate
          req/s (seeded: the same arrival times on both)
TTFT is the time to the first streamed chunk that carries a token, TPOT the mean gap after it,
throughput the output tokens over the load's wall time. The table gives each server's range over
the rounds and the ratio of the medians (splitserve / vLLM; for latencies below 1 is better).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from splitserve.bench.workload import WorkItem, default_workload_dir, load_workload, percentile, write_results

SERVERS = ("splitserve", "vllm")
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
}
VLLM_ARGS = [
    "--dtype",
    "float32",
    "--no-enable-prefix-caching",
    "--max-num-seqs",
    "64",
    "--max-num-batched-tokens",
    "2048",
]
# the closed loops: (label and the flag giving how many, workload file)
CLOSED = (("short", "workload_short.jsonl"), ("mixed", "workload_mixed.jsonl"))
METRICS = ("output_tok_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "e2e_p50_ms")


# -- one load over OpenAI HTTP -------------------------------------------------------------------


async def _one(client, model: str, item: WorkItem, t_run: float, text: bool = False, extra: dict | None = None) -> dict:
    out = {"t_sent": time.perf_counter() - t_run, "ok": False, "ttft_s": math.nan, "e2e_s": math.nan, "tokens": 0}
    t0 = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=model,
            prompt=item.prompt if text else item.prompt_token_ids,
            max_tokens=item.max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True} if extra is None else extra,
        )
        chunks, usage = 0, None
        async for chunk in stream:
            if chunk.choices and math.isnan(out["ttft_s"]):
                out["ttft_s"] = time.perf_counter() - t0
            chunks += bool(chunk.choices and chunk.choices[0].text)
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        out["tokens"] = chunks if usage is None else usage  # (a server that sends no usage: a token a chunk)
        out["e2e_s"] = time.perf_counter() - t0
        out["ok"] = out["tokens"] == item.max_tokens
        if not out["ok"]:
            out["error"] = f"{out['tokens']} tokens of {item.max_tokens}"
    except Exception as e:  # noqa: BLE001 - a failed request is a result, named in the figures
        out["error"] = f"{type(e).__name__}: {e}"[:300]
    return out


async def run_load(
    base_url: str,
    model: str,
    items: list[WorkItem],
    rate: float | None,
    seed: int = 0,
    text: bool = False,
    extra: dict | None = None,
) -> list:
    """Every item sent once: all at once (rate None) or as a seeded Poisson process; text: the prompt
    as text (else its token ids); extra: the request's extra fields (default ignore_eos)."""
    import httpx2
    import openai

    limits = httpx2.Limits(max_connections=1024, max_keepalive_connections=1024)
    async with openai.AsyncOpenAI(
        base_url=base_url,
        api_key="none",
        max_retries=0,
        timeout=3600,
        http_client=openai.DefaultAsyncHttpxClient(limits=limits),
    ) as client:
        t_run = time.perf_counter()
        tasks, next_t, rng = [], 0.0, random.Random(seed)
        for item in items:
            if rate:
                delay = next_t - (time.perf_counter() - t_run)
                if delay > 0:
                    await asyncio.sleep(delay)
                next_t += rng.expovariate(rate)
            tasks.append(asyncio.ensure_future(_one(client, model, item, t_run, text, extra)))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t_run
    return [dict(r, wall_s=wall) for r in results]


def summarize(results: list[dict]) -> dict:
    ok = [r for r in results if r["ok"]]
    wall = results[0]["wall_s"] if results else math.nan
    tpot = [(r["e2e_s"] - r["ttft_s"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if "error" in r})[:5],
        "wall_s": wall,
        "output_tokens": sum(r["tokens"] for r in ok),
        "output_tok_per_s": sum(r["tokens"] for r in ok) / wall if wall else math.nan,
        "ttft_p50_ms": percentile([r["ttft_s"] * 1000 for r in ok], 50),
        "ttft_p99_ms": percentile([r["ttft_s"] * 1000 for r in ok], 99),
        "tpot_p50_ms": percentile([t * 1000 for t in tpot], 50),
        "e2e_p50_ms": percentile([r["e2e_s"] * 1000 for r in ok], 50),
    }


# -- the table -----------------------------------------------------------------------------------


def table(rounds: list[dict]) -> tuple[list[dict], str]:
    """Rows (load, metric, each server's values over the rounds, ratio of the medians) and the
    Markdown table of them. `rounds`: [{load: {server: summary}}]."""
    rows = []
    loads = list(dict.fromkeys(load for r in rounds for load in r))
    for load in loads:
        for metric in METRICS:
            values = {s: [r[load][s][metric] for r in rounds if load in r] for s in SERVERS}
            if load != "poisson" and metric != "output_tok_per_s":
                continue  # closed loops: throughput is the figure
            if load == "poisson" and metric == "output_tok_per_s":
                continue  # an open loop's throughput is its arrival rate
            med = {s: statistics.median(v) for s, v in values.items()}
            ratio = med["splitserve"] / med["vllm"] if med["vllm"] else math.nan
            rows.append({"load": load, "metric": metric, **values, "ratio": ratio})

    def span(vs: list[float]) -> str:
        lo, hi = min(vs), max(vs)
        return f"{lo:.1f}" if round(lo, 1) == round(hi, 1) else f"{lo:.1f}–{hi:.1f}"

    lines = ["| load | metric | splitserve | vLLM | splitserve / vLLM |", "|---|---|---|---|---|"]
    for row in rows:
        lines.append(
            f"| {row['load']} | {row['metric']} | {span(row['splitserve'])} | {span(row['vllm'])} | "
            f"{row['ratio']:.2f}× |"
        )
    return rows, "\n".join(lines)


# -- servers -------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_model_folder(folder: str, into: str) -> str:
    """A copy of the converted model folder whose config.json has no quantization_config."""
    dst = os.path.join(into, "model")
    shutil.copytree(folder, dst)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    return dst


def stop_group(proc: subprocess.Popen) -> None:
    """Stop a server started in a session of its own, and whatever it started: SIGTERM, then
    SIGKILL after 60 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_http(url: str, proc: subprocess.Popen | None, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it was up")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{what} was not up at {url} after {timeout:.0f} s")


def gemm_gflops(n: int = 2048, reps: int = 5) -> float:
    """This run's fp32 GEMM rate (n³, the best of reps): the machine's speed moves from day to day."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor()


def vector_flags() -> list[str]:
    """The CPU's vector extensions the kernels of either server may use: the machines here vary
    (some days AVX2 and FMA only, some days AVX-512 with BF16 as well)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return []
    return sorted(f for f in flags if f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16"))


def cpu_seconds(pids: list[int]) -> float:
    """user + system CPU seconds of these processes and their children that were waited for."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += sum(int(x) for x in fields[11:15]) / tick
        except OSError:
            pass
    return total


def tree(pid: int) -> list[int]:
    """pid and every descendant."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--vllm-python",
        required=True,
        help="the python of a venv with vllm-cpu (make bench-peers); its server module is run directly, since the "
        "`vllm` command looks itself up as the distribution `vllm`, which vllm-cpu is not",
    )
    ap.add_argument("--workloads", default=default_workload_dir())
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--short", type=int, default=64)
    ap.add_argument("--mixed", type=int, default=32)
    ap.add_argument("--rate", type=float, default=1.6)
    ap.add_argument("--poisson", type=int, default=64, help="requests in the Poisson load (0: none)")
    ap.add_argument("--vllm-start-s", type=float, default=900.0, help="how long vLLM may take to load")
    ap.add_argument("--out", default="bench-results/peers.json")
    args = ap.parse_args(argv)
    if args.rounds < 2:
        ap.error("--rounds: a side-by-side figure needs at least 2 rounds")

    from splitserve.engine.config import ModelSpec
    from splitserve.engine.loader import resolve_folder
    from splitserve.service.settings import Settings
    from splitserve.stack import Stack

    loads = [(label, load_workload(os.path.join(args.workloads, f), getattr(args, label)), None) for label, f in CLOSED]
    if args.poisson:
        loads.append(
            ("poisson", load_workload(os.path.join(args.workloads, "workload_short.jsonl"), args.poisson), args.rate)
        )
    results: dict = {
        "command": " ".join(
            [os.path.basename(sys.executable), "-m", __spec__.name if __spec__ else __name__, *sys.argv[1:]]
        ),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "vector_flags": vector_flags(),
            "gemm_2048_fp32_gflops_start": gemm_gflops(),
        },
        "vllm": {"env": VLLM_ENV, "args": VLLM_ARGS},
        "loads": {label: {"requests": len(items), "rate": rate} for label, items, rate in loads},
        "rounds": [],
    }
    print(f"machine: {results['machine']}", flush=True)
    settings = Settings.from_env(prefix_caching=False, max_queue_requests=4096, max_queue_tokens=1 << 24)
    folder = resolve_folder(ModelSpec(path=settings.model or None, cache_dir=settings.cache_dir))
    with tempfile.TemporaryDirectory(prefix="splitserve-peers-") as tmp:
        model_dir = vllm_model_folder(folder, tmp)
        port = free_port()
        log = open(os.path.join(tmp, "vllm.log"), "w")
        vllm = subprocess.Popen(
            [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
            + ["--host", "127.0.0.1", "--port", str(port)]
            + ["--served-model-name", "smollm2", *VLLM_ARGS],
            env={**os.environ, **VLLM_ENV},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            t = time.monotonic()
            with Stack(settings, http_port=free_port()) as stack:
                base = {"splitserve": f"http://{stack.router_http_address}/v1", "vllm": f"http://127.0.0.1:{port}/v1"}
                models = {"splitserve": stack.settings.served_model_name or "", "vllm": "smollm2"}
                wait_http(f"http://127.0.0.1:{port}/health", vllm, args.vllm_start_s, "vLLM's server")
                results["vllm"]["load_s"] = time.monotonic() - t
                with urllib.request.urlopen(base["splitserve"] + "/models", timeout=10) as r:
                    models["splitserve"] = json.load(r)["data"][0]["id"]
                pids = {"splitserve": [p.popen.pid for p in stack.procs], "vllm": [vllm.pid]}
                warm = load_workload(os.path.join(args.workloads, "workload_short.jsonl"), 4)
                for s in SERVERS:
                    asyncio.run(run_load(base[s], models[s], warm, None))
                for r in range(args.rounds):
                    got: dict = {}
                    for label, items, rate in loads:
                        got[label] = {}
                        for s in SERVERS if r % 2 == 0 else SERVERS[::-1]:
                            other = [p for o in SERVERS if o != s for q in pids[o] for p in tree(q)]
                            idle0 = cpu_seconds(other)
                            time.sleep(2)
                            summary = summarize(asyncio.run(run_load(base[s], models[s], items, rate)))
                            summary["other_server_cpu_s"] = cpu_seconds(other) - idle0
                            got[label][s] = summary
                            print(
                                f"round {r + 1} {label:8s} {s:10s} "
                                + " ".join(f"{m} {summary[m]:.1f}" for m in METRICS)
                                + f" failed {summary['failed']}"
                                + f" (the other server's CPU meanwhile {summary['other_server_cpu_s']:.1f} s)",
                                flush=True,
                            )
                    results["rounds"].append(got)
        finally:
            stop_group(vllm)
            log.close()
            if vllm.returncode not in (0, -signal.SIGTERM, None) and not results["rounds"]:
                print(open(os.path.join(tmp, "vllm.log")).read()[-4000:], file=sys.stderr)
    results["machine"]["gemm_2048_fp32_gflops_end"] = gemm_gflops()
    rows, md = table(results["rounds"])
    results["table"], results["table_md"] = rows, md
    print(md)
    write_results(args.out, results)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(
            f"{results['date']}, {results['machine']['cpu']} ({results['machine']['cores']} cores, "
            f"{' '.join(results['machine']['vector_flags'])}), 2048³ fp32 GEMM "
            f"{results['machine']['gemm_2048_fp32_gflops_start']:.0f} GFLOP/s at the start, "
            f"{results['machine']['gemm_2048_fp32_gflops_end']:.0f} at the end; `{results['command']}`\n\n{md}\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
