"""What TLS and bearer tokens cost: a stack with both against one with neither, side by side.

    python -m splitserve.bench.security_bench [--requests 32] [--rounds 2] [--light 160]
        [--light-workload F] [--light-gap-ms 100] [--out results.json]

Two stacks (router + 1 prefill + 1 decode worker each, the default model, prefix cache off) run
at once: `plain` (plaintext, no tokens) and `secure` (TLS on the router's port, mutual TLS on
every internal hop, a tenant's bearer token on every call, checked against the tokens file).
Throughput: the first --requests of workload_mixed.jsonl, all submitted at once, exactly
max_tokens each, through each stack in turn, the order alternating each round; the ratio is the
median of the per-round ratios. Light load: one request at a time, each prompt through both
stacks (alternating which goes first, --light-gap-ms of idleness before each); the TTFT the
security adds is the median of the paired differences, with a bootstrap 95% interval. Each
client keeps its channel open, as services do: the handshake is paid once, not per call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from splitserve.bench.service_bench import light_ttft_service, service_run
from splitserve.bench.workload import default_workload_dir, load_workload, median_interval, percentile, write_results
from splitserve.client import Client
from splitserve.service.settings import Settings
from splitserve.service.tenants import add_token
from splitserve.stack import Stack

SIDES = ("plain", "secure")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=default_workload_dir())
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--light", type=int, default=160, help="light-load pairs (default 160: with 32 the p50's interval spanned 5 ms)"
    )
    ap.add_argument("--light-workload", default="workload_short.jsonl")
    ap.add_argument("--light-gap-ms", type=float, default=100.0)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    items = load_workload(os.path.join(args.workloads, "workload_mixed.jsonl"), max(args.requests, 2))
    prompts = load_workload(os.path.join(args.workloads, args.light_workload))
    light = [prompts[i % len(prompts)] for i in range(max(args.light, 1))]
    heavy = items[: args.requests]
    base = Settings.from_env(
        threads=args.threads, max_queue_requests=4096, max_queue_tokens=1 << 24, prefix_caching=False
    )
    results: dict = {"requests": len(heavy), "rounds": [], "light_workload": args.light_workload}
    with tempfile.TemporaryDirectory(prefix="splitserve-security-bench-") as tmp:
        tokens_file = os.path.join(tmp, "tokens.json")
        token = add_token(tokens_file, "bench")
        with Stack(base) as plain, Stack(base.replace(auth_tokens_file=tokens_file), tls=True) as secure:
            client = {"plain": {}, "secure": {"tls_ca": secure.settings.tls_ca, "token": token}}
            address = {"plain": plain.router_address, "secure": secure.router_address}
            for side in SIDES:  # warm-up
                service_run(address[side], items[:2], **client[side])
            for r in range(args.rounds if args.requests else 0):
                got = {}
                for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                    got[side] = service_run(address[side], heavy, **client[side])
                ratio = got["secure"]["output_tok_per_s"] / got["plain"]["output_tok_per_s"]
                results["rounds"].append({**got, "throughput_ratio": ratio, "first": SIDES[r % 2]})
                print(
                    f"round {r + 1}: mixed, first {len(heavy)} at once: plain {got['plain']['output_tok_per_s']:.1f} "
                    f"tok/s, secure {got['secure']['output_tok_per_s']:.1f} tok/s -> ratio {ratio:.3f}",
                    flush=True,
                )
            ttft: dict[str, list[float]] = {side: [] for side in SIDES}
            with Client(address["plain"]) as p, Client(address["secure"], **client["secure"]) as s:
                clients = {"plain": p, "secure": s}
                for side in SIDES:  # warm path
                    light_ttft_service(clients[side], token_ids=light[0].prompt_token_ids)
                for i, it in enumerate(light[: args.light]):
                    for side in SIDES if i % 2 == 0 else SIDES[::-1]:
                        time.sleep(args.light_gap_ms / 1000)
                        ttft[side].append(light_ttft_service(clients[side], token_ids=it.prompt_token_ids)[0])
    if results["rounds"]:
        results["throughput_ratio"] = statistics.median(r["throughput_ratio"] for r in results["rounds"])
        print(f"throughput secure/plain, median of {len(results['rounds'])} rounds: {results['throughput_ratio']:.3f}")
    added = [s - p for s, p in zip(ttft["secure"], ttft["plain"])]
    lo, hi = median_interval(added)
    results.update(
        light_ttft_ms=ttft,
        ttft_added_ms=added,
        ttft_added_p50_ms=percentile(added, 50),
        ttft_added_p50_interval_ms=(lo, hi),
        light_ttft_p50_ms={side: percentile(v, 50) for side, v in ttft.items()},
    )
    print(
        f"light load ({len(added)} pairs of {args.light_workload}, {args.light_gap_ms:g} ms apart): TTFT p50 plain "
        f"{results['light_ttft_p50_ms']['plain']:.1f} ms, secure {results['light_ttft_p50_ms']['secure']:.1f} ms; "
        f"added by TLS and tokens p50 {results['ttft_added_p50_ms']:.2f} ms (bootstrap 95% interval {lo:.2f} to "
        f"{hi:.2f} ms)"
    )
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
