"""The numbers behind a benchmark: latency histogram and stability rule.

Latencies go into a log-bucketed histogram kept in numpy rather than the
``hdrhistogram`` package: every bucket is 1% wider than the one before, so a value read
back at its bucket's geometric midpoint is within 0.5% of the truth from 1 us to 1000 s
in 2,085 buckets (16 KB). Histograms of different worker processes and windows add up
bucket by bucket, and recording is a numpy pass over a window's raw latencies, not one
Python call per request. HDR's constant *significant digits* buys nothing over a
constant relative error here, and its Python package is little maintained.

>>> hist = LatencyHistogram.from_latencies(np.array([0.001, 0.002, 0.003, 0.004]))
>>> round(hist.percentile_s(50) * 1000, 1), round(hist.mean_s * 1000, 2)
(2.0, 2.5)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

# Histogram range: latencies below land in the first bucket, above in the last.
LATENCY_MIN_S = 1e-6
LATENCY_MAX_S = 1e3
# Each bucket's upper bound is this factor times its lower bound.
BUCKET_GROWTH = 1.01
# Worst-case relative error of a value read at its bucket's geometric midpoint.
RELATIVE_ERROR = math.sqrt(BUCKET_GROWTH) - 1
_LOG_GROWTH = math.log(BUCKET_GROWTH)
_NUM_BUCKETS = math.ceil(math.log(LATENCY_MAX_S / LATENCY_MIN_S) / _LOG_GROWTH)
# Bucket i (1.._NUM_BUCKETS) holds [MIN * g^(i-1), MIN * g^i); 0 and the last hold
# what falls outside the range.
_MIDPOINTS_S = LATENCY_MIN_S * BUCKET_GROWTH ** (np.arange(_NUM_BUCKETS + 2) - 0.5)
_MIDPOINTS_S[0] = LATENCY_MIN_S
_MIDPOINTS_S[-1] = LATENCY_MAX_S

# perf_analyzer's stability rule looks at this many most recent windows.
STABILITY_WINDOWS = 3


@dataclass
class LatencyHistogram:
    """Counts of latencies per log-spaced bucket, plus the exact count, sum, min and max."""

    # [_NUM_BUCKETS + 2] int64: underflow, the buckets, overflow.
    counts: np.ndarray = field(default_factory=lambda: np.zeros(_NUM_BUCKETS + 2, np.int64))
    # Exact figures, kept beside the buckets: the mean and the extremes are not rounded.
    count: int = 0
    total_s: float = 0.0
    min_s: float = math.inf
    max_s: float = 0.0

    @classmethod
    def from_latencies(cls, latencies_s: np.ndarray) -> LatencyHistogram:
        """A histogram of raw latencies in seconds, [N] float64."""
        hist = cls()
        if latencies_s.size == 0:
            return hist
        # Zero and negative (clock) values go to the underflow bucket with the rest.
        positive = np.maximum(latencies_s, LATENCY_MIN_S / 2)
        scaled = np.log(positive / LATENCY_MIN_S) / _LOG_GROWTH
        index = np.floor(np.minimum(scaled, _NUM_BUCKETS)).astype(np.int64) + 1
        np.clip(index, 0, _NUM_BUCKETS + 1, out=index)
        hist.counts = np.bincount(index, minlength=_NUM_BUCKETS + 2).astype(np.int64)
        hist.count = int(latencies_s.size)
        hist.total_s = float(latencies_s.sum())
        hist.min_s = float(latencies_s.min())
        hist.max_s = float(latencies_s.max())
        return hist

    def merge(self, other: LatencyHistogram) -> LatencyHistogram:
        """A new histogram holding both (windows, or worker processes)."""
        return LatencyHistogram(
            counts=self.counts + other.counts,
            count=self.count + other.count,
            total_s=self.total_s + other.total_s,
            min_s=min(self.min_s, other.min_s),
            max_s=max(self.max_s, other.max_s),
        )

    @property
    def mean_s(self) -> float:
        return self.total_s / self.count if self.count else math.nan

    def ms(self, q: float | None = None) -> float | None:
        """The mean (``q`` None) or the q-th percentile in ms, as reports show them;
        None when empty."""
        if self.count == 0:
            return None
        return 1000 * (self.mean_s if q is None else self.percentile_s(q))

    def percentile_s(self, q: float) -> float:
        """The q-th percentile (nearest rank: the smallest value with q% at or below it).

        Within :data:`RELATIVE_ERROR` of ``np.percentile(values, q,
        method="inverted_cdf")``; NaN when empty.
        """
        if self.count == 0:
            return math.nan
        rank = max(1, math.ceil(q / 100 * self.count))
        if rank == 1:
            return self.min_s
        if rank == self.count:
            return self.max_s
        bucket = int(np.searchsorted(np.cumsum(self.counts), rank))
        return float(min(max(_MIDPOINTS_S[bucket], self.min_s), self.max_s))


def merge_histograms(histograms: Sequence[LatencyHistogram]) -> LatencyHistogram:
    merged = LatencyHistogram()
    for hist in histograms:
        merged = merged.merge(hist)
    return merged


def within_pct_of_mean(values: Sequence[float], pct: float) -> bool:
    """True when every value lies within ``pct`` percent of the values' mean."""
    if not values or any(math.isnan(v) for v in values):
        return False
    mean = sum(values) / len(values)
    tolerance = abs(mean) * pct / 100
    return all(abs(v - mean) <= tolerance for v in values)


def is_stable(throughputs: Sequence[float], mean_latencies: Sequence[float], pct: float) -> bool:
    """perf_analyzer's rule: the last 3 windows' throughput and mean latency each lie
    within ``pct`` percent of their own average. Windows without a success never count.

    >>> is_stable([100, 104, 97], [1.0, 1.02, 0.99], 10)
    True
    >>> is_stable([100, 130, 97], [1.0, 1.02, 0.99], 10)
    False
    """
    if len(throughputs) < STABILITY_WINDOWS or len(mean_latencies) < STABILITY_WINDOWS:
        return False
    recent_throughputs = list(throughputs[-STABILITY_WINDOWS:])
    if min(recent_throughputs) <= 0:
        return False
    return within_pct_of_mean(recent_throughputs, pct) and within_pct_of_mean(
        list(mean_latencies[-STABILITY_WINDOWS:]), pct
    )
