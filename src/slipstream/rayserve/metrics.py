"""``/metrics`` of every replica under Ray, with the server's names.

Each replica keeps its own Prometheus registry (the serving core's
:class:`~slipstream.observability.metrics.ServerMetrics`). It sends a snapshot of it
every ``PUSH_INTERVAL_S`` to one board (a Ray actor the driver owns); ``/metrics`` at the
root application answers the latest snapshot of every live replica, each series with a
``replica`` label, so one scrape of the Service sees every replica (the figures of a
replica that stopped reporting drop out after ``STALE_AFTER_S``). The same report
carries the replica's V2 statistics and repository index entries, which the root's
``/v2/models/stats`` and ``/v2/repository/index`` add up, and its drift reports, which a
model's ``/drift`` answers beside its own (:mod:`slipstream.rayserve.control`).

    # replica                                   # the root application's /metrics
    board.put.remote(replica_id, ReplicaReport(snapshot(registry), stats, index, drift))
                                                text = merged_text(await board.all.remote())
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from slipstream.observability import merge
from slipstream.observability.merge import Family, snapshot

__all__ = [
    "BOARD_NAME", "MetricsBoard", "ReplicaReport", "board_actor", "merged_text", "snapshot",
]  # fmt: skip

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


@dataclass
class ReplicaReport:
    """What one replica last sent the board."""

    # Its Prometheus registry's snapshot.
    metrics: list[Family]
    # Its models' V2 statistics: the ``model_stats`` items of GET /v2/models/stats.
    model_stats: list[dict[str, Any]] = field(default_factory=list)
    # Its models' repository index entries, as POST /v2/repository/index lists them.
    index: list[dict[str, str]] = field(default_factory=list)
    # Its drift monitors' reports, as GET /v2/models/<model>/drift answers each.
    drift: list[dict[str, Any]] = field(default_factory=list)


class MetricsBoard:
    """The latest report of each replica (a Ray actor: ``board_actor()``)."""

    def __init__(self) -> None:
        self._reports: dict[str, tuple[float, ReplicaReport]] = {}

    def put(self, replica: str, report: ReplicaReport) -> None:
        self._reports[replica] = (time.monotonic(), report)

    def drop(self, replica: str) -> None:
        self._reports.pop(replica, None)

    def all(self) -> dict[str, list[Family]]:
        """Every live replica's metrics snapshot."""
        return {replica: report.metrics for replica, report in self.reports().items()}

    def reports(self) -> dict[str, ReplicaReport]:
        """Every replica's report, once stale ones are forgotten."""
        now = time.monotonic()
        for replica, (at, _) in list(self._reports.items()):
            if now - at > STALE_AFTER_S:
                del self._reports[replica]
        return {replica: report for replica, (_, report) in self._reports.items()}


def board_actor() -> Any:
    """The board's actor class (Ray imported only here)."""
    import ray

    return ray.remote(num_cpus=0)(MetricsBoard)
