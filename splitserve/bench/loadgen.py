"""Load generation against a running router, and the figures computed from it.

Open loop: requests arrive as a Poisson process at a given rate, whatever the server
does (exponential gaps, seeded). Closed loop: a fixed number of clients, each sending
its next request when the previous one ends. Every request sent ends as one Result
(success or the gRPC status it failed with); warm-up requests are sent first, one at
a time, and are not part of the results.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import asdict, dataclass, field

import grpc

from splitserve.bench.workload import WorkItem, percentile
from splitserve.client import AsyncClient
from splitserve.service.redis_state import PRIORITY_CLASSES, priority_class

PCTS = (50, 90, 99, 99.9)


@dataclass
class Result:
    index: int
    ok: bool
    code: str  # gRPC status name ("OK" on success)
    prompt_tokens: int
    output_tokens: int = 0
    t_sent: float = 0.0  # seconds since the run started
    ttft_s: float = float("nan")
    e2e_s: float = float("nan")
    priority: int = 0
    request_id: str = ""
    # Who prefilled it, by GetRequest after the run: a prefill worker's name, "" for its decode
    # worker (colocated, or conditional disaggregation), None when not known.
    prefill_worker: str | None = None

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (nan with fewer than two tokens)."""
        if not self.ok or self.output_tokens < 2:
            return float("nan")
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class RunSpec:
    mode: str  # "rate" (open loop, Poisson) or "concurrency" (closed loop)
    value: float
    seed: int = 0
    timeout_s: float = 600.0
    label: str = ""
    extra: dict = field(default_factory=dict)


# -- sending ------------------------------------------------------------------------------------


async def _one(client: AsyncClient, i: int, item: WorkItem, t_run: float, timeout: float) -> Result:
    res = Result(i, False, "UNKNOWN", len(item.prompt_token_ids), priority=item.priority)
    t0 = time.perf_counter()
    res.t_sent = t0 - t_run
    try:
        async for chunk in client.generate_stream(
            token_ids=item.prompt_token_ids,
            max_tokens=item.max_tokens,
            ignore_eos=True,
            priority=item.priority,
            timeout=timeout,
        ):
            res.request_id = res.request_id or chunk.request_id
            if chunk.token_ids and math.isnan(res.ttft_s):
                res.ttft_s = time.perf_counter() - t0
            res.output_tokens += len(chunk.token_ids)
        res.e2e_s = time.perf_counter() - t0
        res.ok, res.code = True, "OK"
    except grpc.aio.AioRpcError as e:
        res.code = e.code().name
    return res


async def run(address: str, items: list[WorkItem], spec: RunSpec, progress=None) -> tuple[list[Result], float]:
    """Send every item once; returns the results (in send order) and the wall time."""
    results: list[Result] = []

    def done(r: Result) -> None:
        results.append(r)
        if progress is not None:
            progress.update(1)

    async with AsyncClient(address, balance=True) as client:  # a target of several routers: all of them
        t_run = time.perf_counter()
        if spec.mode == "rate":
            rng = random.Random(spec.seed)
            tasks = []
            next_t = 0.0
            for i, item in enumerate(items):
                delay = next_t - (time.perf_counter() - t_run)
                if delay > 0:
                    await asyncio.sleep(delay)
                task = asyncio.ensure_future(_one(client, i, item, t_run, spec.timeout_s))
                task.add_done_callback(lambda t: done(t.result()))
                tasks.append(task)
                next_t += rng.expovariate(spec.value)
            await asyncio.gather(*tasks)
        elif spec.mode == "concurrency":
            queue = list(enumerate(items))
            queue.reverse()

            async def worker():
                while queue:
                    i, item = queue.pop()
                    done(await _one(client, i, item, t_run, spec.timeout_s))

            await asyncio.gather(*(worker() for _ in range(max(1, int(spec.value)))))
        else:
            raise ValueError(f"mode must be rate or concurrency, got {spec.mode!r}")
        wall = time.perf_counter() - t_run
        await _who_prefilled(client, results)
    results.sort(key=lambda r: r.index)
    return results, wall


async def _who_prefilled(client: AsyncClient, results: list[Result]) -> None:
    """Ask the router who prefilled each successful request (after the timed run, so it costs the
    figures nothing); a request it no longer knows stays None."""
    gate = asyncio.Semaphore(16)

    async def one(r: Result) -> None:
        async with gate:
            try:
                r.prefill_worker = (await client.get_request(r.request_id, timeout=30)).prefill_worker
            except grpc.aio.AioRpcError:
                pass

    await asyncio.gather(*(one(r) for r in results if r.ok and r.request_id))


async def warm_up(address: str, items: list[WorkItem]) -> None:
    async with AsyncClient(address, balance=True) as client:  # a target of several routers: all of them
        for i, item in enumerate(items):
            await _one(client, -1 - i, item, time.perf_counter(), 600)


# -- figures ------------------------------------------------------------------------------------


def pcts(values: list[float]) -> dict:
    xs = [v for v in values if not math.isnan(v)]
    out = {f"p{p:g}": percentile(xs, p) for p in PCTS}
    out["mean"] = sum(xs) / len(xs) if xs else float("nan")
    return out


def summarize(
    results: list[Result], wall_s: float, ttft_slo_s: float | None = None, tpot_slo_s: float | None = None
) -> dict:
    """Latency percentiles (seconds), throughput, goodput and errors by status."""
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.code] = errors.get(r.code, 0) + 1

    def good(r: Result) -> bool:
        if ttft_slo_s is not None and not r.ttft_s <= ttft_slo_s:
            return False
        if tpot_slo_s is not None and r.output_tokens >= 2 and not r.tpot_s <= tpot_slo_s:
            return False
        return True

    n_good = sum(1 for r in ok if good(r))
    out_tokens = sum(r.output_tokens for r in ok)
    out = {
        "sent": len(results),
        "succeeded": len(ok),
        "errors": errors,
        "wall_s": wall_s,
        "request_throughput": len(ok) / wall_s if wall_s > 0 else 0.0,
        "output_throughput": out_tokens / wall_s if wall_s > 0 else 0.0,
        "output_tokens": out_tokens,
        "ttft_s": pcts([r.ttft_s for r in ok]),
        "tpot_s": pcts([r.tpot_s for r in ok]),
        "e2e_s": pcts([r.e2e_s for r in ok]),
        "slo": {"ttft_s": ttft_slo_s, "tpot_s": tpot_slo_s},
        "good_requests": n_good,
        "goodput": n_good / wall_s if wall_s > 0 else 0.0,
        # prefilled by their decode worker (None: not known for any request), and the successes
        # the router no longer knew afterwards (their hash expired: FINISHED_TTL_S in a long run)
        "prefilled_locally": (
            sum(1 for r in ok if r.prefill_worker == "") if any(r.prefill_worker is not None for r in ok) else None
        ),
        "prefill_unknown": sum(1 for r in ok if r.prefill_worker is None),
    }
    if any(r.priority for r in results):  # latency by priority class
        out["by_priority"] = {}
        for name in PRIORITY_CLASSES:
            members = [r for r in results if priority_class(r.priority) == name]
            if members:
                done = [r for r in members if r.ok]
                out["by_priority"][name] = {
                    "sent": len(members),
                    "succeeded": len(done),
                    "ttft_s": pcts([r.ttft_s for r in done]),
                    "e2e_s": pcts([r.e2e_s for r in done]),
                }
    return out


KNEE_RULE = (
    "knee = the highest concurrency whose p99 end-to-end latency is at most {factor:g}x the p99 at the "
    "lowest concurrency tried; the next concurrency is where p99 latency has degraded (as it has at one "
    "where no request succeeded)"
)


def find_knee(points: list[tuple[float, float]], factor: float = 1.5) -> tuple[float | None, float | None]:
    """(concurrency, p99) points in rising concurrency -> (knee, first degraded concurrency). A p99
    of NaN (no request succeeded there) is degraded, tested as such: compared as a number, a NaN is
    never above the bound. At the lowest concurrency, there is no knee."""
    if not points:
        return None, None
    base = points[0][1]
    if math.isnan(base):
        return None, points[0][0]
    knee = points[0][0]
    for c, p99 in points:
        if math.isnan(p99) or p99 > factor * base:
            return knee, c
        knee = c
    return knee, None


def results_as_dicts(results: list[Result]) -> list[dict]:
    return [asdict(r) | {"tpot_s": r.tpot_s} for r in results]
