"""How fast a burst's refusals come back, on a stack that is already busy.

    python -m splitserve.bench.burst_bench [--burst 600] [--busy 8] [--max-tokens 16] [--rounds 2]
        [--out bench-results/burst.json]

Two stacks up at once, each a router, one prefill and one decode worker with the default queue
bounds and the default model: the router's local view on (`local_refusal`, the default) and
off. In each round, on each stack in turn (the order alternating): a closed loop of --busy
streams (workload_mixed, their own max_tokens) keeps it busy; once they run, --burst Generate
calls go at once from one asyncio client (one channel): the prompts of workload_short, in turn,
--max-tokens each. Each call's time is from its send to its answer. Reported: how many were
admitted and refused, the refusals' time at p50, p99 and max, the admitted calls' completion
time, and the busy streams' output tok/s while the burst lasts (admitted work must not slow
down for the refusals). The floor: the same burst against a gRPC server in a process of its
own that refuses every call at once, doing nothing else: what the client and gRPC take.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import time

import grpc

from splitserve.bench.workload import default_workload_dir, load_workload, percentile, write_results
from splitserve.client import AsyncClient


async def _call(client: AsyncClient, item, max_tokens: int) -> tuple[str, float, int, str]:
    t = time.perf_counter()
    try:
        resp = await client.generate(token_ids=item.prompt_token_ids, max_tokens=max_tokens, ignore_eos=True)
        return "OK", time.perf_counter() - t, len(resp.token_ids), ""
    except grpc.RpcError as e:
        return e.code().name, time.perf_counter() - t, 0, e.details() or ""


async def one_round(address: str, burst: list, busy: list, max_tokens: int) -> dict:
    stop = asyncio.Event()
    busy_tokens = [0]

    async def keep_busy(client, items):
        i = 0
        while not stop.is_set():
            item = items[i % len(items)]
            i += 1
            async for chunk in client.generate_stream(
                token_ids=item.prompt_token_ids, max_tokens=item.max_tokens, ignore_eos=True
            ):
                busy_tokens[0] += len(chunk.token_ids)
                if stop.is_set():
                    break

    async with AsyncClient(address) as bg, AsyncClient(address) as client:
        streams = [asyncio.ensure_future(keep_busy(bg, busy[k:] + busy[:k])) for k in range(len(busy))]
        while busy_tokens[0] < 4 * len(busy):  # every stream past its prefill: the stack is busy
            await asyncio.sleep(0.05)
        t0, tok0 = time.perf_counter(), busy_tokens[0]
        results = await asyncio.gather(*(_call(client, it, max_tokens) for it in burst))
        wall = time.perf_counter() - t0
        busy_rate = (busy_tokens[0] - tok0) / wall
        stop.set()
        for s in streams:
            s.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
    refused = [t * 1000 for code, t, _, _ in results if code == "RESOURCE_EXHAUSTED"]
    admitted = [t * 1000 for code, t, _, _ in results if code == "OK"]
    other = sorted({f"{code}: {why}"[:200] for code, _, _, why in results if code not in ("OK", "RESOURCE_EXHAUSTED")})
    return {
        "admitted": len(admitted),
        "refused": len(refused),
        "other_codes": other,
        "refusal_p50_ms": percentile(refused, 50),
        "refusal_p99_ms": percentile(refused, 99),
        "refusal_max_ms": max(refused, default=float("nan")),
        "admitted_p50_ms": percentile(admitted, 50),
        "admitted_tokens": sum(n for code, _, n, _ in results if code == "OK"),
        "other_count": sum(code not in ("OK", "RESOURCE_EXHAUSTED") for code, _, _, _ in results),
        "burst_wall_s": wall,
        "busy_tok_per_s_during_burst": busy_rate,
    }


def _refuse_all(port_out) -> None:
    """A Generation server that refuses every Generate at once (the floor), until killed."""

    async def serve():
        from splitserve_proto.v1 import generation_pb2 as pb

        async def generate(request, context):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue is full")

        handler = grpc.method_handlers_generic_handler(
            "splitserve.v1.Generation",
            {
                "Generate": grpc.unary_unary_rpc_method_handler(
                    generate,
                    request_deserializer=pb.GenerateRequest.FromString,
                    response_serializer=pb.GenerateResponse.SerializeToString,
                )
            },
        )
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((handler,))
        port_out.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


async def floor_round(address: str, burst: list, max_tokens: int) -> dict:
    async with AsyncClient(address) as client:
        results = await asyncio.gather(*(_call(client, it, max_tokens) for it in burst))
    refused = [t * 1000 for code, t, _, _ in results if code == "RESOURCE_EXHAUSTED"]
    return {
        "refused": len(refused),
        "refusal_p50_ms": percentile(refused, 50),
        "refusal_p99_ms": percentile(refused, 99),
        "refusal_max_ms": max(refused, default=float("nan")),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=default_workload_dir())
    ap.add_argument("--burst", type=int, default=600)
    ap.add_argument("--busy", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from splitserve.service.settings import Settings
    from splitserve.stack import Stack

    short = load_workload(os.path.join(args.workloads, "workload_short.jsonl"))
    busy = load_workload(os.path.join(args.workloads, "workload_mixed.jsonl"), args.busy)
    burst = [short[i % len(short)] for i in range(args.burst)]
    settings = Settings.from_env()
    results: dict = {
        "burst": args.burst,
        "busy": args.busy,
        "max_tokens": args.max_tokens,
        "bounds": {
            "max_queue_requests": settings.max_queue_requests,
            "max_queue_tokens": settings.max_queue_tokens,
            "admit_fraction": settings.admit_fraction,
        },
        "rounds": [],
    }
    sides = ("local view on", "local view off")
    ctx = multiprocessing.get_context("spawn")
    port = ctx.Queue()
    floor = ctx.Process(target=_refuse_all, args=(port,), daemon=True)
    floor.start()
    try:
        floor_address = f"127.0.0.1:{port.get(timeout=60)}"
        with Stack(settings.replace(local_refusal=True)) as on, Stack(settings.replace(local_refusal=False)) as off:
            address = {sides[0]: on.router_address, sides[1]: off.router_address}
            for r in range(args.rounds):
                got = {"floor": asyncio.run(floor_round(floor_address, burst, args.max_tokens))}
                print(
                    f"round {r + 1} floor: refusals p50 {got['floor']['refusal_p50_ms']:.1f} ms, p99 "
                    f"{got['floor']['refusal_p99_ms']:.1f} ms",
                    flush=True,
                )
                for side in sides if r % 2 == 0 else sides[::-1]:
                    time.sleep(2)
                    one = got[side] = asyncio.run(one_round(address[side], burst, busy, args.max_tokens))
                    print(
                        f"round {r + 1} {side}: {one['admitted']} admitted, {one['refused']} refused "
                        f"(other: {one['other_codes'] or 'none'}); refusals p50 {one['refusal_p50_ms']:.1f} ms, "
                        f"p99 {one['refusal_p99_ms']:.1f} ms, max {one['refusal_max_ms']:.1f} ms; admitted p50 "
                        f"{one['admitted_p50_ms']:.0f} ms; busy streams {one['busy_tok_per_s_during_burst']:.1f} "
                        f"tok/s during the burst",
                        flush=True,
                    )
                results["rounds"].append(got)
    finally:
        floor.kill()
        floor.join()
    for side in ("floor", *sides):
        results[side] = {
            key: statistics.median(r[side][key] for r in results["rounds"])
            for key in ("refusal_p50_ms", "refusal_p99_ms")
        }
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
