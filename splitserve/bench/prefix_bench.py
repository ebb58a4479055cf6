"""Prefix cache benchmark: chats that share a long system prompt, with the cache on and off.

    python -m splitserve.bench.prefix_bench [--requests 32] [--rounds 2] [--service] [--out results.json]

Every request is a chat: the same system message (the passage of workload_mixed's longest
prompt) and a user turn built from one of workload_short's prompts, rendered with the model's
chat template; each generates exactly --max-tokens (greedy, EOS ignored). Two in-process
engines on the same weights, one with the prefix cache and one without, alternate for
--rounds rounds; the cache is emptied before each of its runs, so only the requests of that
run share it. Each run measures:
- throughput: every request submitted at once (engine_bench.run_workload: output tok/s,
  wall time, prompt tokens computed and found in the cache);
- TTFT at light load: --light requests one at a time (p50), after one that is not counted
  (with the cache on, it fills the cache with the system prompt).

--service: the same through a stack over gRPC (router, 1 prefill worker, 1 decode worker,
the prefix cache on), the chats sent as messages. The cache is turned "off" for a run by
cache_salt: every request of that run gets a salt of its own, so none finds another's blocks,
while in an "on" run all share one salt, new for the run (so each run starts cold, like the
in-process ones). TTFT is the client's (streamed); the prompt tokens found in the cache are
the sum of the clients' usage.cached_tokens.

--multi-turn: chats of --turns turns, each turn up to --max-tokens (ending at EOS, as a chat's
do; the same system message; each later turn's user message is
another of workload_short's prompts, after the last turn's completion as the assistant's
message) through two disaggregated stacks side by side, each with 1 prefill and 2 decode
workers: "affinity" (the router places a turn on the decode worker that ran the chat's last
turn, within prefix_affinity_slack 8, and that worker prefills what its cache lacks when that
is at most --local-tokens tokens: local_prefill_max_tokens) and "by load" (prefix_affinity_slack
-1, local_prefill_max_tokens 0: every turn goes to the prefill worker, whose cache has the
chat's earlier prompt, and its whole KV is handed over). --requests chats at once, each sending
its turns one after another; runs alternate between the stacks, each under a salt of its own
(a cold cache). Measured: wall time, TTFT of the turns after the first (p50, p90), the prompt
tokens found in a cache, and how many turns their decode worker prefilled.

--partial-kv: the same chats through two stacks of 1 prefill and 1 decode worker that hand KV
over as bytes (kv_transport grpc, or --kv-transport shm: written to the shared-memory region;
local_prefill_max_tokens 0, so every turn goes to the prefill worker): "partial" (prefix
affinity on: the KV of a chat's last turn, which the decode worker holds, is not sent) and
"whole" (prefix_affinity_slack -1: all of it is). With one decode worker both place every turn
alike; they differ only in the bytes sent. Measured besides: the KV bytes received (GetRequest's
kv_bytes) and the later turns' KV transfer time (p50).

--prefill-affinity: the same chats through two stacks of 2 prefill workers and 1 decode worker
(local_prefill_max_tokens 0: every turn goes to a prefill worker; prefix affinity on):
"prefill affinity" (prefill_affinity_jobs 4: a turn is queued for the prefill worker that
prefilled the chat's last turn) and "shared queue" (prefill_affinity_jobs 0: whichever worker
pulls first). Measured besides: how many later turns the same prefill worker prefilled as the
turn before.

--shared-records: the same chats through two stacks of 1 prefill worker, 2 decode workers and 2
routers, each turn of a chat sent to the other router than its last (as a load balancer in
front of several routers may), prefix affinity on in both (as --multi-turn's "affinity"):
"shared" (the routers share their prefix records: share_prefix_records) and "unshared" (each
router knows only the turns it placed itself).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import os
import statistics
import time

import torch

from splitserve.bench.engine_bench import light_ttft, run_workload
from splitserve.bench.workload import WorkItem, default_workload_dir, load_workload, percentile, write_results
from splitserve.engine.config import EngineConfig, ModelSpec
from splitserve.engine.engine import LLMEngine
from splitserve.engine.loader import load_model

SYSTEM_INTRO = "You are a helpful assistant. Answer with the help of this reference text.\n\n"


def chats(workloads: str, n: int) -> list[list[dict[str, str]]]:
    longest = max(
        load_workload(os.path.join(workloads, "workload_mixed.jsonl")), key=lambda it: len(it.prompt_token_ids)
    )
    passage = longest.prompt.split("\n\n", 1)[1].split("<|im_end|>", 1)[0]
    questions = [it.prompt for it in load_workload(os.path.join(workloads, "workload_short.jsonl"), n)]
    return [
        [
            {"role": "system", "content": SYSTEM_INTRO + passage},
            {"role": "user", "content": f"What does this mean? {q}"},
        ]
        for q in questions
    ]


def service(args, convs: list) -> dict:
    """The runs through a stack: see the module's docstring."""
    from splitserve.bench.service_bench import light_ttft_service
    from splitserve.client import Client
    from splitserve.service.settings import Settings
    from splitserve.stack import Stack

    settings = Settings.from_env(
        threads=args.threads, max_queue_requests=4096, max_queue_tokens=1 << 24, prefix_caching=True
    )
    results: dict = {"mode": "service", "threads": args.threads, "rounds": []}
    with Stack(settings, prefill=1) as stack, Client(stack.router_address) as c:

        def send(chat, salt: str, max_tokens: int):
            """(client-side TTFT in ms, the last message)."""
            return light_ttft_service(c, max_tokens, messages=chat, cache_salt=salt)

        send(convs[-1], "warm-up", 2)
        for r in range(args.rounds):
            rnd = {}
            for name in ("cache on", "cache off") if r % 2 == 0 else ("cache off", "cache on"):

                def salt(kind: str, i: int) -> str:
                    return f"{kind}-{r}" if name == "cache on" else f"{kind}-{r}-{i}"

                n = args.requests
                t0 = time.perf_counter()
                with cf.ThreadPoolExecutor(n) as ex:
                    got = list(ex.map(lambda i: send(convs[i], salt("heavy", i), args.max_tokens)[1], range(n)))
                wall = time.perf_counter() - t0
                tokens = sum(m.usage.completion_tokens for m in got)
                assert tokens == n * args.max_tokens, tokens
                light = [send(convs[i], salt("light", i), 2) for i in range(args.light + 1)][1:]
                t = rnd[name] = {
                    "wall_s": wall,
                    "output_tokens": tokens,
                    "output_tok_per_s": tokens / wall,
                    "prompt_tokens": sum(m.usage.prompt_tokens for m in got),
                    "prefix_cache_tokens": sum(m.usage.cached_tokens for m in got),
                    "ttft_ms": [f for f, _ in light],
                    "ttft_p50_ms": percentile([f for f, _ in light], 50),
                    "light_cached_tokens": [m.usage.cached_tokens for _, m in light],
                }
                print(
                    f"round {r + 1} {name:>9}: {n} at once {t['output_tok_per_s']:6.1f} tok/s ({wall:.1f} s, "
                    f"{t['prefix_cache_tokens']} of {t['prompt_tokens']} prompt tokens from the cache); one at a "
                    f"time TTFT p50 {t['ttft_p50_ms']:.0f} ms",
                    flush=True,
                )
            results["rounds"].append(rnd)
    return results


def multi_turn(args, convs: list) -> dict:
    """Chats of several turns through two stacks: prefix affinity and without (--multi-turn), KV
    sent without what the decode worker holds and whole (--partial-kv), prefix records shared
    between two routers and not (--shared-records), or prefill workers chosen by their prefix
    caches and not (--prefill-affinity); see the module's docstring."""
    from splitserve.bench.service_bench import light_ttft_service
    from splitserve.client import Client
    from splitserve.service.settings import Settings
    from splitserve.stack import Stack

    base = Settings.from_env(
        threads=args.threads, max_queue_requests=4096, max_queue_tokens=1 << 24, prefix_caching=True
    )
    routers = 2 if args.shared_records else 1
    if args.shared_records:
        affinity = base.replace(prefix_affinity_slack=8, local_prefill_max_tokens=args.local_tokens)
        configs = {
            "shared": affinity.replace(share_prefix_records=True),
            "unshared": affinity.replace(share_prefix_records=False),
        }
    elif args.prefill_affinity:
        disagg = base.replace(prefix_affinity_slack=8, local_prefill_max_tokens=0)
        configs = {
            "prefill affinity": disagg.replace(prefill_affinity_jobs=4),
            "shared queue": disagg.replace(prefill_affinity_jobs=0),
        }
    elif args.partial_kv:
        one_way = base.replace(kv_transport=args.kv_transport, local_prefill_max_tokens=0)
        configs = {
            "partial": one_way.replace(prefix_affinity_slack=8),
            "whole": one_way.replace(prefix_affinity_slack=-1),
        }
    else:
        configs = {
            "affinity": base.replace(prefix_affinity_slack=8, local_prefill_max_tokens=args.local_tokens),
            "by load": base.replace(prefix_affinity_slack=-1, local_prefill_max_tokens=0),
        }
    follow_ups = [c[1]["content"] for c in convs]
    mode = (
        "shared-records"
        if args.shared_records
        else "partial-kv"
        if args.partial_kv
        else "prefill-affinity"
        if args.prefill_affinity
        else "multi-turn"
    )
    results: dict = {
        "mode": mode,
        "threads": args.threads,
        "turns": args.turns,
        "routers": routers,
        "kv_transport": configs[next(iter(configs))].kv_transport,
        "local_prefill_max_tokens": args.local_tokens,
        "rounds": [],
    }
    with contextlib.ExitStack() as es:
        clients = {}
        for name, settings in configs.items():
            stack = es.enter_context(
                Stack(
                    settings,
                    prefill=2 if args.prefill_affinity else 1,
                    decode=1 if args.partial_kv or args.prefill_affinity else 2,
                    routers=routers,
                )
            )
            clients[name] = [es.enter_context(Client(a)) for a in stack.router_addresses]
            for c in clients[name]:
                light_ttft_service(c, 2, messages=convs[-1], cache_salt="warm-up")

        def chat(cs, i: int, salt: str) -> list:
            """One chat's turns, one after another, each through the next of the routers' clients cs:
            [(TTFT ms, last message, request id)]."""
            messages, out = list(convs[i][:2]), []
            for turn in range(args.turns):
                rid = f"{salt}-{i}-{turn}"
                c = cs[(i + turn) % len(cs)]
                ttft, last, text = light_ttft_service(
                    c,
                    args.max_tokens,
                    with_text=True,
                    messages=messages,
                    cache_salt=salt,
                    request_id=rid,
                    ignore_eos=False,
                )
                out.append((ttft, last, rid))
                messages += [
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": follow_ups[(i + turn + 1) % len(follow_ups)]},
                ]
            return out

        for r in range(args.rounds):
            rnd = {}
            for name in list(configs) if r % 2 == 0 else list(configs)[::-1]:
                cs, salt = clients[name], f"run{r}-{name.replace(' ', '-')}"
                c = cs[0]
                t0 = time.perf_counter()
                with cf.ThreadPoolExecutor(args.requests) as ex:
                    got = list(ex.map(lambda i: chat(cs, i, salt), range(args.requests)))
                wall = time.perf_counter() - t0
                later = [ttft for turns in got for ttft, _, _ in turns[1:]]
                infos = [c.get_request(rid) for turns in got for _, _, rid in turns]
                msgs = [m for turns in got for _, m, _ in turns]
                t = rnd[name] = {
                    "wall_s": wall,
                    "turns": len(infos),
                    "output_tokens": sum(m.usage.completion_tokens for m in msgs),
                    "prompt_tokens": sum(m.usage.prompt_tokens for m in msgs),
                    "prefix_cache_tokens": sum(m.usage.cached_tokens for m in msgs),
                    "prefilled_by_decode_worker": sum(1 for i in infos if not i.prefill_worker),
                    "later_ttft_ms": later,
                    "ttft_p50_ms": percentile(later, 50),
                    "ttft_p90_ms": percentile(later, 90),
                    "kv_bytes": sum(i.kv_bytes for i in infos),
                    "later_same_prefill_worker": sum(
                        a.prefill_worker == b.prefill_worker != ""
                        for k in range(0, len(infos), args.turns)
                        for a, b in zip(infos[k : k + args.turns], infos[k + 1 : k + args.turns])
                    ),
                    "later_kv_transfer_p50_ms": percentile(
                        [m.timings.kv_transfer_ms for turns in got for _, m, _ in turns[1:]], 50
                    ),
                }
                t["output_tok_per_s"] = t["output_tokens"] / wall
                print(
                    f"round {r + 1} {name:>8}: {args.requests} chats x {args.turns} turns in {wall:.1f} s "
                    f"({t['output_tok_per_s']:.1f} tok/s); later turns' TTFT p50 {t['ttft_p50_ms']:.0f} ms, p90 "
                    f"{t['ttft_p90_ms']:.0f} ms; {t['prefix_cache_tokens']} of {t['prompt_tokens']} prompt tokens "
                    f"from a cache; {t['prefilled_by_decode_worker']} of {t['turns']} turns prefilled by their "
                    f"decode worker; {t['kv_bytes'] / 1e6:.0f} MB of KV received, later turns' KV transfer "
                    f"p50 {t['later_kv_transfer_p50_ms']:.1f} ms; {t['later_same_prefill_worker']} of "
                    f"{len(later)} later turns prefilled by the prefill worker of the turn before",
                    flush=True,
                )
            results["rounds"].append(rnd)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=default_workload_dir())
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--light", type=int, default=16, help="requests one at a time, for TTFT")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--service", action="store_true", help="through a stack over gRPC (see above)")
    ap.add_argument("--multi-turn", action="store_true", help="chats of several turns, prefix affinity on and off")
    ap.add_argument(
        "--partial-kv",
        action="store_true",
        help="chats of several turns, KV as bytes without what the decode worker holds, and whole",
    )
    ap.add_argument(
        "--kv-transport",
        choices=("grpc", "shm"),
        default="grpc",
        help="--partial-kv: how the KV goes to the decode worker",
    )
    ap.add_argument(
        "--shared-records",
        action="store_true",
        help="chats whose turns alternate between two routers, prefix records shared and not",
    )
    ap.add_argument(
        "--prefill-affinity",
        action="store_true",
        help="chats of several turns over two prefill workers, each turn queued for the one that "
        "prefilled the turn before, and not",
    )
    ap.add_argument("--turns", type=int, default=4, help="--multi-turn: turns per chat")
    ap.add_argument(
        "--local-tokens", type=int, default=256, help="--multi-turn: local_prefill_max_tokens of the affinity stack"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    print(
        "prefix benchmark: the prefix cache is what is measured; runs that must not find each other's "
        "blocks send a cache salt each",
        flush=True,
    )
    for flag, value in (
        ("--requests", args.requests),
        ("--light", args.light),
        ("--max-tokens", args.max_tokens),
        ("--rounds", args.rounds),
    ):
        if value < 1:
            ap.error(f"{flag} must be >= 1, got {value}")

    if args.turns < 2 or args.local_tokens < 1:
        ap.error("--turns must be >= 2 and --local-tokens >= 1")
    if args.multi_turn or args.partial_kv or args.shared_records or args.prefill_affinity:
        results = multi_turn(args, chats(args.workloads, max(args.requests, args.light + 1)))
        on, off = (
            ("partial", "whole")
            if args.partial_kv
            else ("shared", "unshared")
            if args.shared_records
            else ("prefill affinity", "shared queue")
            if args.prefill_affinity
            else ("affinity", "by load")
        )
        ttft = "later turns' TTFT p50"
    elif args.service:
        results = service(args, chats(args.workloads, max(args.requests, args.light + 1)))
        on, off, ttft = "cache on", "cache off", "light-load TTFT p50"
    else:
        results = in_process(args)
        on, off, ttft = "cache on", "cache off", "light-load TTFT p50"
    pairs = [(r[on], r[off]) for r in results["rounds"]]
    results["throughput_ratio"] = statistics.median(a["output_tok_per_s"] / b["output_tok_per_s"] for a, b in pairs)
    results["ttft_p50_ratio"] = statistics.median(b["ttft_p50_ms"] / a["ttft_p50_ms"] for a, b in pairs)
    print(
        f"{on} vs {off}, medians over {args.rounds} rounds: throughput {results['throughput_ratio']:.2f}x, "
        f"{ttft} {results['ttft_p50_ratio']:.2f}x lower"
    )
    if args.partial_kv:
        results["kv_bytes_ratio"] = statistics.median(a["kv_bytes"] / b["kv_bytes"] for a, b in pairs)
        results["kv_transfer_p50_ratio"] = statistics.median(
            b["later_kv_transfer_p50_ms"] / a["later_kv_transfer_p50_ms"] for a, b in pairs
        )
        print(
            f"KV received {results['kv_bytes_ratio']:.2f}x of whole; later turns' KV transfer p50 "
            f"{results['kv_transfer_p50_ratio']:.2f}x lower"
        )
    if args.out:
        write_results(args.out, results)
    return 0


def in_process(args) -> dict:
    """Two engines on the same weights, with the cache and without: see the module's docstring."""
    loaded = load_model(ModelSpec(path=args.model))
    base = EngineConfig(model=ModelSpec(path=args.model), num_threads=args.threads, kv_cache_bytes=1 << 30)
    torch.set_num_threads(base.threads())
    engines = {
        "cache on": LLMEngine(base, loaded=loaded),
        "cache off": LLMEngine(base.replace(prefix_caching=False), loaded=loaded),
    }
    tok = engines["cache on"].tokenizer
    prompts = [tok.encode_chat(c) for c in chats(args.workloads, max(args.requests, args.light + 1))]
    items = [WorkItem(f"chat-{i}", "", p, args.max_tokens) for i, p in enumerate(prompts)]
    shared = min(next(i for i, (a, b) in enumerate(zip(prompts[0], p)) if a != b) for p in prompts[1:])
    print(
        f"{len(prompts[: args.requests])} chats of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
        f"{shared} of them the same in all",
        flush=True,
    )
    for eng in engines.values():  # warm: kernels, allocator
        light_ttft(eng, items[-1:])
    results: dict = {"shared_prefix_tokens": shared, "threads": base.threads(), "rounds": []}
    for r in range(args.rounds):
        order = list(engines.items()) if r % 2 == 0 else list(engines.items())[::-1]
        rnd = {}
        for name, eng in order:
            eng.reset_prefix_cache()
            t = rnd[name] = run_workload(eng, items[: args.requests])
            eng.reset_prefix_cache()
            # the first light request fills the cache (with it on) and is not counted; the rest
            # find the system prompt there
            t["ttft_ms"] = light_ttft(eng, items[: args.light + 1])[1:]
            t["ttft_p50_ms"] = percentile(t["ttft_ms"], 50)
            print(
                f"round {r + 1} {name:>9}: {args.requests} at once {t['output_tok_per_s']:6.1f} tok/s "
                f"({t['wall_s']:.1f} s, {t['prefill_tokens_computed']} prompt tokens computed, "
                f"{t['prefix_cache_tokens']} from the cache); one at a time TTFT p50 {t['ttft_p50_ms']:.0f} ms",
                flush=True,
            )
        results["rounds"].append(rnd)
    return results


if __name__ == "__main__":
    raise SystemExit(main())
