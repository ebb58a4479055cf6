"""KV handoff benchmark: shared memory vs gRPC bytes, against memcpy measured in the same run.

    python -m splitserve.bench.handoff_bench [--reps 7] [--out results.json]

A real decode worker process; this process plays the prefill side with a real
engine and a real arena: it prefills a prompt, exports its KV into the arena, opens
the request's Decode stream and times PutKV (handle, shared memory) or PutKVStream
(bytes in chunks) until it returns, i.e. until the KV sits in the decode worker's pool.
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
from splitserve.service import convert
from splitserve.service.grpc_server import options
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
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.tokens.split(",")]
    settings = Settings.from_env(kv_cache_bytes=1 << 30, heartbeat_s=0.1)
    stack = Stack(settings, prefill=0, decode=1)
    stack.start()
    arena = Arena(f"{stack.settings.shm_prefix}bench-{uuid.uuid4().hex[:6]}", 256 << 20)
    results: dict = {"memcpy_gbps_before": memcpy_gbps(), "sizes": {}}
    try:
        eng = LLMEngine(stack.settings.engine_config("prefill").replace(kv_cache_bytes=512 << 20))
        addr = stack.proc("decode-0").address
        stub = worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(addr, options=options()))
        me = host_id()
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
            row = {}
            for transport in ("shm", "grpc"):
                times, adopt = [], []
                for _ in range(args.reps):
                    rid = f"bench-{uuid.uuid4().hex[:8]}"
                    export.request_id = rid
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
                    t = time.perf_counter()
                    if transport == "shm":
                        resp = stub.PutKV(req, timeout=60)
                    else:
                        step = settings.kv_chunk_bytes

                        def chunks():
                            yield w_pb.KVChunk(header=req, data=bytes(view[:step]))
                            for i in range(step, nbytes, step):
                                yield w_pb.KVChunk(data=bytes(view[i : i + step]))

                        resp = stub.PutKVStream(chunks(), timeout=60)
                    times.append(time.perf_counter() - t)
                    adopt.append(resp.transfer_ms)
                    decode.cancel()
                    _wait_idle(stack)  # each handoff meets an idle decode worker, not a step in progress
                med = percentile(times, 50)
                # ms: PutKV call to answer, as the producer sees it (what holds its region);
                # adopt_ms: inside the decode worker, handle checked -> KV in its paged pool.
                row[transport] = {"ms": med * 1000, "gbps": nbytes / med / 1e9, "adopt_ms": percentile(adopt, 50)}
            row["bytes"] = nbytes
            row["shm_speedup"] = row["grpc"]["ms"] / row["shm"]["ms"]
            results["sizes"][n] = row
            view.release()
            arena.free(off)
            print(
                f"{n:>5} tokens, {nbytes / 1e6:6.1f} MB: "
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
        print(
            f"memcpy (numpy, 256 MB) {mc:.2f} GB/s; shared-memory handoff at {max(sizes)} tokens = "
            f"{100 * big / mc:.0f}% of it",
            flush=True,
        )
    finally:
        arena.close()
        stack.stop()
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
