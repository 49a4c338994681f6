"""Triton's statistics extension: cumulative counts and durations per model version.

The scheduler records into a :class:`ModelStatsRecorder` at the end of each batch; the
HTTP ``/v2/models/{m}/stats`` endpoint and the ModelStatistics RPC read snapshots.

Two parts are kept as Triton keeps them:

* ``response_stats``: per response index ("0": each request's first response, "1" its
  second, ...), what its responses took. As in Triton, where only backends that report
  them (decoupled ones) fill it, a decoupled model's responses are recorded
  (:mod:`slipstream.serving.decoupled`, a generative model's on the V2 routes); a model
  that answers each request once leaves it empty.
* ``memory_usage``: what the version's instances hold, summed per memory kind and device,
  as each backend can say when it loads (:meth:`slipstream.runtime.base.Backend.memory_usage`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from slipstream.types import MemoryUsage, total_memory


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
class ResponseStats:
    """One response index's figures over every request (Triton's InferResponseStatistics)."""

    # From the response's start (its request's execution starting, or its previous
    # response sent) to its outputs computed; an empty or failed one: to its end.
    compute_infer: StatDuration = field(default_factory=StatDuration)
    # From its outputs computed to the response handed to the front end.
    compute_output: StatDuration = field(default_factory=StatDuration)
    # Responses with outputs, start to end.
    success: StatDuration = field(default_factory=StatDuration)
    # Responses that were errors, start to end.
    fail: StatDuration = field(default_factory=StatDuration)
    # Responses with neither outputs nor an error (a final flag alone), start to end.
    empty_response: StatDuration = field(default_factory=StatDuration)
    # Requests whose client left before this response: the time to clean up after it.
    cancel: StatDuration = field(default_factory=StatDuration)


# How one response ended; "cancel": its client left before it.
ResponseOutcome = Literal["success", "fail", "empty", "cancel"]


def add_response(
    responses: dict[str, ResponseStats],
    index: int,
    *,
    outcome: ResponseOutcome,
    start_ns: int,
    end_ns: int,
    output_start_ns: int = 0,
) -> None:
    """Response ``index`` of a request (0: its first) into ``responses``, as Triton's
    backends report one: started at ``start_ns``, its outputs computed at
    ``output_start_ns`` (0: it has none), handed over at ``end_ns``. A ``cancel`` spans
    the clean-up after its client left."""
    entry = responses.get(str(index))
    if entry is None:
        entry = responses[str(index)] = ResponseStats()
    total_ns = max(0, end_ns - start_ns)
    if outcome == "cancel":
        entry.cancel.add(total_ns)
        return
    if output_start_ns:
        entry.compute_infer.add(max(0, output_start_ns - start_ns))
        entry.compute_output.add(max(0, end_ns - output_start_ns))
    else:
        entry.compute_infer.add(total_ns)
    if outcome == "success":
        entry.success.add(total_ns)
    elif outcome == "fail":
        entry.fail.add(total_ns)
    else:
        entry.empty_response.add(total_ns)


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
    # Response index ("0", "1", ...) -> its figures; a decoupled model's (see above).
    response_stats: dict[str, ResponseStats] = field(default_factory=dict)
    # What the instances hold, per kind and device; empty where the backend cannot say.
    memory_usage: list[MemoryUsage] = field(default_factory=list)


class ModelStatsRecorder:
    """Accumulates statistics for one model version (event-loop thread only)."""

    def __init__(self, name: str, version: str) -> None:
        self._stats = ModelStats(name=name, version=version)
        self._by_batch: dict[int, BatchStats] = {}
        self._responses: dict[str, ResponseStats] = {}
        self._memory: list[MemoryUsage] = []

    def set_memory_usage(self, usages: Iterable[MemoryUsage]) -> None:
        """What the version's instances hold once loaded (summed per kind and device)."""
        self._memory = total_memory(usages)

    def record_response(
        self,
        index: int,
        *,
        outcome: ResponseOutcome,
        start_ns: int,
        end_ns: int,
        output_start_ns: int = 0,
    ) -> None:
        """One response of a decoupled model's request; see :func:`add_response`."""
        add_response(
            self._responses,
            index,
            outcome=outcome,
            start_ns=start_ns,
            end_ns=end_ns,
            output_start_ns=output_start_ns,
        )

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
        copy.response_stats = {
            index: ResponseStats(
                **{name: StatDuration(d.count, d.ns) for name, d in _fields(entry).items()}
            )
            for index, entry in self._responses.items()
        }
        copy.memory_usage = list(self._memory)
        return copy


def _fields(stats: InferStats | ResponseStats) -> dict[str, StatDuration]:
    return {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}
