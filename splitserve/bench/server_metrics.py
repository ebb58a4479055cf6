"""What the stack's own processes measured during a bench run, from their Prometheus /metrics.

A bench that starts its stack knows each process's metrics address. It reads every one after
the warm-up and again after the run, and reports the difference: how many engine steps each
worker ran, how long they took on average (and the bucket that holds their median and p99),
how many replayed CUDA graphs, how many sequences and tokens a step carried, how long KV
handoffs took, and the router's parts of TTFT (admission, queue, prefill, first token).
These explain a client-side TPOT or TTFT: a decode worker whose steps take 10 ms cannot
give a TPOT of 5.
"""

from __future__ import annotations

import math
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

PREFIX = "splitserve_"
# (metric, short name) of the histograms and counters reported, when a process has them.
HISTOGRAMS = (
    ("iteration_duration_seconds", "step_s"),
    ("iteration_device_seconds", "step_device_s"),
    ("iteration_sequences", "step_seqs"),
    ("iteration_tokens", "step_tokens"),
    ("kv_adopt_seconds", "kv_adopt_s"),
    ("kv_transfer_seconds", "kv_transfer_s"),
    # the router's: the parts of TTFT (request_kv_transfer runs beside the first token's trip)
    ("request_admission_time_seconds", "admission_s"),
    ("request_queue_time_seconds", "queue_s"),
    ("request_prefill_time_seconds", "prefill_s"),
    ("request_first_token_time_seconds", "first_token_s"),
    ("request_kv_transfer_time_seconds", "request_kv_transfer_s"),
)
TTFT_PARTS = (
    ("admission_s", "admission"),
    ("queue_s", "queue"),
    ("prefill_s", "prefill"),
    ("first_token_s", "first token"),
)
COUNTERS = (
    ("engine_steps", "steps"),
    ("engine_graphed_steps", "graphed_steps"),
    ("engine_prefill_tokens", "prefill_tokens"),
    ("engine_decode_tokens", "decode_tokens"),
    ("num_preemptions", "preemptions"),
)


def parse(text: str) -> dict:
    """Exposition text -> {"counters": {name: value}, "histograms": {name: {le: count, "sum": s}}},
    summed over every label but ``le``; names without the prefix or a counter's _total."""
    counters: dict[str, float] = {}
    hists: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(PREFIX):
            continue
        name = family.name[len(PREFIX) :]
        if family.type == "counter":
            counters[name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
        elif family.type == "histogram":
            h = hists.setdefault(name, {"sum": 0.0})
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    le = float(s.labels["le"])
                    h[le] = h.get(le, 0.0) + s.value
                elif s.name.endswith("_sum"):
                    h["sum"] += s.value
    return {"counters": counters, "histograms": hists}


def scrape(address: str, timeout: float = 5.0) -> dict | None:
    """One process's parsed /metrics; None when it does not answer."""
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout) as resp:
            return parse(resp.read().decode())
    except OSError:
        return None


def _bucket_of(buckets: list[tuple[float, float]], total: float, q: float) -> float | None:
    """Upper bound of the bucket holding quantile q (cumulative buckets, ascending); None for the
    +Inf bucket (results.json stays plain JSON)."""
    for le, cum in buckets:
        if cum >= q * total:
            return None if math.isinf(le) else le
    return None


def histogram_delta(before: dict | None, after: dict) -> dict | None:
    """count, mean, and the upper bounds of the buckets that hold the median and p99, of what was
    observed between two reads of one histogram; None when nothing was."""
    before = before or {}
    les = sorted(k for k in after if k != "sum")
    buckets = [(le, after[le] - before.get(le, 0.0)) for le in les]
    count = buckets[-1][1] if buckets else 0.0  # the +Inf bucket
    if count <= 0:
        return None
    total = after["sum"] - before.get("sum", 0.0)
    return {
        "count": int(count),
        "mean": total / count,
        "p50_le": _bucket_of(buckets, count, 0.5),
        "p99_le": _bucket_of(buckets, count, 0.99),
    }


def summarize(before: dict, after: dict) -> dict:
    """{process: {short name: delta}} for the processes read both times (parsed /metrics each)."""
    out = {}
    for proc, a in after.items():
        b = before.get(proc)
        if a is None or b is None:
            continue
        row = {}
        for metric, short in COUNTERS:
            if metric in a["counters"]:
                row[short] = a["counters"][metric] - b["counters"].get(metric, 0.0)
        for metric, short in HISTOGRAMS:
            if metric in a["histograms"]:
                d = histogram_delta(b["histograms"].get(metric), a["histograms"][metric])
                if d is not None:
                    row[short] = d
        if any(row.values()):  # counted or observed something (histograms with nothing are left out)
            out[proc] = row
    return out


def _bound(le: float | None, scale: float, unit: str) -> str:
    return "over the largest bucket" if le is None else f"<= {le * scale:g}{unit}"


def lines(server: dict) -> list[str]:
    """One line per process, for the tables."""
    rows = []
    for proc, row in server.items():
        parts = []
        st = row.get("step_s")
        if st:
            graphed = row.get("graphed_steps", 0) / st["count"] if st["count"] else 0.0
            parts.append(
                f"{st['count']} steps, mean {st['mean'] * 1000:.1f} ms (median "
                f"{_bound(st['p50_le'], 1000, ' ms')}, p99 {_bound(st['p99_le'], 1000, ' ms')}), "
                f"{graphed:.0%} graphed"
            )
            dev = row.get("step_device_s")
            if dev and dev["count"]:  # CUDA: the forward's share on the device; the rest is the host's
                parts.append(f"forward on the device mean {dev['mean'] * 1000:.1f} ms")
        for short, what in (("step_seqs", "seqs"), ("step_tokens", "tokens")):
            if row.get(short):
                parts.append(f"{row[short]['mean']:.1f} {what}/step")
        for short, what in (("kv_adopt_s", "KV adopt"), ("kv_transfer_s", "KV handoff")):
            if row.get(short):
                parts.append(f"{what} mean {row[short]['mean'] * 1000:.1f} ms over {row[short]['count']}")
        if row.get("admission_s"):
            parts.append(
                f"TTFT parts, mean over {row['admission_s']['count']}: "
                + ", ".join(f"{what} {row[short]['mean'] * 1000:.1f}" for short, what in TTFT_PARTS if row.get(short))
                + " ms"
            )
        if row.get("request_kv_transfer_s") and row["request_kv_transfer_s"]["mean"] > 0:  # none colocated
            parts.append(f"KV transfer (beside the first token) {row['request_kv_transfer_s']['mean'] * 1000:.1f} ms")
        if row.get("preemptions"):
            parts.append(f"{row['preemptions']:g} preempted")
        rows.append(f"  {proc}: " + "; ".join(parts))
    return rows
