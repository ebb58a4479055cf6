"""asyncio's `wait_for` as Python 3.12 has it, for the 3.11 the stack runs on.

On 3.11, `asyncio.wait_for` runs what it waits for as a task of its own, and a cancel that comes
as that task completes is lost: `wait_for` returns the result and the task that awaited it goes
on as if it had never been cancelled (CPython gh-86296, fixed in 3.12 by running it in the
caller's own task under `asyncio.timeout`). redis-py's asyncio client writes every command under
`wait_for` when the client has a socket timeout, as ours do (CALL_TIMEOUT_S), so a loop of Redis
calls lost about one cancel in three in a test, and one in many on a busy router: a router sent
SIGTERM stopped serving but never exited, its heartbeat loop (cancelled at stop, and again by
`asyncio.run` at its end) still running minutes later.

`use_fixed_wait_for()` puts this one in `asyncio.wait_for` for the whole process (redis-py looks
it up there at each call); `connect()` (redis_state) calls it, so every process that has an
asyncio Redis client of ours has it. On 3.12 and later it does nothing.
"""

from __future__ import annotations

import asyncio
import sys

_original_wait_for = asyncio.wait_for


async def wait_for(aw, timeout: float | None):
    """`asyncio.wait_for(aw, timeout)`, with 3.12's semantics: aw runs in this task, under
    `asyncio.timeout`, so a cancel of this task is never lost."""
    if timeout is not None and timeout <= 0:  # no wait: 3.11's is 3.12's
        return await _original_wait_for(aw, timeout)
    async with asyncio.timeout(timeout):
        return await aw


def use_fixed_wait_for() -> None:
    if sys.version_info < (3, 12) and asyncio.wait_for is _original_wait_for:
        asyncio.wait_for = wait_for


async def outlast_cancel(fut: asyncio.Future) -> tuple[object, bool]:
    """fut's result, waited for to its end even if this task is cancelled meanwhile, and whether it
    was: work handed to another thread (the engine's) runs all the same, and what it did must be
    kept or undone by the caller. If fut fails, its exception is raised, or CancelledError if this
    task was cancelled (fut did nothing to keep)."""
    cancelled = False
    while True:
        try:
            return await asyncio.shield(fut), cancelled
        except asyncio.CancelledError:
            if fut.cancelled():  # (by its owner, not by a cancel of this task)
                raise
            cancelled = True
            if fut.done():  # done as the cancel came
                if fut.exception() is not None:
                    raise
                return fut.result(), True
        except BaseException:  # fut's own
            if cancelled:
                raise asyncio.CancelledError() from None
            raise
