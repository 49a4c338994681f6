"""Triton's statistics extension: cumulative counts and durations per model version.

The scheduler records into a :class:`ModelStatsRecorder` at the end of each batch; the
HTTP ``/v2/models/{m}/stats`` endpoint and the ModelStatistics RPC read snapshots.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(slots=True)
class StatDuration:
    """A cumulative count and total duration in nanoseconds."""

    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns


@dataclass(slots=True)
class InferStats:
    """Per-request figures (a request of batch 4 counts once)."""

    success: StatDuration = field(default_factory=StatDuration)
    fail: StatDuration = field(default_factory=StatDuration)
    queue: StatDuration = field(default_factory=StatDuration)
    compute_input: StatDuration = field(default_factory=StatDuration)
    compute_infer: StatDuration = field(default_factory=StatDuration)
    compute_output: StatDuration = field(default_factory=StatDuration)
    cache_hit: StatDuration = field(default_factory=StatDuration)
    cache_miss: StatDuration = field(default_factory=StatDuration)


@dataclass(slots=True)
class BatchStats:
    """Per-execution figures for one batch size."""

    batch_size: int
    compute_input: StatDuration = field(default_factory=StatDuration)
    compute_infer: StatDuration = field(default_factory=StatDuration)
    compute_output: StatDuration = field(default_factory=StatDuration)


@dataclass(slots=True)
class ModelStats:
    """Snapshot of one model version's statistics."""

    name: str
    version: str
    # Wall-clock time of the last inference, ms since the epoch (0 = never).
    last_inference_ms: int = 0
    # Inferences performed (a batch of 8 rows counts 8).
    inference_count: int = 0
    # Batches executed.
    execution_count: int = 0
    inference_stats: InferStats = field(default_factory=InferStats)
    batch_stats: list[BatchStats] = field(default_factory=list)


class ModelStatsRecorder:
    """Accumulates statistics for one model version (event-loop thread only)."""

    def __init__(self, name: str, version: str) -> None:
        self._stats = ModelStats(name=name, version=version)
        self._by_batch: dict[int, BatchStats] = {}

    def record_batch(
        self,
        *,
        batch_size: int,
        num_requests: int,
        input_ns: int,
        infer_ns: int,
        output_ns: int,
        end_ms: int,
    ) -> None:
        """One executed batch; its compute time is shared out among its requests."""
        stats = self._stats
        stats.execution_count += 1
        stats.inference_count += batch_size
        stats.last_inference_ms = end_ms
        per_request = stats.inference_stats
        per_request.compute_input.add(input_ns * num_requests, num_requests)
        per_request.compute_infer.add(infer_ns * num_requests, num_requests)
        per_request.compute_output.add(output_ns * num_requests, num_requests)
        batch = self._by_batch.get(batch_size)
        if batch is None:
            batch = self._by_batch[batch_size] = BatchStats(batch_size=batch_size)
        batch.compute_input.add(input_ns)
        batch.compute_infer.add(infer_ns)
        batch.compute_output.add(output_ns)

    def record_queue(self, queue_ns: int, count: int = 1) -> None:
        """``count`` requests left the queue for an instance after ``queue_ns`` in all."""
        self._stats.inference_stats.queue.add(queue_ns, count)

    def record_cache(self, *, hit: bool, ns: int) -> None:
        """One response-cache lookup: a hit's lookup, or a miss's lookup plus insertion."""
        inference = self._stats.inference_stats
        (inference.cache_hit if hit else inference.cache_miss).add(ns)

    def record_request(self, *, ok: bool, total_ns: int, count: int = 1) -> None:
        """``count`` finished requests, each ``total_ns`` end to end in the server."""
        inference = self._stats.inference_stats
        (inference.success if ok else inference.fail).add(total_ns * count, count)

    def snapshot(self) -> ModelStats:
        """A copy that later batches do not change."""
        s = self._stats
        copy = ModelStats(
            name=s.name,
            version=s.version,
            last_inference_ms=s.last_inference_ms,
            inference_count=s.inference_count,
            execution_count=s.execution_count,
            inference_stats=InferStats(
                **{
                    name: StatDuration(d.count, d.ns)
                    for name, d in _fields(s.inference_stats).items()
                }
            ),
        )
        copy.batch_stats = [
            BatchStats(
                batch_size=b.batch_size,
                compute_input=StatDuration(b.compute_input.count, b.compute_input.ns),
                compute_infer=StatDuration(b.compute_infer.count, b.compute_infer.ns),
                compute_output=StatDuration(b.compute_output.count, b.compute_output.ns),
            )
            for _, b in sorted(self._by_batch.items())
        ]
        return copy


def _fields(stats: InferStats) -> dict[str, StatDuration]:
    return {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}
