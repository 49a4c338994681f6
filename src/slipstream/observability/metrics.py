"""Prometheus metrics, counted in plain Python objects and collected at scrape time.

Every update happens on the event-loop thread, so the hot path only adds to ints and
lists: no locks and no per-sample label lookups. prometheus_client's own Counter and
Histogram children take a lock per update and loop over the buckets in Python, which
measured about a quarter of the serving core's time per request for a small model.
Scrapes turn the counts into metric families (:class:`_Collector`).

Durations are histograms (not summaries) so p99 can be aggregated across replicas.
Triton's per-model series (``nv_inference_*``, :class:`_TritonCollector`) come from the
same counts, beside the ``slipstream_*`` ones, so Triton's dashboards and autoscaling
rules read a Slipstream server unchanged.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator
from itertools import accumulate

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

# Request-level latencies from 100 us to 30 s.
_LATENCY_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# Why a request failed, as the `reason` label.
FAILURE_REASONS = ("bad_request", "not_found", "queue_full", "timeout", "cancelled", "internal")

# FAILURE_REASONS under the `reason` label of Triton's nv_inference_request_failure
# (Triton 2.37 and later). REJECTED: refused or dropped by the scheduler before it ran
# (queue full; timed out in the queue). CANCELED: the client went away. BACKEND: the run
# failed (a model's error, or another fault of the server's). OTHER: the request itself
# was wrong (a bad input, an unknown version or output). Triton counts an ensemble's
# failures as OTHER; here an ensemble's or a cascade's fall in these four by their cause.
TRITON_FAILURE_REASONS = {
    "queue_full": "REJECTED",
    "timeout": "REJECTED",
    "cancelled": "CANCELED",
    "internal": "BACKEND",
    "bad_request": "OTHER",
    "not_found": "OTHER",
}

# Why the HTTP transport closed a connection on its own, as the `reason` label.
CONNECTION_CLOSE_REASONS = (
    "header_too_large",  # 431: request line and headers past --max-header-bytes
    "uri_too_long",  # 414: the URL alone past --max-header-bytes
    "too_many_headers",  # 431: past --max-header-count
    # 413: a body past --max-request-bytes (by Content-Length, as received, or decoded).
    "body_too_large",
    "header_timeout",  # 408 (or silence): head not complete within --header-timeout-s
    "body_timeout",  # 408: the body stalled for --body-timeout-s
    "body_too_slow",  # 408: the body came slower than --min-body-rate-bytes-s
    "send_timeout",  # a client read none of a pending response for --send-timeout-s
    "keep_alive_timeout",  # idle between requests for --keep-alive-timeout-s
    "evicted_idle",  # at --max-connections: the longest-idle one closed for a new one
    "refused_full",  # at --max-connections with none idle: the new one refused (503)
    # Still sending after its refusal when the server's discard budget ran out: reset.
    "discard_budget",
)


class Histogram:
    """Bucket counts and a sum; ``observe`` is one bisect and two additions."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        # counts[i] holds observations <= bounds[i] and > bounds[i-1]; the last is +Inf.
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        """``count`` observations of ``value`` (a stack of requests that waited alike)."""
        self.counts[bisect_left(self.bounds, value)] += count
        self.total += value * count

    def cumulative(self) -> list[tuple[str, float]]:
        labels = [repr(float(b)) for b in self.bounds] + ["+Inf"]
        return list(zip(labels, accumulate(self.counts), strict=True))


class ModelMetrics:
    """The counts of one model version; attributes are updated in place."""

    def __init__(self, model: str, version: str) -> None:
        self.labels = [model, version]
        self.request_success = 0
        self.request_failure = dict.fromkeys(FAILURE_REASONS, 0)
        self.inference_count = 0
        self.execution_count = 0
        # Batches handed to an instance (counted at dispatch, unlike execution_count).
        self.dispatch_count = 0
        self.request_duration = Histogram(_LATENCY_BUCKETS_S)
        self.queue_duration = Histogram(_LATENCY_BUCKETS_S)
        self.compute_duration = Histogram(_LATENCY_BUCKETS_S)
        # Each batch's compute time once for every client request in it, in ns (Triton's
        # nv_inference_compute_infer_duration_us: what per-request averages divide).
        self.compute_request_ns = 0
        self.batch_size = Histogram(_BATCH_BUCKETS)
        self.instance_idle = Histogram(_LATENCY_BUCKETS_S)
        self.model_load_duration_s = 0.0
        self.warmup_duration_s = 0.0  # the part of the load spent warming up
        # Response cache (Triton's nv_cache_* counters): lookups, and their total time.
        self.cache_hits = 0
        self.cache_misses = 0
        self.cache_hit_us = 0.0
        self.cache_miss_us = 0.0
        # Read at scrape time, so queue depth costs nothing per request.
        self.pending_requests: Callable[[], int] = lambda: 0
        self.oldest_pending_age_s: Callable[[], float] = lambda: 0.0
        # The CPU threads of the instances' next runs, summed; None: the backend does not
        # say (only torch on the CPU does, whose count follows the host's load).
        self.cpu_threads: Callable[[], int | None] = lambda: None

    def count_failure(self, reason: str) -> None:
        self.request_failure[reason] += 1


class CacheCounts:
    """The response cache's counts of a model served outside V2's metrics (a generative
    model on the OpenAI routes): the nv_cache_* series, as ModelMetrics has them."""

    def __init__(self, model: str, version: str) -> None:
        self.labels = [model, version]
        self.cache_hits = 0
        self.cache_misses = 0
        self.cache_hit_us = 0.0
        self.cache_miss_us = 0.0


class TransportMetrics:
    """The HTTP transport's counts: connections open, and closed by a limit."""

    def __init__(self) -> None:
        self.closed_by_limit = dict.fromkeys(CONNECTION_CLOSE_REASONS, 0)
        # Read at scrape time (the transport hands in len of its connection set).
        self.open_connections: Callable[[], int] = lambda: 0

    def count_close(self, reason: str) -> None:
        self.closed_by_limit[reason] += 1


class ServerMetrics:
    """Every model version's metrics, exposed through one registry."""

    def __init__(
        self, registry: CollectorRegistry | None = None, with_transport: bool = True
    ) -> None:
        """``with_transport``: export the HTTP transport's series (not in an engine
        process, which has no HTTP server: its front ends export theirs)."""
        self.registry = registry if registry is not None else CollectorRegistry()
        self._models: dict[tuple[str, str], ModelMetrics] = {}
        self.transport = TransportMetrics()
        # Whether the server has a response cache (--cache): only then are the nv_cache_*
        # series exported, as Triton does.
        self.cache_enabled = False
        # The generative models' cache counts (server/openai_cache.py), by model and version.
        self._generative_cache: dict[tuple[str, str], CacheCounts] = {}
        self.registry.register(_Collector(self._models))
        self.registry.register(_CacheCollector(self))
        self.registry.register(_TritonCollector(self._models))
        if with_transport:
            self.registry.register(_TransportCollector(self.transport))

    def models(self) -> list[ModelMetrics]:
        """The versions exposed now."""
        return list(self._models.values())

    def for_model(self, model: str, version: str) -> ModelMetrics:
        metrics = ModelMetrics(model, version)
        self._models[(model, version)] = metrics
        return metrics

    def generative_cache(self, model: str, version: str) -> CacheCounts:
        """The cache counts of a generative model version, created at its first lookup."""
        counts = self._generative_cache.get((model, version))
        if counts is None:
            counts = self._generative_cache[model, version] = CacheCounts(model, version)
        return counts

    def remove_model(self, model: str, version: str) -> None:
        """Drop an unloaded version's series so dashboards stop showing it."""
        self._models.pop((model, version), None)

    def add(self, metrics: ModelMetrics) -> None:
        """Expose a version's counts, replacing those of a version of the same number.

        A reload counts into fresh :class:`ModelMetrics` while it loads and adds them
        only when it takes over: until then the serving version's series stay exposed.
        """
        model, version = metrics.labels
        self._models[(model, version)] = metrics

    def remove(self, metrics: ModelMetrics) -> None:
        """Drop these counts, unless a reloaded version of the same number replaced them."""
        key = (metrics.labels[0], metrics.labels[1])
        if self._models.get(key) is metrics:
            del self._models[key]


class _Collector(Collector):
    """Builds the metric families from the live counts at each scrape."""

    def __init__(self, models: dict[tuple[str, str], ModelMetrics]) -> None:
        self._models = models

    def collect(self) -> Iterator[Metric]:
        labels = ["model", "version"]
        models = list(self._models.values())
        success = CounterMetricFamily(
            "slipstream_request_success", "Requests answered successfully.", labels=labels
        )
        failure = CounterMetricFamily(
            "slipstream_request_failure", "Requests that failed, by reason.",
            labels=[*labels, "reason"],
        )  # fmt: skip
        inferences = CounterMetricFamily(
            "slipstream_inference_count", "Inferences run (a batch of 8 counts 8).", labels=labels
        )
        executions = CounterMetricFamily(
            "slipstream_execution_count", "Batches executed.", labels=labels
        )
        dispatches = CounterMetricFamily(
            "slipstream_batch_dispatch",
            "Batches handed to an instance; its rate is dispatches per second.",
            labels=labels,
        )
        pending = GaugeMetricFamily(
            "slipstream_pending_requests", "Requests waiting in the queue.", labels=labels
        )
        oldest = GaugeMetricFamily(
            "slipstream_queue_oldest_age_seconds",
            "How long the oldest queued request has waited (0 when none waits): a stuck "
            "queue shows as a growing age.",
            labels=labels,
        )
        load = GaugeMetricFamily(
            "slipstream_model_load_duration_seconds",
            "How long the last load (incl. warm-up) of a model version took.",
            labels=labels,
        )
        threads = GaugeMetricFamily(
            "slipstream_model_cpu_threads",
            "CPU threads the instances' next runs use, summed (torch on the CPU: fewer "
            "while the host's cores are crowded, unless the config sets "
            "intra_op_thread_count).",
            labels=labels,
        )
        for m in models:
            cpu_threads = m.cpu_threads()
            if cpu_threads is not None:
                threads.add_metric(m.labels, cpu_threads)
            success.add_metric(m.labels, m.request_success)
            for reason, count in m.request_failure.items():
                failure.add_metric([*m.labels, reason], count)
            inferences.add_metric(m.labels, m.inference_count)
            executions.add_metric(m.labels, m.execution_count)
            dispatches.add_metric(m.labels, m.dispatch_count)
            pending.add_metric(m.labels, m.pending_requests())
            oldest.add_metric(m.labels, m.oldest_pending_age_s())
            load.add_metric(m.labels, m.model_load_duration_s)
        yield from (success, failure, inferences, executions, dispatches, pending, oldest, load)
        yield threads
        yield from _histograms(models)


class _CacheCollector(Collector):
    """Triton's response-cache counters, per model version, under Triton's names."""

    def __init__(self, server: ServerMetrics) -> None:
        self._server = server

    def collect(self) -> Iterator[Metric]:
        if not self._server.cache_enabled:
            return
        # Typed gauge so the names stay Triton's exactly: prometheus_client writes a
        # counter's family as <name>_total, which Triton's dashboards would not find.
        families = [
            ("nv_cache_num_hits_per_model", "Response-cache hits per model.", "cache_hits"),
            ("nv_cache_num_misses_per_model", "Response-cache misses per model.",
             "cache_misses"),
            ("nv_cache_hit_duration_per_model",
             "Total cache-hit lookup time per model, in microseconds.", "cache_hit_us"),
            ("nv_cache_miss_duration_per_model",
             "Total cache-miss lookup and insertion time per model, in microseconds.",
             "cache_miss_us"),
        ]  # fmt: skip
        models: list[ModelMetrics | CacheCounts] = [
            *self._server._models.values(),
            *self._server._generative_cache.values(),
        ]
        for name, documentation, attribute in families:
            family = Metric(name, documentation, "gauge")
            for m in models:
                family.add_sample(name, dict(zip(("model", "version"), m.labels, strict=True)),
                                  getattr(m, attribute))  # fmt: skip
            yield family


def _us(histogram: Histogram) -> int:
    """A histogram's cumulative total in whole microseconds, as Triton counts them."""
    return round(histogram.total * 1e6)


# Triton's per-model series: name, help, and the count it reads. Not emitted: Triton's
# nv_inference_compute_input_duration_us and _output_duration_us (these counts hold a
# batch's input gather and output split only inside its compute time, which goes to
# nv_inference_compute_infer_duration_us whole), nor the summaries and histograms of its
# --metrics-config.
_TRITON_SERIES: tuple[tuple[str, str, Callable[[ModelMetrics], int]], ...] = (
    ("nv_inference_request_success",
     "Requests answered successfully (a request of a batch of 8 counts 1).",
     lambda m: m.request_success),
    ("nv_inference_count",
     "Inferences performed: a batch of 8 counts 8 (not counting response-cache hits).",
     lambda m: m.inference_count),
    ("nv_inference_exec_count",
     "Batches executed (not counting response-cache hits).",
     lambda m: m.execution_count),
    ("nv_inference_request_duration_us",
     "Total time of the requests answered successfully, in microseconds (with "
     "response-cache hits).",
     lambda m: _us(m.request_duration)),
    ("nv_inference_queue_duration_us",
     "Total time requests waited in the model's queue, in microseconds.",
     lambda m: _us(m.queue_duration)),
    # As Triton counts it: a batch's run once for each request in it, so that dividing by
    # nv_inference_request_success gives a request's compute time.
    ("nv_inference_compute_infer_duration_us",
     "Total compute time of the requests, in microseconds: a batch's run, its input "
     "gather and output split included, counted once for each request in it.",
     lambda m: m.compute_request_ns // 1000),
    ("nv_inference_pending_request_count",
     "Requests waiting in the model's queue now.",
     lambda m: m.pending_requests()),
)  # fmt: skip


class _TritonCollector(Collector):
    """Triton's per-model series under Triton's names and labels (model, version).

    Typed gauge, as the nv_cache_* series: Triton writes its counters without the
    ``_total`` suffix that prometheus_client gives a counter family, and its dashboards
    and autoscaling rules (``rate(nv_inference_request_success[1m])``,
    ``nv_inference_queue_duration_us``) query the bare names.
    """

    def __init__(self, models: dict[tuple[str, str], ModelMetrics]) -> None:
        self._models = models

    def collect(self) -> Iterator[Metric]:
        models = list(self._models.values())
        labelled = [(m, {"model": m.labels[0], "version": m.labels[1]}) for m in models]
        for name, documentation, count in _TRITON_SERIES:
            family = Metric(name, documentation, "gauge")
            for m, labels in labelled:
                family.add_sample(name, labels, count(m))
            yield family
        name = "nv_inference_request_failure"
        failure = Metric(name, "Requests that failed, by Triton's reason (REJECTED, "
                         "CANCELED, BACKEND, OTHER).", "gauge")  # fmt: skip
        for m, labels in labelled:
            by_reason = dict.fromkeys(("REJECTED", "CANCELED", "BACKEND", "OTHER"), 0)
            for reason, failures in m.request_failure.items():
                by_reason[TRITON_FAILURE_REASONS[reason]] += failures
            for reason, failures in by_reason.items():
                failure.add_sample(name, {**labels, "reason": reason}, failures)
        yield failure


class _TransportCollector(Collector):
    def __init__(self, transport: TransportMetrics) -> None:
        self._transport = transport

    def collect(self) -> Iterator[Metric]:
        open_now = GaugeMetricFamily(
            "slipstream_http_connections_open", "HTTP connections open now."
        )
        open_now.add_metric([], self._transport.open_connections())
        closed = CounterMetricFamily(
            "slipstream_http_connections_closed_by_limit",
            "HTTP connections the server closed or refused on its own, by the limit that "
            "did it (header size and count, body size, header and body timeouts, send "
            "timeout, keep-alive idle, --max-connections, the discard budget).",
            labels=["reason"],
        )
        for reason, count in self._transport.closed_by_limit.items():
            closed.add_metric([reason], count)
        yield from (open_now, closed)


_HISTOGRAMS = (
    ("request_duration", "slipstream_request_duration_seconds",
     "End-to-end time in the server, from decoded request to response."),
    ("queue_duration", "slipstream_queue_duration_seconds",
     "Time a request waited in its model's queue."),
    ("compute_duration", "slipstream_compute_duration_seconds",
     "Time one batch took to execute (input gather, run, output split)."),
    ("batch_size", "slipstream_batch_size", "Rows per executed batch."),
    ("instance_idle", "slipstream_instance_idle_seconds",
     "Time an instance sat between two batches while requests were queued: from the end "
     "of one on its thread to the start of the next (the event loop's hand-off, plus any "
     "queue delay waited on purpose). On a GPU, device time the server lost."),
)  # fmt: skip


def _histograms(models: list[ModelMetrics]) -> Iterator[Metric]:
    for attribute, name, documentation in _HISTOGRAMS:
        family = HistogramMetricFamily(name, documentation, labels=["model", "version"])
        for m in models:
            histogram: Histogram = getattr(m, attribute)
            family.add_metric(m.labels, histogram.cumulative(), histogram.total)
        yield family
