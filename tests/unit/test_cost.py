"""Cost per inference on the server: the price shared out by compute time."""

from __future__ import annotations

import pytest

from slipstream.observability.cost import CostTracker
from slipstream.observability.metrics import ModelMetrics, ServerMetrics


def run(metrics: ServerMetrics, model: str, compute_s: float, inferences: int) -> None:
    version = metrics.models()[[m.labels[0] for m in metrics.models()].index(model)]
    version.compute_duration.observe(compute_s)
    version.inference_count += inferences


def test_one_model_pays_the_price_over_its_throughput() -> None:
    metrics = ServerMetrics()
    metrics.for_model("mlp", "1")
    tracker = CostTracker(metrics, price_per_hour=3.6, window_s=60)
    tracker.sample(0.0)
    run(metrics, "mlp", 5.0, 10_000)  # 10,000 inferences in 10 s: 1,000 per second
    tracker.sample(10.0)
    # $3.6/h = $0.001/s; at 1,000/s an inference costs $1e-6: $1 per million.
    ((cost, share),) = tracker.costs().values()
    assert cost == pytest.approx(1.0) and share == 1.0


def test_two_models_share_the_price_by_compute_time() -> None:
    metrics = ServerMetrics()
    metrics.for_model("big", "1")
    metrics.for_model("small", "1")
    tracker = CostTracker(metrics, price_per_hour=3.6, window_s=60)
    tracker.sample(0.0)
    run(metrics, "big", 3.0, 1_000)
    run(metrics, "small", 1.0, 1_000)
    tracker.sample(10.0)
    costs = tracker.costs()
    # $0.01 over the 10 s: big takes 3/4 of it over 1,000 inferences, small 1/4.
    assert costs[("big", "1")] == pytest.approx((7.5, 0.75))
    assert costs[("small", "1")] == pytest.approx((2.5, 0.25))


def test_the_window_forgets_what_came_before_it() -> None:
    metrics = ServerMetrics()
    metrics.for_model("mlp", "1")
    tracker = CostTracker(metrics, price_per_hour=3.6, window_s=10)
    tracker.sample(0.0)
    run(metrics, "mlp", 1.0, 100)  # an early, expensive stretch
    for at in range(5, 60, 5):
        run(metrics, "mlp", 1.0, 1_000)
        tracker.sample(float(at))
    ((cost, _),) = tracker.costs().values()
    # The last 10 s: 2,000 inferences for $0.01.
    assert cost == pytest.approx(5.0)


def test_nothing_is_shown_before_two_samples_or_without_compute() -> None:
    metrics = ServerMetrics()
    metrics.for_model("mlp", "1")
    tracker = CostTracker(metrics, price_per_hour=1.0, window_s=60)
    assert tracker.costs() == {}
    tracker.sample(0.0)
    tracker.sample(5.0)
    assert tracker.costs() == {}
    names = {family.name for family in tracker.collect()}
    assert names == {
        "slipstream_price_per_hour",
        "slipstream_cost_per_million_inferences",
        "slipstream_compute_share",
    }


def test_a_reload_starts_its_counts_again_and_the_gauges_stay_true() -> None:
    """A reloaded version counts from zero in fresh counters: its deltas are its new
    counts, never negative, so no version's gauges vanish or pass a share of 1."""
    metrics = ServerMetrics()
    metrics.for_model("big", "1")
    metrics.for_model("small", "1")
    tracker = CostTracker(metrics, price_per_hour=3.6, window_s=60)
    tracker.sample(0.0)
    run(metrics, "big", 30.0, 10_000)
    run(metrics, "small", 10.0, 10_000)
    tracker.sample(10.0)
    metrics.add(ModelMetrics("big", "1"))  # big reloaded: its counts start at zero
    run(metrics, "big", 3.0, 1_000)
    run(metrics, "small", 1.0, 1_000)
    tracker.sample(20.0)
    costs = tracker.costs()
    # 33 + 11 s of compute over the 20 s ($0.02): big 3/4 of it, small 1/4.
    assert costs[("big", "1")] == pytest.approx((0.015 / 11_000 * 1e6, 0.75))
    assert costs[("small", "1")] == pytest.approx((0.005 / 11_000 * 1e6, 0.25))
    # The minor model reloaded instead, and counts that went down in the same counters
    # (a reset): both are counted from zero.
    metrics.add(ModelMetrics("small", "1"))
    run(metrics, "big", 3.0, 1_000)
    run(metrics, "small", 1.0, 1_000)
    tracker.sample(30.0)
    (big := metrics.models()[0]).inference_count = 500
    big.compute_duration.total = 1.0
    tracker.sample(40.0)
    shares = {key: share for key, (_, share) in tracker.costs().items()}
    assert shares[("small", "1")] == pytest.approx(12 / 49)
    assert sum(shares.values()) == pytest.approx(1.0)
