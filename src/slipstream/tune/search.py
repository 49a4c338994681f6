"""Search strategies: which configurations to measure, given a space and an objective.

Pure on purpose: a strategy knows nothing of servers. It calls ``objective(point)``
(higher is better; ``None``: the trial failed) for points of the space, never the same
point twice and never more than ``max_trials`` of them, and returns what it measured.
The tuner's objective runs a real server; tests pass a table.

- ``brute``: every point, in order (Model Analyzer's brute mode).
- ``quick``: hill climbing from the smallest configuration of each model variant on
  each hardware profile: measure the neighbours of the current point one by one, move
  to the first that is better, stop when none is (Model Analyzer's quick mode climbs
  each model's configurations the same way); trials left start climbs at random points.
- ``optuna``: Optuna's TPE sampler over the dimensions (ordered ones as integer ranges
  of their value index, so TPE sees that 8 lies between 4 and 16), stopping early
  when ``patience`` trials in a row bring no improvement.

Example::

    table = {point: float(sum(point)) for point in space.points()}
    found = QuickSearch().search(space, table.get, max_trials=20)
    best = max(found, key=lambda e: e.score if e.score is not None else -math.inf)
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import random
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from slipstream.tune.space import Point, Space

logger = logging.getLogger(__name__)

# Higher is better; None: the trial failed (no figure at all).
Objective = Callable[[Point], float | None]
SearchMode = Literal["brute", "quick", "optuna"]
SEARCH_MODES: tuple[SearchMode, ...] = ("brute", "quick", "optuna")


@dataclass(frozen=True)
class Evaluation:
    """One measured point."""

    point: Point
    # The objective's value; None when the trial failed.
    score: float | None

    @property
    def rank_score(self) -> float:
        return -math.inf if self.score is None else self.score


class BudgetSpent(Exception):
    """Raised inside a search when its trial budget is used up."""


class Trials:
    """The points measured so far: calls the objective once per point, within budget."""

    def __init__(self, space: Space, objective: Objective, max_trials: int) -> None:
        self._space = space
        self._objective = objective
        self._max_trials = max_trials
        self.done: dict[Point, Evaluation] = {}

    @property
    def left(self) -> int:
        return self._max_trials - len(self.done)

    def measure(self, point: Point) -> Evaluation:
        """The point's evaluation, measuring it only the first time."""
        if point in self.done:
            return self.done[point]
        if not self._space.contains(point):
            raise ValueError(f"{point} is not a point of the space")
        if self.left <= 0:
            raise BudgetSpent
        evaluation = Evaluation(point, self._objective(point))
        self.done[point] = evaluation
        return evaluation

    def best(self) -> Evaluation | None:
        return max(self.done.values(), key=lambda e: e.rank_score, default=None)


class SearchStrategy(ABC):
    """Chooses the points to measure; see the module docstring."""

    name: SearchMode

    def search(self, space: Space, objective: Objective, max_trials: int) -> list[Evaluation]:
        """Measure up to ``max_trials`` distinct points; the evaluations in order measured."""
        trials = Trials(space, objective, max_trials)
        with contextlib.suppress(BudgetSpent):
            self._run(space, trials)
        return list(trials.done.values())

    @abstractmethod
    def _run(self, space: Space, trials: Trials) -> None: ...


class BruteSearch(SearchStrategy):
    name: SearchMode = "brute"

    def _run(self, space: Space, trials: Trials) -> None:
        for point in space.points():
            trials.measure(point)


class QuickSearch(SearchStrategy):
    """Hill climbing, one climb per combination of the unordered dimensions (each model
    variant on each hardware profile), each from its smallest configuration, then climbs
    from random points while trials remain; the best point of all climbs wins.
    ``start`` replaces the first climb's start."""

    name: SearchMode = "quick"

    def __init__(self, start: Point | None = None, seed: int = 0) -> None:
        self._start = start
        self._seed = seed

    def _run(self, space: Space, trials: Trials) -> None:
        starts = _climb_starts(space)
        if self._start is not None:
            starts = [self._start, *(p for p in starts if p != self._start)]
        for start in starts:
            self._climb(space, trials, start)
        # Measurements are noisy and most of a tight SLO's space can miss it: a climb
        # can stop on a plateau of misses. Trials left start new climbs at random.
        rng = random.Random(self._seed)
        while (fresh := _random_unmeasured(space, trials, rng)) is not None:
            self._climb(space, trials, fresh)

    @staticmethod
    def _climb(space: Space, trials: Trials, start: Point) -> None:
        current = trials.measure(start)
        while True:
            # First improvement: move as soon as a neighbour beats the current point
            # (measuring every neighbour first costs a trial per dimension per step).
            better = None
            for point in space.neighbours(current.point):
                evaluation = trials.measure(point)
                if evaluation.rank_score > current.rank_score:
                    better = evaluation
                    break
            if better is None:
                return
            current = better


def _climb_starts(space: Space) -> list[Point]:
    """The smallest ordered configuration for every combination of unordered values."""
    choices = [d.values if not d.ordered else d.values[:1] for d in space.dimensions]
    return list(itertools.product(*choices))


class OptunaSearch(SearchStrategy):
    """TPE with early stopping; ``patience``: trials without improvement before stopping."""

    name: SearchMode = "optuna"
    # Proposals of already measured points in a row before a random new one is taken.
    _MAX_REPEATS = 20

    def __init__(self, patience: int = 15, seed: int = 0, startup_trials: int | None = None):
        self._patience = patience
        self._seed = seed
        self._startup_trials = startup_trials

    def _run(self, space: Space, trials: Trials) -> None:
        import optuna
        from optuna.distributions import (
            BaseDistribution,
            CategoricalDistribution,
            IntDistribution,
        )

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        startup = self._startup_trials or max(3, min(10, trials.left // 3))
        with warnings.catch_warnings():
            # Optuna before 4.x marked multivariate TPE experimental; it is what models
            # the dimensions' interplay (batch size with instances, threads with cores).
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            sampler = optuna.samplers.TPESampler(
                seed=self._seed, n_startup_trials=startup, multivariate=True
            )
        study = optuna.create_study(direction="maximize", sampler=sampler)
        distributions: dict[str, BaseDistribution] = {
            d.name: IntDistribution(0, len(d.values) - 1)
            if d.ordered
            else CategoricalDistribution(list(range(len(d.values))))
            for d in space.dimensions
        }
        rng = random.Random(self._seed)
        best, since_best, repeats = -math.inf, 0, 0
        while trials.left > 0 and since_best < self._patience:
            trial = study.ask(distributions)
            point = tuple(d.values[int(trial.params[d.name])] for d in space.dimensions)
            if point in trials.done:
                repeats += 1
                study.tell(trial, _told(trials.done[point]))
                if repeats < self._MAX_REPEATS:
                    continue
                fresh = _random_unmeasured(space, trials, rng)
                if fresh is None:
                    return
                evaluation = trials.measure(fresh)
                study.add_trial(
                    optuna.trial.create_trial(
                        params={
                            d.name: d.values.index(v)
                            for d, v in zip(space.dimensions, point, strict=True)
                        },
                        distributions=distributions,
                        value=_told(evaluation),
                    )
                )
            else:
                evaluation = trials.measure(point)
                study.tell(trial, _told(evaluation))
            repeats = 0
            if evaluation.rank_score > best:
                best, since_best = evaluation.rank_score, 0
            else:
                since_best += 1


# What TPE is told for a failed trial: worse than any infeasible one (those score > -10).
_FAILED_SCORE = -1e9


def _told(evaluation: Evaluation) -> float:
    return _FAILED_SCORE if evaluation.score is None else evaluation.score


def _random_unmeasured(space: Space, trials: Trials, rng: random.Random) -> Point | None:
    left = [p for p in space.points() if p not in trials.done]
    return rng.choice(left) if left else None


def make_strategy(mode: SearchMode, *, patience: int = 15, seed: int = 0) -> SearchStrategy:
    if mode == "brute":
        return BruteSearch()
    if mode == "quick":
        return QuickSearch(seed=seed)
    return OptunaSearch(patience=patience, seed=seed)


def default_trials(mode: SearchMode, space: Space) -> int:
    """Trials when --trials is not given: all for brute, a fifth of the space (at least
    10) for quick and optuna (optuna may stop before)."""
    if mode == "brute":
        return space.size
    return min(space.size, max(10, math.ceil(space.size / 5)))
