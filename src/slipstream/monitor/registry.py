"""Every version's drift monitor in one process: made at load, read by /metrics and the
drift route, closed at unload.

The process runner passes :meth:`DriftMonitors.tap_for` to the serving core as its tap
factory, registers :meth:`DriftMonitors.collect` with the Prometheus registry, and
answers ``GET /v2/models/{m}[/versions/{v}]/drift`` with :meth:`DriftMonitors.report`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from slipstream.config import ModelConfig
from slipstream.errors import ModelNotFound
from slipstream.monitor.sampler import DriftMonitor


class DriftMonitors(Collector):
    """The live monitors by (model, version)."""

    def __init__(self) -> None:
        self._monitors: dict[tuple[str, str], DriftMonitor] = {}

    def tap_for(
        self, model: str, version: str, config: ModelConfig, version_dir: Path
    ) -> _Tap | None:
        """A monitor for the version when its config enables drift, else None."""
        settings = config.monitoring.drift
        if not settings.enable:
            return None
        if importlib.util.find_spec("scipy") is None:
            raise ValueError(
                "monitoring.drift.enable: drift tests need scipy: pip install "
                "'slipstream[monitor]' (or turn monitoring.drift.enable off)"
            )
        monitor = DriftMonitor(model, version, settings, version_dir)
        self._monitors[(model, version)] = monitor
        return _Tap(self, monitor)

    def _forget(self, monitor: DriftMonitor) -> None:
        key = (monitor.model, monitor.version)
        if self._monitors.get(key) is monitor:
            del self._monitors[key]

    def report(self, model: str, version: str = "") -> dict[str, Any]:
        """The drift of a version (the newest monitored one when ``version`` is empty)."""
        versions = {v: m for (name, v), m in self._monitors.items() if name == model}
        if version:
            monitor = versions.get(version)
        else:
            monitor = versions[max(versions, key=int)] if versions else None
        if monitor is None:
            which = f"model {model!r} version {version}" if version else f"model {model!r}"
            raise ModelNotFound(
                f"{which} has no drift monitor: it is not loaded, or its config.yaml does not "
                "set monitoring.drift.enable: true"
            )
        return monitor.to_json()

    def reports(self) -> list[dict[str, Any]]:
        """Every monitored version's report, by model and version."""
        return [monitor.to_json() for _, monitor in sorted(self._monitors.items())]

    def collect(self) -> Iterator[Metric]:
        labels = ["model", "version", "tensor", "feature"]
        p_value = GaugeMetricFamily(
            "slipstream_drift_p_value",
            "p-value of the last window's test, per feature",
            labels=labels,
        )
        score = GaugeMetricFamily(
            "slipstream_drift_score",
            "PSI of the last window against the reference, per feature (> 0.2: a large shift)",
            labels=labels,
        )
        detected = GaugeMetricFamily(
            "slipstream_drift_detected",
            "1 when the last window of the tensor drifted (Bonferroni over its features)",
            labels=["model", "version", "tensor"],
        )
        sampled = CounterMetricFamily(
            "slipstream_drift_samples", "Requests sampled for drift", labels=["model", "version"]
        )
        dropped = CounterMetricFamily(
            "slipstream_drift_samples_dropped",
            "Sampled requests dropped because the drift queue was full",
            labels=["model", "version"],
        )
        windows = CounterMetricFamily(
            "slipstream_drift_windows",
            "Windows tested (one per window, whatever the number of tensors it tests)",
            labels=["model", "version"],
        )

        for (model, version), monitor in sorted(self._monitors.items()):
            state = monitor.state
            sampled.add_metric([model, version], state.sampled)
            dropped.add_metric([model, version], state.dropped)
            windows.add_metric([model, version], state.windows)
            for tensor, report in sorted(state.reports.items()):
                detected.add_metric([model, version, tensor], float(report.detected))
                for feature in report.features:
                    key = [model, version, tensor, feature.feature]
                    p_value.add_metric(key, feature.p_value)
                    score.add_metric(key, feature.psi)
        yield from (p_value, score, detected, sampled, dropped, windows)


class _Tap:
    """A monitor as the serving core's response tap; closing it forgets it here too."""

    def __init__(self, registry: DriftMonitors, monitor: DriftMonitor) -> None:
        self._registry = registry
        self.offer = monitor.offer
        self._monitor = monitor

    def close(self) -> None:
        self._registry._forget(self._monitor)
        self._monitor.close()
