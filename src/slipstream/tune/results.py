"""What a tune found: one record per trial, the leaderboard order, the Pareto front.

Everything here is plain data (written as ``tune.json``) and pure functions over it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Literal

TrialStatus = Literal["ok", "slo_unmet", "failed"]


@dataclass
class LevelFigures:
    """One load level of a trial, as bench measured it."""

    concurrency: int
    throughput_infer_per_s: float
    p50_ms: float | None
    p99_ms: float | None
    avg_ms: float | None
    errors: int
    # bench's cost per 1M inferences at this level's throughput (priced profiles only).
    cost_per_1m_infer: float | None
    server_avg_batch_size: float | None
    # How far from the SLO: <= 1 within it (see tune.measure.slo_ratio).
    slo_ratio: float


@dataclass
class TrialRecord:
    """One configuration measured (and perhaps re-measured)."""

    trial: int
    # Dimension name -> value: variant, profile, max_batch_size, ... (see tune.session).
    config: dict[str, Any]
    status: TrialStatus
    levels: list[LevelFigures] = field(default_factory=list)
    # Index into ``levels`` of the best level within the SLO (ok), or of the closest one.
    chosen_level: int | None = None
    # The search's objective: inferences per unit of money (priced), else per second;
    # negative (-slo ratio) when the SLO was not met; None when the trial failed.
    score: float | None = None
    # Throughput at the SLO of every measurement of this config (the first, then
    # re-measurements).
    throughput_runs: list[float] = field(default_factory=list)
    # The level within the SLO of each of those measurements, in the same order: the
    # reported p50 and p99 are medians over the same runs as the throughput.
    run_levels: list[LevelFigures] = field(default_factory=list)
    price_per_hour: float = 0.0
    accuracy_drop: float | None = None
    # The version ``accuracy_drop`` is measured against when that is an optimized one
    # (see tune.variants); None: against the original.
    accuracy_baseline: int | None = None
    # Cores the load generator ran on, apart from the server's; None: it shared them
    # (no usable core was left outside the profile).
    client_cpus: list[int] | None = None
    error: str = ""
    log_tail: str = ""
    wall_s: float = 0.0

    @property
    def level(self) -> LevelFigures | None:
        return None if self.chosen_level is None else self.levels[self.chosen_level]

    @property
    def throughput(self) -> float | None:
        """The median throughput at the SLO over every measurement."""
        return statistics.median(self.throughput_runs) if self.throughput_runs else None

    @property
    def p50_ms(self) -> float | None:
        """p50 at the SLO: the median over the measurements, as ``throughput``."""
        return self._median_figure("p50_ms")

    @property
    def p99_ms(self) -> float | None:
        """p99 at the SLO: the median over the measurements, as ``throughput``."""
        return self._median_figure("p99_ms")

    def _median_figure(self, name: str) -> float | None:
        if not self.run_levels:  # not within the SLO: the chosen (closest) level's
            return getattr(self.level, name, None)
        values = [getattr(level, name) for level in self.run_levels]
        known = [value for value in values if value is not None]
        return statistics.median(known) if known else None

    @property
    def spread_pct(self) -> float | None:
        """(max - min) / median of the runs, in percent; None with one run."""
        runs = self.throughput_runs
        if len(runs) < 2 or not self.throughput:
            return None
        return 100.0 * (max(runs) - min(runs)) / self.throughput

    @property
    def cost_per_1m_infer(self) -> float | None:
        """bench's formula at the median throughput: price / (infer/s * 3600) * 1e6."""
        throughput = self.throughput
        if not self.price_per_hour or not throughput:
            return None
        return self.price_per_hour / (throughput * 3600) * 1e6


def leaderboard(records: list[TrialRecord]) -> list[TrialRecord]:
    """Configurations within the SLO, best first: cheapest per inference when priced,
    else highest throughput (the median over re-measurements)."""
    ok = [r for r in records if r.status == "ok" and r.throughput]
    return sorted(ok, key=_rank_key)


def _rank_key(record: TrialRecord) -> tuple[float, float]:
    cost = record.cost_per_1m_infer
    return (cost if cost is not None else 0.0, -(record.throughput or 0.0))


def closest(records: list[TrialRecord]) -> TrialRecord | None:
    """The trial nearest the SLO among those that did not meet it."""
    unmet = [r for r in records if r.status == "slo_unmet" and r.score is not None]
    return max(unmet, key=lambda r: r.score or 0.0, default=None)


def pareto_front(records: list[TrialRecord]) -> list[TrialRecord]:
    """Configurations no other beats on both cost per 1M inferences and p99 (lower
    is better on each), by cost. Unpriced runs use 1 / throughput for cost."""
    points = []
    for record in leaderboard(records):
        p99 = record.p99_ms
        if p99 is not None:
            points.append((cost_axis(record), p99, record))
    front = []
    best_p99 = float("inf")
    for _cost, p99, record in sorted(points, key=lambda item: (item[0], item[1])):
        if p99 < best_p99:
            front.append(record)
            best_p99 = p99
    return front


def cost_axis(record: TrialRecord) -> float:
    cost = record.cost_per_1m_infer
    if cost is not None:
        return cost
    return 1.0 / record.throughput if record.throughput else float("inf")


@dataclass
class TuneResult:
    """The whole run, as tune.json."""

    model: str
    model_dir: str
    slo: dict[str, Any]
    mode: str
    space: dict[str, list[Any]]
    space_size: int
    # Variants, with accuracy and why any was excluded.
    variants: list[dict[str, Any]]
    # Catalogue profiles, with why any was skipped on this machine.
    profiles: list[dict[str, Any]]
    trials: list[TrialRecord]
    # Trial numbers of the leaderboard, best first, and of the Pareto front.
    leaderboard: list[int] = field(default_factory=list)
    pareto: list[int] = field(default_factory=list)
    # The best trial's number; None when no configuration met the SLO.
    winner: int | None = None
    # The trial nearest the SLO when none met it.
    closest: int | None = None
    interrupted: bool = False
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    applied_version: int | None = None

    def record(self, trial: int) -> TrialRecord:
        return next(r for r in self.trials if r.trial == trial)
