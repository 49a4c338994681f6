"""``slipstream_model_ready``: each model version's state, read from the repository index
at scrape time (tensor models and generative ones alike), for the "model not ready" alert."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from slipstream.serving.core import ModelServer


class ModelStateCollector(Collector):
    def __init__(self, service: ModelServer) -> None:
        self._service = service

    def collect(self) -> Iterator[Metric]:
        ready = GaugeMetricFamily(
            "slipstream_model_ready",
            "1 when the model version is READY; 0 while it loads, unloads, after its load "
            "failed, or while it sleeps after an idle unload (state IDLE; its next request "
            "loads it), or after it was unloaded (UNLOADED) (state says which)",
            labels=["model", "version", "state"],
        )
        for entry in self._service.index_now():
            state = entry.state or "UNLOADED"
            if state == "UNAVAILABLE" and entry.reason == "idle":
                state = "IDLE"
            elif state == "UNAVAILABLE" and entry.reason == "unloaded":
                state = "UNLOADED"  # by the operator, or replaced: not an alert
            ready.add_metric([entry.name, entry.version, state], float(state == "READY"))
        yield ready
