"""What a client sees when its decode worker, or its router, is lost mid-stream.

A stack of one prefill worker and two decode workers, the real model. Each round sends `--streams`
greedy streams of `--max-tokens` tokens at once (prompts: workload_mixed's first ones). Once every
stream has sent `--at` tokens, the decode worker holding most of them is killed (SIGKILL), or sent
SIGTERM with `--drain-s` (`--sigterm`). Its streams resume on the other worker: the router queues
their prompt and the tokens sent for a prefill again. The worker is then restarted for the next
round. With `--lose router`: two routers and one decode worker, and clients balancing over both
routers with `generate_stream(resumes=1)`; the router holding most streams is lost, and each of its
clients sends its request again with the tokens it has (`resume_from`) to the other router (after
a kill, once the earlier attempt is reaped: the dead router's lease, 10 heartbeats). With `--n` > 1,
each stream is that many seeded samples (temperature 0.8, seed 1000 + its number), each of which
has sent `--at` tokens when the process is lost; each goes on from its own tokens.

Reported, over every round:
- the streams that ended OK, and those whose tokens equal an unbroken run's (greedy or seeded, sent first);
- for each resumed stream, the stall its client saw: the longest gap between two of its messages
  (of one sample: the loss, then a prefill of prompt + tokens sent and the new worker's first step);
- for comparison, the median gap between messages of all streams, and the longest gap of the
  streams on the other worker (they share it with the resumed ones from then on).

    python -m splitserve.bench.resume_bench --rounds 3 --out bench-results/resume.json
    python -m splitserve.bench.resume_bench --rounds 3 --lose router --sigterm --out bench-results/resume-router.json
    python -m splitserve.bench.resume_bench --rounds 3 --lose router --n 2 --out bench-results/resume-router-n2.json
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import threading
import time

import grpc

from splitserve.bench.workload import default_workload_dir, load_workload, percentile, write_results
from splitserve.client import Client
from splitserve.service.settings import Settings
from splitserve.stack import Stack


def _sampling(i: int, n: int) -> dict:
    """Stream i's sampling: greedy, or n seeded samples."""
    return (
        dict(ignore_eos=True, temperature=0.0) if n == 1 else dict(ignore_eos=True, temperature=0.8, n=n, seed=1000 + i)
    )


def _stream(address: str, prompt: str, rid: str, max_tokens: int, sampling: dict, out: dict, resumes: int = 0) -> None:
    """Run one stream; out gets each sample's tokens and the arrival time of each of its messages,
    and the stream's outcome. resumes: the client goes on after its router is lost (over every
    address of a balanced target)."""
    out.update(tokens={}, times={}, sizes={}, outcome=None)
    try:
        with Client(address, balance=bool(resumes)) as c:
            for chunk in c.generate_stream(
                prompt, request_id=rid, max_tokens=max_tokens, timeout=600, resumes=resumes, **sampling
            ):
                out["times"].setdefault(chunk.index, []).append(time.perf_counter())
                out["tokens"].setdefault(chunk.index, []).extend(chunk.token_ids)
                out["sizes"].setdefault(chunk.index, []).append(len(chunk.token_ids))
        out["outcome"] = "OK"
    except grpc.RpcError as e:
        out["outcome"] = f"{e.code().name}: {e.details()}"


def _gaps(times: dict[int, list[float]]) -> list[float]:
    """The gaps between messages of one sample, of every sample."""
    return [(b - a) * 1000 for ts in times.values() for a, b in zip(ts, ts[1:])]


def _unequal(i: int, out: dict, want: dict, lost: bool) -> dict:
    """Where stream i's samples first differ from the unbroken run's, and how many tokens each had
    before its longest gap (a lost stream's stall: the tokens it went on from)."""
    first, before = {}, {}
    for k, w in want.items():
        got = out["tokens"].get(k, [])
        first[k] = next((j for j, (a, b) in enumerate(zip(got, w)) if a != b), min(len(got), len(w)))
        ts, sizes = out["times"].get(k, []), out["sizes"].get(k, [])
        gaps = _gaps({k: ts})
        before[k] = sum(sizes[: gaps.index(max(gaps)) + 1]) if gaps else 0
    return {"stream": i, "lost": lost, "first_differing_token": first, "tokens_before_longest_gap": before}


def _reached(out: dict, n: int, at: int) -> bool:
    tokens = out.get("tokens", {})
    return len(tokens) == n and all(len(t) >= at for t in tokens.values())


def run(args) -> dict:
    prompts = [it.prompt for it in load_workload(os.path.join(args.workloads, "workload_mixed.jsonl"), args.streams)]
    # placement by load alone (prefix affinity would put every stream where the reference run's
    # prompts are cached): both workers hold streams when one is lost
    settings = Settings.from_env(
        threads=args.threads,
        keepalive_s=1.0,
        drain_s=args.drain_s,
        prefix_affinity_slack=-1,
        **({"model": args.model} if args.model else {}),
    )
    rounds = []
    routers = args.lose == "router"
    with (
        Stack(settings, prefill=1, decode=1 if routers else 2, routers=2 if routers else 1) as stack,
        Client(stack.router_address) as c,
    ):
        target = "ipv4:" + ",".join(stack.router_addresses) if routers else stack.router_address
        names = {f"router-{stack.stack_id}": "router", f"router-1-{stack.stack_id}": "router-1"}
        want = []  # by stream: each sample's tokens in an unbroken run
        for i, p in enumerate(prompts):
            one = c.generate(p, max_tokens=args.max_tokens, timeout=600, **_sampling(i, args.n))
            want.append({ch.index: list(ch.token_ids) for ch in one.choices or [one]})
        for r in range(args.rounds):
            time.sleep(2 * settings.heartbeat_s)  # placement by load reads the registry: fresh entries
            outs = [dict() for _ in prompts]
            threads = [
                threading.Thread(
                    target=_stream,
                    args=(target, p, f"r{r}-{i}", args.max_tokens, _sampling(i, args.n), outs[i], int(routers)),
                )
                for i, p in enumerate(prompts)
            ]
            for t in threads:
                t.start()
            deadline = time.time() + 600
            while not all(_reached(o, args.n, args.at) for o in outs):
                if time.time() > deadline or any(o.get("outcome") for o in outs):
                    raise RuntimeError(f"round {r}: the streams did not reach {args.at} tokens")
                time.sleep(0.01)
            if routers:
                red = stack.redis()
                placed = [names[red.hget(stack.keys.req(f"r{r}-{i}"), "router").decode()] for i in range(len(prompts))]
                victim = max(("router", "router-1"), key=placed.count)
            else:
                placed = [c.get_request(f"r{r}-{i}").decode_worker.rsplit("-", 1)[0] for i in range(len(prompts))]
                victim = max(("decode-0", "decode-1"), key=placed.count)
            p = stack.proc(victim)
            if args.sigterm:
                p.popen.send_signal(signal.SIGTERM)
                p.popen.wait(120)
            else:
                p.popen.kill()
                p.popen.wait()
            for t in threads:
                t.join(600)
            lost = [i for i, w in enumerate(placed) if w == victim]
            if routers:  # sent again: a new attempt of its request_id
                resumed = [i for i in lost if int(red.hget(stack.keys.req(f"r{r}-{i}"), "attempts") or 1) > 1]
            else:
                resumed = [i for i in lost if c.get_request(f"r{r}-{i}").resumes]
            rounds.append(
                {
                    "victim": victim,
                    "resumed": resumed,
                    "ok": sum(o["outcome"] == "OK" for o in outs),
                    "equal": sum(o["tokens"] == w for o, w in zip(outs, want)),
                    "unequal": [
                        _unequal(i, o, w, i in lost) for i, (o, w) in enumerate(zip(outs, want)) if o["tokens"] != w
                    ],
                    "outcomes": [o["outcome"] for o in outs],
                    "stall_ms": [max(_gaps(outs[i]["times"])) for i in lost],
                    "other_max_gap_ms": [max(_gaps(outs[i]["times"])) for i in range(len(prompts)) if i not in lost],
                    "gaps_ms": [g for o in outs for g in _gaps(o["times"])],
                }
            )
            stack.restart(victim)
    stalls = [s for rd in rounds for s in rd["stall_ms"]]
    others = [s for rd in rounds for s in rd["other_max_gap_ms"]]
    gaps = [g for rd in rounds for g in rd.pop("gaps_ms")]
    return {
        "settings": {
            "streams": len(prompts),
            "n": args.n,
            "max_tokens": args.max_tokens,
            "at": args.at,
            "rounds": args.rounds,
            "lose": args.lose,
            "signal": "SIGTERM" if args.sigterm else "SIGKILL",
            "drain_s": args.drain_s,
        },
        "rounds": rounds,
        "streams": len(prompts) * args.rounds,
        "ok": sum(rd["ok"] for rd in rounds),
        "equal_to_unbroken": sum(rd["equal"] for rd in rounds),
        "resumed": sum(len(rd["resumed"]) for rd in rounds),
        "lost": len(stalls),
        "stall_ms_p50": statistics.median(stalls) if stalls else float("nan"),
        "stall_ms_max": max(stalls, default=float("nan")),
        "other_worker_max_gap_ms_p50": statistics.median(others) if others else float("nan"),
        "gap_ms_p50": percentile(gaps, 50),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=default_workload_dir())
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--streams", type=int, default=6)
    ap.add_argument("--n", type=int, default=1, help="samples a stream (sampling.n; above 1, seeded)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--at", type=int, default=32, help="tokens every stream has sent when the worker is lost")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lose", choices=["decode", "router"], default="decode", help="the process lost")
    ap.add_argument("--sigterm", action="store_true", help="SIGTERM with --drain-s rather than SIGKILL")
    ap.add_argument("--drain-s", type=float, default=1.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    print(
        "resume benchmark: prefix cache on, as by default: a resumed leg may find its prompt's start in "
        "its new decode worker's cache, as it would in service",
        flush=True,
    )
    res = run(args)
    write_results(args.out, res)
    print(
        f"{res['settings']['lose']}, {res['settings']['signal']}: {res['ok']}/{res['streams']} streams OK, "
        f"{res['equal_to_unbroken']} equal to an unbroken run; {res['resumed']}/{res['lost']} of the lost one's resumed"
    )
    print(
        f"stall seen by a resumed stream: p50 {res['stall_ms_p50']:.0f} ms, max {res['stall_ms_max']:.0f} ms; "
        f"longest gap of a stream on the other one: p50 {res['other_worker_max_gap_ms_p50']:.0f} ms; "
        f"median gap between messages: {res['gap_ms_p50']:.1f} ms"
    )
    return 0 if res["ok"] == res["streams"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
