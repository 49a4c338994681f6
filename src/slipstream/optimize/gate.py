"""The accuracy gate: run the original and the optimized model on the same rows, compare.

Metrics (``--metric``) and what ``--max-drop X`` means for each:

- ``top1``: accuracy against the data's labels; fails when it drops by more than X
  percentage points (default 1.0).
- ``agreement``: share of rows where the optimized model's top-1 class matches the
  original's; fails below 100 - X percent (default X = 1.0, i.e. 99 %).
- ``cosine``: cosine similarity of each row's output to the original's; fails when the
  mean is below 1 - X or the minimum below 1 - 2X (default X = 0.01: 0.99 and 0.98).
- ``mae`` / ``maxae``: mean / largest absolute difference to the original's outputs;
  fails above X (defaults 0.01 / 0.1).

``X`` is at least 0 for every metric, at most 100 for top1 and agreement (percentage
points) and at most 1 for cosine (1 - X then bounds the mean at 0 and the minimum at -1,
the lowest a cosine can be).

Without ``--metric``: labels in the data -> top1; an integer output, or one whose name
says it is a class or probability -> agreement; any other float output -> cosine.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from slipstream.optimize.data import Dataset

__all__ = [
    "DEFAULT_MAX_DROP",
    "MAX_DROP_LIMIT",
    "CalibrationJudge",
    "CandidateScore",
    "GateResult",
    "MetricName",
    "check_max_drop",
    "choose_metric",
    "compare_outputs",
    "judge",
    "margin",
    "run_model",
]

MetricName = Literal["top1", "agreement", "cosine", "mae", "maxae"]
METRIC_NAMES: tuple[MetricName, ...] = ("top1", "agreement", "cosine", "mae", "maxae")
DEFAULT_MAX_DROP: dict[MetricName, float] = {
    "top1": 1.0,
    "agreement": 1.0,
    "cosine": 0.01,
    "mae": 0.01,
    "maxae": 0.1,
}
# The largest meaningful ``--max-drop`` per metric (see the module docstring).
MAX_DROP_LIMIT: dict[MetricName, float] = {
    "top1": 100.0,
    "agreement": 100.0,
    "cosine": 1.0,
    "mae": math.inf,
    "maxae": math.inf,
}
# Output names that mark a classifier (scores over classes, or the class itself).
_CLASSIFIER_HINTS = ("logit", "prob", "class", "label", "score", "predict")
# Rows per run when the model takes a variable batch.
_EVAL_BATCH_ROWS = 64


@dataclass(frozen=True, slots=True)
class GateResult:
    """The accuracy comparison and its verdict, as written into optimization.json."""

    metric: MetricName
    # Why this metric was used ("--metric", "labels present", ...).
    metric_reason: str
    # The model output compared.
    output_name: str
    # Rows compared.
    num_rows: int
    # Metric values of the original model (top1 only; the others compare to it).
    before: dict[str, float]
    # Metric values of the optimized model.
    after: dict[str, float]
    # The limit each value of ``after`` had to meet, by the same keys.
    limits: dict[str, float]
    max_drop: float
    passed: bool
    # By how much the worst value missed its limit (0 when passed), in the metric's unit.
    shortfall: float
    # One line for people: the verdict with the numbers.
    summary: str


def margin(result: GateResult) -> float:
    """How far the worst value is inside its limit (negative: outside), in the metric's unit.

    Candidates that pass are told apart by this, e.g. two settings that both keep the
    cosines above their limits."""
    upper = result.metric in ("mae", "maxae")
    return min(
        (limit - result.after[key]) if upper else (result.after[key] - limit)
        for key, limit in result.limits.items()
    )


@dataclass(frozen=True, slots=True)
class CandidateScore:
    """One candidate model judged on the calibration rows (see :class:`CalibrationJudge`)."""

    gate: GateResult
    # ||after - before|| / ||before|| over all outputs of those rows: a continuous measure
    # of damage that ranks candidates even when the gate metric ties (top-1 on few rows).
    relative_error: float


class CalibrationJudge:
    """The accuracy gate applied to a candidate model on the calibration rows.

    A search (see ``optimize.int8_search``) picks among candidate models with it, so the
    rows the final gate judges stay unseen by the choice. ``before`` is the original
    model's ``output_name`` on ``rows``.
    """

    def __init__(
        self,
        rows: Dataset,
        before: np.ndarray,
        output_name: str,
        metric: MetricName,
        max_drop: float,
    ) -> None:
        if metric == "top1" and rows.labels is None:
            # Calibration rows without labels: judge agreement with the original's
            # top-1 instead, on the same scale (percentage points).
            metric = "agreement"
        self.metric: MetricName = metric
        self.max_drop = max_drop
        self.output_name = output_name
        self._rows = rows
        self._before = before

    def __call__(self, candidate: Path) -> CandidateScore:
        _, after = run_model(candidate, self._rows, self.output_name)
        values = compare_outputs(self.metric, self.max_drop, self._before, after, self._rows.labels)
        result = judge(
            self.metric, "calibration rows", self.output_name, self._rows.num_rows,
            self.max_drop, values,
        )  # fmt: skip
        before = _as_rows(self._before)
        norm = max(float(np.linalg.norm(before)), 1e-30)
        return CandidateScore(result, float(np.linalg.norm(_as_rows(after) - before)) / norm)


def run_model(
    path: Path,
    data: Dataset,
    output_name: str | None = None,
    on_progress: Callable[[str, int, int], None] | None = None,
    task: str = "evaluating",
) -> tuple[str, np.ndarray]:
    """Run ``data`` through the model at ``path``; (output name, that output [N, ...])."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = output_name or session.get_outputs()[0].name
    first_dim = session.get_inputs()[0].shape[0] if session.get_inputs()[0].shape else None
    step = first_dim if isinstance(first_dim, int) and first_dim > 0 else _EVAL_BATCH_ROWS
    total = data.num_rows
    parts = []
    for start in range(0, total, step):
        stop = min(start + step, total)
        feed = {key: value for key, value in data.rows(start, stop).inputs.items()}
        parts.append(np.asarray(session.run([name], feed)[0]))
        if on_progress is not None:
            on_progress(task, stop, total)
    return name, np.concatenate(parts)


def choose_metric(
    requested: MetricName | None, has_labels: bool, output_name: str, output: np.ndarray
) -> tuple[MetricName, str]:
    """The metric to gate on and why (see the module docstring)."""
    if requested is not None:
        if requested == "top1" and not has_labels:
            raise ValueError(
                "--metric top1 needs labels: add a 'labels' array to the validation data, "
                "or use --metric agreement"
            )
        return requested, "--metric"
    if has_labels:
        return "top1", "the validation data has labels"
    if output.dtype.kind in "iu" or any(hint in output_name.lower() for hint in _CLASSIFIER_HINTS):
        return (
            "agreement",
            f"output {output_name!r} looks like a classifier's and there are no labels",
        )
    return "cosine", f"output {output_name!r} is a float tensor (an embedding) with no labels"


def check_max_drop(metric: MetricName | None, max_drop: float) -> float:
    """``max_drop`` if it is a drop ``metric`` can have; ValueError naming ``--max-drop``.

    ``metric`` None (not chosen yet) checks only what holds for every metric.

    >>> check_max_drop("cosine", 0.02)
    0.02
    """
    if not 0 <= max_drop < math.inf:  # also refuses NaN
        raise ValueError(
            f"--max-drop {max_drop:g}: expected a number >= 0 (the largest accepted drop, "
            "e.g. 1.0 percentage point of top-1 or 0.01 of cosine similarity)"
        )
    if metric is not None and max_drop > MAX_DROP_LIMIT[metric]:
        unit = "1 - cosine" if metric == "cosine" else "percentage points"
        raise ValueError(
            f"--max-drop {max_drop:g}: the {metric} gate takes 0 to "
            f"{MAX_DROP_LIMIT[metric]:g} ({unit}; default {DEFAULT_MAX_DROP[metric]:g})"
        )
    return max_drop


def compare_outputs(
    metric: MetricName,
    max_drop: float,
    before: np.ndarray,
    after: np.ndarray,
    labels: np.ndarray | None,
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """(before values, after values, limits) for ``metric``; see the module docstring."""
    if metric == "top1":
        if labels is None:
            raise ValueError("top1 needs labels")
        accuracy_before = 100.0 * float(np.mean(_top1(before) == labels))
        accuracy_after = 100.0 * float(np.mean(_top1(after) == labels))
        return (
            {"top1_percent": accuracy_before},
            {"top1_percent": accuracy_after},
            {"top1_percent": accuracy_before - max_drop},
        )
    if metric == "agreement":
        agreement = 100.0 * float(np.mean(_top1(before) == _top1(after)))
        return {}, {"agreement_percent": agreement}, {"agreement_percent": 100.0 - max_drop}
    if metric == "cosine":
        cosines = _cosines(before, after)
        values = {"mean_cosine": float(cosines.mean()), "min_cosine": float(cosines.min())}
        return {}, values, {"mean_cosine": 1.0 - max_drop, "min_cosine": 1.0 - 2 * max_drop}
    errors = np.abs(_as_rows(after) - _as_rows(before))
    if metric == "mae":
        return {}, {"mae": float(errors.mean())}, {"mae": max_drop}
    return {}, {"maxae": float(errors.max())}, {"maxae": max_drop}


def judge(
    metric: MetricName,
    metric_reason: str,
    output_name: str,
    num_rows: int,
    max_drop: float,
    values: tuple[dict[str, float], dict[str, float], dict[str, float]],
) -> GateResult:
    """The verdict on ``values`` from :func:`compare_outputs`."""
    before, after, limits = values
    # Errors must stay below their limit; every other value must stay above it.
    upper = metric in ("mae", "maxae")
    misses = {
        key: (after[key] - limit if upper else limit - after[key]) for key, limit in limits.items()
    }
    shortfall = max(0.0, *misses.values())
    passed = shortfall <= 0.0
    shown = ", ".join(
        f"{key} {after[key]:.4f} ({'<=' if upper else '>='} {limits[key]:.4f} required)"
        for key in limits
    )
    if before:
        shown += "; original " + ", ".join(f"{key} {value:.4f}" for key, value in before.items())
    verdict = "passed" if passed else f"FAILED, missed by {shortfall:.4f}"
    return GateResult(
        metric=metric,
        metric_reason=metric_reason,
        output_name=output_name,
        num_rows=num_rows,
        before=before,
        after=after,
        limits=limits,
        max_drop=max_drop,
        passed=passed,
        shortfall=shortfall,
        summary=f"accuracy gate ({metric}) {verdict}: {shown}",
    )


def _top1(output: np.ndarray) -> np.ndarray:
    if output.ndim == 1 or output.dtype.kind in "iu":
        return output.reshape(len(output), -1)[:, 0].astype(np.int64)
    classes: np.ndarray = np.argmax(output.reshape(len(output), -1), axis=1)
    return classes


def _as_rows(output: np.ndarray) -> np.ndarray:
    return output.reshape(len(output), -1).astype(np.float64)


def _cosines(before: np.ndarray, after: np.ndarray) -> np.ndarray:
    a, b = _as_rows(before), _as_rows(after)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    dots = np.sum(a * b, axis=1)
    # Two all-zero rows are identical; one all-zero row against another is not similar.
    both_zero = norms == 0
    safe = np.where(both_zero, 1.0, norms)
    same = np.all(a == b, axis=1)
    return np.where(both_zero, np.where(same, 1.0, 0.0), dots / safe)
