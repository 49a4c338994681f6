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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

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
    # KS statistic or chi-squared statistic.
    statistic: float
    p_value: float
    # Population stability index of the window against the reference.
    psi: float
    # p_value below the window's Bonferroni threshold.
    drifted: bool
    # The share of reference and window samples in each bin: the reference's deciles
    # (continuous; bins split at ``bins``) or its categories (``bins``, then "other").
    bins: tuple[float, ...] = ()
    reference_shares: tuple[float, ...] = ()
    window_shares: tuple[float, ...] = ()


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
        return min((f.p_value for f in self.features), default=1.0)

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
    # Reference deciles of each continuous feature, for PSI.
    edges: list[np.ndarray]
    alpha: float = 0.05
    # [raw features, projected] when the tensor was projected; None otherwise.
    projection: np.ndarray | None = field(default=None, repr=False)
    # PSI bin shares of the reference's continuous features, by feature (made once).
    _shares: dict[int, np.ndarray] = field(default_factory=dict, init=False, repr=False)
    # [features, n]: ``samples`` as the windows' dtype, each feature sorted, and each
    # feature's empirical CDF at its own values (made once, for the KS tests).
    _sorted: tuple[np.ndarray, np.ndarray] | None = field(default=None, init=False, repr=False)

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
        # Every continuous feature's deciles in one call (the same values as a call each).
        continuous = [i for i, kind in enumerate(kinds) if kind != "categorical"]
        deciles = np.quantile(rows[:, continuous], np.linspace(0.1, 0.9, 9), axis=0)
        edges = [np.empty(0)] * len(kinds)
        for index, column_deciles in zip(continuous, deciles.T, strict=True):
            edges[index] = np.unique(column_deciles)
        return cls(tensor, rows, kinds, categories, edges, alpha, projection)

    @property
    def num_features(self) -> int:
        return len(self.kinds)

    def _reference_shares(self, index: int, ordered: np.ndarray) -> np.ndarray:
        """The reference's share in each PSI bin of a continuous feature (made once from
        ``ordered``, its values sorted)."""
        shares = self._shares.get(index)
        if shares is None:
            shares = self._shares[index] = _histogram(ordered, self.edges[index])
        return shares

    def _sorted_samples(self, dtype: np.dtype[Any]) -> tuple[np.ndarray, np.ndarray]:
        """[features, n] twice: the reference's values as ``dtype``, each feature sorted,
        and each feature's empirical CDF at its own values (made once)."""
        if self._sorted is None or self._sorted[0].dtype != dtype:
            # A feature's values contiguous, as searchsorted wants them.
            ordered = np.sort(np.ascontiguousarray(self.samples.T, dtype=dtype), axis=1)
            ranks = [np.searchsorted(values, values, side="right") for values in ordered]
            self._sorted = (ordered, np.stack(ranks) / ordered.shape[1])
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
        if continuous:
            # [features, m]: the window as ks_2samp compares it with the reference, sorted.
            dtype = np.result_type(self.samples.dtype, rows.dtype)
            window = np.sort(np.ascontiguousarray(rows.T, dtype=dtype), axis=1)
            reference = self._sorted_samples(dtype)[0]
            ks_tests = self._ks_tests(rows, continuous, window)
        results = []
        for index, kind in enumerate(self.kinds):
            if kind == "categorical":
                bins = self.categories[index]
                statistic, p_value, shares = _categorical(
                    bins, self.samples[:, index], rows[:, index]
                )
            else:
                statistic, p_value = ks_tests[index]
                bins = self.edges[index]
                shares = (
                    self._reference_shares(index, reference[index]),
                    _histogram(window[index], bins),
                )
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
                )
            )
        detected = any(f.drifted for f in results)
        return DriftReport(self.tensor, rows.shape[0], threshold, detected, tuple(results))

    def _ks_tests(
        self, rows: np.ndarray, continuous: list[int], window: np.ndarray
    ) -> dict[int, tuple[float, float]]:
        """ks_2samp's (statistic, exact p-value) of each continuous feature: from
        _KS_RESULTS when a window of these sizes had the feature's statistic before, else
        from one ks_2samp call for every feature not found there. ``window``: ``rows``
        sorted, as in test()."""
        reference, reference_cdf = self._sorted_samples(window.dtype)
        tests: dict[int, tuple[float, float]] = {}
        keys: dict[int, tuple[int, int, float] | None] = {}
        for index in continuous:
            statistic = _ks_statistic(reference[index], reference_cdf[index], window[index])
            key = None if statistic is None else (reference.shape[1], window.shape[1], statistic)
            found = None if key is None else _KS_RESULTS.get(key)
            if found is None:
                keys[index] = key
            else:
                tests[index] = found
        if keys:
            # Every feature not found in one call (a third of the time of one call a
            # feature: the per-call checks dominate).
            unseen = list(keys)
            ks = _stats().ks_2samp(self.samples[:, unseen], rows[:, unseen], axis=0)
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
    if array.ndim == 0:
        raise ValueError("drift needs samples along a first (batch) dimension, got a scalar")
    return array.reshape(array.shape[0], -1) if array.ndim != 2 else array


def _ks_statistic(
    reference: np.ndarray, reference_cdf: np.ndarray, window: np.ndarray
) -> float | None:
    """The largest distance between the empirical CDFs of two sorted samples, made of the
    same floats as ks_2samp's (each sample's CDF at every value of both, less one
    another), so the same float; None for an empty window or a NaN in either (ks_2samp
    answers NaN). ``reference_cdf`` is the reference's CDF at its own values."""
    if len(window) == 0:
        return None
    if reference.dtype.kind == "f" and (np.isnan(reference[-1]) or np.isnan(window[-1])):
        return None  # a sort puts NaN last
    n, m = len(reference), len(window)
    gaps = np.concatenate([
        reference_cdf - np.searchsorted(window, reference, side="right") / m,
        np.searchsorted(reference, window, side="right") / n
        - np.searchsorted(window, window, side="right") / m,
    ])  # fmt: skip
    below, above = np.clip(-gaps.min(), 0, 1), gaps.max()
    return float(below if below > above else above)


def _histogram(ordered: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """The share of the sorted values ``ordered`` in each bin split at ``edges``: below
    the first edge, from each edge up to the next, from the last edge up (NaN, sorted
    last, in the last bin)."""
    below = np.searchsorted(ordered, edges, side="left")  # values under each edge
    counts = np.diff(below, prepend=0, append=len(ordered))
    return counts / max(len(ordered), 1)


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
    table = full[:, full.sum(axis=0) > 0]
    if table.shape[1] < 2:
        return 0.0, 1.0, shares  # one category on both sides: nothing can differ
    result = _stats().chi2_contingency(table)
    return float(result.statistic), float(result.pvalue), shares
