"""Metrics counted on the hot path come out of the registry as Prometheus families."""

from __future__ import annotations

from prometheus_client import generate_latest

from slipstream.observability.metrics import ServerMetrics


def test_counts_and_histograms_reach_the_registry() -> None:
    metrics = ServerMetrics()
    model = metrics.for_model("m", "1")
    model.request_success += 3
    model.count_failure("timeout")
    model.pending_requests = lambda: 7
    for seconds in (0.0001, 0.0003, 2.0, 99.0):  # 0.0001 sits exactly on a bound
        model.request_duration.observe(seconds)
    sample = metrics.registry.get_sample_value
    labels = {"model": "m", "version": "1"}
    assert sample("slipstream_request_success_total", labels) == 3
    assert sample("slipstream_request_failure_total", {**labels, "reason": "timeout"}) == 1
    assert sample("slipstream_pending_requests", labels) == 7
    bucket = "slipstream_request_duration_seconds_bucket"
    assert sample(bucket, {**labels, "le": "0.0001"}) == 1  # buckets are inclusive (le)
    assert sample(bucket, {**labels, "le": "0.0005"}) == 2
    assert sample(bucket, {**labels, "le": "30.0"}) == 3
    assert sample(bucket, {**labels, "le": "+Inf"}) == 4
    assert sample("slipstream_request_duration_seconds_count", labels) == 4
    assert abs(sample("slipstream_request_duration_seconds_sum", labels) - 101.0004) < 1e-9
    assert b"slipstream_batch_size_bucket" in generate_latest(metrics.registry)


def test_unloaded_versions_disappear() -> None:
    metrics = ServerMetrics()
    metrics.for_model("m", "1").request_success += 1
    metrics.remove_model("m", "1")
    sample = metrics.registry.get_sample_value
    assert sample("slipstream_request_success_total", {"model": "m", "version": "1"}) is None
