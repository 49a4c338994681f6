"""Cascade metrics: which stage answered, how many rows went on, how often a stage failed.

The stages' own request, queue and compute series are those of their models
(``slipstream_request_success{model="digits_small"}``, ...); these add what the cascade
decides. Plain counts updated on the event loop and read at scrape time, as in
:mod:`slipstream.observability.metrics`.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector


class CascadeCounts:
    """One cascade's counts by stage name; the serving core writes, scrapes read."""

    __slots__ = ("escalated_rows", "escalations", "fallbacks", "requests", "rows", "stages")

    def __init__(self, stages: list[str]) -> None:
        self.stages = stages
        # Requests by the last stage that answered any of their rows.
        self.requests = dict.fromkeys(stages, 0)
        # Rows answered by each stage.
        self.rows = dict.fromkeys(stages, 0)
        # Requests (and rows) sent on to each stage after the first.
        self.escalations = dict.fromkeys(stages[1:], 0)
        self.escalated_rows = dict.fromkeys(stages[1:], 0)
        # Requests answered by an earlier stage because this stage failed.
        self.fallbacks = dict.fromkeys(stages[1:], 0)


class CascadeMetrics:
    """Every loaded cascade's counts, exported through one collector."""

    def __init__(self) -> None:
        self.cascades: dict[str, CascadeCounts] = {}

    def for_cascade(self, model: str, stages: list[str]) -> CascadeCounts:
        """Fresh counts for ``model`` (a reload with other stages starts again)."""
        counts = self.cascades.get(model)
        if counts is None or counts.stages != stages:
            counts = self.cascades[model] = CascadeCounts(stages)
        return counts

    def remove(self, model: str) -> None:
        self.cascades.pop(model, None)

    def collector(self) -> Collector:
        return _CascadeCollector(self)


class _CascadeCollector(Collector):
    def __init__(self, metrics: CascadeMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        cascades = list(self._metrics.cascades.items())
        if not cascades:
            return  # a server without cascades exports none of these
        labels = ["model", "stage"]
        families = (
            (
                "requests",
                "slipstream_cascade_requests",
                "Cascade requests by the stage that answered (the last stage any row reached).",
            ),
            ("rows", "slipstream_cascade_rows", "Cascade rows answered by each stage."),
            (
                "escalations",
                "slipstream_cascade_escalations",
                "Cascade requests with rows sent on to this stage.",
            ),
            (
                "escalated_rows",
                "slipstream_cascade_escalated_rows",
                "Cascade rows sent on to this stage.",
            ),
            (
                "fallbacks",
                "slipstream_cascade_fallbacks",
                "Cascade requests answered by an earlier stage because this one failed "
                "(on_stage_failure: answer).",
            ),
        )
        for attribute, name, documentation in families:
            family = CounterMetricFamily(name, documentation, labels=labels)
            for model, counts in cascades:
                for stage, count in getattr(counts, attribute).items():
                    family.add_metric([model, stage], count)
            yield family
