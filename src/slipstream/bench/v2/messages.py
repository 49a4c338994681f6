"""What the coordinator and its worker processes tell each other over their pipes.

The coordinator sends a :class:`WorkerPlan` once, then per load level a
:class:`RunLevel` and later a :class:`StopLevel`; a worker answers ``Ready`` once, a
:class:`WindowSample` per measurement window and :class:`LevelDone` when its requests
have drained. Windows are cut on a shared schedule (``time.monotonic()`` is one clock
for every process of a machine), so the samples of one window line up across workers.

This module stays light (no pydantic, no protobuf): worker processes import it first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from slipstream.bench.core.endpoint import Endpoint
from slipstream.bench.core.histogram import LatencyHistogram
from slipstream.bench.core.levels import Distribution
from slipstream.bench.core.schedule import SendStats

Protocol = Literal["http", "http-binary", "grpc"]
SequenceIdKind = Literal["int", "string"]


@dataclass(frozen=True)
class EncodedRequest:
    """One request ready for the wire."""

    # The HTTP body, or the serialised ModelInferRequest for gRPC.
    body: bytes
    # Inference-Header-Content-Length for binary tensors; None for JSON and gRPC.
    header_length: int | None
    # Inferences the request counts for (its batch size).
    batch_size: int


@dataclass(frozen=True)
class SequencePlan:
    """How a run's workers drive a stateful model's sequences (see
    :mod:`slipstream.bench.v2.sequences`)."""

    # Requests per sequence: sequence_start on the first, sequence_end on the last.
    length: int
    # Integer ids, or string ids (a model whose CORRID control is TYPE_STRING).
    id_kind: SequenceIdKind
    # The largest integer id the model's CORRID control holds.
    max_id: int
    # Drawn per run, so two runs against one server never share an id.
    run_tag: int
    # Worker w's k-th sequence is id run_tag + w + k * stride: more than any worker id.
    stride: int

    def sequence_id(self, worker_id: int, number: int) -> int | str:
        """The id of worker ``worker_id``'s ``number``-th sequence (never 0)."""
        if self.id_kind == "string":
            return f"{self.run_tag:x}-{worker_id}-{number}"
        return 1 + (self.run_tag + worker_id + number * self.stride) % self.max_id


@dataclass(frozen=True)
class WorkerPlan:
    """Everything a worker process needs, sent once when it starts."""

    worker_id: int
    endpoint: Endpoint
    model: str
    # Empty: the server's default version.
    version: str
    # Pre-encoded requests, sent in turn.
    requests: list[EncodedRequest]
    timeout_s: float
    distribution: Distribution
    seed: int
    # A stateful model's sequences (each request in one); None for a stateless model.
    sequences: SequencePlan | None = None


@dataclass(frozen=True)
class Ready:
    """A worker has started and imported everything it needs."""

    worker_id: int


@dataclass(frozen=True)
class RunLevel:
    """Start one load level: this worker's share of it, on the shared schedule."""

    # Unique per attempt at a level, so a late StopLevel never stops the next one.
    level_id: int
    # Closed loop: this worker's outstanding requests (0 in open loop).
    concurrency: int
    # Open loop: this worker's share of the request rate, per second (0 in closed loop).
    request_rate: float
    # Open loop: this worker's first send is this long after start_at (workers with a
    # constant distribution interleave rather than send together).
    phase_s: float
    # Open loop: most outstanding requests of this worker.
    max_inflight: int
    # Closed loop: global index of this worker's first virtual user, so users across
    # workers start at different requests of the input data.
    first_user: int
    # time.monotonic() at which every worker starts sending.
    start_at: float
    warmup_s: float
    window_s: float
    # The worker stops by itself after this many measurement windows.
    max_windows: int


@dataclass(frozen=True)
class StopLevel:
    level_id: int


@dataclass(frozen=True)
class Shutdown:
    """Close every connection and exit."""


@dataclass
class WindowSample:
    """What one worker saw in one window (requests counted when they completed)."""

    worker_id: int
    level_id: int
    # -1 is the warm-up, then 0, 1, ...
    window_index: int
    # time.monotonic() at the window's start and when it was cut.
    start_s: float
    end_s: float
    # Successful requests and the inferences they carried (their batch sizes).
    ok_requests: int
    ok_inferences: int
    # Latencies of successful requests.
    latency: LatencyHistogram
    # Failed requests by error key ("http 400", "grpc UNAVAILABLE", "timeout", ...).
    errors: dict[str, int] = field(default_factory=dict)
    # Error key -> first message seen with it.
    error_examples: dict[str, str] = field(default_factory=dict)
    # CPU time (user + system) of the worker process in the window.
    cpu_s: float = 0.0
    # Open loop: requests started, those over 1 ms late, the in-flight cap's waits.
    sends: SendStats = field(default_factory=SendStats)
    # Requests sent again on a fresh connection after the server closed a reused one.
    reconnects: int = 0


@dataclass(frozen=True)
class LevelDone:
    """The worker stopped sending and its outstanding requests finished or were dropped."""

    worker_id: int
    level_id: int


@dataclass(frozen=True)
class WorkerFailed:
    """The worker hit an internal fault; the coordinator stops the run."""

    worker_id: int
    message: str


# Everything a worker sends back.
Message = Ready | WindowSample | LevelDone | WorkerFailed
