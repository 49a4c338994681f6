"""Drift detection: does a window of recent samples come from the reference's distribution?

One tensor is tested per :class:`Reference` (a model input, or an output for prediction
drift). Its samples are the rows of the batch dimension, flattened to features, and each
feature is tested on its own, as Alibi Detect's and Evidently's tabular detectors do:

* **continuous** features (floats, or integers of many values): the two-sample
  Kolmogorov-Smirnov test (:func:`scipy.stats.ks_2samp`);
* **categorical** features (integers taking at most ``max_categories`` values in the
  reference, e.g. a class label): the chi-squared test of the two count tables
  (:func:`scipy.stats.chi2_contingency`);
* **high-dimensional** tensors (more than ``max_features`` features, e.g. an embedding):
  a fixed Gaussian random projection down to ``max_features`` dimensions first, then KS
  on each (Alibi Detect's "reduce, then test each dimension"), so a shift spread thinly
  over hundreds of dimensions adds up in the projected ones.

The window drifts when any feature's p-value falls below ``alpha / features``
(Bonferroni, so on undrifted data the chance of a false alarm per window stays below
``alpha``). PSI (population stability index, over the reference's deciles or its
categories) is reported beside each p-value as the size of the shift: the p-value says
whether, PSI says how much (above 0.2 is the usual "significant shift").

A missing value (NaN) is a category of its own: a feature whose share of NaN differs
between the reference and the window drifts by the chi-squared test of (finite, NaN)
counts, and KS and PSI's deciles see only the finite values. A broken sensor that starts
sending NaN is drift, and one NaN in a reference does not blind its feature. When both
tests run, the feature's p-value is the smaller one doubled (Bonferroni again).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from slipstream.datatypes import BF16

FeatureKind = Literal["continuous", "categorical", "projected"]
# PSI's floor for an empty bin: log(0) would make one empty bin infinite.
_PSI_FLOOR = 1e-4
# ks_2samp's (statistic, p-value) by (reference samples, window samples, statistic as
# ks_2samp computes it before rounding it): everything ks_2samp does after finding the
# statistic depends on those three alone. Its exact p-value costs ~1 ms a feature, the
# statistic ~0.1 ms from a sorted reference, and a monitor's windows keep their sizes:
# after a few windows most features' p-values come from here, the same floats. Shared
# by every reference of the process; emptied when it reaches _KS_RESULTS_MAX entries.
_KS_RESULTS: dict[tuple[int, int, float], tuple[float, float]] = {}
_KS_RESULTS_MAX = 1 << 16


@dataclass(frozen=True)
class FeatureDrift:
    """One feature's test on one window."""

    # "3" for a tensor's fourth feature, "p3" for its fourth projected dimension.
    feature: str
    kind: FeatureKind
    # KS statistic or chi-squared statistic (with NaN on either side: that of the test,
    # KS or NaN share, that gave the p-value).
    statistic: float
    p_value: float
    # Population stability index of the window against the reference.
    psi: float
    # p_value below the window's Bonferroni threshold.
    drifted: bool
    # The share of reference and window samples in each bin: the reference's deciles
    # (continuous; bins split at ``bins``) or its categories (``bins``, then "other"),
    # then NaN's share when either side has NaN in this feature.
    bins: tuple[float, ...] = ()
    reference_shares: tuple[float, ...] = ()
    window_shares: tuple[float, ...] = ()
    # (reference, window) share of NaN; empty when neither has any.
    nan_shares: tuple[float, ...] = ()
    # How the feature was tested when it was not plainly (NaN on either side), or why
    # it could not be; empty otherwise.
    note: str = ""


@dataclass(frozen=True)
class DriftReport:
    """One window of one tensor against its reference."""

    tensor: str
    samples: int
    # alpha / features: a feature drifts below it.
    p_threshold: float
    detected: bool
    features: tuple[FeatureDrift, ...]

    @property
    def min_p_value(self) -> float:
        return min((f.p_value for f in self.features if math.isfinite(f.p_value)), default=1.0)

    @property
    def drifted(self) -> list[FeatureDrift]:
        return [f for f in self.features if f.drifted]

    def to_json(self) -> dict[str, Any]:
        return {
            "tensor": self.tensor,
            "samples": self.samples,
            "p_threshold": self.p_threshold,
            "detected": self.detected,
            "min_p_value": self.min_p_value,
            "features": [
                {
                    "feature": f.feature,
                    "kind": f.kind,
                    "statistic": f.statistic,
                    "p_value": f.p_value,
                    "psi": f.psi,
                    "drifted": f.drifted,
                    "bins": list(f.bins),
                    "reference_shares": list(f.reference_shares),
                    "window_shares": list(f.window_shares),
                    "nan_shares": list(f.nan_shares),
                    "note": f.note,
                }
                for f in self.features
            ],
        }


@dataclass
class Reference:
    """What one tensor looked like when it was known good: its samples as features.

    >>> rng = np.random.default_rng(0)
    >>> reference = Reference.from_samples("x", rng.normal(size=(2000, 4)))
    >>> reference.test(rng.normal(size=(500, 4))).detected
    False
    >>> shifted = rng.normal(size=(500, 4)) + [0, 0, 0.5, 0]
    >>> [f.feature for f in reference.test(shifted).drifted]
    ['2']
    """

    tensor: str
    # [n, features] after projection; what every window is compared with.
    samples: np.ndarray
    kinds: list[FeatureKind]
    # Sorted category values of each categorical feature (empty for the others).
    categories: list[np.ndarray]
    # Reference deciles of each continuous feature's finite values, for PSI.
    edges: list[np.ndarray]
    alpha: float = 0.05
    # [raw features, projected] when the tensor was projected; None otherwise.
    projection: np.ndarray | None = field(default=None, repr=False)
    # PSI bin shares of the reference's continuous features, by feature (made once).
    _shares: dict[int, np.ndarray] = field(default_factory=dict, init=False, repr=False)
    # ``samples`` sorted as the windows' dtype (made once, for the KS tests).
    _sorted: _Sorted | None = field(default=None, init=False, repr=False)

    @classmethod
    def from_samples(
        cls,
        tensor: str,
        data: np.ndarray,
        alpha: float = 0.05,
        max_categories: int = 20,
        max_features: int = 64,
        seed: int = 0,
    ) -> Reference:
        """A reference from ``data`` ([samples, ...]); at least 2 samples."""
        rows = _rows(data)
        if rows.shape[0] < 2:
            raise ValueError(f"{tensor}: a reference needs at least 2 samples, got {rows.shape[0]}")
        projection = None
        if rows.shape[1] > max_features:
            rng = np.random.default_rng(seed)
            projection = rng.normal(size=(rows.shape[1], max_features)) / np.sqrt(max_features)
            rows = rows.astype(np.float64) @ projection
        kinds: list[FeatureKind] = []
        categories: list[np.ndarray] = []
        for column in rows.T:
            # Only integers can be categories: a float column's values are never counted.
            integral = column.dtype.kind in "iub"
            values = np.unique(column) if integral else column
            if projection is None and integral and len(values) <= max_categories:
                kinds.append("categorical")
                categories.append(values)
            else:
                kinds.append("projected" if projection is not None else "continuous")
                categories.append(np.empty(0))
        continuous = [i for i, kind in enumerate(kinds) if kind != "categorical"]
        edges = [np.empty(0)] * len(kinds)
        for index, column_deciles in zip(continuous, _deciles(rows[:, continuous]), strict=True):
            edges[index] = column_deciles
        return cls(tensor, rows, kinds, categories, edges, alpha, projection)

    @property
    def num_features(self) -> int:
        return len(self.kinds)

    def _reference_shares(self, index: int, finite: np.ndarray, rows: int) -> np.ndarray:
        """The reference's share in each PSI bin of a continuous feature (made once from
        ``finite``, its finite values sorted, of ``rows`` in all)."""
        shares = self._shares.get(index)
        if shares is None:
            shares = self._shares[index] = _histogram(finite, self.edges[index], rows)
        return shares

    def _sorted_samples(self, dtype: np.dtype[Any]) -> _Sorted:
        """The reference's values as ``dtype``, each feature sorted (made once)."""
        if self._sorted is None or self._sorted.values.dtype != dtype:
            self._sorted = _Sorted.of(self.samples, dtype)
        return self._sorted

    def test(self, data: np.ndarray) -> DriftReport:
        """Test a window ([samples, ...], the reference's feature shape) against it."""
        rows = _rows(data)
        width = self.samples.shape[1] if self.projection is None else self.projection.shape[0]
        if rows.shape[1] != width:
            raise ValueError(
                f"{self.tensor}: samples of {rows.shape[1]} features, the reference has {width}"
            )
        if self.projection is not None:
            rows = rows.astype(np.float64) @ self.projection
        threshold = self.alpha / self.num_features
        continuous = [i for i, kind in enumerate(self.kinds) if kind != "categorical"]
        ks_tests: dict[int, tuple[float, float]] = {}
        reference = window = None
        if continuous:
            # The window as ks_2samp compares it with the reference, sorted.
            dtype = np.result_type(self.samples.dtype, rows.dtype)
            window = _Sorted.of(rows, dtype, with_cdf=False)
            reference = self._sorted_samples(dtype)
            ks_tests = self._ks_tests(rows, continuous, reference, window)
        results = []
        for index, kind in enumerate(self.kinds):
            if kind == "categorical":
                bins = self.categories[index]
                statistic, p_value, shares = _categorical(
                    bins, self.samples[:, index], rows[:, index]
                )
                nan_shares: tuple[float, ...] = ()
                note = ""
            else:
                assert reference is not None and window is not None
                bins = self.edges[index]
                statistic, p_value, shares, nan_shares, note = self._continuous(
                    index, reference, window, ks_tests.get(index)
                )
            if not math.isfinite(p_value):
                note = note or "could not be tested: the test's p-value is NaN"
            name = f"p{index}" if kind == "projected" else str(index)
            results.append(
                FeatureDrift(
                    name,
                    kind,
                    statistic,
                    p_value,
                    _psi(*shares),
                    p_value < threshold,
                    tuple(float(b) for b in bins),
                    _rounded(shares[0]),
                    _rounded(shares[1]),
                    nan_shares,
                    note,
                )
            )
        detected = any(f.drifted for f in results)
        return DriftReport(self.tensor, rows.shape[0], threshold, detected, tuple(results))

    def _continuous(
        self, index: int, reference: _Sorted, window: _Sorted, ks: tuple[float, float] | None
    ) -> tuple[float, float, tuple[np.ndarray, np.ndarray], tuple[float, ...], str]:
        """(statistic, p-value, PSI shares, NaN shares, note) of a continuous feature:
        KS on the finite values (``ks``, None when a side has none), and the NaN share's
        own test when either side has NaN."""
        n, m = reference.finite[index], window.finite[index]
        shares = (
            self._reference_shares(index, reference.values[index, :n], reference.rows),
            _histogram(window.values[index, :m], self.edges[index], window.rows),
        )
        if n == reference.rows and m == window.rows:
            assert ks is not None
            return ks[0], ks[1], shares, (), ""
        nan_shares = (1 - n / reference.rows, 1 - m / window.rows)
        counts = np.array([[n, reference.rows - n], [m, window.rows - m]], dtype=np.float64)
        nan_test = _chi_squared(counts)
        shares = (np.append(shares[0], nan_shares[0]), np.append(shares[1], nan_shares[1]))
        described = (
            f"NaN: {nan_shares[1]:.1%} of the window, {nan_shares[0]:.1%} of the reference "
            f"(chi-squared p {nan_test[1]:.3g})"
        )
        if ks is None:
            side = "window's" if m == 0 else "reference's"
            note = f"{described}; the {side} values are all NaN: only their share is tested"
            return nan_test[0], nan_test[1], shares, _rounded(np.array(nan_shares)), note
        statistic, p_value = min(ks, nan_test, key=lambda test: test[1])
        note = (
            f"{described}; KS on the finite values (p {ks[1]:.3g}); the feature's p-value "
            "is the smaller, doubled"
        )
        return statistic, min(1.0, 2 * p_value), shares, _rounded(np.array(nan_shares)), note

    def _ks_tests(
        self, rows: np.ndarray, continuous: list[int], reference: _Sorted, window: _Sorted
    ) -> dict[int, tuple[float, float]]:
        """ks_2samp's (statistic, exact p-value) on the finite values of each continuous
        feature that has some on both sides: from _KS_RESULTS when a window of these
        sizes had the feature's statistic before, else from one ks_2samp call for every
        feature not found there. ``window``: ``rows`` sorted, as in test()."""
        tests: dict[int, tuple[float, float]] = {}
        keys: dict[int, tuple[int, int, float] | None] = {}
        for index in continuous:
            n, m = int(reference.finite[index]), int(window.finite[index])
            if n == 0 or m == 0:
                continue  # nothing to compare: the NaN share's test alone
            statistic = _ks_statistic(
                reference.values[index, :n], reference.cdf[index, :n], window.values[index, :m]
            )
            key = None if statistic is None else (n, m, statistic)
            found = None if key is None else _KS_RESULTS.get(key)
            if found is None:
                keys[index] = key
            else:
                tests[index] = found
        if keys:
            # Every feature not found in one call (a third of the time of one call a
            # feature: the per-call checks dominate).
            unseen = list(keys)
            ks = _stats().ks_2samp(
                self.samples[:, unseen], rows[:, unseen], axis=0, nan_policy="omit"
            )
            if len(_KS_RESULTS) + len(unseen) > _KS_RESULTS_MAX:
                _KS_RESULTS.clear()
            for index, statistic, p_value in zip(
                unseen, ks.statistic.tolist(), ks.pvalue.tolist(), strict=True
            ):
                tests[index] = (statistic, p_value)
                if (key := keys[index]) is not None:
                    _KS_RESULTS[key] = tests[index]
        return tests


def _stats() -> Any:
    """scipy.stats, imported when a window is first tested: a server that monitors
    nothing never needs scipy (the monitor extra)."""
    try:
        from scipy import stats
    except ImportError as exc:
        raise ImportError(
            "drift monitoring needs scipy: pip install 'slipstream[monitor]'"
        ) from exc
    return stats


def _rows(data: np.ndarray) -> np.ndarray:
    """[samples, features]: the batch dimension first, the rest flattened."""
    array = np.asarray(data)
    if array.dtype == BF16:  # tested as the FP32 numbers it holds (numpy's sort and
        array = array.astype(np.float32)  # quantiles know no bfloat16)
    if array.ndim == 0:
        raise ValueError("drift needs samples along a first (batch) dimension, got a scalar")
    return array.reshape(array.shape[0], -1) if array.ndim != 2 else array


@dataclass(frozen=True)
class _Sorted:
    """A tensor's samples, each feature sorted (NaN last, as a sort puts it)."""

    # [features, rows]: a feature's values contiguous, as searchsorted wants them.
    values: np.ndarray
    # [features]: how many of each feature's values are finite (the first ones).
    finite: np.ndarray
    # [features, rows]: each feature's empirical CDF over its finite values, at each of
    # them (0 past them); empty when not asked for.
    cdf: np.ndarray
    rows: int

    @classmethod
    def of(cls, samples: np.ndarray, dtype: np.dtype[Any], with_cdf: bool = True) -> _Sorted:
        values = np.sort(np.ascontiguousarray(samples.T, dtype=dtype), axis=1)
        rows = values.shape[1]
        if dtype.kind in "fc":
            finite = rows - np.count_nonzero(np.isnan(values), axis=1)
        else:
            finite = np.full(values.shape[0], rows)
        if not with_cdf:
            return cls(values, finite, np.empty((0, 0)), rows)
        cdf = np.zeros(values.shape)
        for index, (column, n) in enumerate(zip(values, finite, strict=True)):
            cdf[index, :n] = np.searchsorted(column[:n], column[:n], side="right") / n
        return cls(values, finite, cdf, rows)


def _deciles(columns: np.ndarray) -> list[np.ndarray]:
    """The distinct deciles of each column's finite values (none for an all-NaN one)."""
    probabilities = np.linspace(0.1, 0.9, 9)
    missing = np.isnan(columns) if columns.dtype.kind in "fc" else None
    if missing is None or not missing.any():
        # Every column in one call (the same values as a call each).
        return [np.unique(d) for d in np.quantile(columns, probabilities, axis=0).T]
    return [
        np.unique(np.quantile(column[~gaps], probabilities)) if (~gaps).any() else np.empty(0)
        for column, gaps in zip(columns.T, missing.T, strict=True)
    ]


def _ks_statistic(
    reference: np.ndarray, reference_cdf: np.ndarray, window: np.ndarray
) -> float | None:
    """The largest distance between the empirical CDFs of two sorted samples, made of the
    same floats as ks_2samp's (each sample's CDF at every value of both, less one
    another), so the same float; None for an empty window. Both are finite values (NaN
    are tested apart). ``reference_cdf`` is the reference's CDF at its own values."""
    if len(window) == 0:
        return None
    n, m = len(reference), len(window)
    gaps = np.concatenate([
        reference_cdf - np.searchsorted(window, reference, side="right") / m,
        np.searchsorted(reference, window, side="right") / n
        - np.searchsorted(window, window, side="right") / m,
    ])  # fmt: skip
    below, above = np.clip(-gaps.min(), 0, 1), gaps.max()
    return float(below if below > above else above)


def _histogram(ordered: np.ndarray, edges: np.ndarray, rows: int) -> np.ndarray:
    """The share of ``rows`` that the sorted finite values ``ordered`` put in each bin
    split at ``edges``: below the first edge, from each edge up to the next, from the
    last edge up."""
    below = np.searchsorted(ordered, edges, side="left")  # values under each edge
    counts = np.diff(below, prepend=0, append=len(ordered))
    return counts / max(rows, 1)


def _psi(expected: np.ndarray, actual: np.ndarray) -> float:
    e = np.maximum(expected, _PSI_FLOOR)
    a = np.maximum(actual, _PSI_FLOOR)
    return float(np.sum((a - e) * np.log(a / e)))


def _rounded(shares: np.ndarray) -> tuple[float, ...]:
    return tuple(round(float(x), 6) for x in shares)


def _categorical(
    categories: np.ndarray, expected: np.ndarray, observed: np.ndarray
) -> tuple[float, float, tuple[np.ndarray, np.ndarray]]:
    """Chi-squared over the reference's categories plus one for values it never had."""

    def counts(values: np.ndarray) -> np.ndarray:
        index = np.searchsorted(categories, values)
        known = (index < len(categories)) & (
            categories[np.minimum(index, len(categories) - 1)] == values
        )
        table = np.bincount(index[known], minlength=len(categories)).astype(np.float64)
        return np.append(table, np.count_nonzero(~known))

    full = np.stack([counts(expected), counts(observed)])
    shares = (full[0] / full[0].sum(), full[1] / full[1].sum())
    return (*_chi_squared(full), shares)


def _chi_squared(full: np.ndarray) -> tuple[float, float]:
    """Chi-squared (statistic, p-value) of two rows of counts by category."""
    table = full[:, full.sum(axis=0) > 0]
    if table.shape[1] < 2:
        return 0.0, 1.0  # one category on both sides: nothing can differ
    result = _stats().chi2_contingency(table)
    return float(result.statistic), float(result.pvalue)
