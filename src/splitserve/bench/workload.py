"""Benchmark workloads: the JSONL format of shared/bench (id, prompt, prompt_token_ids, max_tokens)."""

from __future__ import annotations

import json
import os
import pathlib
import random
import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkItem:
    id: str
    prompt: str
    prompt_token_ids: list[int]
    max_tokens: int
    priority: int = 0  # sent as GenerateRequest.priority (lower is served first)


def load_workload(path: str, limit: int | None = None) -> list[WorkItem]:
    items = []
    with open(path) as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                items.append(WorkItem(d["id"], d.get("prompt", ""), d["prompt_token_ids"], int(d["max_tokens"])))
    return items[:limit] if limit else items


def default_workload_dir() -> str:
    """shared/bench beside the checkout (or SPLITSERVE_BENCH_DIR)."""
    env = os.environ.get("SPLITSERVE_BENCH_DIR")
    if env:
        return env
    here = pathlib.Path(__file__).resolve()
    for parent in here.parents:
        for cand in (parent / "shared" / "bench", parent.parent / "shared" / "bench"):
            if cand.is_dir():
                return str(cand)
    return "shared/bench"


def write_results(path: str | None, results: dict) -> None:
    """Write a benchmark's results as JSON (no-op without a path)."""
    if not path:
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=2)


def median_interval(values: list[float], level: float = 0.95, resamples: int = 4000,
                    seed: int = 0) -> tuple[float, float]:
    """A bootstrap interval of the median: the median of `resamples` resamples (with replacement,
    seeded) of the values, their (1 - level) / 2 and (1 + level) / 2 percentiles."""
    if not values:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    n = len(values)
    meds = [statistics.median(rng.choices(values, k=n)) for _ in range(resamples)]
    return percentile(meds, 100 * (1 - level) / 2), percentile(meds, 100 * (1 + level) / 2)


def percentile(values: list[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default), p in [0, 100]."""
    if not values:
        return float("nan")
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)
