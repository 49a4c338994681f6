"""Cost per inference on the server: the price of the machine shared out by compute time.

With ``--price-per-hour``, the server's cost over the last ``cost_window_s`` seconds is
split among the model versions by their share of compute time in that window (the sum of
their batches' execution times), and each share is divided by the inferences the
version ran in the window:

    cost per 1M inferences = price/h x window/3600 x compute share / inferences x 1e6

With one model this is the price divided by the throughput, as ``slipstream bench
--price-per-hour`` computes it from the client's side, so the two agree on the same run.
Idle time is paid too (the machine costs the same), which is what an operator pays.

The runner calls :meth:`CostTracker.sample` every few seconds; a scrape reads the
gauges over the snapshots of the last window. A version's counts start again from zero
when it is reloaded (fresh counters for the new instance), so the window's deltas are
summed snapshot to snapshot, and a count from another instance, or one that went down,
is counted from zero, as Prometheus's rate() takes a counter reset.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from slipstream.observability.metrics import ModelMetrics, ServerMetrics


@dataclass(frozen=True)
class _Count:
    """One version's counts at a snapshot."""

    # The counters read: a reload replaces them (held, so a new one never takes the id
    # of one freed).
    source: ModelMetrics
    # Compute seconds and inferences since that instance loaded.
    compute_s: float
    inferences: int


@dataclass(frozen=True)
class _Snapshot:
    at_s: float
    totals: dict[tuple[str, str], _Count]


class CostTracker(Collector):
    """Gauges of cost per million inferences and compute share per model version."""

    def __init__(self, metrics: ServerMetrics, price_per_hour: float, window_s: float) -> None:
        self._metrics = metrics
        self.price_per_hour = price_per_hour
        self.window_s = window_s
        self._snapshots: deque[_Snapshot] = deque()

    def sample(self, now_s: float) -> None:
        """Record the counts now; keep what the window needs (and one snapshot before it)."""
        totals = {
            (m.labels[0], m.labels[1]): _Count(m, m.compute_duration.total, m.inference_count)
            for m in self._metrics.models()
        }
        self._snapshots.append(_Snapshot(now_s, totals))
        while len(self._snapshots) > 2 and self._snapshots[1].at_s <= now_s - self.window_s:
            self._snapshots.popleft()

    def costs(self) -> dict[tuple[str, str], tuple[float, float]]:
        """(cost per 1M inferences, compute share) per version over the window; versions
        that ran nothing in it are left out."""
        if len(self._snapshots) < 2:
            return {}
        elapsed_s = self._snapshots[-1].at_s - self._snapshots[0].at_s
        deltas = self._deltas()
        total_compute_s = sum(c for c, _ in deltas.values())
        if elapsed_s <= 0 or total_compute_s <= 0:
            return {}
        window_cost = self.price_per_hour * elapsed_s / 3600
        return {
            key: (
                window_cost * (compute_s / total_compute_s) / inferences * 1e6,
                compute_s / total_compute_s,
            )
            for key, (compute_s, inferences) in deltas.items()
            if inferences > 0
        }

    def _deltas(self) -> dict[tuple[str, str], tuple[float, int]]:
        """(compute seconds, inferences) per version over the window, summed snapshot to
        snapshot; versions not loaded at its end are left out."""
        deltas: dict[tuple[str, str], tuple[float, int]] = {}
        for before, after in itertools.pairwise(self._snapshots):
            for key, now in after.totals.items():
                then = before.totals.get(key)
                compute_s, inferences = now.compute_s, now.inferences
                # Another instance's counts, or counts that went down (a reset), are all
                # new; never a negative delta.
                if (
                    then is not None
                    and then.source is now.source
                    and compute_s >= then.compute_s
                    and inferences >= then.inferences
                ):
                    compute_s -= then.compute_s
                    inferences -= then.inferences
                sum_s, sum_n = deltas.get(key, (0.0, 0))
                deltas[key] = (sum_s + compute_s, sum_n + inferences)
        last = self._snapshots[-1].totals
        return {key: delta for key, delta in deltas.items() if key in last}

    def collect(self) -> Iterator[Metric]:
        price = GaugeMetricFamily(
            "slipstream_price_per_hour", "The machine's price per hour (--price-per-hour)."
        )
        price.add_metric([], self.price_per_hour)
        per_million = GaugeMetricFamily(
            "slipstream_cost_per_million_inferences",
            "The machine's cost over the last --cost-window-s, shared out by compute time, "
            "per million inferences of the version",
            labels=["model", "version"],
        )
        share = GaugeMetricFamily(
            "slipstream_compute_share",
            "The version's share of the server's compute time over the last --cost-window-s",
            labels=["model", "version"],
        )
        for (model, version), (cost, fraction) in sorted(self.costs().items()):
            per_million.add_metric([model, version], cost)
            share.add_metric([model, version], fraction)
        yield from (price, per_million, share)
