"""A burst far over the queue's bound: every call is admitted or refused RESOURCE_EXHAUSTED, and
every admitted one completes. Three bursts in a row on the same stack."""

import asyncio
import collections

import grpc
from service_helpers import kv_idle, wait_for

from splitserve.client import AsyncClient

from .common import admission_counts


async def _burst(address: str, n: int) -> list[tuple[str, int]]:
    async with AsyncClient(address) as client:

        async def one(i: int) -> tuple[str, int]:
            try:
                resp = await client.generate(f"Burst {i}: the capital of France is", max_tokens=4, ignore_eos=True)
                return "OK", len(resp.token_ids)
            except grpc.RpcError as e:
                return e.code().name, 0

        return await asyncio.gather(*(one(i) for i in range(n)))


def test_a_burst_of_200_against_a_bound_of_64_loses_no_admitted_request_three_times(stack):
    """The package stack's queue bound is 64 requests (51 at admit_fraction 0.8). Guards against:
    a burst held the decode worker's loop past its registry lease, and the router failed every
    request it had admitted UNAVAILABLE "no decode worker is registered"."""
    for round_ in range(3):
        results = asyncio.run(_burst(stack.router_address, 200))
        codes = collections.Counter(code for code, _ in results)
        assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, (round_, codes)
        assert codes["OK"] >= 51 and codes["RESOURCE_EXHAUSTED"] > 0, (round_, codes)
        assert all(n == 4 for code, n in results if code == "OK")
        wait_for(lambda: admission_counts(stack) == [0, 0], what="the queue's counts back to zero")
    wait_for(lambda: kv_idle(stack), what="every KV block back")


def test_the_workers_yield_the_cores_to_the_router(stack):
    """worker_nice (5): every thread of a worker runs at a nice value 5 above the router's, so
    that the router's small, latency-bound work (a burst's refusals) goes first on a shared host."""
    import os

    def nices(pid: int) -> set[int]:
        out = set()
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                out.add(int(f.read().rsplit(")", 1)[1].split()[16]))
        return out

    router = nices(stack.proc("router").popen.pid)
    assert len(router) == 1
    for name in ("decode-0", "prefill-0"):
        engine = nices(stack.proc(name).popen.pid)
        assert max(engine) == min(router) + 5, (name, engine, router)
