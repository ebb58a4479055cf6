"""EngineRunner: the one thread that owns an engine; everything else sends it commands.

The engine is not thread-safe. Commands (``submit``) run on the engine thread
between steps and answer through an asyncio future; every RequestOutput of a step is
handed to its request's sink on the event loop.

The engine thread also builds the engine, so that every torch op of the process runs on
it. NOTE: each thread that runs a parallel op gets an OpenMP team of its own, and a
second team (here: the loader's, on an executor thread) made the decode step 2-3%
slower (1 and 8 sequences, PASSIVE wait with GOMP_SPINCOUNT=30000, three runs each).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable

from splitserve.engine.engine import LLMEngine
from splitserve.engine.errors import StepFailed
from splitserve.engine.outputs import RequestOutput
from splitserve.service.watchdog import StepWatch

log = logging.getLogger(__name__)


class EngineRunner:
    def __init__(
        self,
        make_engine: Callable[[], LLMEngine],
        loop: asyncio.AbstractEventLoop,
        on_step: Callable[[], None] | None = None,
        watch: StepWatch | None = None,
    ):
        self._make_engine = make_engine
        self._built: concurrent.futures.Future = concurrent.futures.Future()
        self.engine: LLMEngine = None  # type: ignore[assignment]  # set by start()
        self.watch = watch or StepWatch(0, "engine")
        self.loop = loop
        self.sinks: dict[str, Callable[[RequestOutput], None]] = {}  # touched on the loop thread only
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._on_step = on_step
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    async def start(self) -> LLMEngine:
        """Start the engine thread; it builds the engine, which this returns (or the error building it raised)."""
        self._thread.start()
        return await asyncio.wrap_future(self._built)

    def stop(self) -> None:
        self._stop.set()
        self._cmds.put(None)
        self._thread.join(timeout=10)

    def submit(self, fn: Callable[[LLMEngine], object]) -> asyncio.Future:
        fut = self.loop.create_future()
        self._cmds.put((fn, fut))
        return fut

    def submit_nowait(self, fn: Callable[[LLMEngine], object]) -> None:
        self._cmds.put((fn, None))

    def _resolve(self, fut, result, exc) -> None:
        if fut is None or fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def _run(self) -> None:
        try:
            eng = self.engine = self._make_engine()
        except BaseException as e:  # noqa: BLE001 - raised by start()
            self._built.set_exception(e)
            return
        self._built.set_result(eng)
        while not self._stop.is_set():
            try:  # with nothing to compute, sleep until a command comes (stop() sends None): no polling
                item = self._cmds.get_nowait() if eng.has_work() else self._cmds.get()
            except queue.Empty:
                item = ()
            while item:
                fn, fut = item
                try:
                    result, exc = fn(eng), None
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    result, exc = None, e
                if fut is not None:
                    self.loop.call_soon_threadsafe(self._resolve, fut, result, exc)
                try:
                    item = self._cmds.get_nowait()
                except queue.Empty:
                    item = ()
            if item is None or self._stop.is_set():
                break
            if eng.has_work():
                try:
                    with self.watch.step():
                        outputs = eng.step()
                except Exception as e:  # noqa: BLE001 - never lose the process; fail what was running
                    log.exception("engine step failed; failing its requests")
                    outputs = eng.fail_all(StepFailed(e))
                if self._on_step is not None:  # first: a step's metrics are in before its outputs leave
                    try:
                        self._on_step()
                    except Exception:  # noqa: BLE001 - a step's metrics must not stop the engine's thread
                        log.exception("after an engine step")
                if outputs:
                    self.loop.call_soon_threadsafe(self._deliver, outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            sink = self.sinks.get(out.request_id)
            if sink is not None:
                try:
                    sink(out)
                except Exception:  # noqa: BLE001 - the step's other outputs still go out
                    log.exception("the output of %s was not delivered", out.request_id)
