"""Scale to zero inside one server: models idle longer than their ``idle_unload_seconds``
are unloaded, and their next request loads them again (:meth:`ModelManager.wake`).

A model is idle when none of its versions finished, failed or started a request, and
none has one queued, for the whole delay. The check reads counters the serving path
keeps anyway, so a request pays nothing for it.

Example::

    watcher = IdleWatcher(manager, default_s=300.0)
    task = asyncio.create_task(watcher.run())
"""

from __future__ import annotations

import asyncio
import logging
import time

from slipstream.serving.manager import ModelManager
from slipstream.serving.model import ModelVersion

logger = logging.getLogger(__name__)

# How often the check runs at most (a shorter delay is checked more often).
_MAX_TICK_S = 1.0


class IdleWatcher:
    """Unloads idle models; one per server."""

    def __init__(self, manager: ModelManager, default_s: float) -> None:
        self._manager = manager
        self._default_s = default_s
        # Model -> (its activity count when it last changed, when that was, and the
        # version it was counted on: a reload starts the idle clock again).
        self._seen: dict[str, tuple[int, float, ModelVersion]] = {}

    def delay_s(self, versions: list[ModelVersion]) -> float:
        """The model's idle delay (0: never unloaded), from its config or the default."""
        config = versions[0].config
        if config.pin:
            return 0.0
        own = config.idle_unload_seconds
        return self._default_s if own is None else own

    async def run(self) -> None:
        """Check until cancelled."""
        while True:
            await asyncio.sleep(self.tick_s())
            try:
                await self.check(time.monotonic())
            except Exception:
                logger.exception("idle check failed")

    def tick_s(self) -> float:
        delays = [self.delay_s(v) for _, v in self._manager.idle_candidates()]
        shortest = min((d for d in delays if d > 0), default=_MAX_TICK_S)
        return min(_MAX_TICK_S, max(0.05, shortest / 4))

    async def check(self, now: float) -> list[str]:
        """Unload the models idle past their delay; the names unloaded."""
        unloaded = []
        serving = self._manager.idle_candidates()
        for name in [n for n in self._seen if n not in dict(serving)]:
            del self._seen[name]  # asleep or gone: it starts afresh when it loads
        for name, versions in serving:
            delay = self.delay_s(versions)
            if delay <= 0:
                continue
            activity = sum(_activity(model) for model in versions)
            busy = any(model.batcher.num_pending for model in versions)
            seen = self._seen.get(name)
            if seen is None or seen[0] != activity or busy or seen[2] is not versions[0]:
                self._seen[name] = (activity, now, versions[0])
                continue
            if now - seen[1] >= delay and await self._manager.sleep(name):
                del self._seen[name]
                unloaded.append(name)
        return unloaded


def _activity(model: ModelVersion) -> int:
    """A count that moves whenever the version takes, runs or ends a request."""
    metrics = model.metrics  # cache hits count as successes
    return metrics.request_success + sum(metrics.request_failure.values()) + metrics.dispatch_count
