"""Drift detection against issue #16's targets, on data built here.

* a 0.5 standard-deviation mean shift in 1 of 64 features is detected within 500
  samples in at least 95% of trials;
* on undrifted data the false alarm rate per window is at most 5%;
* a shift spread over a high-dimensional tensor (an embedding) is detected through the
  projection; labels (categorical) drift by the chi-squared test.
"""

from __future__ import annotations

import doctest
import math

import numpy as np
import pytest

from slipstream.monitor import drift
from slipstream.monitor.drift import Reference

FEATURES = 64
TRIALS = 100
WINDOW = 500


def test_the_docstring_examples_hold() -> None:
    assert doctest.testmod(drift).failed == 0


@pytest.mark.slow  # 100 windows of 64 KS tests: ~5 s on an idle core
def test_a_half_sigma_shift_in_one_of_64_features_is_found_in_500_samples() -> None:
    rng = np.random.default_rng(1)
    reference = Reference.from_samples("x", rng.normal(size=(5000, FEATURES)))
    found = 0
    for trial in range(TRIALS):
        window = rng.normal(size=(WINDOW, FEATURES))
        window[:, trial % FEATURES] += 0.5
        report = reference.test(window)
        found += str(trial % FEATURES) in [f.feature for f in report.drifted]
    assert found >= 0.95 * TRIALS


@pytest.mark.slow  # 200 references and windows
def test_undrifted_windows_raise_at_most_5_percent_false_alarms() -> None:
    """Each trial a reference and a window of its own: the rate over draws of both (a
    fixed reference's own quirks would make every window's test share them).

    Bonferroni makes the rate alpha (5%) at most by construction (measured: 0.080% of
    single KS tests below 0.05 / 64, so 5.0% of windows); 200 trials estimate it within
    sampling error, so the bound allows two standard errors above 5%. Without the
    correction, 64 features at 5% each would alarm in 96% of windows."""
    rng = np.random.default_rng(2)
    trials = 200
    alarms = 0
    for _ in range(trials):
        reference = Reference.from_samples("x", rng.normal(size=(2000, FEATURES)))
        alarms += reference.test(rng.normal(size=(WINDOW, FEATURES))).detected
    assert alarms / trials <= 0.05 + 2 * math.sqrt(0.05 * 0.95 / trials)


def test_an_embedding_shift_spread_over_384_dimensions_is_found_through_the_projection() -> None:
    rng = np.random.default_rng(3)
    # Embeddings of one "topic": a common direction plus noise, unit-normalised.
    topic_a, topic_b = rng.normal(size=384), rng.normal(size=384)

    def embeddings(topic: np.ndarray, n: int) -> np.ndarray:
        raw = 0.3 * topic + rng.normal(size=(n, 384))
        return raw / np.linalg.norm(raw, axis=1, keepdims=True)

    reference = Reference.from_samples("embedding", embeddings(topic_a, 2000))
    assert reference.num_features == 64
    assert all(kind == "projected" for kind in reference.kinds)
    assert not reference.test(embeddings(topic_a, WINDOW)).detected
    assert reference.test(embeddings(topic_b, WINDOW)).detected


def test_labels_are_categorical_and_their_mix_drifts_by_chi_squared() -> None:
    rng = np.random.default_rng(4)
    labels = rng.choice(10, size=(4000, 1), p=[0.1] * 10)
    reference = Reference.from_samples("label", labels)
    assert reference.kinds == ["categorical"]
    same = reference.test(rng.choice(10, size=(WINDOW, 1), p=[0.1] * 10))
    assert not same.detected
    skewed = reference.test(rng.choice(10, size=(WINDOW, 1), p=[0.28] + [0.08] * 9))
    assert skewed.detected and skewed.features[0].psi > 0.1
    # A label the reference never had counts as drift, not as an error.
    unseen = reference.test(np.full((WINDOW, 1), 11))
    assert unseen.detected


def test_psi_grows_with_the_shift() -> None:
    rng = np.random.default_rng(5)
    reference = Reference.from_samples("x", rng.normal(size=(5000, 1)))
    psis = [reference.test(rng.normal(size=(2000, 1)) + shift).features[0].psi
            for shift in (0.0, 0.25, 0.5, 1.0)]  # fmt: skip
    assert psis == sorted(psis)
    assert psis[0] < 0.02 and psis[-1] > 0.5


def test_the_p_values_are_scipys_whether_or_not_a_statistic_was_seen_before() -> None:
    """Reference.test reuses ks_2samp's answer for a statistic it has seen at the same
    sizes: every window still gets what ks_2samp answers for it (ties included)."""
    from scipy import stats

    rng = np.random.default_rng(8)
    samples = np.round(rng.normal(size=(1000, 8)), 1)
    reference = Reference.from_samples("x", samples)
    for _ in range(12):  # 96 tests, 9 of them on a statistic seen before
        window = np.round(rng.normal(size=(300, 8)) + 0.1, 1)
        for index, feature in enumerate(reference.test(window).features):
            expected = stats.ks_2samp(samples[:, index], window[:, index])
            assert (feature.statistic, feature.p_value) == (expected.statistic, expected.pvalue)


def test_windows_of_the_wrong_shape_and_tiny_references_are_refused() -> None:
    rng = np.random.default_rng(6)
    reference = Reference.from_samples("x", rng.normal(size=(100, 8)))
    with pytest.raises(ValueError, match="3 features, the reference has 8"):
        reference.test(rng.normal(size=(50, 3)))
    with pytest.raises(ValueError, match="at least 2 samples"):
        Reference.from_samples("x", rng.normal(size=(1, 8)))


def test_the_report_as_json_names_each_feature() -> None:
    rng = np.random.default_rng(7)
    reference = Reference.from_samples("x", rng.normal(size=(1000, 3, 2)))
    window = rng.normal(size=(400, 3, 2))
    window[:, 1, 0] += 1.0
    doc = reference.test(window).to_json()
    assert doc["tensor"] == "x" and doc["samples"] == 400 and doc["detected"] is True
    assert [f["feature"] for f in doc["features"] if f["drifted"]] == ["2"]
    assert doc["p_threshold"] == pytest.approx(0.05 / 6)


def test_a_feature_that_turns_nan_drifts_however_much_of_it_is_nan() -> None:
    """A broken sensor sends NaN: its share of NaN is tested as a category, and every
    p-value stays a number (a NaN p-value would read as "no drift")."""
    rng = np.random.default_rng(9)
    reference = Reference.from_samples("x", rng.normal(size=(1000, 8)).astype(np.float32))
    for rows in (slice(None), slice(None, None, 2)):  # all of the window, half of it
        window = rng.normal(size=(WINDOW, 8)).astype(np.float32)
        window[rows, 3] = np.nan
        report = reference.test(window)
        (feature,) = report.drifted
        assert report.detected and feature.feature == "3" and feature.p_value < 1e-10
        assert feature.nan_shares[0] == 0.0 and feature.nan_shares[1] >= 0.5
        assert feature.window_shares[-1] == feature.nan_shares[1]  # NaN's own PSI bin
        assert feature.psi > 0.2 and "NaN" in feature.note
        assert all(math.isfinite(f["p_value"]) for f in report.to_json()["features"])
    # A stray NaN is not drift.
    window = rng.normal(size=(WINDOW, 8)).astype(np.float32)
    window[0, 3] = np.nan
    assert not reference.test(window).detected


def test_one_nan_in_the_reference_does_not_blind_its_feature() -> None:
    from scipy import stats

    rng = np.random.default_rng(10)
    samples = rng.normal(size=(1000, 4))
    samples[7, 2] = np.nan
    reference = Reference.from_samples("x", samples)
    window = rng.normal(size=(WINDOW, 4))
    calm = reference.test(window)
    assert not calm.detected
    # KS on the finite values, as scipy answers it for them; doubled for the two tests.
    expected = stats.ks_2samp(samples[~np.isnan(samples[:, 2]), 2], window[:, 2])
    assert calm.features[2].p_value == min(1.0, 2 * expected.pvalue)
    window[:, 2] += 3.0  # a 3-sigma shift
    shifted = reference.test(window)
    assert [f.feature for f in shifted.drifted] == ["2"]
    # A feature all NaN in the reference: a window of values drifts, one of NaN does not.
    samples[:, 1] = np.nan
    reference = Reference.from_samples("x", samples)
    window[:, 2] -= 3.0  # the calm window again
    assert [f.feature for f in reference.test(window).drifted] == ["1"]
    nan_window = window.copy()
    nan_window[:, 1] = np.nan
    (feature,) = [f for f in reference.test(nan_window).features if f.feature == "1"]
    assert not feature.drifted and "all NaN" in feature.note


def test_the_report_page_draws_a_nan_window_and_survives_untested_features() -> None:
    """A window with NaN gets a NaN bar; a feature with no p-value (a null in the JSON
    of a server that could not test it) is tabled as untested, not a crash."""
    from slipstream.drift_report import drift_page

    rng = np.random.default_rng(11)
    reference = Reference.from_samples("input", rng.normal(size=(1000, 2)))
    window = rng.normal(size=(WINDOW, 2))
    window[:, 1] = np.nan
    report = reference.test(window).to_json()
    untested = {**report["features"][0], "statistic": None, "p_value": None, "drifted": False}
    report["features"].append({**untested, "feature": "2"})
    doc = {"model": "m", "version": "1", "reference": "file", "reference_rows": 1000,
           "window": WINDOW, "windows": 1, "sampled": 50, "dropped": 0, "detected": True,
           "tensors": {"input": report}, "skipped": {}}  # fmt: skip
    page = drift_page(doc, all_features=True)
    assert "<h2>input: drifted" in page and page.count("data:image/png;base64,") == 3
    assert "<td>untested</td>" in page and "all NaN" in page
