"""What tracing costs: the same closed-loop workload through a stack with tracing off
(``OTEL_TRACES_EXPORTER=none``) and on (every span written to the stack's span file),
alternated, several rounds; medians and the ratio.

    python -m splitserve.bench.tracing_bench [--requests 32] [--rounds 3] [--out results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics

from splitserve.bench import loadgen
from splitserve.bench.workload import default_workload_dir, load_workload, write_results
from splitserve.service.settings import Settings
from splitserve.stack import Stack


def one(items, tracing_on: bool) -> float:
    saved = os.environ.get("OTEL_TRACES_EXPORTER")
    if tracing_on:
        os.environ.pop("OTEL_TRACES_EXPORTER", None)
    else:
        os.environ["OTEL_TRACES_EXPORTER"] = "none"
    try:
        # no prefix cache: the warm-up's prompts come again in the run
        with Stack(Settings.from_env(max_queue_requests=4096, max_queue_tokens=1 << 24, prefix_caching=False)) as stack:
            assert bool(stack.settings.trace_file) == tracing_on
            asyncio.run(loadgen.warm_up(stack.router_address, items[:2]))
            results, wall = asyncio.run(
                loadgen.run(stack.router_address, items, loadgen.RunSpec("concurrency", len(items)))
            )
            s = loadgen.summarize(results, wall)
            assert s["succeeded"] == len(items)
            return s["output_throughput"]
    finally:
        if saved is None:
            os.environ.pop("OTEL_TRACES_EXPORTER", None)
        else:
            os.environ["OTEL_TRACES_EXPORTER"] = saved


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=default_workload_dir())
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    print("tracing benchmark: prefix cache off (every round sends the same prompts again)", flush=True)
    items = load_workload(os.path.join(args.workloads, "workload_mixed.jsonl"), args.requests)
    off, on = [], []
    for r in range(args.rounds):
        for flag, bucket in ((False, off), (True, on)) if r % 2 == 0 else ((True, on), (False, off)):
            bucket.append(one(items, flag))
            print(f"round {r + 1}: tracing {'on ' if flag else 'off'} {bucket[-1]:.1f} tok/s", flush=True)
    ratio = statistics.median(on) / statistics.median(off)
    print(
        f"mixed, first {len(items)} requests at once, {args.rounds} rounds alternated: tracing off "
        f"{statistics.median(off):.1f} tok/s, on {statistics.median(on):.1f} tok/s (medians) -> cost "
        f"{(1 - ratio) * 100:.1f}%"
    )
    write_results(args.out, {"off_tok_s": off, "on_tok_s": on, "ratio": ratio, "requests": len(items)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
