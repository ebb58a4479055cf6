"""EngineRunner: the one thread that builds and steps a worker's engine."""

import asyncio
import threading

import pytest

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.sampling import SamplingParams
from splitserve.service.runner import EngineRunner


async def _served(runner: EngineRunner, max_tokens: int) -> tuple[str, list[int]]:
    """One request through the runner: (its finish reason, its tokens)."""
    done, tokens = asyncio.get_running_loop().create_future(), []

    def sink(out):
        tokens.extend(out.new_token_ids)
        if out.finished and not done.done():
            done.set_result(out.finish_reason)

    runner.sinks["r"] = sink
    await runner.submit(
        lambda e: e.add_request("r", [5, 6, 7, 8], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    )
    return await asyncio.wait_for(done, 30), tokens


def test_the_engine_is_built_and_stepped_on_the_runners_thread(tiny_loaded):
    built_on, stepped_on = [], set()

    def make():
        built_on.append(threading.current_thread().name)
        return LLMEngine(EngineConfig(kv_cache_bytes=16 << 20, num_threads=1), loaded=tiny_loaded)

    async def go():
        loop = asyncio.get_running_loop()
        runner = EngineRunner(make, loop, on_step=lambda: stepped_on.add(threading.current_thread().name))
        engine = await runner.start()
        assert runner.engine is engine
        served = await _served(runner, 4)
        runner.stop()
        return served

    reason, tokens = asyncio.run(go())
    assert built_on == ["engine"] and stepped_on == {"engine"}
    assert reason == "length" and len(tokens) == 4


def test_an_engine_that_cannot_be_built_fails_start_with_its_error():
    def make():
        raise ValueError("kv_cache_bytes too small for one block")

    async def go():
        runner = EngineRunner(make, asyncio.get_running_loop())
        with pytest.raises(ValueError, match="kv_cache_bytes"):
            await runner.start()
        runner._thread.join(timeout=5)
        assert not runner._thread.is_alive()

    asyncio.run(go())


def test_a_step_that_raises_outside_the_engines_isolation_fails_its_requests_and_the_runner_serves_on(tiny_loaded):
    """The scheduler raising (once): every request held ends "error" with the cause (StepFailed, so
    a worker answers INTERNAL with it), none is lost silently, and the next request runs."""
    from splitserve.engine.errors import StepFailed

    async def go():
        loop = asyncio.get_running_loop()
        runner = EngineRunner(
            lambda: LLMEngine(EngineConfig(kv_cache_bytes=16 << 20, num_threads=1), loaded=tiny_loaded), loop
        )
        engine = await runner.start()
        schedule, failures = engine.scheduler.schedule, []

        def fails_once():
            if not failures:
                failures.append(1)
                raise RuntimeError("scheduler bug")
            return schedule()

        engine.scheduler.schedule = fails_once
        ends = {rid: loop.create_future() for rid in ("a", "b", "c")}
        for rid, fut in ends.items():
            runner.sinks[rid] = lambda out, fut=fut: out.finished and not fut.done() and fut.set_result(out)
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        await runner.submit(lambda e: [e.add_request(rid, [5, 6, 7, 8], params) for rid in ("a", "b")])
        first = await asyncio.wait_for(asyncio.gather(ends["a"], ends["b"]), 30)
        await runner.submit(lambda e: e.add_request("c", [5, 6, 7, 8], params))
        after = await asyncio.wait_for(ends["c"], 30)
        held = await runner.submit(lambda e: e.cache.pool.num_used)
        runner.stop()
        return first, after, held

    first, after, held = asyncio.run(go())
    for out in first:
        assert out.finish_reason == "error" and isinstance(out.exception, StepFailed)
        assert out.error == "engine step failed: RuntimeError: scheduler bug"
    assert after.finish_reason == "length" and after.num_output_tokens == 4 and held == 0


def test_a_sink_that_raises_loses_no_other_requests_output(tiny_loaded):
    """A step's outputs go to their sinks in one callback on the event loop: one sink raising (its
    own request's fault) used to leave the outputs after it in that step undelivered. Now each
    request, the ones stepped beside a failing sink included, gets all its tokens."""

    async def go():
        loop = asyncio.get_running_loop()
        runner = EngineRunner(
            lambda: LLMEngine(EngineConfig(kv_cache_bytes=16 << 20, num_threads=1), loaded=tiny_loaded), loop
        )
        await runner.start()
        got = {rid: [] for rid in ("a", "b", "c")}
        ended = {rid: loop.create_future() for rid in got}

        def sink_of(rid):
            def sink(out):
                got[rid].extend(out.new_token_ids)
                if out.finished:
                    ended[rid].set_result(out.finish_reason)
                if rid == "a":
                    raise RuntimeError("a sink's fault")

            return sink

        for rid in got:
            runner.sinks[rid] = sink_of(rid)

        def add(e):
            for i, rid in enumerate(got):
                e.add_request(rid, [5 + i, 6, 7, 8], SamplingParams(max_tokens=6, ignore_eos=True))

        await runner.submit(add)
        reasons = await asyncio.wait_for(asyncio.gather(*ended.values()), 30)
        runner.stop()
        return reasons, got

    reasons, got = asyncio.run(go())
    assert reasons == ["length"] * 3 and all(len(tokens) == 6 for tokens in got.values()), got


def test_an_on_step_that_raises_does_not_stop_the_engines_thread(tiny_loaded):
    """on_step (a worker's metrics, run on the engine's thread after each step) raising once ended
    that thread: every request held waited for its deadline, and no step ran again."""
    calls = []

    def on_step():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("a metric's fault")

    async def go():
        loop = asyncio.get_running_loop()
        runner = EngineRunner(
            lambda: LLMEngine(EngineConfig(kv_cache_bytes=16 << 20, num_threads=1), loaded=tiny_loaded),
            loop,
            on_step=on_step,
        )
        await runner.start()
        served = await _served(runner, 5)
        runner.stop()
        return served

    reason, tokens = asyncio.run(go())
    assert reason == "length" and len(tokens) == 5 and len(calls) >= 5
