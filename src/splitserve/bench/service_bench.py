"""The full service against the in-process engine on the same requests.

    python -m splitserve.bench.service_bench [--requests 32] [--light 8] [--out results.json]

Throughput: the first N requests of workload_mixed.jsonl, all submitted at once, greedy,
exactly max_tokens each, through the stack (router + 1 prefill + 1 decode worker) and
through one in-process engine. Light load: one request at a time; the TTFT the service
path adds is the median of (service TTFT - in-process TTFT) over the same prompts.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import time

from splitserve.bench.engine_bench import run_workload
from splitserve.bench.workload import write_results, default_workload_dir, load_workload, percentile
from splitserve.client import Client
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.sampling import SamplingParams
from splitserve.service.settings import Settings
from splitserve.stack import Stack


def service_run(address: str, items) -> dict:
    t0 = time.perf_counter()
    with Client(address) as c, cf.ThreadPoolExecutor(len(items)) as ex:
        futs = [ex.submit(c.generate, token_ids=it.prompt_token_ids, max_tokens=it.max_tokens, ignore_eos=True,
                          timeout=3600) for it in items]
        res = [f.result() for f in futs]
    wall = time.perf_counter() - t0
    tokens = sum(len(r.token_ids) for r in res)
    assert tokens == sum(it.max_tokens for it in items)
    return {"wall_s": wall, "output_tokens": tokens, "output_tok_per_s": tokens / wall,
            "ttft_p50_ms": percentile([r.timings.ttft_ms for r in res], 50)}


def light_ttft_service(address: str, items) -> list[float]:
    out = []
    with Client(address) as c:
        for it in items:
            t = time.perf_counter()
            for chunk in c.generate_stream(token_ids=it.prompt_token_ids, max_tokens=2, ignore_eos=True):
                if chunk.token_ids:
                    out.append((time.perf_counter() - t) * 1000)
                    break
    return out


def light_ttft_engine(engine: LLMEngine, items) -> list[float]:
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=default_workload_dir())
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--light", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    items = load_workload(os.path.join(args.workloads, "workload_mixed.jsonl"), args.requests)
    results: dict = {"requests": len(items)}
    settings = Settings.from_env(threads=args.threads, max_queue_requests=4096, max_queue_tokens=1 << 24)
    with Stack(settings) as stack:
        service_run(stack.router_address, items[:2])  # warm-up
        results["service"] = service_run(stack.router_address, items)
        svc_light = light_ttft_service(stack.router_address, items[: args.light])
    engine = LLMEngine(EngineConfig(num_threads=args.threads))
    run_workload(engine, items[:2])
    results["in_process"] = run_workload(engine, items)
    eng_light = light_ttft_engine(engine, items[: args.light])
    ratio = results["service"]["output_tok_per_s"] / results["in_process"]["output_tok_per_s"]
    added = [s - e for s, e in zip(svc_light, eng_light)]
    results.update(throughput_ratio=ratio, light_ttft_service_ms=svc_light, light_ttft_engine_ms=eng_light,
                   ttft_added_p50_ms=percentile(added, 50))
    print(f"mixed, first {len(items)} requests at once: service {results['service']['output_tok_per_s']:.1f} tok/s, "
          f"in-process {results['in_process']['output_tok_per_s']:.1f} tok/s -> ratio {ratio:.2f}")
    print(f"light load ({args.light} requests one at a time): TTFT service p50 {percentile(svc_light, 50):.1f} ms, "
          f"in-process p50 {percentile(eng_light, 50):.1f} ms, added by the service path p50 "
          f"{results['ttft_added_p50_ms']:.1f} ms")
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
