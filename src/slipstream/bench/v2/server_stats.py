"""The server's side of a measurement: statistics-extension deltas and process usage
(CPU and RSS of ``--server-pid``'s process tree, and the GPUs' utilization and memory
where this machine has a GPU).

Triton's statistics extension (``GET /v2/models/{m}/stats``, the ModelStatistics RPC)
keeps cumulative counts and nanoseconds per model version. Two snapshots, one at each
end of the measured windows, give the mean time a request of that stretch spent queued
and computing; what the client saw beyond that is overhead (network, HTTP or gRPC
framing, (de)serialisation, the server's front end).

>>> before = StatsSnapshot(success_count=10, success_ns=10_000_000)
>>> after = StatsSnapshot(success_count=20, success_ns=30_000_000, queue_count=10,
...                       queue_ns=5_000_000)
>>> after.since(before).queue_ms, after.since(before).request_ms
(0.5, 2.0)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import psutil

from slipstream.observability.gpu import Gpus, totals

_STAT_NAMES = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")


@dataclass(frozen=True)
class StatsSnapshot:
    """Cumulative statistics of the measured model, summed over its versions."""

    success_count: int = 0
    success_ns: int = 0
    fail_count: int = 0
    fail_ns: int = 0
    queue_count: int = 0
    queue_ns: int = 0
    compute_input_count: int = 0
    compute_input_ns: int = 0
    compute_infer_count: int = 0
    compute_infer_ns: int = 0
    compute_output_count: int = 0
    compute_output_ns: int = 0
    # Inferences (a request of batch 4 counts 4) and executed batches.
    inference_count: int = 0
    execution_count: int = 0

    def since(self, earlier: StatsSnapshot) -> ServerBreakdown:
        """Mean per-request figures of what happened between ``earlier`` and this."""
        delta = {f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)}
        executions = delta["execution_count"]
        return ServerBreakdown(
            requests=delta["success_count"],
            queue_ms=_mean_ms(delta, "queue"),
            compute_input_ms=_mean_ms(delta, "compute_input"),
            compute_infer_ms=_mean_ms(delta, "compute_infer"),
            compute_output_ms=_mean_ms(delta, "compute_output"),
            request_ms=_mean_ms(delta, "success"),
            avg_batch_size=delta["inference_count"] / executions if executions > 0 else None,
        )


def _mean_ms(delta: Mapping[str, int], name: str) -> float | None:
    count = delta[f"{name}_count"]
    return delta[f"{name}_ns"] / count / 1e6 if count > 0 else None


@dataclass(frozen=True)
class ServerBreakdown:
    """Where a request's time went inside the server, means over a stretch of load."""

    # Requests the server finished successfully in the stretch.
    requests: int
    queue_ms: float | None
    compute_input_ms: float | None
    compute_infer_ms: float | None
    compute_output_ms: float | None
    # The server's own end-to-end time per successful request.
    request_ms: float | None
    # Inferences per executed batch: how much the dynamic batcher combined.
    avg_batch_size: float | None

    @property
    def server_ms(self) -> float | None:
        """Queue plus the three compute phases; None when the server reported no queue
        or compute time (it offers no statistics, or nothing ran)."""
        parts = [
            self.queue_ms,
            self.compute_input_ms,
            self.compute_infer_ms,
            self.compute_output_ms,
        ]
        if all(p is None for p in parts):
            return None
        return sum(p or 0.0 for p in parts)


def snapshot_from_json(doc: Mapping[str, Any], version: str) -> StatsSnapshot:
    """A snapshot from the statistics in JSON form ``{"model_stats": [...]}`` (the
    HTTP body, or the ModelStatisticsResponse as protobuf's MessageToDict gives it)."""
    totals: dict[str, int] = {f.name: 0 for f in fields(StatsSnapshot)}
    for entry in doc.get("model_stats", []):
        if version and str(entry.get("version", "")) != version:
            continue
        infer = entry.get("inference_stats", {})
        for name in _STAT_NAMES:
            duration = infer.get(name, {})
            totals[f"{name}_count"] += int(duration.get("count", 0))
            totals[f"{name}_ns"] += int(duration.get("ns", 0))
        totals["inference_count"] += int(entry.get("inference_count", 0))
        totals["execution_count"] += int(entry.get("execution_count", 0))
    return StatsSnapshot(**totals)


# ----------------------------------------------------------------------- server process


@dataclass(frozen=True)
class ProcessSample:
    """CPU time and memory of the server process tree at one moment."""

    # time.monotonic() of the sample.
    at_s: float
    # user + system CPU seconds of the process and its children.
    cpu_s: float
    rss_bytes: int
    # NVML's utilization of the visible GPUs, summed (2.0 = two GPUs busy), and their
    # device memory in use (by every process on them); None without a GPU.
    gpu_utilization: float | None = None
    gpu_memory_used_bytes: int | None = None


@dataclass(frozen=True)
class ProcessUsage:
    """The server's resource use over a stretch of load."""

    # CPU use in percent of one core (200 = two cores busy).
    cpu_pct: float
    # Highest resident memory seen, MiB.
    rss_mb: float
    # GPU use in percent of one GPU (200 = two GPUs busy): the mean of the readings at the
    # end of each window, each covering NVML's last sample period (up to 1 s).
    gpu_util_pct: float | None = None
    # Highest GPU memory in use seen, MiB.
    gpu_memory_mb: float | None = None


class ProcessSampler:
    """Samples ``--server-pid`` (and every child it has) on the same machine, and
    ``gpus`` (this machine's, see :meth:`Gpus.open`) with it."""

    def __init__(self, pid: int, gpus: Gpus | None = None) -> None:
        self._process = psutil.Process(pid)  # NoSuchProcess for a wrong pid
        self._gpus = gpus

    def sample(self, at_s: float) -> ProcessSample | None:
        """None once the process has exited."""
        try:
            processes = [self._process, *self._process.children(recursive=True)]
        except psutil.Error:
            return None
        cpu_s = 0.0
        rss = 0
        for process in processes:
            try:
                times = process.cpu_times()
                rss += process.memory_info().rss
            except psutil.Error:
                continue  # a child that exited between the listing and the read
            cpu_s += times.user + times.system
        gpu = totals(self._gpus.read()) if self._gpus is not None else None
        return ProcessSample(
            at_s=at_s,
            cpu_s=cpu_s,
            rss_bytes=rss,
            gpu_utilization=gpu.utilization if gpu else None,
            gpu_memory_used_bytes=gpu.memory_used_bytes if gpu else None,
        )

    def close(self) -> None:
        if self._gpus is not None:
            self._gpus.close()


def process_usage(samples: list[ProcessSample]) -> ProcessUsage | None:
    """Usage between the first and last sample; None with fewer than two."""
    if len(samples) < 2 or samples[-1].at_s <= samples[0].at_s:
        return None
    elapsed = samples[-1].at_s - samples[0].at_s
    cpu_pct = 100 * (samples[-1].cpu_s - samples[0].cpu_s) / elapsed
    rss_mb = max(s.rss_bytes for s in samples) / 2**20
    # The first sample's utilization covers the moments before the stretch: left out.
    utilizations = [s.gpu_utilization for s in samples[1:] if s.gpu_utilization is not None]
    memory = [s.gpu_memory_used_bytes for s in samples if s.gpu_memory_used_bytes is not None]
    return ProcessUsage(
        cpu_pct=cpu_pct,
        rss_mb=rss_mb,
        gpu_util_pct=100 * sum(utilizations) / len(utilizations) if utilizations else None,
        gpu_memory_mb=max(memory) / 2**20 if memory else None,
    )
