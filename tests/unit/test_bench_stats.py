"""slipstream bench's statistics on synthetic timings: histogram percentiles against numpy,
merging, the stability rule, open-loop arrivals and the coordinated-omission correction."""

from __future__ import annotations

import math

import numpy as np
import pytest

from slipstream.bench.core.histogram import (
    LATENCY_MAX_S,
    LATENCY_MIN_S,
    RELATIVE_ERROR,
    LatencyHistogram,
    is_stable,
    merge_histograms,
    within_pct_of_mean,
)
from slipstream.bench.core.schedule import arrival_gaps_s, corrected_latency_s

QUANTILES = [0.1, 1, 10, 25, 50, 75, 90, 95, 99, 99.9, 100]


def _latencies(seed: int, size: int) -> np.ndarray:
    """Latency-like data: log-normal around 2 ms with a long tail, plus a few outliers."""
    rng = np.random.default_rng(seed)
    values = rng.lognormal(mean=math.log(0.002), sigma=0.8, size=size)
    stalls = min(10, size // 100)
    values[:stalls] = rng.uniform(0.5, 2.0, size=stalls)
    return values


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_percentiles_match_numpy_within_the_bucket_error(seed: int) -> None:
    values = _latencies(seed, 50_000)
    hist = LatencyHistogram.from_latencies(values)
    for q in QUANTILES:
        expected = float(np.percentile(values, q, method="inverted_cdf"))
        got = hist.percentile_s(q)
        assert got == pytest.approx(expected, rel=RELATIVE_ERROR + 1e-9), q


def test_mean_count_and_extremes_are_exact() -> None:
    values = _latencies(3, 10_000)
    hist = LatencyHistogram.from_latencies(values)
    assert hist.count == values.size
    assert hist.mean_s == pytest.approx(values.mean(), rel=1e-12)
    assert hist.max_s == values.max()
    assert hist.min_s == values.min()
    assert hist.percentile_s(100) == values.max()


def test_the_relative_error_is_half_a_percent() -> None:
    assert 0.004 < RELATIVE_ERROR < 0.005


def test_merging_equals_one_histogram_of_all_values() -> None:
    a, b, c = _latencies(4, 3000), _latencies(5, 7000), _latencies(6, 1)
    merged = merge_histograms(
        [LatencyHistogram.from_latencies(x) for x in (a, b, c)] + [LatencyHistogram()]
    )
    whole = LatencyHistogram.from_latencies(np.concatenate([a, b, c]))
    np.testing.assert_array_equal(merged.counts, whole.counts)
    assert merged.count == whole.count
    assert merged.total_s == pytest.approx(whole.total_s)
    assert (merged.min_s, merged.max_s) == (whole.min_s, whole.max_s)
    for q in QUANTILES:
        assert merged.percentile_s(q) == whole.percentile_s(q)


def test_an_empty_histogram_has_no_figures() -> None:
    hist = LatencyHistogram.from_latencies(np.array([]))
    assert hist.count == 0
    assert math.isnan(hist.mean_s)
    assert math.isnan(hist.percentile_s(50))


def test_values_outside_the_range_are_kept_at_their_exact_extremes() -> None:
    values = np.array([LATENCY_MIN_S / 10, 0.001, LATENCY_MAX_S * 5])
    hist = LatencyHistogram.from_latencies(values)
    assert hist.counts[0] == 1 and hist.counts[-1] == 1
    assert hist.percentile_s(0.1) == values[0]
    assert hist.percentile_s(100) == values[-1]
    assert hist.percentile_s(50) == pytest.approx(0.001, rel=RELATIVE_ERROR)


def test_a_single_value_is_every_percentile() -> None:
    hist = LatencyHistogram.from_latencies(np.array([0.0123]))
    assert {hist.percentile_s(q) for q in QUANTILES} == {0.0123}


# ------------------------------------------------------------------- stability rule


def test_stable_when_the_last_three_windows_agree() -> None:
    assert is_stable([500, 1000, 1010, 990], [9.0, 1.0, 1.05, 0.97], pct=10)


def test_not_stable_when_throughput_strays() -> None:
    assert not is_stable([1000, 1200, 990], [1.0, 1.0, 1.0], pct=10)


def test_not_stable_when_latency_strays_even_with_steady_throughput() -> None:
    assert not is_stable([1000, 1000, 1000], [1.0, 1.5, 1.0], pct=10)


def test_fewer_than_three_windows_are_never_stable() -> None:
    assert not is_stable([1000, 1000], [1.0, 1.0], pct=10)


def test_windows_without_throughput_or_latency_are_not_stable() -> None:
    assert not is_stable([0, 0, 0], [math.nan] * 3, pct=10)
    assert not is_stable([10, 10, 10], [1.0, math.nan, 1.0], pct=10)


def test_the_tolerance_is_relative_to_the_mean() -> None:
    # mean 100: 91 and 109 are within 10%, 89 is not.
    assert within_pct_of_mean([91, 100, 109], 10)
    assert not within_pct_of_mean([89, 102, 109], 10)


# ------------------------------------------------------------------- open loop


def test_constant_arrivals_are_evenly_spaced() -> None:
    gaps = arrival_gaps_s(250.0, "constant", np.random.default_rng(0))
    assert [next(gaps) for _ in range(5)] == [0.004] * 5


def test_poisson_arrivals_have_exponential_gaps_at_the_rate() -> None:
    gaps = arrival_gaps_s(500.0, "poisson", np.random.default_rng(0), chunk=1000)
    sample = np.array([next(gaps) for _ in range(20_000)])
    assert sample.mean() == pytest.approx(1 / 500, rel=0.03)
    # An exponential distribution's standard deviation equals its mean.
    assert sample.std() / sample.mean() == pytest.approx(1.0, rel=0.05)


def test_an_unknown_distribution_is_refused() -> None:
    with pytest.raises(ValueError, match="poisson"):
        next(arrival_gaps_s(10.0, "uniform", np.random.default_rng(0)))


def test_a_late_send_counts_from_its_schedule_and_an_early_one_from_the_send() -> None:
    assert corrected_latency_s(scheduled_s=10.0, sent_s=10.5, done_s=10.75) == 0.75
    assert corrected_latency_s(scheduled_s=10.0, sent_s=9.999, done_s=10.003) == pytest.approx(
        0.004
    )
