"""Rollout metrics: traffic weights, rollout state, analysis verdicts, shadow comparisons.

Per-version request, error and latency series are the serving core's own
(``slipstream_request_success``, ``slipstream_request_failure``,
``slipstream_request_duration_seconds``, labels ``model`` and ``version``), which count
clients' requests only; these add what a rollout decides, and what became of the shadow
copies (``slipstream_shadow_*``: a copy is in no ``slipstream_request_*`` series). Plain
counts updated on the event loop, read at scrape time, as in
:mod:`slipstream.observability.metrics`.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from slipstream.observability.metrics import Histogram

ROLLOUT_STATES = ("none", "running", "paused", "promoted", "rolled_back", "aborted")
VERDICTS = ("pass", "fail", "inconclusive")
# What happened to a request mirrored to a shadow version.
SHADOW_OUTCOMES = ("agreed", "disagreed", "failed", "dropped")
_DIFF_BUCKETS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0)


class ShadowCounts:
    """One shadow version's comparisons."""

    __slots__ = ("max_abs_diff", "min_cosine", "outcomes")

    def __init__(self) -> None:
        self.outcomes = dict.fromkeys(SHADOW_OUTCOMES, 0)
        self.max_abs_diff = Histogram(_DIFF_BUCKETS)
        # Lowest cosine similarity seen between a shadow answer and its primary's.
        self.min_cosine = 1.0


class RolloutMetrics:
    """Every model's rollout series; the rollout controller writes, scrapes read."""

    def __init__(self) -> None:
        # model -> version -> share of unversioned requests, percent.
        self.weights: dict[str, dict[str, float]] = {}
        self.states: dict[str, str] = {}
        # model -> candidate traffic step index.
        self.steps: dict[str, int] = {}
        self.verdicts: dict[str, dict[str, int]] = {}
        self.shadows: dict[tuple[str, str], ShadowCounts] = {}

    def count_verdict(self, model: str, outcome: str) -> None:
        counts = self.verdicts.setdefault(model, dict.fromkeys(VERDICTS, 0))
        counts[outcome] += 1

    def shadow(self, model: str, version: str) -> ShadowCounts:
        counts = self.shadows.get((model, version))
        if counts is None:
            counts = self.shadows[(model, version)] = ShadowCounts()
        return counts

    def collector(self) -> Collector:
        return _RolloutCollector(self)


class _RolloutCollector(Collector):
    def __init__(self, metrics: RolloutMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterator[Metric]:
        m = self._m
        weight = GaugeMetricFamily(
            "slipstream_rollout_weight",
            "Percent of the requests naming no version that each version gets.",
            labels=["model", "version"],
        )
        for model, weights in list(m.weights.items()):
            for version, share in weights.items():
                weight.add_metric([model, version], share)
        state = GaugeMetricFamily(
            "slipstream_rollout_state",
            "1 for a model's rollout state now.",
            labels=["model", "state"],
        )
        step = GaugeMetricFamily(
            "slipstream_rollout_step", "Index of the rollout's current step.", labels=["model"]
        )
        for model, now in list(m.states.items()):
            for name in ROLLOUT_STATES:
                state.add_metric([model, name], 1.0 if name == now else 0.0)
            step.add_metric([model], m.steps.get(model, 0))
        verdicts = CounterMetricFamily(
            "slipstream_rollout_verdicts",
            "Analysis windows judged, by verdict.",
            labels=["model", "verdict"],
        )
        for model, counts in list(m.verdicts.items()):
            for outcome, count in counts.items():
                verdicts.add_metric([model, outcome], count)
        # Only families with samples: a server without rollouts exports none of them.
        yield from (f for f in (weight, state, step, verdicts) if f.samples)
        shadows = list(m.shadows.items())
        if shadows:
            yield from _shadow_families(shadows)


def _shadow_families(shadows: list[tuple[tuple[str, str], ShadowCounts]]) -> Iterator[Metric]:
    labels = ["model", "version"]
    outcomes = CounterMetricFamily(
        "slipstream_shadow_requests",
        "Requests mirrored to a shadow version, by outcome (dropped: its queue was full).",
        labels=[*labels, "outcome"],
    )
    cosine = GaugeMetricFamily(
        "slipstream_shadow_min_cosine",
        "Lowest cosine similarity of a shadow answer's float outputs to the primary's.",
        labels=labels,
    )
    diff = HistogramMetricFamily(
        "slipstream_shadow_max_abs_diff",
        "Largest absolute difference between a shadow answer's float outputs and the "
        "primary's, per compared request.",
        labels=labels,
    )
    for key, counts in shadows:
        for outcome, count in counts.outcomes.items():
            outcomes.add_metric([*key, outcome], count)
        cosine.add_metric(list(key), counts.min_cosine)
        diff.add_metric(list(key), counts.max_abs_diff.cumulative(), counts.max_abs_diff.total)
    yield from (outcomes, cosine, diff)
