"""Triton's per-model series (nv_inference_*) come out of the same counts as slipstream_*,
under Triton's exact names and labels, so its dashboards and autoscaling rules read them."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from slipstream.observability.merge import merged_text, snapshot
from slipstream.observability.metrics import (
    FAILURE_REASONS,
    TRITON_FAILURE_REASONS,
    ServerMetrics,
)

TRITON_REASONS = {"REJECTED", "CANCELED", "BACKEND", "OTHER"}


def scraped(text: bytes) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Every sample of a /metrics text as parsed by prometheus_client: sample name ->
    sorted labels -> value."""
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            key = tuple(sorted(sample.labels.items()))
            samples.setdefault(sample.name, {})[key] = sample.value
    return samples


def test_counts_reach_tritons_series_under_tritons_names() -> None:
    metrics = ServerMetrics()
    model = metrics.for_model("resnet", "2")
    model.request_success += 5
    model.inference_count += 12  # two batches of 8 and 4 rows
    model.execution_count += 2
    model.request_duration.observe(0.0025, 5)  # 5 requests of 2.5 ms
    model.queue_duration.observe(0.0004, 5)
    model.compute_duration.observe(0.003)
    model.compute_duration.observe(0.002)
    model.compute_request_ns += 3 * 3_000_000 + 2 * 2_000_000  # batches of 3 and 2 requests
    model.pending_requests = lambda: 3
    text = generate_latest(metrics.registry)
    samples = scraped(text)
    labels = (("model", "resnet"), ("version", "2"))
    assert samples["nv_inference_request_success"][labels] == 5
    assert samples["nv_inference_count"][labels] == 12
    assert samples["nv_inference_exec_count"][labels] == 2
    assert samples["nv_inference_request_duration_us"][labels] == 12500  # 5 x 2.5 ms
    assert samples["nv_inference_queue_duration_us"][labels] == 2000
    # Each batch's run counted once for each of its requests, as Triton counts it.
    assert samples["nv_inference_compute_infer_duration_us"][labels] == 13000
    assert samples["nv_inference_pending_request_count"][labels] == 3
    # Written as Triton writes them: no _total suffix, no _created series.
    for line in text.decode().splitlines():
        if line.startswith("nv_inference"):
            assert line.split("{", 1)[0].split(" ", 1)[0] in samples, line
    assert not any(name.startswith("nv_") and name.endswith(("_total", "_created"))
                   for name in samples)  # fmt: skip
    # Beside the slipstream_* series, not instead of them.
    assert samples["slipstream_request_success_total"][labels] == 5


def test_failures_are_counted_under_tritons_four_reasons() -> None:
    assert set(TRITON_FAILURE_REASONS) == set(FAILURE_REASONS)
    assert set(TRITON_FAILURE_REASONS.values()) == TRITON_REASONS
    metrics = ServerMetrics()
    model = metrics.for_model("m", "1")
    for reason, times in (("queue_full", 2), ("timeout", 1), ("cancelled", 4),
                          ("internal", 3), ("bad_request", 5), ("not_found", 1)):  # fmt: skip
        for _ in range(times):
            model.count_failure(reason)
    failures = scraped(generate_latest(metrics.registry))["nv_inference_request_failure"]
    by_reason = {dict(labels)["reason"]: value for labels, value in failures.items()}
    assert by_reason == {"REJECTED": 3, "CANCELED": 4, "BACKEND": 3, "OTHER": 6}
    assert {tuple(sorted(dict(labels))) for labels in failures} == {("model", "reason", "version")}


def test_a_fresh_version_shows_zeros_and_an_unloaded_one_disappears() -> None:
    metrics = ServerMetrics()
    metrics.for_model("m", "1")
    samples = scraped(generate_latest(metrics.registry))
    labels = (("model", "m"), ("version", "1"))
    assert samples["nv_inference_request_success"][labels] == 0
    assert len(samples["nv_inference_request_failure"]) == 4  # every reason, at zero
    # Only what is measured: compute input and output are inside compute_infer here.
    assert "nv_inference_compute_input_duration_us" not in samples
    assert "nv_inference_compute_output_duration_us" not in samples
    metrics.remove_model("m", "1")
    samples = scraped(generate_latest(metrics.registry))
    assert not samples.get("nv_inference_request_success")
    assert not samples.get("nv_inference_request_failure")


def test_the_split_layouts_merge_keeps_the_names_and_adds_its_label() -> None:
    # A split layout's /metrics merges each process's snapshot; Triton's names survive it.
    metrics = ServerMetrics(with_transport=False)
    metrics.for_model("m", "1").request_success += 7
    text = merged_text([({"engine": "cpu"}, snapshot(metrics.registry))])
    samples = scraped(text)
    key = (("engine", "cpu"), ("model", "m"), ("version", "1"))
    assert samples["nv_inference_request_success"][key] == 7
    assert b'nv_inference_request_success{engine="cpu",model="m",version="1"} 7.0' in text
