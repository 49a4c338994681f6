"""Models coming and going: loads (and how long they took), unloads by reason, and the
requests that waited for a model to load (scale to zero inside one server).

Counted in plain objects on the event loop, turned into metric families at scrape time,
as :mod:`slipstream.observability.metrics` does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from slipstream.observability.metrics import Histogram

# Why a model version stopped being served, as the `reason` label.
UNLOAD_REASONS = ("idle", "request", "removed")
# Load durations from 10 ms (a small ONNX file) to 5 minutes (a large checkpoint).
_LOAD_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class LifecycleMetrics(Collector):
    """Loads, unloads and waits per model (the label is the model, not its version)."""

    def __init__(self) -> None:
        self.loads: Counter[tuple[str, str]] = Counter()  # (model, outcome: ready|failed)
        self.unloads: Counter[tuple[str, str]] = Counter()  # (model, reason)
        self.load_waits: Counter[str] = Counter()  # requests that waited for a load
        self._durations: dict[str, Histogram] = {}

    def loaded(self, model: str, seconds: float, ok: bool) -> None:
        """One version's load attempt finished."""
        histogram = self._durations.get(model)
        if histogram is None:  # its first load: every series of it from now on (rate())
            histogram = self._durations[model] = Histogram(_LOAD_BUCKETS_S)
            for outcome in ("ready", "failed"):
                self.loads[model, outcome] += 0
            for reason in UNLOAD_REASONS:
                self.unloads[model, reason] += 0
            self.load_waits[model] += 0
        self.loads[model, "ready" if ok else "failed"] += 1
        histogram.observe(seconds)

    def collect(self) -> Iterator[Metric]:
        loads = CounterMetricFamily(
            "slipstream_model_loads",
            "Model version loads finished, by outcome (ready, failed): at start, on "
            "request, by polling, and on demand after an idle unload.",
            labels=["model", "outcome"],
        )
        for (model, outcome), count in sorted(self.loads.items()):
            loads.add_metric([model, outcome], count)
        unloads = CounterMetricFamily(
            "slipstream_model_unloads",
            "Model versions unloaded, by reason: idle (idle_unload_seconds), request "
            "(the repository API), removed (gone from the repository, poll mode).",
            labels=["model", "reason"],
        )
        for (model, reason), count in sorted(self.unloads.items()):
            unloads.add_metric([model, reason], count)
        waits = CounterMetricFamily(
            "slipstream_model_load_waits",
            "Requests that arrived for an idle-unloaded model and waited for it to load.",
            labels=["model"],
        )
        for model, count in sorted(self.load_waits.items()):
            waits.add_metric([model], count)
        durations = HistogramMetricFamily(
            "slipstream_model_load_seconds",
            "How long each model version's load took (files read, instances created, "
            "warm-up run), successful or not.",
            labels=["model"],
        )
        for model, histogram in sorted(self._durations.items()):
            durations.add_metric([model], histogram.cumulative(), histogram.total)
        yield from (loads, unloads, waits, durations)
