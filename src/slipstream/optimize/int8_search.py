"""Gate-steered int8-dynamic: build candidates fastest first, keep the first that passes.

Each candidate is quantized and judged with the accuracy gate on the calibration rows
(``gate.CalibrationJudge``), never on the rows the final gate judges. In the order of
their expected speed:

1. plain dynamic int8 of every node the settings name (the fastest);
2. the same after activation smoothing (``optimize.smoothing``) with each ``alpha`` of
   ``PassSettings.smoothing_alphas``; these cost the same, so among those that pass the
   one with the widest margin to the gate's limits is kept;
3. keep the most damaging nodes in FP32 (``nodes_to_exclude``), on top of the best of
   1-2: each node's damage is measured by quantizing it alone; nodes are ranked by
   damage per weight element (the FP32 time kept per unit of error avoided), and the
   shortest prefix of that ranking that passes is found by doubling, then bisection.

If nothing passes, the candidate with the widest margin is kept and the final gate
reports by how much it misses. Every candidate tried is recorded.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from slipstream.optimize.data import Dataset
from slipstream.optimize.gate import CandidateScore, margin
from slipstream.optimize.smoothing import channel_absmax, smooth_model

logger = logging.getLogger(__name__)

__all__ = ["Quantizer", "SearchResult", "SearchStep", "quantizable_nodes", "search_int8_dynamic"]

# (source, target, nodes kept in FP32, nodes to quantize or None for all): writes target.
Quantizer = Callable[[Path, Path, Sequence[str], Sequence[str] | None], None]
ProgressCallback = Callable[[str, int, int], None]


@dataclass(frozen=True, slots=True)
class SearchStep:
    """One candidate built and judged on the calibration rows."""

    # Smoothing strength, or None for no smoothing.
    smoothing_alpha: float | None
    # Nodes kept in FP32.
    excluded_nodes: list[str]
    passed: bool
    # gate.margin on the calibration rows (negative: short of the limit by that much).
    margin: float
    relative_error: float
    # The gate's one-line verdict on the calibration rows.
    summary: str


@dataclass(slots=True)
class SearchResult:
    """The candidate kept and how it was found."""

    smoothing_alpha: float | None
    excluded_nodes: list[str]
    # Whether the kept candidate passed the gate on the calibration rows.
    passed: bool
    steps: list[SearchStep] = field(default_factory=list)
    # Node -> relative output error on the calibration rows with only that node in int8;
    # measured only when step 3 ran.
    sensitivity: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    def to_record(self) -> dict[str, Any]:
        return {
            "smoothing_alpha": self.smoothing_alpha,
            "excluded_nodes": self.excluded_nodes,
            "passed_on_calibration_rows": self.passed,
            "seconds": round(self.seconds, 2),
            "candidates": [
                {
                    "smoothing_alpha": step.smoothing_alpha,
                    "excluded_nodes": len(step.excluded_nodes),
                    "passed": step.passed,
                    "margin": step.margin,
                    "relative_error": step.relative_error,
                }
                for step in self.steps
            ],
            "sensitivity": self.sensitivity,
        }


def quantizable_nodes(model: onnx.ModelProto, op_types: Sequence[str]) -> dict[str, int]:
    """Nodes of ``op_types`` with a constant weight, by name -> weight elements.

    The weight's size stands for the node's share of the run time when it stays FP32.
    """
    sizes = {init.name: max(1, _elements(init.dims)) for init in model.graph.initializer}
    found = {}
    for node in model.graph.node:
        if op_types and node.op_type not in op_types:
            continue
        weights = [sizes[name] for name in node.input if name in sizes]
        if node.name and weights:
            found[node.name] = max(weights)
    return found


def search_int8_dynamic(
    source: Path,
    target: Path,
    quantize: Quantizer,
    judge: Callable[[Path], CandidateScore],
    calibration: Dataset,
    alphas: Sequence[float],
    op_types: Sequence[str],
    on_progress: ProgressCallback | None = None,
) -> SearchResult:
    """Write the fastest candidate that passes ``judge`` to ``target`` (see module doc)."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="int8-search-", dir=target.parent) as scratch:
        search = _Search(source, Path(scratch), quantize, judge, on_progress)
        best = search.run(alphas, calibration, op_types)
        shutil.copyfile(best.path, target)
    result = SearchResult(
        smoothing_alpha=best.alpha,
        excluded_nodes=list(best.excluded),
        passed=best.score.gate.passed,
        steps=search.steps,
        sensitivity=search.sensitivity,
        seconds=time.perf_counter() - started,
    )
    return result


@dataclass(frozen=True, slots=True)
class _Candidate:
    path: Path
    alpha: float | None
    excluded: tuple[str, ...]
    score: CandidateScore

    @property
    def margin(self) -> float:
        return margin(self.score.gate)


class _Search:
    def __init__(
        self,
        source: Path,
        work: Path,
        quantize: Quantizer,
        judge: Callable[[Path], CandidateScore],
        on_progress: ProgressCallback | None,
    ) -> None:
        self._source = source
        self._work = work
        self._quantize = quantize
        self._judge = judge
        self._on_progress = on_progress
        self._smoothed: dict[float, Path] = {}
        # Candidates the search expects to build, for progress bars; it grows when the
        # node-exclusion step starts, as its length depends on where the gate passes.
        self._planned = 1
        self.steps: list[SearchStep] = []
        self.sensitivity: dict[str, float] = {}

    def run(self, alphas: Sequence[float], rows: Dataset, op_types: Sequence[str]) -> _Candidate:
        self._planned = 1 + len(alphas)
        plain = self._try(None, ())
        if plain.score.gate.passed:
            return plain
        absmax = channel_absmax(self._source, rows, self._on_progress)
        smoothed = []
        for alpha in alphas:
            path = self._work / f"smoothed-{alpha:g}.onnx"
            smooth_model(self._source, path, absmax, alpha)
            self._smoothed[alpha] = path
            smoothed.append(self._try(alpha, ()))
        passing = [candidate for candidate in smoothed if candidate.score.gate.passed]
        if passing:
            return max(passing, key=lambda candidate: candidate.margin)
        base = max([plain, *smoothed], key=lambda candidate: candidate.margin)
        ranking = self._rank_nodes(base.alpha, op_types)
        return self._shortest_passing_prefix(base, ranking)

    def _try(self, alpha: float | None, excluded: Sequence[str]) -> _Candidate:
        path = self._work / f"candidate-{len(self.steps)}.onnx"
        self._quantize(self._input(alpha), path, excluded, None)
        score = self._judge(path)
        candidate = _Candidate(path, alpha, tuple(excluded), score)
        self.steps.append(
            SearchStep(
                alpha,
                list(excluded),
                score.gate.passed,
                candidate.margin,
                score.relative_error,
                score.gate.summary,
            )
        )
        logger.info(
            "int8 search: alpha %s, %d nodes in FP32: %s",
            alpha,
            len(excluded),
            score.gate.summary,
        )
        if self._on_progress is not None:
            total = max(self._planned, len(self.steps))
            self._on_progress("int8 search (candidates)", len(self.steps), total)
        return candidate

    def _input(self, alpha: float | None) -> Path:
        return self._source if alpha is None else self._smoothed[alpha]

    def _rank_nodes(self, alpha: float | None, op_types: Sequence[str]) -> list[str]:
        """Nodes by the error each causes alone per weight element, most damaging first."""
        source = self._input(alpha)
        sizes = quantizable_nodes(onnx.load(str(source), load_external_data=False), op_types)
        probe = self._work / "probe.onnx"
        for index, name in enumerate(sizes):
            self._quantize(source, probe, (), [name])
            self.sensitivity[name] = self._judge(probe).relative_error
            if self._on_progress is not None:
                self._on_progress("int8 search: sensitivity (nodes)", index + 1, len(sizes))
        return sorted(sizes, key=lambda name: self.sensitivity[name] / sizes[name], reverse=True)

    def _shortest_passing_prefix(self, base: _Candidate, ranking: list[str]) -> _Candidate:
        # Doubling, then bisection: at most about 2 * log2(nodes) more candidates.
        self._planned = len(self.steps) + 2 * max(1, (len(ranking) - 1).bit_length())
        tried = [base]
        failed_at, passed = 0, None
        count = 1
        # Keeping every node in FP32 is the original model: stop one short of it.
        while count < len(ranking):
            candidate = self._try(base.alpha, ranking[:count])
            tried.append(candidate)
            if candidate.score.gate.passed:
                passed = candidate
                break
            failed_at, count = count, min(2 * count, len(ranking) - 1)
            if count == failed_at:
                break
        if passed is None:
            return max(tried, key=lambda candidate: candidate.margin)
        low, high = failed_at, len(passed.excluded)  # fails at low, passes at high
        while high - low > 1:
            middle = (low + high) // 2
            candidate = self._try(base.alpha, ranking[:middle])
            if candidate.score.gate.passed:
                passed, high = candidate, middle
            else:
                low = middle
        return passed


def _elements(dims: Sequence[int]) -> int:
    total = 1
    for dim in dims:
        total *= int(dim)
    return total
