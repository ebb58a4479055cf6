"""The full service against the in-process engine on the same requests, side by side.

    python -m splitserve.bench.service_bench [--requests 32] [--rounds 2] [--light 64] [--light-workload F]
        [--light-gap-ms 100] [--mode M] [--out results.json]

Throughput: the first N requests of workload_mixed.jsonl, all submitted at once, greedy,
exactly max_tokens each, through the stack (router + 1 prefill + 1 decode worker, or with
--mode colocated router + 1 decode worker that prefills as well) and
through one in-process engine, alternated for --rounds rounds; the ratio is the median
of the per-round ratios. Light load: one request at a time, each prompt sent through
the service and through the in-process engine (alternating which goes first); the TTFT the service path adds is
the median of the paired differences. The stack stays up (idle) while the in-process
engine runs, so both see the same machine, and each measurement starts after
--light-gap-ms of idleness: right after a forward, the OpenMP threads of the side just
measured still spin for a while and take a core from the other (workload_short: the
in-process engine's lingering spin made the service's forward 3.9-6.9 ms slower than its
own with no gap, 96 pairs a run; -0.5 ms with 100 ms, 64 pairs).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import statistics
import time

from splitserve.bench.engine_bench import light_ttft as light_ttft_engine
from splitserve.bench.engine_bench import run_workload
from splitserve.bench.workload import default_workload_dir, load_workload, median_interval, percentile, write_results
from splitserve.client import Client
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.service.settings import Settings
from splitserve.stack import Stack


def service_run(address: str, items, **client) -> dict:
    """items all sent at once to the router at address (Client's keywords: tls_ca, token), greedy,
    exactly max_tokens each: throughput, TTFT p50 and how many were prefilled by their decode worker."""
    t0 = time.perf_counter()
    with Client(address, **client) as c, cf.ThreadPoolExecutor(len(items)) as ex:
        futs = [
            ex.submit(
                c.generate, token_ids=it.prompt_token_ids, max_tokens=it.max_tokens, ignore_eos=True, timeout=3600
            )
            for it in items
        ]
        res = [f.result() for f in futs]
        wall = time.perf_counter() - t0
        # prefilled by their decode worker (colocated, or conditional disaggregation): no prefill worker named
        local = sum(not c.get_request(r.request_id).prefill_worker for r in res)
    tokens = sum(len(r.token_ids) for r in res)
    assert tokens == sum(it.max_tokens for it in items)
    return {
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tok_per_s": tokens / wall,
        "ttft_p50_ms": percentile([r.timings.ttft_ms for r in res], 50),
        "prefilled_locally": local,
    }


def light_ttft_service(client: Client, max_tokens: int = 2, with_text: bool = False, **request) -> tuple:
    """Client-side TTFT in ms of one streamed request (build_request's keywords, EOS ignored
    unless ignore_eos=False), and its last message (and, with_text, the completion's text)."""
    t = time.perf_counter()
    first = None
    last = None
    texts = []
    request.setdefault("ignore_eos", True)
    for chunk in client.generate_stream(max_tokens=max_tokens, timeout=3600, **request):
        if chunk.token_ids and first is None:
            first = (time.perf_counter() - t) * 1000
        texts.append(chunk.text)
        last = chunk
    return (first, last, "".join(texts)) if with_text else (first, last)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=default_workload_dir())
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--light",
        type=int,
        default=64,
        help="light-load pairs (default 64: a pair's difference moves by tens of ms with the "
        "forward's noise, and the p50 of 16 pairs ranged 11-30 ms across runs); more pairs "
        "than the workload has prompts go round it again",
    )
    ap.add_argument(
        "--light-workload",
        default="workload_mixed.jsonl",
        help="the light-load prompts, a file in --workloads (default workload_mixed.jsonl; "
        "workload_short.jsonl's short forwards leave the path's own cost less noise)",
    )
    ap.add_argument(
        "--light-gap-ms",
        type=float,
        default=100.0,
        help="idle time before each light-load measurement (default 100 ms), so that neither side "
        "starts while the threads of the one measured before it still spin",
    )
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--mode", choices=("disaggregated", "colocated"), default="disaggregated")
    ap.add_argument(
        "--worker-env",
        action="append",
        default=[],
        metavar="ROLE:NAME=VALUE",
        help="an environment variable for the stack's prefill or decode workers (for A/B runs), "
        "e.g. decode:GOMP_SPINCOUNT=30000; may be repeated",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    print(
        "service benchmark: prefix cache off in the stack and in the in-process engine (the warm-up and "
        "every round send the same prompts again)",
        flush=True,
    )
    items = load_workload(os.path.join(args.workloads, "workload_mixed.jsonl"), max(args.requests, 2))
    prompts = load_workload(os.path.join(args.workloads, args.light_workload))
    light = [prompts[i % len(prompts)] for i in range(max(args.light, 1))]  # more pairs than prompts: round again
    heavy = items[: args.requests]
    results: dict = {"requests": len(heavy), "mode": args.mode, "rounds": []}
    # No prefix cache on either side: the rounds and the light pairs send the same prompts again.
    settings = Settings.from_env(
        threads=args.threads, max_queue_requests=4096, max_queue_tokens=1 << 24, mode=args.mode, prefix_caching=False
    )
    worker_env: dict[str, dict[str, str]] = {"prefill": {}, "decode": {}}
    for spec in args.worker_env:
        role, _, kv = spec.partition(":")
        name, eq, value = kv.partition("=")
        if role not in worker_env or not name or not eq:
            ap.error(f"--worker-env wants ROLE:NAME=VALUE with ROLE prefill or decode, got {spec!r}")
        worker_env[role][name] = value
    with Stack(
        settings,
        prefill=0 if args.mode == "colocated" else 1,
        prefill_env=worker_env["prefill"],
        decode_env=worker_env["decode"],
    ) as stack:
        engine = LLMEngine(EngineConfig(num_threads=args.threads, device=settings.device, prefix_caching=False))
        service_run(stack.router_address, items[:2])  # warm-up
        run_workload(engine, items[:2])
        for r in range(args.rounds if args.requests else 0):
            svc = service_run(stack.router_address, heavy)
            eng = run_workload(engine, heavy)
            ratio = svc["output_tok_per_s"] / eng["output_tok_per_s"]
            results["rounds"].append({"service": svc, "in_process": eng, "throughput_ratio": ratio})
            print(
                f"round {r + 1}: mixed, first {len(heavy)} requests at once: service {svc['output_tok_per_s']:.1f} "
                f"tok/s, in-process {eng['output_tok_per_s']:.1f} tok/s -> ratio {ratio:.2f} "
                f"({svc['prefilled_locally']} prefilled by the decode worker)",
                flush=True,
            )
        svc_light, eng_light, parts = [], [], []
        with Client(stack.router_address) as c:
            light_ttft_service(c, token_ids=light[0].prompt_token_ids)  # warm path
            light_ttft_engine(engine, light[:1])

            def in_process(it) -> None:
                eng_light.append(light_ttft_engine(engine, [it])[0])

            def service(it) -> None:
                ttft, last = light_ttft_service(c, token_ids=it.prompt_token_ids)
                timings = last.timings
                svc_light.append(ttft)
                parts.append(
                    {
                        k: getattr(timings, k)
                        for k in (
                            "admission_ms",
                            "queue_ms",
                            "prefill_ms",
                            "first_token_ms",
                            "kv_transfer_ms",
                            "ttft_ms",
                        )
                    }
                )

            for i, it in enumerate(light[: args.light]):  # the order alternates, so neither side goes warm
                for measure in (in_process, service) if i % 2 else (service, in_process):
                    time.sleep(args.light_gap_ms / 1000)
                    measure(it)
    if results["rounds"]:
        results["throughput_ratio"] = statistics.median(r["throughput_ratio"] for r in results["rounds"])
        print(f"throughput ratio, median of {len(results['rounds'])} rounds: {results['throughput_ratio']:.2f}")
    if svc_light:
        added = [s - e for s, e in zip(svc_light, eng_light)]
        outside = [s - p["prefill_ms"] for s, p in zip(svc_light, parts)]
        results.update(
            light_workload=args.light_workload,
            light_gap_ms=args.light_gap_ms,
            light_ttft_service_ms=svc_light,
            light_ttft_engine_ms=eng_light,
            light_parts=parts,
            ttft_added_ms=added,
            ttft_added_p50_ms=percentile(added, 50),
            ttft_added_p50_interval_ms=median_interval(added),
            outside_prefill_p50_ms=percentile(outside, 50),
        )
        # Pair i measured the service first when i is even. Apart, the two orders show whether the side
        # measured second ran slower (100 ms apart, one run: 4.8 ms service first, 14.3 in-process first).
        by_order = {
            "service_first": percentile(added[0::2], 50),
            "in_process_first": percentile(added[1::2], 50) if len(added) > 1 else None,
        }
        results["ttft_added_p50_by_order_ms"] = by_order
        med = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
        lo, hi = results["ttft_added_p50_interval_ms"]
        print(
            f"light load ({len(svc_light)} requests of {args.light_workload} one at a time, "
            f"{args.light_gap_ms:g} ms apart, each also in-process): TTFT service p50 "
            f"{percentile(svc_light, 50):.1f} ms, in-process p50 {percentile(eng_light, 50):.1f} ms, added by the "
            f"service path p50 {results['ttft_added_p50_ms']:.1f} ms (paired; bootstrap 95% interval of that p50 "
            f"{lo:.1f} to {hi:.1f} ms)"
        )
        if by_order["in_process_first"] is not None:
            print(
                f"  added p50 by order: service measured first {by_order['service_first']:.1f} ms, in-process "
                f"first {by_order['in_process_first']:.1f} ms"
            )
        print(
            f"  service TTFT outside the prefill forward p50 {results['outside_prefill_p50_ms']:.1f} ms; parts p50: "
            + ", ".join(f"{k} {v:.1f}" for k, v in med.items())
        )
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
