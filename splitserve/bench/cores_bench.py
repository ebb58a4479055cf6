"""A prefill loop and a decode loop side by side on one host, with and without a core-share board.

    python -m splitserve.bench.cores_bench [--seconds 25] [--rounds 2] [--out results.json]

Two processes run at once for --seconds: one prefills 4 prompts of 500 tokens per
forward again and again (prompt tok/s), the other decodes 32 sequences (decode tok/s),
both with every core (the way a local stack's prefill and decode worker run), started
together once both are loaded and warm. The two variants alternate for --rounds rounds:
``off`` (each engine on every core) and ``board`` (both on one CoreShare board: busy
engines divide the cores). Each process loads the model itself; the figures count only
its measured loop.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from splitserve.bench.workload import default_workload_dir, load_workload, write_results


def _loop(role: str, seconds: float, board: str, workload: str) -> None:
    """One side: print its rate as JSON on stdout."""
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.engine import LLMEngine
    from splitserve.engine.sampling import SamplingParams

    items = load_workload(workload, 32)
    engine = LLMEngine(EngineConfig(core_share=board, prefix_caching=False))  # the same prompts every round
    if role == "prefill":
        prompts = [it.prompt_token_ids[:500] for it in items[:4]]
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        engine.generate(prompts, params)  # warm
        _ready()
        tokens, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            engine.generate(prompts, params)
            tokens += sum(map(len, prompts))
    else:
        params = SamplingParams(max_tokens=4000, ignore_eos=True)
        for i, it in enumerate(items):
            engine.add_request(f"d{i}", it.prompt_token_ids[:64], params)
        for _ in range(4):  # prefill the 32 prompts, then a few warm decode steps
            engine.step()
        _ready()
        tokens, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            tokens += sum(len(o.new_token_ids) for o in engine.step())
    print(json.dumps({"role": role, "tok_per_s": tokens / (time.perf_counter() - t0)}), flush=True)


def _ready() -> None:
    """Tell the parent this side is loaded and warm; start when it says go (both at once)."""
    print("ready", flush=True)
    sys.stdin.readline()


def side_by_side(seconds: float, board: str, workload: str) -> dict:
    env = dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
    procs = {
        role: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "splitserve.bench.cores_bench",
                "--loop",
                role,
                "--seconds",
                str(seconds),
                "--board",
                board,
                "--workload",
                workload,
            ],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for role in ("prefill", "decode")
    }
    for role, p in procs.items():
        if p.stdout.readline().strip() != "ready":
            raise RuntimeError(f"{role} loop did not start")
    for p in procs.values():
        p.stdin.write("go\n")
        p.stdin.flush()
    out = {}
    for role, p in procs.items():
        stdout, _ = p.communicate(timeout=seconds + 600)
        if p.returncode != 0:
            raise RuntimeError(f"{role} loop exited with {p.returncode}")
        out[role] = json.loads(stdout.strip().splitlines()[-1])["tok_per_s"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m splitserve.bench.cores_bench")
    ap.add_argument("--workload", default=os.path.join(default_workload_dir(), "workload_mixed.jsonl"))
    ap.add_argument("--seconds", type=float, default=25.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--loop", choices=("prefill", "decode"), help=argparse.SUPPRESS)
    ap.add_argument("--board", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    print("cores benchmark: prefix cache off (every round sends the same prompts again)", flush=True)
    if args.loop:
        _loop(args.loop, args.seconds, args.board, args.workload)
        return 0
    rows: dict[str, list[dict]] = {"off": [], "board": []}
    with tempfile.TemporaryDirectory(prefix="splitserve-cores-") as tmp:
        for r in range(args.rounds):
            for variant in ("off", "board"):
                got = side_by_side(
                    args.seconds, os.path.join(tmp, f"cores-{r}") if variant == "board" else "", args.workload
                )
                rows[variant].append(got)
                print(
                    f"round {r + 1} {variant:5}: prefill {got['prefill']:.1f} prompt tok/s, "
                    f"decode {got['decode']:.1f} tok/s (32 sequences)",
                    flush=True,
                )
    med = {v: {role: statistics.median(g[role] for g in rows[v]) for role in ("prefill", "decode")} for v in rows}
    for role in ("prefill", "decode"):
        print(
            f"{role}: median off {med['off'][role]:.1f}, board {med['board'][role]:.1f} tok/s "
            f"-> {med['board'][role] / med['off'][role]:.2f}x"
        )
    write_results(args.out, {"seconds": args.seconds, "rounds": rows, "median": med})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
