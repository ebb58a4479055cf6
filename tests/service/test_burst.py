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
