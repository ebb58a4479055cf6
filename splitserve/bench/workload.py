"""Benchmark workloads: the JSONL format of ``workloads/`` (id, prompt, prompt_token_ids, max_tokens)."""

from __future__ import annotations

import json
import math
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


def load_workload(path: str, limit: int | None = None, tokenize=None) -> list[WorkItem]:
    """The workload's requests. A line needs max_tokens, and prompt_token_ids or (with `tokenize`,
    which turns a prompt into token ids) prompt; id defaults to the line's number. A line that is
    not such a request raises ValueError naming the file, the line and the field."""
    items = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                items.append(_item(line, f"{path}:{n}", tokenize))
                if limit and len(items) == limit:
                    break
    return items


def _item(line: str, where: str, tokenize) -> WorkItem:
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{where}: must be a JSON object, got {type(d).__name__}")
    prompt = d.get("prompt", "")
    ids = d.get("prompt_token_ids")
    if ids is None:
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{where}: prompt_token_ids (or prompt) is required")
        if tokenize is None:
            raise ValueError(f"{where}: prompt_token_ids is required here")
        ids = tokenize(prompt)
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
        raise ValueError(f"{where}: prompt_token_ids must be a non-empty list of token ids (integers >= 0)")
    max_tokens = d.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"{where}: max_tokens must be an integer >= 1, got {max_tokens!r}")
    return WorkItem(
        str(d.get("id", where.rsplit(":", 1)[-1])), prompt if isinstance(prompt, str) else "", ids, max_tokens
    )


WORKLOAD_DIR = str(pathlib.Path(__file__).resolve().parent / "workloads")


def default_workload_dir() -> str:
    """The project's own copy of the benchmark workloads (``splitserve/bench/workloads``, shipped
    with the package), or the folder SPLITSERVE_BENCH_DIR names."""
    return os.environ.get("SPLITSERVE_BENCH_DIR") or WORKLOAD_DIR


def write_results(path: str | None, results: dict, indent: int = 2, default=None) -> None:
    """Write a benchmark's results as plain JSON (no-op without a path); default: as json.dump's."""
    if not path:
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(plain(results), f, indent=indent, default=default)


def plain(obj):
    """obj with each float that is not finite (a percentile of no values: NaN) as None, so that it is
    plain JSON, which strict readers (jq, JavaScript) take; Python writes NaN, which they refuse."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj


def median_interval(
    values: list[float], level: float = 0.95, resamples: int = 4000, seed: int = 0
) -> tuple[float, float]:
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
