"""A whole tune, as its steps: find the variants and profiles, build the space, search
it with real trials, re-measure the best few, rank.

Example::

    result = run_tune(TuneOptions(model_dir=Path("models/minilm"),
                                  slo=parse_slo("p99_ms=200", None),
                                  catalogue=this_machine(None), work_dir=Path("tune-out")))
    print(result.winner, result.leaderboard)
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from slipstream.repository.layout import raw_config as layout_raw_config
from slipstream.runtime import backend_for_file
from slipstream.tune.measure import MeasureSettings
from slipstream.tune.results import TrialRecord, TuneResult, closest, leaderboard, pareto_front
from slipstream.tune.search import SearchMode, default_trials, make_strategy
from slipstream.tune.settings import Catalogue, HardwareProfile, Slo, TuneInputError, usable_cpus
from slipstream.tune.space import Dimension, Point, Space
from slipstream.tune.trials import TrialContext, run_trial, score
from slipstream.tune.variants import (
    AUTO_BACKENDS,
    Variant,
    apply_budget,
    backend_variants,
    find_variants,
    measure_drops,
)

logger = logging.getLogger(__name__)

# Backends a GPU profile can measure: torch (parameters.device cuda). Slipstream's ONNX
# Runtime backend runs the CPU execution provider only.
GPU_BACKENDS = ("torch",)


@dataclass
class TuneOptions:
    """Everything one tune needs; the CLI's options map onto it one to one."""

    model_dir: Path
    slo: Slo
    catalogue: Catalogue
    # Trial repositories and server logs go under it.
    work_dir: Path
    mode: SearchMode = "quick"
    # Most distinct configurations measured; None: the mode's default.
    trials: int | None = None
    max_accuracy_drop: float | None = None
    validation: Path | None = None
    batch_sizes: tuple[int, ...] = (1, 4, 8, 16, 32)
    queue_delays_us: tuple[int, ...] = (0, 1000, 4000)
    instances: tuple[int, ...] = (1, 2)
    threads: tuple[int, ...] = (1, 2)
    # Backends each variant is tried on beside the model's own: "auto" is every installed
    # backend that reads its file (ONNX: ONNX Runtime and OpenVINO); () the own only.
    backends: tuple[str, ...] = (AUTO_BACKENDS,)
    # The best N configurations are measured again `remeasure_runs` more times each.
    remeasure_top: int = 3
    remeasure_runs: int = 1
    # optuna: stop after this many trials in a row without a better one.
    patience: int = 15
    seed: int = 0
    measure: MeasureSettings = field(default_factory=lambda: MeasureSettings(url="", model=""))
    startup_timeout_s: float = 120.0


class TuneListener:
    """Told about the tune as it goes (the CLI's live display overrides these no-ops)."""

    def started(self, space_size: int, max_trials: int) -> None:
        pass

    def trial_started(self, trial: int, config: dict[str, Any]) -> None:
        pass

    def trial_done(self, record: TrialRecord, best: TrialRecord | None) -> None:
        pass

    def remeasuring(self, trial: int, config: dict[str, Any]) -> None:
        """A finished trial's configuration is being measured again."""

    def note(self, message: str) -> None:
        pass


@dataclass
class TunePlan:
    space: Space
    variants: list[Variant]
    profiles: list[dict[str, Any]]
    context: TrialContext
    priced: bool


def plan_tune(options: TuneOptions) -> TunePlan:
    """Variants, profiles and the space; TuneInputError when nothing can be searched."""
    config, variants = find_variants(options.model_dir)
    if options.validation is not None:
        measure_drops(variants, options.validation)
    variants = backend_variants(variants, config, options.backends)
    apply_budget(variants, options.max_accuracy_drop)
    eligible = [v for v in variants if not v.excluded]
    if not eligible:
        reasons = "; ".join(f"{v.name}: {v.excluded}" for v in variants)
        raise TuneInputError(f"every model variant is excluded ({reasons})")
    usable = usable_cpus()
    backend = config.backend or backend_for_file(variants[0].model_file)
    profiles, cpu_sets = _profiles(options.catalogue.profiles, usable, backend)
    runnable = [p for p in options.catalogue.profiles if p.name in cpu_sets]
    if not runnable:
        reasons = "; ".join(f"{p['name']}: {p['skipped']}" for p in profiles)
        raise TuneInputError(f"no hardware profile of the catalogue runs here ({reasons})")
    space = Space(
        (
            Dimension("variant", tuple(v.name for v in eligible), ordered=False),
            Dimension("profile", tuple(p.name for p in runnable), ordered=False),
            Dimension("max_batch_size", options.batch_sizes),
            Dimension("max_queue_delay_us", options.queue_delays_us),
            Dimension("instances", options.instances),
            Dimension("threads", options.threads),
        )
    )
    context = TrialContext(
        model_dir=options.model_dir,
        base_config=raw_config(options.model_dir),
        variants={v.name: v for v in eligible},
        profiles={p.name: p for p in runnable},
        cpu_sets=cpu_sets,
        slo=options.slo,
        measure=options.measure,
        work_dir=options.work_dir,
        startup_timeout_s=options.startup_timeout_s,
    )
    priced = all(p.price_per_hour > 0 for p in runnable)
    return TunePlan(space, variants, profiles, context, priced)


def _profiles(
    catalogue: list[HardwareProfile], usable: list[int], backend: str
) -> tuple[list[dict[str, Any]], dict[str, list[int]]]:
    listed, cpu_sets = [], {}
    gpu_here = any(Path("/dev").glob("nvidia[0-9]*"))
    for profile in catalogue:
        entry: dict[str, Any] = {**profile.model_dump(), "skipped": ""}
        cpus = profile.cpu_set(usable)
        if cpus is None:
            entry["skipped"] = (
                f"needs {profile.cores or profile.cpus} cores; this machine lets the tuner "
                f"use {len(usable)} ({','.join(map(str, usable))})"
            )
        elif profile.gpu is not None and backend not in GPU_BACKENDS:
            entry["skipped"] = (
                f"asks for GPU {profile.gpu}; the model's backend {backend} runs on the CPU "
                "here (the torch backend runs on a GPU: parameters.device cuda)"
            )
        elif profile.gpu is not None and not gpu_here:
            entry["skipped"] = f"asks for GPU {profile.gpu}; no NVIDIA GPU is visible here"
        else:
            entry["cpus"] = cpus
            cpu_sets[profile.name] = cpus
        listed.append(entry)
    return listed, cpu_sets


def raw_config(model_dir: Path) -> dict[str, Any]:
    """The model's config keys as written (a Triton config.pbtxt translated): the base
    every trial's config.yaml and ``--apply``'s start from."""
    data = layout_raw_config(model_dir)
    return dict(data) if isinstance(data, dict) else {}


def run_tune(options: TuneOptions, listener: TuneListener | None = None) -> TuneResult:
    """Search, re-measure, rank. Ctrl-C stops the search and keeps what was measured
    (``interrupted`` is set); TuneInputError for input no search can use."""
    started = time.monotonic()
    listener = listener or TuneListener()
    plan = plan_tune(options)
    space = plan.space
    max_trials = min(space.size, options.trials or default_trials(options.mode, space))
    result = _new_result(options, plan)
    listener.started(space.size, max_trials)

    def objective(point: Point) -> float | None:
        config = space.as_dict(point)
        number = len(result.trials) + 1
        listener.trial_started(number, config)
        record = run_trial(plan.context, number, config)
        record.score = score(record, plan.priced)
        result.trials.append(record)
        best = max(
            (r for r in result.trials if r.status == "ok"),
            key=lambda r: r.score or 0.0,
            default=None,
        )
        listener.trial_done(record, best)
        return record.score

    strategy = make_strategy(options.mode, patience=options.patience, seed=options.seed)
    try:
        strategy.search(space, objective, max_trials)
        _remeasure(plan, result, options, listener)
    except KeyboardInterrupt:
        result.interrupted = True
        listener.note("interrupted: the report covers what was measured so far")
    _rank(result)
    result.wall_s = time.monotonic() - started
    return result


def _new_result(options: TuneOptions, plan: TunePlan) -> TuneResult:
    space = plan.space
    result = TuneResult(
        model=options.model_dir.name,
        model_dir=str(options.model_dir),
        slo={**options.slo.latency_ms, "min_throughput": options.slo.min_throughput},
        mode=options.mode,
        space={d.name: list(d.values) for d in space.dimensions},
        space_size=space.size,
        variants=[_variant_entry(v) for v in plan.variants],
        profiles=plan.profiles,
        trials=[],
        notes=[f"hardware catalogue: {options.catalogue.source}"]
        if options.catalogue.source
        else [],
    )
    shared = [p["name"] for p in plan.profiles if p.get("cpus") and p["cpus"] == usable_cpus()]
    if shared:
        result.notes.append(
            f"the load generator shared the cores of {', '.join(shared)} (no other core "
            "was usable): their figures include its CPU"
        )
    return result


def _remeasure(
    plan: TunePlan, result: TuneResult, options: TuneOptions, listener: TuneListener
) -> None:
    """Measure the best few again: their figures become medians with a spread. One that
    misses the SLO (or fails) in a re-measurement leaves the leaderboard: a configuration
    within it once and not again is not one to deploy as "within the SLO"."""
    top = leaderboard(result.trials)[: options.remeasure_top]
    for record in top:
        for _ in range(options.remeasure_runs):
            listener.remeasuring(record.trial, record.config)
            again = run_trial(plan.context, record.trial, record.config)
            if again.status != "ok" or again.level is None:
                _missed_on_remeasure(record, again)
                break
            record.throughput_runs.append(again.level.throughput_infer_per_s)
            record.run_levels.append(again.level)
        record.score = score(record, plan.priced)


def _missed_on_remeasure(record: TrialRecord, again: TrialRecord) -> None:
    """``record`` met the SLO, ``again`` (its re-measurement) did not: the record takes
    the re-measurement's status and figures, and says why."""
    run = len(record.throughput_runs) + 1
    if again.status == "failed":
        record.error = f"re-measurement {run} failed: {again.error}"
        record.log_tail = again.log_tail
    else:
        level = again.level
        figures = (
            f" (closest level: concurrency {level.concurrency}, p50 {_ms(level.p50_ms)}, "
            f"p99 {_ms(level.p99_ms)}, {level.throughput_infer_per_s:.1f} infer/s)"
            if level is not None
            else ""
        )
        record.error = (
            f"re-measurement {run} did not meet the SLO{figures}; the first "
            f"measurement{'s' if run > 2 else ''} did"
        )
    record.status = again.status
    record.levels, record.chosen_level = again.levels, again.chosen_level
    record.throughput_runs, record.run_levels = [], []


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} ms"


def _rank(result: TuneResult) -> None:
    board = leaderboard(result.trials)
    # The re-measured first: the winner is one measured several times, never a single
    # run that happened to be luckier than a re-measured configuration's median.
    board = [r for r in board if len(r.throughput_runs) > 1] + [
        r for r in board if len(r.throughput_runs) <= 1
    ]
    result.leaderboard = [r.trial for r in board]
    result.pareto = [r.trial for r in pareto_front(result.trials)]
    result.winner = board[0].trial if board else None
    near = closest(result.trials)
    result.closest = near.trial if near is not None and result.winner is None else None


def _variant_entry(variant: Variant) -> dict[str, Any]:
    entry = asdict(variant)
    entry["model_file"] = str(variant.model_file)
    return entry
