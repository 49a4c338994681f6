"""Prometheus metrics, one bound set of children per model version.

Durations are histograms (not summaries) so p99 can be aggregated across replicas.
Label lookups are done once per model version at load time: ``labels()`` costs a
dict lookup and a lock on every call, which the hot path should not pay per request.
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Request-level latencies from 100 us to 30 s.
_LATENCY_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# Why a request failed, as the `reason` label.
FAILURE_REASONS = ("bad_request", "not_found", "queue_full", "timeout", "cancelled", "internal")


class ServerMetrics:
    """Every metric family of one server, registered in its own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ("model", "version")
        r = self.registry
        self.request_success = Counter(
            "slipstream_request_success", "Requests answered successfully.", labels, registry=r
        )
        self.request_failure = Counter(
            "slipstream_request_failure",
            "Requests that failed, by reason.",
            (*labels, "reason"),
            registry=r,
        )
        self.inference_count = Counter(
            "slipstream_inference_count", "Inferences run (a batch of 8 counts 8).", labels,
            registry=r,
        )  # fmt: skip
        self.execution_count = Counter(
            "slipstream_execution_count", "Batches executed.", labels, registry=r
        )
        self.request_duration = Histogram(
            "slipstream_request_duration_seconds",
            "End-to-end time in the server, from decoded request to response.",
            labels, buckets=_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.queue_duration = Histogram(
            "slipstream_queue_duration_seconds",
            "Time a request waited in its model's queue.",
            labels, buckets=_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.compute_duration = Histogram(
            "slipstream_compute_duration_seconds",
            "Time one batch took to execute (input gather, run, output split).",
            labels, buckets=_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.batch_size = Histogram(
            "slipstream_batch_size", "Rows per executed batch.", labels,
            buckets=_BATCH_BUCKETS, registry=r,
        )  # fmt: skip
        self.pending_requests = Gauge(
            "slipstream_pending_requests", "Requests waiting in the queue.", labels, registry=r
        )
        self.model_load_duration = Gauge(
            "slipstream_model_load_duration_seconds",
            "How long the last load (incl. warm-up) of a model version took.",
            labels, registry=r,
        )  # fmt: skip

    def for_model(self, model: str, version: str) -> ModelMetrics:
        return ModelMetrics(self, model, version)

    def remove_model(self, model: str, version: str) -> None:
        """Drop an unloaded version's series so dashboards stop showing it."""
        for family in (
            self.request_success, self.inference_count, self.execution_count,
            self.request_duration, self.queue_duration, self.compute_duration,
            self.batch_size, self.pending_requests, self.model_load_duration,
        ):  # fmt: skip
            with contextlib.suppress(KeyError):
                family.remove(model, version)
        for reason in FAILURE_REASONS:
            with contextlib.suppress(KeyError):
                self.request_failure.remove(model, version, reason)


class ModelMetrics:
    """The children of every family for one model version, bound once."""

    def __init__(self, metrics: ServerMetrics, model: str, version: str) -> None:
        self.request_success = metrics.request_success.labels(model, version)
        self.request_failure = {
            reason: metrics.request_failure.labels(model, version, reason)
            for reason in FAILURE_REASONS
        }
        self.inference_count = metrics.inference_count.labels(model, version)
        self.execution_count = metrics.execution_count.labels(model, version)
        self.request_duration = metrics.request_duration.labels(model, version)
        self.queue_duration = metrics.queue_duration.labels(model, version)
        self.compute_duration = metrics.compute_duration.labels(model, version)
        self.batch_size = metrics.batch_size.labels(model, version)
        self.pending_requests = metrics.pending_requests.labels(model, version)
        self.model_load_duration = metrics.model_load_duration.labels(model, version)
