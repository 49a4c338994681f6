"""The coordinator: prepares the requests, then measures one load level after another.

A level reads as its steps: split the load over the workers, warm up (and add workers
if one saturated), cut windows until throughput and latency are stable (or the
``--duration`` is over), stop, and turn the windows and the server's statistics into a
:class:`LevelResult`. The coordinator itself sends no requests.

Example::

    from slipstream.bench.v2.runner import run_bench
    from slipstream.bench.v2.settings import BenchSettings

    result = run_bench(BenchSettings(url="http://localhost:8000", model="mlp",
                                     concurrency=[1, 8]))
    print([level.throughput_infer_per_s for level in result.levels])
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from slipstream.bench.core.endpoint import Endpoint, parse_endpoint
from slipstream.bench.core.errors import BenchError
from slipstream.bench.core.histogram import STABILITY_WINDOWS, is_stable
from slipstream.bench.core.levels import LoadLevel
from slipstream.bench.core.schedule import SATURATED_CPU_PCT
from slipstream.bench.v2.inputs import (
    InputError,
    RemoteModel,
    generate_requests,
    read_input_data,
)
from slipstream.bench.v2.messages import (
    EncodedRequest,
    LevelDone,
    Message,
    RunLevel,
    SequencePlan,
    StopLevel,
    WindowSample,
    WorkerPlan,
)
from slipstream.bench.v2.payloads import encode_request
from slipstream.bench.v2.results import (
    BenchResult,
    LevelInputs,
    LevelResult,
    WindowTotals,
    level_result,
    merge_samples,
)
from slipstream.bench.v2.sequences import sequence_plan
from slipstream.bench.v2.server_api import ServerApi, connect_api
from slipstream.bench.v2.server_stats import (
    ProcessSample,
    ProcessSampler,
    StatsSnapshot,
    process_usage,
)
from slipstream.bench.v2.settings import BenchSettings
from slipstream.bench.v2.workers import WorkerPool, usable_cores
from slipstream.observability.gpu import Gpus

# What the CLI adds when no request of any level succeeded.
ALL_FAILED_HINT = "wrong --model-version, inputs the model refuses, or an overloaded server"
# Workers get this long after a RunLevel before sending starts, so they start together.
_START_DELAY_S = 0.2
# Auto mode adds workers when one used more than this share of a core in the warm-up.
_GROW_CPU_PCT = 80.0
# Auto mode never runs more workers than this.
_MAX_AUTO_WORKERS = 8
# Slack on top of a window (or of the request timeout) when waiting for the workers.
_REPORT_SLACK_S = 10.0
# Timeout of the metadata and statistics calls.
_API_TIMEOUT_S = 10.0


class ProgressListener:
    """Told about the run as it goes: the CLI's live progress overrides these no-ops
    (``slipstream.bench.v2.report.RichProgress``); the API passes nothing."""

    def level_started(self, level: LoadLevel, workers: int, max_windows: int) -> None:
        pass

    def window_done(self, level: LoadLevel, window: WindowTotals, stable: bool) -> None:
        pass

    def level_done(self, result: LevelResult) -> None:
        pass

    def note(self, message: str) -> None:
        pass


def run_bench(settings: BenchSettings, progress: ProgressListener | None = None) -> BenchResult:
    """Measure every load level of ``settings``; raises BenchError when it cannot run."""
    listener = progress or ProgressListener()
    try:
        endpoint = parse_endpoint(settings.url, settings.protocol)
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    api = connect_api(endpoint, settings.model, settings.model_version, _API_TIMEOUT_S)
    sampler = None
    try:
        signature = api.signature()
        requests = build_requests(settings, signature)
        sequences = sequence_plan(
            api.model_config(),
            settings.sequence_length,
            settings.sequence_ids,
            settings.workers or _MAX_AUTO_WORKERS,
        )
        if settings.server_pid:
            # The server runs on this machine: its GPUs are this machine's.
            sampler = ProcessSampler(settings.server_pid, Gpus.open())
        pool = WorkerPool(
            lambda worker_id: worker_plan(settings, endpoint, requests, worker_id, sequences)
        )
        try:
            runner = LevelRunner(settings, pool, api, sampler, listener)
            levels = []
            for level in settings.load_levels():
                result = runner.run(level)
                listener.level_done(result)
                levels.append(result)
        finally:
            pool.close()
        warnings = _run_warnings(api, sampler, settings)
    finally:
        api.close()
        if sampler is not None:
            sampler.close()
    return BenchResult(
        url=settings.url,
        model=settings.model,
        model_version=settings.model_version,
        protocol=settings.protocol,
        batch_size=settings.batch_size,
        distribution=settings.distribution if settings.request_rate else None,
        levels=levels,
        warnings=warnings,
        settings=settings.model_dump(mode="json"),
        sequence_length=sequences.length if sequences else None,
        sequence_ids=sequences.id_kind if sequences else None,
    )


def build_requests(settings: BenchSettings, signature: RemoteModel) -> list[EncodedRequest]:
    """The requests to send, encoded for the protocol; BenchError names a bad input."""
    try:
        if settings.input_data is not None:
            inputs = read_input_data(settings.input_data, signature, settings.batch_size)
        else:
            inputs = generate_requests(
                signature, settings.batch_size, settings.shapes, settings.seed
            )
        return [
            encode_request(settings.protocol, settings.model, settings.model_version, request)
            for request in inputs
        ]
    except InputError as exc:
        raise BenchError(str(exc)) from None


def worker_plan(
    settings: BenchSettings,
    endpoint: Endpoint,
    requests: list[EncodedRequest],
    worker_id: int,
    sequences: SequencePlan | None = None,
) -> WorkerPlan:
    return WorkerPlan(
        worker_id=worker_id,
        endpoint=endpoint,
        model=settings.model,
        version=settings.model_version,
        requests=requests,
        timeout_s=settings.timeout_s,
        distribution=settings.distribution,
        seed=settings.seed,
        sequences=sequences,
    )


def _run_warnings(
    api: ServerApi, sampler: ProcessSampler | None, settings: BenchSettings
) -> list[str]:
    warnings = []
    if api.stats_snapshot() is None:
        warnings.append(
            "the server offers no statistics extension (/v2/models/{m}/stats or "
            "ModelStatistics): no queue / compute / overhead breakdown"
        )
    if sampler is not None and sampler.sample(time.monotonic()) is None:
        warnings.append(f"--server-pid {settings.server_pid} exited during the run")
    fields = BenchSettings.model_fields
    sequence_options = ", ".join(
        f"--{name.replace('_', '-')}"
        for name in ("sequence_length", "sequence_ids")
        if getattr(settings, name) != fields[name].default
    )
    config = api.model_config()
    if sequence_options and config is None:
        warnings.append(
            f"{sequence_options}: not used; the server publishes no model config "
            "(/v2/models/{m}/config or ModelConfig), so the bench cannot tell the model is "
            "stateful"
        )
    elif sequence_options and config is not None and "sequence_batching" not in config:
        warnings.append(
            f"{sequence_options}: not used; the model's config has no sequence_batching "
            "(it is not a stateful model)"
        )
    return warnings


@dataclass(frozen=True)
class _Snapshot:
    """What the coordinator reads of the server at a window boundary."""

    stats: StatsSnapshot | None
    process: ProcessSample | None


@dataclass
class _Attempt:
    """One try at a level with a given number of workers."""

    level: LoadLevel
    level_id: int
    workers: int
    start_at: float
    window_s: float
    max_windows: int


class LevelRunner:
    """Measures load levels with one pool of workers, growing it in auto mode."""

    def __init__(
        self,
        settings: BenchSettings,
        pool: WorkerPool,
        api: ServerApi,
        sampler: ProcessSampler | None,
        progress: ProgressListener,
    ) -> None:
        self._settings = settings
        self._pool = pool
        self._api = api
        self._sampler = sampler
        self._progress = progress
        self._auto = settings.workers == 0
        self._max_workers = settings.workers or max(1, min(usable_cores(), _MAX_AUTO_WORKERS))
        self._workers = settings.workers or 1
        self._next_level_id = 0

    def run(self, level: LoadLevel) -> LevelResult:
        while True:
            attempt = self._start(level)
            result = self._measure(attempt)
            if result is not None:
                return result

    def _start(self, level: LoadLevel) -> _Attempt:
        workers = self._workers
        if level.concurrency is not None:
            workers = min(workers, level.concurrency)
        self._pool.grow_to(workers)
        window_s, max_windows = self._windows()
        attempt = _Attempt(
            level=level,
            level_id=self._next_level_id,
            workers=workers,
            start_at=time.monotonic() + _START_DELAY_S,
            window_s=window_s,
            max_windows=max_windows,
        )
        self._next_level_id += 1
        for worker_id, command in enumerate(self._commands(attempt)):
            self._pool.send(worker_id, command)
        self._progress.level_started(level, workers, max_windows)
        return attempt

    def _windows(self) -> tuple[float, int]:
        """(window length, most windows): a --duration run splits it into equal windows."""
        settings = self._settings
        if settings.duration_s is None:
            return settings.window_s, settings.max_windows
        count = max(1, round(settings.duration_s / settings.window_s))
        return settings.duration_s / count, count

    def _commands(self, attempt: _Attempt) -> list[RunLevel]:
        settings, level, n = self._settings, attempt.level, attempt.workers
        commands = []
        first_user = 0
        for worker_id in range(n):
            if level.concurrency is not None:
                share = level.concurrency // n + (1 if worker_id < level.concurrency % n else 0)
                rate, phase_s = 0.0, 0.0
            else:
                total_rate = level.request_rate or 0.0
                share, rate = 0, total_rate / n
                # Constant gaps: workers interleave, each 1/rate after the previous.
                phase_s = worker_id / total_rate if settings.distribution == "constant" else 0.0
            commands.append(
                RunLevel(
                    level_id=attempt.level_id,
                    concurrency=share,
                    request_rate=rate,
                    phase_s=phase_s,
                    max_inflight=max(1, settings.max_inflight // n),
                    first_user=first_user,
                    start_at=attempt.start_at,
                    warmup_s=settings.warmup_s,
                    window_s=attempt.window_s,
                    max_windows=attempt.max_windows,
                )
            )
            first_user += share
        return commands

    def _measure(self, attempt: _Attempt) -> LevelResult | None:
        """The level's result, or None when auto mode stopped it to add workers."""
        settings = self._settings
        measure_from = attempt.start_at + settings.warmup_s
        _sleep_until(measure_from)
        snapshots = [self._snapshot()]
        if settings.warmup_s > 0:
            warmup = self._collect_window(attempt, -1)
            if self._should_grow(attempt, warmup):
                self._stop(attempt)
                self._workers = min(self._max_workers, 2 * attempt.workers)
                self._progress.note(
                    f"{attempt.level.label}: a worker used {warmup.max_worker_cpu_pct:.0f}% of "
                    f"a core in the warm-up; retrying with {self._workers} workers"
                )
                return None
        windows: list[WindowTotals] = []
        stable = False
        for index in range(attempt.max_windows):
            _sleep_until(measure_from + (index + 1) * attempt.window_s)
            snapshots.append(self._snapshot())
            windows.append(self._collect_window(attempt, index))
            if settings.duration_s is None:
                stable = is_stable(
                    [w.throughput_infer_per_s for w in windows],
                    [w.latency.mean_s for w in windows],
                    settings.stability_pct,
                )
            self._progress.window_done(attempt.level, windows[-1], stable)
            if stable:
                break
        self._stop(attempt)
        return self._result(attempt, windows, snapshots, stable)

    def _should_grow(self, attempt: _Attempt, warmup: WindowTotals) -> bool:
        if not self._auto or attempt.workers >= self._max_workers:
            return False
        concurrency = attempt.level.concurrency
        if concurrency is not None and concurrency <= attempt.workers:
            return False
        return warmup.max_worker_cpu_pct >= _GROW_CPU_PCT

    def _collect_window(self, attempt: _Attempt, index: int) -> WindowTotals:
        def wanted(message: Message) -> bool:
            return (
                isinstance(message, WindowSample)
                and message.level_id == attempt.level_id
                and message.window_index == index
            )

        timeout_s = attempt.window_s + _REPORT_SLACK_S
        samples = self._pool.collect(wanted, attempt.workers, timeout_s)
        return merge_samples([s for s in samples if isinstance(s, WindowSample)])

    def _stop(self, attempt: _Attempt) -> None:
        for worker_id in range(attempt.workers):
            self._pool.send(worker_id, StopLevel(attempt.level_id))

        def wanted(message: Message) -> bool:
            return isinstance(message, LevelDone) and message.level_id == attempt.level_id

        timeout_s = self._settings.timeout_s + _REPORT_SLACK_S
        self._pool.collect(wanted, attempt.workers, timeout_s)

    def _snapshot(self) -> _Snapshot:
        process = self._sampler.sample(time.monotonic()) if self._sampler else None
        return _Snapshot(stats=self._api.stats_snapshot(), process=process)

    def _result(
        self,
        attempt: _Attempt,
        windows: list[WindowTotals],
        snapshots: list[_Snapshot],
        stable: bool,
    ) -> LevelResult:
        settings = self._settings
        stability_required = settings.duration_s is None
        reported = windows[-STABILITY_WINDOWS:] if stability_required else windows
        first = len(windows) - len(reported)
        before, after = snapshots[first].stats, snapshots[-1].stats
        processes = [s.process for s in snapshots[first:] if s.process is not None]
        saturated = any(w.max_worker_cpu_pct >= SATURATED_CPU_PCT for w in reported)
        return level_result(
            LevelInputs(
                level=attempt.level,
                workers=attempt.workers,
                windows=reported,
                windows_measured=len(windows),
                stable=stable,
                stability_required=stability_required,
                stability_pct=settings.stability_pct,
                server=after.since(before) if before and after else None,
                server_process=process_usage(processes),
                price_per_hour=settings.price_per_hour,
                workers_capped=self._auto and saturated and attempt.workers >= self._max_workers,
            )
        )


def _sleep_until(deadline: float) -> None:
    delay = deadline - time.monotonic()
    if delay > 0:
        time.sleep(delay)
