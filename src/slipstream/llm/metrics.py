"""Prometheus metrics of the generative lane.

Histograms (so p99 aggregates across replicas) of time to first token, inter-token
latency and end-to-end latency; token and request counters; and, read from each engine
at scrape time, running and waiting sequences and the KV cache's block usage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from slipstream.llm.engine import CacheStats

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


class LlmMetrics:
    """The generative lane's metrics, registered in the server's registry."""

    def __init__(
        self, registry: CollectorRegistry, engines: Callable[[], dict[str, CacheStats]]
    ) -> None:
        labels = ["model"]
        self.ttft = Histogram(
            "slipstream_llm_time_to_first_token_seconds",
            "Time from request arrival to the first generated token",
            labels, buckets=_LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.itl = Histogram(
            "slipstream_llm_inter_token_latency_seconds",
            "Time between consecutive generated tokens of one sequence",
            labels, buckets=_LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.e2e = Histogram(
            "slipstream_llm_e2e_request_latency_seconds",
            "Time from request arrival to its last token",
            labels, buckets=_LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "slipstream_llm_prompt_tokens", "Prompt tokens processed", labels, registry=registry
        )
        self.generation_tokens = Counter(
            "slipstream_llm_generation_tokens", "Tokens generated", labels, registry=registry
        )
        self.requests = Counter(
            "slipstream_llm_requests",
            "Finished generation requests by finish reason (stop, length, cancelled, error)",
            ["model", "finish_reason"], registry=registry,
        )  # fmt: skip
        registry.register(_CacheCollector(engines))
        self._of: dict[str, ModelMetrics] = {}

    def of(self, model: str) -> ModelMetrics:
        """``model``'s children of the per-token metrics, looked up once: ``labels()``
        takes a lock and builds a key on every call, three calls per streamed token."""
        found = self._of.get(model)
        if found is None:
            found = self._of[model] = ModelMetrics(
                self.ttft.labels(model),
                self.itl.labels(model),
                self.e2e.labels(model),
                self.generation_tokens.labels(model),
            )
        return found


@dataclass(frozen=True, slots=True)
class ModelMetrics:
    """One model's labelled children of :class:`LlmMetrics`' histograms and counters."""

    # slipstream_llm_time_to_first_token_seconds{model}
    ttft: Any
    # slipstream_llm_inter_token_latency_seconds{model}
    itl: Any
    # slipstream_llm_e2e_request_latency_seconds{model}
    e2e: Any
    # slipstream_llm_generation_tokens{model}
    generation_tokens: Any


class _CacheCollector(Collector):
    def __init__(self, engines: Callable[[], dict[str, CacheStats]]) -> None:
        self._engines = engines

    def collect(self) -> Iterable[Metric]:
        families = {
            key: GaugeMetricFamily(name, documentation, labels=["model"])
            for key, name, documentation in _CACHE_GAUGES
        }
        for model, stats in self._engines().items():
            families["running"].add_metric([model], stats.running)
            families["waiting"].add_metric([model], stats.waiting)
            families["used"].add_metric([model], stats.blocks_used)
            families["free"].add_metric([model], stats.blocks_free)
            families["utilization"].add_metric([model], stats.utilization)
        queries = CounterMetricFamily(
            "slipstream_llm_prefix_cache_queries",
            "Prompt tokens of scheduled sequences (engines with prefix caching)",
            labels=["model"],
        )
        hits = CounterMetricFamily(
            "slipstream_llm_prefix_cache_hits",
            "Prompt tokens found in the KV cache and not computed again",
            labels=["model"],
        )
        threads = GaugeMetricFamily(
            "slipstream_llm_cpu_threads",
            "CPU threads of the forward passes now (llama_cpp; fewer while the host's cores "
            "are crowded, unless the config sets generation.threads)",
            labels=["model"],
        )
        for model, stats in self._engines().items():
            queries.add_metric([model], stats.prefix_cache_queries)
            hits.add_metric([model], stats.prefix_cache_hits)
            if stats.cpu_threads:
                threads.add_metric([model], stats.cpu_threads)
        return [*families.values(), queries, hits, threads]


_CACHE_GAUGES = (
    ("running", "slipstream_llm_sequences_running", "Sequences being decoded"),
    ("waiting", "slipstream_llm_sequences_waiting", "Sequences admitted, not yet scheduled"),
    ("used", "slipstream_llm_kv_cache_blocks_used", "KV-cache blocks held by sequences"),
    ("free", "slipstream_llm_kv_cache_blocks_free", "KV-cache blocks free"),
    ("utilization", "slipstream_llm_kv_cache_utilization",
     "Cached tokens / token slots in the blocks held"),
)  # fmt: skip
