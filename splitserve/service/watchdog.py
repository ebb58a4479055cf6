"""Is a worker's engine stuck in one step?

A step that does not return (a hung GPU kernel or driver, a deadlock in a native
library) leaves the process alive: its gRPC server still answers health checks and
its heartbeat thread still renews its lease, so work keeps coming to it. The engine's
loop brackets each step with ``StepWatch.step()``; the heartbeat asks ``stalled()``.
While a step has run longer than ``ENGINE_STALL_S``, the worker reports NOT_SERVING
(so a liveness probe restarts it) and stops renewing its registry lease (so routers
and, for a prefill worker, the job stream's other consumers take its work).
"""

from __future__ import annotations

import contextlib
import logging
import time

log = logging.getLogger(__name__)


class StepWatch:
    def __init__(self, stall_s: float, what: str):
        self.stall_s = stall_s  # 0 = off
        self.what = what
        self._since: float | None = None  # monotonic start of the step in progress
        self.reported = False

    @contextlib.contextmanager
    def step(self):
        self._since = time.monotonic()
        try:
            yield
        finally:
            self._since = None

    def in_step_for(self) -> float:
        since = self._since
        return 0.0 if since is None else time.monotonic() - since

    def stalled(self) -> bool:
        """True while the step in progress has run longer than the limit; logs each change."""
        now = bool(self.stall_s) and self.in_step_for() > self.stall_s
        if now != self.reported:
            self.reported = now
            if now:
                log.error(
                    "%s: one engine step has run for over %.0f s: reporting NOT_SERVING and letting "
                    "the registry lease lapse",
                    self.what,
                    self.stall_s,
                )
            else:
                log.warning("%s: the stalled engine step returned: serving again", self.what)
        return now
