"""One trial: a configuration written as a model repository, served by a real
``slipstream serve`` pinned to the profile's cores, measured with the bench core.

A trial never raises for a bad configuration: a server that exits or never becomes
ready, or a benchmark that cannot run, is a ``failed`` record with the server's log tail.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from slipstream.bench.core.errors import BenchError
from slipstream.bench.v2.runner import ProgressListener
from slipstream.runtime import model_files
from slipstream.tune.measure import LoadCurve, MeasureSettings, measure_curve, slo_ratio
from slipstream.tune.results import LevelFigures, TrialRecord
from slipstream.tune.server import TrialServer, TrialServerError
from slipstream.tune.settings import HardwareProfile, Slo
from slipstream.tune.variants import Variant

# The config dimensions a point sets, beside "variant" and "profile".
CONFIG_DIMENSIONS = ("max_batch_size", "max_queue_delay_us", "instances", "threads")


def model_config(base: dict[str, Any], point: dict[str, Any]) -> dict[str, Any]:
    """``base`` (the model's config.yaml as parsed) with the point's settings in it.

    >>> model_config({"max_batch_size": 64}, {"max_batch_size": 8,
    ...     "max_queue_delay_us": 500, "instances": 2, "threads": 1})["instance_group"]
    [{'count': 2, 'kind': 'KIND_CPU'}]
    """
    config = copy.deepcopy(base)
    if point.get("backend"):
        config["backend"] = point["backend"]
    config["max_batch_size"] = int(point["max_batch_size"])
    batching = dict(config.get("dynamic_batching") or {})
    batching["max_queue_delay_microseconds"] = int(point["max_queue_delay_us"])
    preferred = [
        b for b in batching.get("preferred_batch_size", []) if b <= point["max_batch_size"]
    ]
    batching["preferred_batch_size"] = preferred
    config["dynamic_batching"] = batching
    kind = "KIND_GPU" if point.get("gpu") else "KIND_CPU"
    config["instance_group"] = [{"count": int(point["instances"]), "kind": kind}]
    parameters = dict(config.get("parameters") or {})
    parameters["intra_op_thread_count"] = str(point["threads"])
    if point.get("gpu"):
        parameters["device"] = "cuda"  # the torch backend's setting (see runtime/torch.py)
    config["parameters"] = parameters
    return config


def write_trial_repository(
    root: Path, model_dir: Path, variant: Variant, config: dict[str, Any]
) -> Path:
    """``root/repo/<model>/1/<model file>`` plus config.yaml and the model directory's
    other files (a tokenizer); the repository's path."""
    target = root / "repo" / model_dir.name
    if target.exists():
        shutil.rmtree(target)
    version_dir = target / "1"
    version_dir.mkdir(parents=True)
    for path in model_files(variant.model_file):
        _link_or_copy(path, version_dir / path.name)
    for entry in model_dir.iterdir():
        if entry.name.isdigit() or entry.name in ("config.yaml", "config.yml"):
            continue
        if entry.name.startswith("."):
            continue
        if entry.is_dir():
            shutil.copytree(entry, target / entry.name)
        else:
            shutil.copy2(entry, target / entry.name)
    # The trial repository holds one version: the model's own version policy would not
    # find it.
    served = {k: v for k, v in config.items() if k != "version_policy"}
    (target / "config.yaml").write_text(yaml.safe_dump(served, sort_keys=False))
    return target.parent


def _link_or_copy(source: Path, target: Path) -> None:
    # A hard link costs nothing for a 90 MB model; another file system needs a copy.
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


@dataclass
class TrialContext:
    """What every trial of a tune shares."""

    model_dir: Path
    base_config: dict[str, Any]
    variants: dict[str, Variant]
    profiles: dict[str, HardwareProfile]
    # Profile name -> CPU ids on this machine.
    cpu_sets: dict[str, list[int]]
    slo: Slo
    measure: MeasureSettings
    work_dir: Path
    startup_timeout_s: float = 120.0


def run_trial(
    context: TrialContext,
    trial: int,
    point: dict[str, Any],
    progress: ProgressListener | None = None,
) -> TrialRecord:
    """Serve and measure one configuration; never raises for a failing one."""
    started = time.monotonic()
    variant = context.variants[point["variant"]]
    profile = context.profiles[point["profile"]]
    record = TrialRecord(
        trial=trial,
        config=dict(point),
        status="failed",
        price_per_hour=profile.price_per_hour,
        accuracy_drop=variant.accuracy_drop,
        accuracy_baseline=variant.accuracy_baseline,
    )
    trial_dir = context.work_dir / f"trial-{trial:03d}"
    config = model_config(
        context.base_config, {**point, "gpu": profile.gpu, "backend": variant.backend}
    )
    repository = write_trial_repository(trial_dir, context.model_dir, variant, config)
    server = TrialServer(
        repository,
        cpus=context.cpu_sets[profile.name],
        gpu=profile.gpu,
        log_path=trial_dir / "server.log",
        startup_timeout_s=context.startup_timeout_s,
    )
    try:
        with server, client_affinity(context.cpu_sets[profile.name]) as client_cpus:
            record.client_cpus = client_cpus
            measure = _measure_settings(context, profile, server)
            curve = measure_curve(measure, context.slo, progress)
            _fill(record, curve, context.slo)
            if server.stop() not in (0, None):
                record.error = "the server exited with an error after the measurement"
    except TrialServerError as exc:
        record.error, record.log_tail = str(exc), exc.log_tail
    except BenchError as exc:
        record.error, record.log_tail = f"bench: {exc}", server.log_tail()
    record.wall_s = time.monotonic() - started
    if record.status != "failed":
        shutil.rmtree(trial_dir / "repo", ignore_errors=True)
    return record


@contextlib.contextmanager
def client_affinity(server_cpus: list[int]) -> Iterator[list[int] | None]:
    """Run the load generator (this process and the bench workers it starts) on the
    usable cores the server is not pinned to, so it does not take the profile's cores;
    yields them, or None when no core is left and the two share."""
    try:
        usable = sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        yield None
        return
    others = [cpu for cpu in usable if cpu not in server_cpus]
    if not others:
        yield None
        return
    os.sched_setaffinity(0, others)
    try:
        yield others
    finally:
        os.sched_setaffinity(0, usable)


def _measure_settings(
    context: TrialContext, profile: HardwareProfile, server: TrialServer
) -> MeasureSettings:
    from dataclasses import replace

    return replace(
        context.measure,
        url=server.url,
        model=context.model_dir.name,
        price_per_hour=profile.price_per_hour or None,
    )


def _fill(record: TrialRecord, curve: LoadCurve, slo: Slo) -> None:
    record.levels = [
        LevelFigures(
            concurrency=level.concurrency or 0,
            throughput_infer_per_s=level.throughput_infer_per_s,
            p50_ms=level.p50_ms,
            p99_ms=level.p99_ms,
            avg_ms=level.avg_ms,
            errors=level.errors,
            cost_per_1m_infer=level.cost_per_1m_infer,
            server_avg_batch_size=level.server_avg_batch_size,
            slo_ratio=slo_ratio(level, slo),
        )
        for level in curve.levels
    ]
    if not record.levels:
        record.error = "no load level was measured"
        return
    if curve.best is not None:
        record.status = "ok"
        record.chosen_level = curve.levels.index(curve.best)
        record.throughput_runs = [curve.best.throughput_infer_per_s]
        record.run_levels = [record.levels[record.chosen_level]]
        return
    record.status = "slo_unmet"
    ratios = [level.slo_ratio for level in record.levels]
    record.chosen_level = ratios.index(min(ratios))


def score(record: TrialRecord, priced: bool) -> float | None:
    """The search objective (see TrialRecord.score)."""
    if record.status == "failed":
        return None
    if record.status == "slo_unmet":
        level = record.level
        ratio = level.slo_ratio if level else float("inf")
        return -min(ratio, 1e6)
    throughput = record.throughput or 0.0
    if priced and record.price_per_hour > 0:
        return throughput * 3600 / record.price_per_hour
    return throughput
