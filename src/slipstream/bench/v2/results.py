"""Figures of a benchmark: per window (summed over workers) and per load level.

A level's figures cover the windows it reports: the last 3 once stable (perf_analyzer
reports the stable windows), or every window of a ``--duration`` run. Names are the
JSON / CSV column names, with units in them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from slipstream.bench.core.errors import error_summary, reconnects_warning
from slipstream.bench.core.histogram import LatencyHistogram, merge_histograms
from slipstream.bench.core.levels import LoadLevel
from slipstream.bench.core.schedule import LATE_SEND_SHARE, SATURATED_CPU_PCT, SendStats
from slipstream.bench.v2.messages import WindowSample
from slipstream.bench.v2.server_stats import ProcessUsage, ServerBreakdown

# Open loop: warn when fewer than this share of the asked rate was sent (or more than
# LATE_SEND_SHARE of the sends left over 1 ms late).
SEND_RATE_SHARE = 0.95


@dataclass
class WindowTotals:
    """One measurement window, summed over the worker processes."""

    index: int
    # Mean over workers of their window's length (they cut within a millisecond).
    duration_s: float
    ok_requests: int
    ok_inferences: int
    latency: LatencyHistogram
    errors: dict[str, int]
    error_examples: dict[str, str]
    # CPU seconds of each worker in the window, by worker id.
    cpu_s_by_worker: dict[int, float]
    # Open loop: the workers' sends in the window.
    sends: SendStats = field(default_factory=SendStats)
    # Requests sent again on a fresh connection (see LevelResult.reconnects).
    reconnects: int = 0

    @property
    def throughput_req_per_s(self) -> float:
        return _per_s(self.ok_requests, self.duration_s)

    @property
    def throughput_infer_per_s(self) -> float:
        return _per_s(self.ok_inferences, self.duration_s)

    @property
    def cpu_pct(self) -> float:
        """Every worker's CPU (and below, the busiest one's) in percent of one core."""
        return _per_s(100 * sum(self.cpu_s_by_worker.values()), self.duration_s)

    @property
    def max_worker_cpu_pct(self) -> float:
        return _per_s(100 * max(self.cpu_s_by_worker.values(), default=0.0), self.duration_s)


def _per_s(count: float, duration_s: float) -> float:
    return count / duration_s if duration_s > 0 else 0.0


def merge_samples(samples: list[WindowSample]) -> WindowTotals:
    """The workers' samples of one window as one."""
    duration_s = sum(s.end_s - s.start_s for s in samples) / len(samples)
    cpu_s = {s.worker_id: s.cpu_s for s in samples}
    return _sum(samples, samples[0].window_index, duration_s, cpu_s)


def _sum(
    parts: Sequence[WindowSample | WindowTotals],
    index: int,
    duration_s: float,
    cpu_s_by_worker: dict[int, float],
) -> WindowTotals:
    """Counts summed over workers or windows, with the first example of each error key."""
    errors: dict[str, int] = {}
    examples: dict[str, str] = {}
    for part in parts:
        for key, count in part.errors.items():
            errors[key] = errors.get(key, 0) + count
        for key, message in part.error_examples.items():
            examples.setdefault(key, message)
    return WindowTotals(
        index=index,
        duration_s=duration_s,
        ok_requests=sum(p.ok_requests for p in parts),
        ok_inferences=sum(p.ok_inferences for p in parts),
        latency=merge_histograms([p.latency for p in parts]),
        errors=errors,
        error_examples=examples,
        cpu_s_by_worker=cpu_s_by_worker,
        sends=SendStats.total(p.sends for p in parts),
        reconnects=sum(p.reconnects for p in parts),
    )


@dataclass
class LevelResult:
    """Every figure of one load level; ``None`` where a figure does not apply or the
    server does not offer it."""

    concurrency: int | None
    request_rate: float | None
    workers: int
    # Windows the figures cover, and windows measured in all (a stable level reports
    # its last 3).
    windows: int
    windows_measured: int
    stable: bool
    duration_s: float
    requests: int
    inferences: int
    errors: int
    errors_by_code: dict[str, int]
    error_examples: dict[str, str]
    throughput_infer_per_s: float
    throughput_req_per_s: float
    avg_ms: float | None
    p50_ms: float | None
    p90_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    max_ms: float | None
    # Open loop: requests actually sent per second, and how late the late ones were.
    send_rate_per_s: float | None = None
    late_sends: int = 0
    max_send_lag_ms: float | None = None
    # Server statistics extension, means per request.
    server_queue_ms: float | None = None
    server_compute_input_ms: float | None = None
    server_compute_infer_ms: float | None = None
    server_compute_output_ms: float | None = None
    # The server's own end-to-end time per request.
    server_request_ms: float | None = None
    # Client-observed mean latency minus queue and compute in the server.
    server_overhead_ms: float | None = None
    server_avg_batch_size: float | None = None
    # CPU of the load generator: all workers in percent of one core, and the busiest.
    client_cpu_pct: float = 0.0
    client_max_worker_cpu_pct: float = 0.0
    server_cpu_pct: float | None = None
    server_rss_mb: float | None = None
    # The GPUs' utilization (percent of one GPU) and peak memory in use (MiB, every
    # process on them), with --server-pid on a machine with a GPU.
    server_gpu_util_pct: float | None = None
    server_gpu_memory_mb: float | None = None
    cost_per_1m_infer: float | None = None
    # Requests sent again on a fresh connection after the server closed a reused one
    # before answering (keep-alive timeouts): not errors.
    reconnects: int = 0
    warnings: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return LoadLevel(self.concurrency, self.request_rate).label


@dataclass
class BenchResult:
    """A whole run: what was measured and one result per load level."""

    url: str
    model: str
    model_version: str
    protocol: str
    batch_size: int
    distribution: str | None
    levels: list[LevelResult]
    # Warnings about the run as a whole (per-level ones are in each level).
    warnings: list[str] = field(default_factory=list)
    # The settings as given, for the JSON record.
    settings: dict[str, Any] = field(default_factory=dict)
    # A stateful model's: the requests per sequence each user ran, and the ids' type
    # ("int" or "string"); None for a stateless model.
    sequence_length: int | None = None
    sequence_ids: str | None = None


@dataclass(frozen=True)
class LevelInputs:
    """What the coordinator measured for one level, turned into a LevelResult here."""

    level: LoadLevel
    workers: int
    windows: list[WindowTotals]
    # Windows measured in all, the reported ones being the last of them.
    windows_measured: int
    stable: bool
    # Whether the stability rule applied (False for a --duration run).
    stability_required: bool
    stability_pct: float
    server: ServerBreakdown | None
    server_process: ProcessUsage | None
    price_per_hour: float | None
    # True when auto mode would have added a worker but no core was left.
    workers_capped: bool


def level_result(inputs: LevelInputs) -> LevelResult:
    windows = inputs.windows
    cpu_s_by_worker: dict[int, float] = {}
    for window in windows:
        for worker, cpu_s in window.cpu_s_by_worker.items():
            cpu_s_by_worker[worker] = cpu_s_by_worker.get(worker, 0.0) + cpu_s
    total = _sum(windows, len(windows), sum(w.duration_s for w in windows), cpu_s_by_worker)
    result = LevelResult(
        concurrency=inputs.level.concurrency,
        request_rate=inputs.level.request_rate,
        workers=inputs.workers,
        windows=len(windows),
        windows_measured=inputs.windows_measured,
        stable=inputs.stable,
        duration_s=total.duration_s,
        requests=total.ok_requests,
        inferences=total.ok_inferences,
        errors=sum(total.errors.values()),
        errors_by_code=dict(sorted(total.errors.items())),
        error_examples=total.error_examples,
        throughput_infer_per_s=total.throughput_infer_per_s,
        throughput_req_per_s=total.throughput_req_per_s,
        avg_ms=total.latency.ms(),
        p50_ms=total.latency.ms(50),
        p90_ms=total.latency.ms(90),
        p95_ms=total.latency.ms(95),
        p99_ms=total.latency.ms(99),
        max_ms=total.latency.ms(100),
        client_cpu_pct=total.cpu_pct,
        client_max_worker_cpu_pct=total.max_worker_cpu_pct,
        reconnects=total.reconnects,
    )
    if result.request_rate is not None:
        result.send_rate_per_s = _per_s(total.sends.sent, total.duration_s)
        result.late_sends = total.sends.late_sends
        result.max_send_lag_ms = total.sends.max_send_lag_s * 1000
    _add_server_figures(result, inputs)
    if inputs.price_per_hour is not None and result.throughput_infer_per_s > 0:
        result.cost_per_1m_infer = (
            inputs.price_per_hour / (result.throughput_infer_per_s * 3600) * 1e6
        )
    result.warnings = level_warnings(result, inputs)
    return result


def _add_server_figures(result: LevelResult, inputs: LevelInputs) -> None:
    server = inputs.server
    if server is not None and server.requests > 0:
        result.server_queue_ms = server.queue_ms
        result.server_compute_input_ms = server.compute_input_ms
        result.server_compute_infer_ms = server.compute_infer_ms
        result.server_compute_output_ms = server.compute_output_ms
        result.server_request_ms = server.request_ms
        result.server_avg_batch_size = server.avg_batch_size
        server_ms = server.server_ms
        if server_ms is not None and result.avg_ms is not None:
            result.server_overhead_ms = result.avg_ms - server_ms
    if inputs.server_process is not None:
        result.server_cpu_pct = inputs.server_process.cpu_pct
        result.server_rss_mb = inputs.server_process.rss_mb
        result.server_gpu_util_pct = inputs.server_process.gpu_util_pct
        result.server_gpu_memory_mb = inputs.server_process.gpu_memory_mb


def level_warnings(result: LevelResult, inputs: LevelInputs) -> list[str]:
    """What a reader must know before trusting this level's figures."""
    warnings = []
    if result.client_max_worker_cpu_pct >= SATURATED_CPU_PCT:
        advice = (
            "no free core was left for another worker" if inputs.workers_capped else "try --workers"
        )
        warnings.append(
            f"client saturated: a load-generator process used "
            f"{result.client_max_worker_cpu_pct:.0f}% of a core, so the throughput may be the "
            f"client's limit rather than the server's ({advice})"
        )
    if result.request_rate is not None:
        warnings.extend(_open_loop_warnings(result, inputs))
    if inputs.stability_required and not inputs.stable:
        warnings.append(
            f"not stable: throughput or mean latency of the last 3 windows varied by more "
            f"than {inputs.stability_pct:g}% after {inputs.windows_measured} windows; figures are "
            "over the last 3 (more --max-windows or a longer --window-s may settle it)"
        )
    if result.requests == 0:
        warnings.append("every request failed: " + error_summary(result))
    return warnings + reconnects_warning(result.reconnects)


def _open_loop_warnings(result: LevelResult, inputs: LevelInputs) -> list[str]:
    warnings = []
    rate = result.request_rate or 0.0
    sent_rate = result.send_rate_per_s or 0.0
    sent = sent_rate * result.duration_s
    cap_waits = sum(w.sends.inflight_cap_waits for w in inputs.windows)
    if cap_waits:
        cause = (
            "the in-flight cap (--max-inflight) was reached: the server does not keep up "
            "with this rate"
        )
    else:
        cause = (
            f"the client was busy (busiest worker at {result.client_max_worker_cpu_pct:.0f}% CPU)"
        )
    if sent_rate < SEND_RATE_SHARE * rate:
        warnings.append(f"open loop sent {sent_rate:.0f} req/s of the {rate:g} asked: {cause}")
    if sent > 0 and result.late_sends > LATE_SEND_SHARE * sent:
        warnings.append(
            f"open loop: {100 * result.late_sends / sent:.1f}% of requests were sent over 1 ms "
            f"late (worst {result.max_send_lag_ms or 0:.1f} ms): {cause}; their latency "
            "counts from the scheduled time"
        )
    return warnings
