"""``/metrics`` of every replica under Ray, with the server's names.

Each replica keeps its own Prometheus registry (the serving core's
:class:`~slipstream.observability.metrics.ServerMetrics`). It sends a snapshot of it
every ``PUSH_INTERVAL_S`` to one board (a Ray actor the driver owns); ``/metrics`` at the
root application answers the latest snapshot of every live replica, each series with a
``replica`` label, so one scrape of the Service sees every replica (the figures of a
replica that stopped reporting drop out after ``STALE_AFTER_S``).

    # replica                                   # the root application's /metrics
    board.put.remote(replica_id, snapshot(registry))
                                                text = merged_text(await board.all.remote())
"""

from __future__ import annotations

import time
from typing import Any

from slipstream.observability import merge
from slipstream.observability.merge import Family, snapshot

__all__ = ["BOARD_NAME", "MetricsBoard", "board_actor", "merged_text", "snapshot"]

BOARD_NAME = "slipstream-metrics"
BOARD_NAMESPACE = "slipstream"
PUSH_INTERVAL_S = 2.0
STALE_AFTER_S = 3 * PUSH_INTERVAL_S


def merged_text(reports: dict[str, list[Family]]) -> bytes:
    """The Prometheus text of every replica's snapshot, a ``replica`` label on each series."""
    return merge.merged_text(
        ({"replica": replica} if replica else {}, report)
        for replica, report in sorted(reports.items())
    )


class MetricsBoard:
    """The latest snapshot of each replica (a Ray actor: ``board_actor()``)."""

    def __init__(self) -> None:
        self._reports: dict[str, tuple[float, list[Family]]] = {}

    def put(self, replica: str, report: list[Family]) -> None:
        self._reports[replica] = (time.monotonic(), report)

    def drop(self, replica: str) -> None:
        self._reports.pop(replica, None)

    def all(self) -> dict[str, list[Family]]:
        """Every replica's snapshot, once stale ones are forgotten."""
        now = time.monotonic()
        for replica, (at, _) in list(self._reports.items()):
            if now - at > STALE_AFTER_S:
                del self._reports[replica]
        return {replica: report for replica, (_, report) in self._reports.items()}


def board_actor() -> Any:
    """The board's actor class (Ray imported only here)."""
    import ray

    return ray.remote(num_cpus=0)(MetricsBoard)
