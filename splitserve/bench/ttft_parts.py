"""Where the TTFT tail goes: the parts of the slowest requests' time to first token.

    python -m splitserve.bench.ttft_parts [--rate 1.6] [--requests 128] [--out bench-results/ttft-parts.json]

A stack as `make bench-peers` runs it (router, one prefill and one decode worker, the default
model, prefix cache off) takes the first --requests of workload_short.jsonl arriving as a seeded
Poisson process at --rate req/s, streamed over gRPC, greedy, exactly max_tokens each. Each
request's TTFT is split into the parts the router reports with its first token (admission,
queue, prefill, KV transfer, first token's way back), and whether its decode worker prefilled it
itself. Printed: the parts' medians over all requests and over the slowest 5%, each slow one
with its parts, and how many requests each worker was running when it arrived.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time

from splitserve.bench.workload import default_workload_dir, load_workload, percentile, write_results
from splitserve.client import AsyncClient

PARTS = ("admission_ms", "queue_ms", "prefill_ms", "kv_transfer_ms", "first_token_ms")


async def _one(client: AsyncClient, item, t_run: float) -> dict:
    t0 = time.perf_counter()
    out = {"t_sent": t0 - t_run, "prompt_tokens": len(item.prompt_token_ids)}
    last = None
    async for chunk in client.generate_stream(
        token_ids=item.prompt_token_ids, max_tokens=item.max_tokens, ignore_eos=True, timeout=600
    ):
        if chunk.token_ids and "ttft_ms" not in out:
            out["ttft_ms"] = (time.perf_counter() - t0) * 1000
        last = chunk
    out.update({p: getattr(last.timings, p) for p in PARTS})
    out["request_id"] = last.request_id
    return out


async def run(address: str, items, rate: float, seed: int = 0) -> list[dict]:
    async with AsyncClient(address) as client:
        rng, t_run, next_t, tasks = random.Random(seed), time.perf_counter(), 0.0, []
        for item in items:
            delay = next_t - (time.perf_counter() - t_run)
            if delay > 0:
                await asyncio.sleep(delay)
            next_t += rng.expovariate(rate)
            tasks.append(asyncio.ensure_future(_one(client, item, t_run)))
        results = await asyncio.gather(*tasks)
        for r in results:
            r["prefill_worker"] = (await client.get_request(r["request_id"])).prefill_worker
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=default_workload_dir())
    ap.add_argument("--rate", type=float, default=1.6)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from splitserve.service.settings import Settings
    from splitserve.stack import Stack

    items = load_workload(os.path.join(args.workloads, "workload_short.jsonl"), args.requests)
    settings = Settings.from_env(prefix_caching=False)
    with Stack(settings) as stack:
        asyncio.run(run(stack.router_address, items[:4], 100.0))  # warm-up
        results = asyncio.run(run(stack.router_address, items, args.rate))
    ttft = [r["ttft_ms"] for r in results]
    cut = percentile(ttft, 95)
    slow = sorted((r for r in results if r["ttft_ms"] >= cut), key=lambda r: -r["ttft_ms"])
    summary = {
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "parts_p50_all": {p: statistics.median(r[p] for r in results) for p in PARTS},
        "parts_p50_slowest_5pct": {p: statistics.median(r[p] for r in slow) for p in PARTS},
        "local_prefill_share_all": sum(not r["prefill_worker"] for r in results) / len(results),
        "local_prefill_share_slowest": sum(not r["prefill_worker"] for r in slow) / len(slow),
    }
    print(
        f"TTFT p50 {summary['ttft_p50_ms']:.1f} ms, p99 {summary['ttft_p99_ms']:.1f} ms; "
        f"prefilled by the decode worker: {summary['local_prefill_share_all']:.0%} of all, "
        f"{summary['local_prefill_share_slowest']:.0%} of the slowest 5%"
    )
    for name in ("parts_p50_all", "parts_p50_slowest_5pct"):
        print(f"  {name}: " + ", ".join(f"{p} {v:.1f}" for p, v in summary[name].items()))
    for r in slow:
        print(
            f"  slow: ttft {r['ttft_ms']:.0f} ms, {r['prompt_tokens']} prompt tokens, "
            f"{'local' if not r['prefill_worker'] else 'prefill worker'}: "
            + ", ".join(f"{p} {r[p]:.1f}" for p in PARTS)
        )
    write_results(args.out, {"rate": args.rate, "requests": len(results), **summary, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
