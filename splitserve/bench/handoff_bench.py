"""KV handoff benchmark: shared memory vs gRPC bytes, against memcpy measured in the same run.

    python -m splitserve.bench.handoff_bench [--reps 7] [--out results.json]
    python -m splitserve.bench.handoff_bench --partial   # the decode worker holds the prompt already

A real decode worker process; this process plays the prefill side with a real
engine and a real arena: it prefills a prompt, exports its KV into the arena, opens
the request's Decode stream and times PutKV (handle, shared memory) or PutKVStream
(bytes in chunks) until it returns, i.e. until the KV sits in the decode worker's pool.

By default each handoff is a full copy: the decode worker's prefix cache is off, and each
repetition has a cache salt of its own, so no block of an earlier one is reused. Every
answer says how many bytes the worker copied (PutKVResponse.copied_bytes); a full copy that
copied fewer is an error, and no rate above the memcpy rate measured in the same run is
reported as a handoff's. --partial leaves the cache on and sends the same prompt again: the
worker then copies only what it does not hold, a separate figure, labelled so.
"""

from __future__ import annotations

import argparse
import time
import uuid

import grpc
import numpy as np

from splitserve.bench.workload import percentile, write_results
from splitserve.engine.engine import LLMEngine
from splitserve.engine.sampling import SamplingParams
from splitserve.handoff.arena import Arena
from splitserve.handoff.layout import HEADER_SIZE
from splitserve.service import convert, redis_scripts
from splitserve.service.grpc_server import options
from splitserve.service.redis_state import WorkerInfo
from splitserve.service.settings import Settings, host_id
from splitserve.stack import Stack
from splitserve_proto.v1 import worker_pb2 as w_pb
from splitserve_proto.v1 import worker_pb2_grpc


def memcpy_gbps(nbytes: int = 256 << 20, reps: int = 7) -> float:
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return nbytes / percentile(times, 50) / 1e9


def _wait_idle(stack, timeout: float = 10.0) -> None:
    r = stack.redis()
    key = stack.keys.worker("decode", f"decode-0-{stack.stack_id}")
    end = time.time() + timeout
    time.sleep(stack.settings.heartbeat_s)  # let a heartbeat after the cancel land
    while time.time() < end:
        m = r.hgetall(key)
        if m and int(m[b"running"]) == 0 and int(m[b"pending"]) == 0:
            return
        time.sleep(0.05)
    raise TimeoutError("decode worker did not go idle")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tokens", default="128,512,2048")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--partial",
        action="store_true",
        help="prefix cache on and the same prompt each time: the worker copies only what it lacks",
    )
    ap.add_argument(
        "--prefix-cache",
        choices=("on", "off"),
        default=None,
        help="the decode worker's prefix cache (default: off, or on with --partial)",
    )
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.tokens.split(",")]
    cache_on = args.prefix_cache == "on" if args.prefix_cache else args.partial
    mode = "partial" if args.partial else "full"
    print(
        f"handoff benchmark: {mode} copies; the decode worker's prefix cache is {'on' if cache_on else 'off'}"
        + ("" if args.partial else "; each repetition has a cache salt of its own"),
        flush=True,
    )
    settings = Settings.from_env(kv_cache_bytes=1 << 30, heartbeat_s=0.1)
    stack = Stack(settings, prefill=0, decode=1, decode_env={"SPLITSERVE_PREFIX_CACHING": str(cache_on).lower()})
    stack.start()
    arena = Arena(f"{stack.settings.shm_prefix}bench-{uuid.uuid4().hex[:6]}", 256 << 20)
    results: dict = {"mode": mode, "prefix_cache": cache_on, "memcpy_gbps_before": memcpy_gbps(), "sizes": {}}
    try:
        eng = LLMEngine(stack.settings.engine_config("prefill").replace(kv_cache_bytes=512 << 20))
        addr = stack.proc("decode-0").address
        stub = worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(addr, options=options()))
        me = host_id()
        # registered as a prefill worker of this host: a decode worker maps only such arenas
        bench = WorkerInfo(worker_id="bench-handoff", role="prefill", address="-", host_id=me, arena=arena.name)
        redis_scripts.Scripts(stack.redis()).run(redis_scripts.heartbeat(stack.keys, info=bench, lease_s=3600))
        for n in sizes:
            prompt = [(7 * i) % 40000 + 100 for i in range(n)]
            eng.add_request("kv", prompt, SamplingParams(max_tokens=2, ignore_eos=True), prefill_only=True)
            while "kv" not in eng.parked:
                eng.step()
            nbytes = eng.kv_nbytes("kv")
            off = arena.alloc(nbytes)
            view = arena.view(off, nbytes)
            export = eng.export_kv("kv", view)
            eng.release("kv")
            body = nbytes - HEADER_SIZE  # what a full copy copies

            def handoff(transport: str) -> tuple[float, float, int]:
                """One handoff of this KV: (seconds from PutKV's call to its answer, the worker's
                adopt time in ms, the bytes it copied)."""
                rid = f"bench-{uuid.uuid4().hex[:8]}"
                export.request_id = rid
                export.cache_salt = "" if args.partial else rid  # full: no block of an earlier one is shared
                seq = convert.sequence_to_pb(export)
                h = w_pb.KVHandle(
                    arena=arena.name if transport == "shm" else "",
                    offset=off,
                    length=nbytes,
                    num_tokens=export.num_tokens,
                    layout_version=export.layout_version,
                    dtype=export.dtype,
                    fingerprint=export.fingerprint,
                    host_id=me,
                    transport=transport,
                    lease_deadline_unix=time.time() + 60,
                )
                decode = stub.Decode(w_pb.DecodeRequest(request_id=rid, prompt_tokens=n))
                assert next(decode).accepted
                req = w_pb.PutKVRequest(sequence=seq, handle=h)
                step = settings.kv_chunk_bytes

                def chunks():
                    yield w_pb.KVChunk(header=req, data=bytes(view[:step]))
                    for i in range(step, nbytes, step):
                        yield w_pb.KVChunk(data=bytes(view[i : i + step]))

                t = time.perf_counter()
                if transport == "shm":
                    resp = stub.PutKV(req, timeout=60)
                else:
                    resp = stub.PutKVStream(chunks(), timeout=60)
                took = time.perf_counter() - t
                if not args.partial and resp.copied_bytes != body:
                    raise RuntimeError(
                        f"{transport} handoff of {n} tokens copied {resp.copied_bytes} of {body} bytes "
                        f"(the worker held {resp.shared_tokens} tokens): not a full copy"
                    )
                decode.cancel()
                _wait_idle(stack)  # each handoff meets an idle decode worker, not a step in progress
                return took, resp.transfer_ms, resp.copied_bytes

            # The two transports alternate, each repetition starting with the other one.
            got: dict[str, list] = {"shm": [], "grpc": []}
            for rep in range(args.reps):
                for transport in ("shm", "grpc") if rep % 2 == 0 else ("grpc", "shm"):
                    got[transport].append(handoff(transport))
            row = {}
            for transport, runs in got.items():
                times, adopt, copied = zip(*runs)
                med = percentile(list(times), 50)
                # ms: PutKV call to answer, as the producer sees it (what holds its region);
                # adopt_ms: inside the decode worker, handle checked -> KV in its paged pool.
                row[transport] = {
                    "ms": med * 1000,
                    "gbps": percentile(list(copied), 50) / med / 1e9,  # of the bytes the worker copied
                    "adopt_ms": percentile(list(adopt), 50),
                    "copied_bytes": percentile(list(copied), 50),
                }
            row["bytes"] = nbytes
            row["kv_bytes"] = body
            row["shm_speedup"] = row["grpc"]["ms"] / row["shm"]["ms"]
            results["sizes"][n] = row
            view.release()
            arena.free(off)
            print(
                f"{n:>5} tokens, {body / 1e6:6.1f} MB of KV, copied {row['shm']['copied_bytes'] / 1e6:6.1f} MB: "
                f"shm {row['shm']['ms']:7.2f} ms ({row['shm']['gbps']:5.2f} GB/s) "
                f"| grpc {row['grpc']['ms']:7.2f} ms ({row['grpc']['gbps']:5.2f} GB/s) "
                f"| shm {row['shm_speedup']:.1f}x faster "
                f"| adopt in worker: shm {row['shm']['adopt_ms']:.2f} ms, grpc {row['grpc']['adopt_ms']:.2f} ms",
                flush=True,
            )
        results["memcpy_gbps_after"] = memcpy_gbps()
        mc = (results["memcpy_gbps_before"] + results["memcpy_gbps_after"]) / 2
        results["memcpy_gbps"] = mc
        big = results["sizes"][max(sizes)]["shm"]["gbps"]
        fastest = max(row[t]["gbps"] for row in results["sizes"].values() for t in ("shm", "grpc"))
        if fastest > max(results["memcpy_gbps_before"], results["memcpy_gbps_after"]):
            print(
                f"refused: a handoff rate of {fastest:.2f} GB/s is above the memcpy rate measured in this run "
                f"({mc:.2f} GB/s); a copy cannot beat memcpy, so these are not handoff rates",
                flush=True,
            )
            results["refused"] = True
            write_results(args.out, results)
            return 1
        print(
            f"memcpy (numpy, 256 MB) {mc:.2f} GB/s; shared-memory handoff at {max(sizes)} tokens = "
            f"{100 * big / mc:.0f}% of it ({mode} copies)",
            flush=True,
        )
    finally:
        arena.close()
        stack.stop()
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
