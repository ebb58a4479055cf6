"""``splitserve bench``: drive a stack over gRPC and report latency, throughput and goodput.

    splitserve bench --rate 0.5 --requests 64                  # open loop, Poisson, own stack
    splitserve bench --address HOST:PORT --concurrency 1,4,16  # closed loop against a running router
    splitserve bench --sweep --max-concurrency 64              # find the knee
    splitserve bench --compare static,dynamic,continuous --rate 0.5
    splitserve bench --compare colocated,disaggregated --rate 1.0

Without ``--address`` it starts a stack (embedded Redis, router, workers) per variant and
stops it afterwards. Results go to ``--out`` (results.json and PNG plots).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import random
import sys

from splitserve.bench import loadgen, server_metrics
from splitserve.bench.workload import WorkItem, default_workload_dir, load_workload, write_results

POLICIES = ("static", "dynamic", "continuous")
MODES = ("colocated", "disaggregated")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="load generator: latency, throughput, goodput, sweeps and comparisons",
        description=__doc__,
        formatter_class=__import__("argparse").RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--address",
        default="",
        help="a running router, or several (ipv4:A,B or a DNS name of several; calls go round robin) "
        "(default: start a stack per variant)",
    )
    p.add_argument(
        "--workload", default="", help="JSONL workload (default: the package's workloads/workload_mixed.jsonl)"
    )
    p.add_argument("--input-len", default="", help="synthetic prompts instead: N or LO-HI (uniform) tokens")
    p.add_argument("--output-len", default="64", help="synthetic output tokens: N or LO-HI (default 64)")
    p.add_argument("--vocab", type=int, default=0, help="synthetic token ids below this (default: the model's)")
    p.add_argument("--requests", type=int, default=64, help="requests per run (default 64; 0 = the whole file)")
    p.add_argument("--warmup", type=int, default=2, help="requests sent first, one at a time, not counted")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--high-priority",
        type=float,
        default=0.0,
        help="fraction of the measured requests sent with priority -1 (seeded); latency is also "
        "reported per priority class",
    )
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", default="", help="open loop: Poisson arrivals, requests/s (comma list)")
    load.add_argument("--concurrency", default="", help="closed loop: concurrent clients (comma list)")
    p.add_argument("--sweep", action="store_true", help="closed-loop concurrency sweep 1,2,4,... to find the knee")
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--knee-factor", type=float, default=1.5)
    p.add_argument("--compare", default="", help="static,dynamic,continuous or colocated,disaggregated")
    p.add_argument("--ttft-slo-ms", type=float, default=None, help="goodput: TTFT limit")
    p.add_argument("--tpot-slo-ms", type=float, default=None, help="goodput: time-per-output-token limit")
    p.add_argument("--timeout", type=float, default=900.0, help="per-request deadline, seconds")
    # a stack of our own
    p.add_argument("--model", default=None)
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--mode", default=None, choices=MODES)
    p.add_argument("--policy", default=None, choices=POLICIES)
    p.add_argument(
        "--prefix-caching",
        action="store_true",
        help="turn the stack's prefix cache on (default off: every point sends the same prompts "
        "again, and the cache would serve them instead of computing them)",
    )
    p.add_argument("--out", default="bench-results/bench", help="folder for results.json and plots")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=main)


# -- requests -----------------------------------------------------------------------------------


def _length(spec: str, rng: random.Random) -> int:
    lo, hi = _length_range("length", spec)
    return rng.randint(lo, hi)


def _length_range(flag: str, spec: str) -> tuple[int, int]:
    """N or LO-HI, whole numbers with 1 <= LO <= HI; ValueError naming the flag otherwise."""
    try:
        lo, hi = (int(x) for x in spec.split("-", 1)) if "-" in spec else (int(spec),) * 2
    except ValueError:
        lo = hi = 0
    if not 1 <= lo <= hi:
        raise ValueError(f"{flag} takes N or LO-HI tokens, whole numbers with 1 <= LO <= HI, got {spec!r}")
    return lo, hi


def make_items(args, vocab: int) -> list[WorkItem]:
    rng = random.Random(args.seed)
    if args.input_len:
        n = args.requests or 64
        return [
            WorkItem(
                f"synthetic-{i}",
                "",
                [rng.randrange(10, vocab) for _ in range(_length(args.input_len, rng))],
                _length(args.output_len, rng),
            )
            for i in range(n + args.warmup)
        ]
    path = args.workload or os.path.join(default_workload_dir(), "workload_mixed.jsonl")
    items = load_workload(path, tokenize=_model_tokenizer(args))
    if not items:
        raise ValueError(f"workload {path} is empty")
    want = (args.requests or len(items)) + args.warmup
    return [items[i % len(items)] for i in range(want)]


def mark_high_priority(items: list[WorkItem], warmup: int, fraction: float, seed: int) -> list[WorkItem]:
    """round(fraction * measured) of the measured items, chosen with the seed, get priority -1."""
    measured = range(warmup, len(items))
    chosen = set(random.Random(seed + 1).sample(measured, round(fraction * len(measured))))
    return [dataclasses.replace(it, priority=-1) if i in chosen else it for i, it in enumerate(items)]


# -- stacks -------------------------------------------------------------------------------------


class Target:
    """A running router: the one given, or a stack started (and later stopped) here."""

    def __init__(self, args, variant: str = ""):
        self.args, self.variant, self.stack = args, variant, None
        self.address = args.address

    def __enter__(self) -> Target:
        if self.address:
            return self
        from splitserve.service.settings import Settings, needs_colocated
        from splitserve.stack import Stack

        over = {
            "model": self.args.model,
            "policy": self.args.policy,
            "mode": self.args.mode,
            "max_queue_requests": 1 << 16,
            "max_queue_tokens": 1 << 26,
            "prefix_caching": self.args.prefix_caching,
        }
        prefill = self.args.prefill
        if self.variant in POLICIES:  # compared on equal terms: one engine prefills and decodes
            over.update(policy=self.variant, mode="colocated")
        elif self.variant in MODES:
            over.update(mode=self.variant)
        if needs_colocated(over.get("policy") or ""):
            over["mode"] = "colocated"
        if over.get("mode") == "colocated":
            prefill = 0
        settings = Settings.from_env(**{k: v for k, v in over.items() if v is not None})
        print(
            f"starting a stack ({settings.mode}, policy {settings.policy}, {prefill} prefill + "
            f"{self.args.decode} decode, prefix cache {'on' if settings.prefix_caching else 'off'})",
            file=sys.stderr,
            flush=True,
        )
        self.stack = Stack(settings, prefill=prefill, decode=self.args.decode).start()
        self.address = self.stack.router_address
        print(f"stack up; its logs and traces stay in {self.stack.run_dir}", file=sys.stderr, flush=True)
        return self

    def __exit__(self, *exc) -> None:
        if self.stack is not None:
            self.stack.stop()

    def snapshot(self) -> dict | None:
        """Each process's parsed /metrics (None for one that did not answer); None for a router
        given by --address, whose workers this bench does not know."""
        if self.stack is None:
            return None
        return {p.name: server_metrics.scrape(p.metrics_address) for p in self.stack.procs if p.metrics_address}


def check_answers(address: str, wait_s: float = 10.0) -> None:
    """OSError naming --address when no server answers there within wait_s, rather than every request
    of every run sent to fail UNAVAILABLE."""
    import grpc

    with grpc.insecure_channel(address) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=wait_s)
        except grpc.FutureTimeoutError:
            raise OSError(
                f"--address {address}: nothing answers there within {wait_s:g} s (start a stack with "
                "splitserve up, or leave --address out and the bench starts one)"
            ) from None


def _model_tokenizer(args):
    """prompt -> token ids with the model's tokenizer, loaded at the first call (a workload whose
    lines carry prompt_token_ids never loads it)."""
    tok = []

    def tokenize(prompt: str) -> list[int]:
        if not tok:
            from splitserve.engine.config import ModelSpec
            from splitserve.engine.loader import load_frontend

            tokenizer, _, _ = load_frontend(ModelSpec(path=args.model))
            if tokenizer is None:
                raise ValueError("this model has no tokenizer: give the workload's prompt_token_ids")
            tok.append(tokenizer)
        return tok[0].encode(prompt)

    return tokenize


def _check_args(args) -> None:
    """ValueError naming the flag when one is out of range."""
    for flag, value, least in (
        ("--requests", args.requests, 0),
        ("--warmup", args.warmup, 0),
        ("--max-concurrency", args.max_concurrency, 1),
        ("--prefill", args.prefill, 0),
        ("--decode", args.decode, 1),
    ):
        if value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {args.timeout}")
    if not args.knee_factor > 1:
        raise ValueError(f"--knee-factor must be > 1, got {args.knee_factor}")
    for flag, slo in (("--ttft-slo-ms", args.ttft_slo_ms), ("--tpot-slo-ms", args.tpot_slo_ms)):
        if slo is not None and not slo > 0:
            raise ValueError(f"{flag} must be > 0, got {slo}")
    for flag, spec in (("--input-len", args.input_len), ("--output-len", args.output_len)):
        if spec:
            _length_range(flag, spec)
    for s in _specs(args):
        flag = "--rate" if s.mode == "rate" else "--concurrency"
        if not (math.isfinite(s.value) and s.value > 0) or (s.mode == "concurrency" and s.value != int(s.value)):
            raise ValueError(
                f"{flag} takes {'numbers' if s.mode == 'rate' else 'whole numbers'} > 0, got {s.label.split('=', 1)[1]}"
            )


def model_vocab(args) -> int:
    if args.vocab:
        return args.vocab
    from splitserve.engine.config import ModelSpec
    from splitserve.engine.loader import load_frontend

    _, config, _ = load_frontend(ModelSpec(path=args.model))
    return config.vocab_size


# -- running ------------------------------------------------------------------------------------


def _progress(args, total: int, desc: str):
    if args.no_progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, dynamic_ncols=True)


def one_run(args, address: str, items: list[WorkItem], spec: loadgen.RunSpec, target: Target | None = None) -> dict:
    warm, measured = items[: args.warmup], items[args.warmup :]
    if warm:
        asyncio.run(loadgen.warm_up(address, warm))
    before = target.snapshot() if target is not None else None
    bar = _progress(args, len(measured), spec.label or f"{spec.mode}={spec.value:g}")
    try:
        results, wall = asyncio.run(loadgen.run(address, measured, spec, bar))
    finally:
        if bar is not None:
            bar.close()
    ms = lambda x: None if x is None else x / 1000  # noqa: E731
    summary = loadgen.summarize(results, wall, ms(args.ttft_slo_ms), ms(args.tpot_slo_ms))
    summary.update(label=spec.label, load={"mode": spec.mode, "value": spec.value}, variant=spec.extra)
    summary["requests"] = loadgen.results_as_dicts(results)
    if before is not None:
        summary["server"] = server_metrics.summarize(before, target.snapshot())
    return summary


def _specs(args) -> list[loadgen.RunSpec]:
    mode, values = ("rate", args.rate) if args.rate else ("concurrency", args.concurrency or "8")
    specs = []
    for v in values.split(","):
        try:
            specs.append(loadgen.RunSpec(mode, float(v), args.seed, args.timeout, f"{mode}={v.strip()}"))
        except ValueError:
            raise ValueError(f"--{mode} takes a comma list of numbers, got {v!r}") from None
    return specs


def main(args) -> int:
    try:
        _check_args(args)
        vocab = model_vocab(args) if args.input_len else 0
        items = make_items(args, vocab)
        if not 0 <= args.high_priority <= 1:
            raise ValueError(f"--high-priority must be a fraction in [0, 1], got {args.high_priority}")
        if args.high_priority:
            items = mark_high_priority(items, args.warmup, args.high_priority, args.seed)
        if args.address and not args.compare:
            check_answers(args.address)
    except (OSError, ValueError) as e:
        print(f"splitserve bench: error: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    plots = []  # (function, its arguments): drawn once the results are written
    if args.compare:
        variants = [v.strip() for v in args.compare.split(",") if v.strip()]
        bad = [v for v in variants if v not in POLICIES + MODES]
        if bad or len(variants) < 2:
            print(
                f"splitserve bench: error: --compare takes two or more of {', '.join(POLICIES + MODES)}",
                file=sys.stderr,
            )
            return 2
        if args.address:
            print("splitserve bench: error: --compare starts its own stacks; drop --address", file=sys.stderr)
            return 2
        report = {"kind": "compare", "variants": {}}
        spec = _specs(args)[0]
        for v in variants:
            with Target(args, v) as t:
                spec.label = v
                report["variants"][v] = one_run(args, t.address, items, spec, t)
        print(compare_table(report))
        plots.append((plot_compare, report, os.path.join(args.out, "compare.png")))
    elif args.sweep:
        report = {"kind": "sweep", "points": []}
        with Target(args) as t:
            c = 1
            while c <= args.max_concurrency:
                spec = loadgen.RunSpec("concurrency", c, args.seed, args.timeout, f"concurrency={c}")
                report["points"].append(one_run(args, t.address, items, spec, t))
                c *= 2
        pts = [(p["load"]["value"], p["e2e_s"]["p99"]) for p in report["points"]]
        knee, degraded = loadgen.find_knee(pts, args.knee_factor)
        report.update(knee=knee, degraded_at=degraded, rule=loadgen.KNEE_RULE.format(factor=args.knee_factor))
        print(runs_table(report["points"]))
        found = f"concurrency {knee:g}" if knee is not None else "none: no request succeeded at the lowest"
        print(
            f"\n{report['rule']}\nknee: {found}"
            + (f"; p99 degrades at {degraded:g}" if degraded else "; no degradation up to the largest tried")
        )
        plots.append(
            (plot_runs, report["points"], "concurrency", os.path.join(args.out, "latency_vs_concurrency.png"), knee)
        )
        plots.append((plot_runs, report["points"], "throughput", os.path.join(args.out, "latency_vs_throughput.png")))
    else:
        report = {"kind": "runs", "points": []}
        with Target(args) as t:
            for spec in _specs(args):
                report["points"].append(one_run(args, t.address, items, spec, t))
        print(runs_table(report["points"]))
        plots.append((plot_runs, report["points"], "throughput", os.path.join(args.out, "latency_vs_throughput.png")))
        if report["points"][0]["load"]["mode"] == "concurrency":
            plots.append(
                (plot_runs, report["points"], "concurrency", os.path.join(args.out, "latency_vs_concurrency.png"))
            )
    path = os.path.join(args.out, "results.json")
    write_results(path, report, indent=1, default=lambda x: None)
    succeeded = any(p["succeeded"] for p in _all_points(report))
    if succeeded:
        for plot, *plot_args in plots:
            plot(*plot_args)
        print(f"\nresults: {path}; plots in {args.out}")
    else:  # nothing to plot: a log scale of no latencies fails
        print(f"\nresults: {path}; no plots: no request succeeded")
    failed = sum(sum(p["errors"].values()) for p in _all_points(report))
    return 1 if failed and not succeeded else 0


def _all_points(report: dict) -> list[dict]:
    return list(report["variants"].values()) if report["kind"] == "compare" else report["points"]


# -- tables and plots ---------------------------------------------------------------------------


def _ms(x: float) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 1000:.0f}"


def _ttft_cells(t: dict) -> str:
    return f"{_ms(t['p50']):>8} {_ms(t['p90']):>6} {_ms(t['p99']):>6} {_ms(t['p99.9']):>6}"


def _e2e_cells(e: dict) -> str:
    return f"{_ms(e['p50']):>8} {_ms(e['p90']):>6} {_ms(e['p99']):>7} {_ms(e['p99.9']):>7}"


def _server_lines(named_points) -> list[str]:
    """What each stack's processes measured during each point (server_metrics); none when the
    bench did not start the stack."""
    rows = []
    for name, p in named_points:
        if p.get("server"):
            rows.append(f"{name}, as the stack measured it (engine steps, KV handoffs, TTFT parts):")
            rows += server_metrics.lines(p["server"])
    return rows


def _local_prefills_line(named_points) -> list[str]:
    """One line counting, per (name, point), the requests their decode worker prefilled; none when
    no point knows."""
    local = [
        f"{name} {p['prefilled_locally']} of {p['succeeded']}"
        + (f" ({p['prefill_unknown']} no longer known to the router)" if p.get("prefill_unknown") else "")
        for name, p in named_points
        if p.get("prefilled_locally") is not None
    ]
    return (
        ["prefilled by their decode worker (colocated, or conditional disaggregation): " + ", ".join(local)]
        if local
        else []
    )


def runs_table(points: list[dict]) -> str:
    head = (
        f"{'load':>16} {'ok/sent':>8} {'req/s':>7} {'tok/s':>7} {'goodput':>8} | "
        f"{'TTFT p50':>8} {'p90':>6} {'p99':>6} {'p99.9':>6} | {'TPOT p50':>8} {'p99':>6} | "
        f"{'E2E p50':>8} {'p90':>6} {'p99':>7} {'p99.9':>7}  (ms)  errors"
    )
    rows = [head]
    for p in points:
        o = p["tpot_s"]
        rows.append(
            f"{p['label']:>16} {p['succeeded']:>3}/{p['sent']:<4} {p['request_throughput']:7.2f} "
            f"{p['output_throughput']:7.1f} {p['goodput']:8.2f} | {_ttft_cells(p['ttft_s'])} | "
            f"{_ms(o['p50']):>8} {_ms(o['p99']):>6} | {_e2e_cells(p['e2e_s'])}        {p['errors'] or ''}"
        )
        for name, c in p.get("by_priority", {}).items():  # TPOT is not split by class: its cells stay blank
            rows.append(
                f"{'  priority ' + name:>16} {c['succeeded']:>3}/{c['sent']:<4} {'':>24} | "
                f"{_ttft_cells(c['ttft_s'])} | {'':>15} | {_e2e_cells(c['e2e_s'])}"
            )
    rows += _local_prefills_line((p["label"], p) for p in points)
    rows += _server_lines((p["label"], p) for p in points)
    return "\n".join(rows)


def compare_table(report: dict) -> str:
    vs = report["variants"]
    names = list(vs)
    base = vs[names[0]]
    rows = [
        f"{'variant':>14} {'req/s':>7} {'tok/s':>7} {'x ' + names[0]:>10} | {'E2E p50':>8} {'p99':>7} "
        f"{'p99.9':>7} {'p99 vs ' + names[0]:>12} | {'TTFT p99':>8} {'TPOT p99':>8}  (ms)"
    ]
    for name, p in vs.items():
        e = p["e2e_s"]
        ratio = p["output_throughput"] / base["output_throughput"] if base["output_throughput"] else float("nan")
        p99_ratio = base["e2e_s"]["p99"] / e["p99"] if e["p99"] else float("nan")
        rows.append(
            f"{name:>14} {p['request_throughput']:7.2f} {p['output_throughput']:7.1f} {ratio:9.2f}x | "
            f"{_ms(e['p50']):>8} {_ms(e['p99']):>7} {_ms(e['p99.9']):>7} {p99_ratio:11.2f}x | "
            f"{_ms(p['ttft_s']['p99']):>8} {_ms(p['tpot_s']['p99']):>8}"
        )
    rows.append(
        f"(load: {base['load']['mode']} {base['load']['value']:g}; 'p99 vs' = {names[0]}'s p99 / this p99, "
        f"higher is better)"
    )
    rows += _local_prefills_line(vs.items())
    rows += _server_lines(vs.items())
    return "\n".join(rows)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_runs(points: list[dict], x: str, path: str, knee: float | None = None) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [p["load"]["value"] if x == "concurrency" else p["request_throughput"] for p in points]
    for key, label, style in (("e2e_s", "E2E", "-"), ("ttft_s", "TTFT", "--")):
        for pct, marker in (("p50", "o"), ("p99", "s")):
            ax.plot(xs, [p[key][pct] for p in points], style, marker=marker, label=f"{label} {pct}")
    if x == "concurrency":
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients (closed loop)")
        if knee is not None:
            ax.axvline(knee, color="grey", linestyle=":", label=f"knee ({knee:g})")
        ax2 = ax.twinx()
        ax2.plot(
            xs, [p["output_throughput"] for p in points], color="black", alpha=0.4, marker="^", label="output tok/s"
        )
        ax2.set_ylabel("output tokens/s")
        ax2.legend(loc="lower right", fontsize=8)
    else:
        ax.set_xlabel("throughput (requests/s)")
    ax.set_yscale("log")
    ax.set_ylabel("latency (s)")
    ax.set_title(f"latency vs {x}")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_compare(report: dict, path: str) -> None:
    plt = _plt()
    vs = report["variants"]
    names = list(vs)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4.2))
    a1.bar(names, [vs[n]["output_throughput"] for n in names], color="tab:blue")
    a1.set_ylabel("output tokens/s")
    a1.set_title("throughput")
    width = 0.2
    metrics = [("e2e_s", "p50"), ("e2e_s", "p99"), ("e2e_s", "p99.9"), ("ttft_s", "p99"), ("tpot_s", "p99")]
    for j, (key, pct) in enumerate(metrics):
        a2.bar(
            [i + (j - 2) * width * 0.8 for i in range(len(names))],
            [vs[n][key][pct] for n in names],
            width * 0.8,
            label=f"{key[:-2].upper()} {pct}",
        )
    a2.set_xticks(range(len(names)), names)
    a2.set_yscale("log")
    a2.set_ylabel("seconds")
    a2.set_title("latency")
    a2.legend(fontsize=8)
    load = vs[names[0]]["load"]
    fig.suptitle(f"same workload, {load['mode']} {load['value']:g}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
