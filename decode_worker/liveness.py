"""The decode worker's registry entry, written from a thread of its own.

The worker's event loop relays every stream's tokens and takes every handoff; in a burst it
can be busy for seconds at a time. A heartbeat written from that loop would wait behind it, the
entry's lease (3 heartbeats) would lapse, and routers, finding no decode worker, would fail the
requests they admit meanwhile. This thread has its own Redis connection and needs nothing from
the loop: the entry lapses only when the process is stopped, stalled in one engine step
(StepWatch), or cut off from Redis.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

from splitserve.service import redis_scripts as scripts
from splitserve.service.redis_scripts import Scripts
from splitserve.service.redis_state import Keys, WorkerInfo, open_redis
from splitserve.service.settings import Settings
from splitserve.service.watchdog import StepWatch

log = logging.getLogger(__name__)

LEASE_HEARTBEATS = 3


class Heartbeat:
    """Writes `info()` as this worker's registry entry once a heartbeat, on a daemon thread.
    `on_stall(stalled)` is called from that thread whenever the engine's stall state changes."""

    def __init__(
        self,
        settings: Settings,
        name: str,
        watch: StepWatch,
        metrics,
        info: Callable[[], WorkerInfo],
        on_stall: Callable[[bool], None],
    ):
        self.s = settings
        self.name = name
        self.watch = watch
        self.metrics = metrics
        self.info = info
        self.on_stall = on_stall
        self.lease_s = LEASE_HEARTBEATS * settings.heartbeat_s
        # Its own connection: a command never queues behind the loop's. Its timeout is the lease:
        # a round Redis holds longer has lapsed anyway, and the next one is tried at once.
        self.redis = open_redis(settings, socket_timeout=self.lease_s, socket_connect_timeout=self.lease_s)
        self.scripts = Scripts(self.redis)
        self.keys = Keys(settings.redis_prefix)
        self.stopped = threading.Event()
        self.last_written: float | None = None  # monotonic time of the last write Redis answered
        self.thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        serving = True
        wait = 0.0  # the first write at once
        while not self.stopped.wait(wait):
            wait = self.s.heartbeat_s
            stalled = self.watch.stalled()
            self.metrics.stalled.set(int(stalled))
            if stalled == serving:  # a step that does not return: report it, and let the lease lapse
                serving = not stalled
                self.on_stall(stalled)
            if stalled:
                continue
            started = time.monotonic()
            try:  # Redis down or restarted empty: keep trying, so the worker registers again when it is back
                info = self.info()
                self.scripts.run(scripts.heartbeat(self.keys, info=info, lease_s=self.lease_s))
                self._written(started)
            except redis.RedisError as e:
                log.warning("heartbeat failed: %s", e)
            except Exception:  # noqa: BLE001 - the heartbeat must outlive any round (its lease would lapse)
                log.exception("heartbeat round failed")
            # One write a heartbeat, the round's time included: a round that Redis held is followed
            # by a write at once, not a heartbeat on.
            wait = max(0.0, self.s.heartbeat_s - (time.monotonic() - started))

    def _written(self, started: float) -> None:
        last, self.last_written = self.last_written, time.monotonic()
        if last is not None and started - last > self.lease_s:
            self.metrics.lease_lapses.inc()
            log.warning(
                "registry lease lapsed: %.1f s between two heartbeats that Redis answered (lease %.1f s); "
                "routers placed nothing here meanwhile",
                started - last,
                self.lease_s,
            )

    def leave(self) -> None:
        """Stop writing, and remove the entry (its lease would end it anyway)."""
        self.stopped.set()
        self.thread.join(timeout=self.lease_s + 1)
        try:
            self.redis.delete(self.keys.worker("decode", self.name))
        except redis.RedisError as e:  # its lease ends it anyway; drain regardless
            log.warning("could not remove the registry entry: %s", e)
        self.redis.close()
