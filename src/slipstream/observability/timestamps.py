"""Where a traced request's time went: Triton's TIMESTAMPS (``REQUEST_START``,
``QUEUE_START``, ``COMPUTE_START``, ``COMPUTE_INPUT_END``, ``COMPUTE_OUTPUT_START``,
``COMPUTE_END``, ``REQUEST_END``), recorded while the serving core runs the request and
made spans by :meth:`slipstream.observability.tracing.Tracing.add_timestamps`.

Only a request that is traced is recorded. Whoever traces it (the front end's
``TracedService``, or the engine process for a front end's traced request) sets
:data:`RECORDING` to a :class:`Recording` for the calls that serve it; the batcher adds a
:class:`ModelRun` for each submission it queues under one (a model's request, each step
of an ensemble or cascade) and fills its times. Where :data:`RECORDING` is None, the
default, nothing is recorded and no time is taken: the batcher's whole cost is reading
the variable and one None check a request, and one check of an empty dict a batch (a
split layout's front end reads the variable once a request too).

Times are recorded on the monotonic clock (``time.monotonic_ns``; on Linux and macOS
``perf_counter_ns`` is the same clock, and on every platform from Python 3.13), which the
batcher already reads, and made wall-clock times (what OpenTelemetry's events carry) by
:meth:`Recording.finish`, all with one offset, so their order is kept exactly.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import TypeVar

_Item = TypeVar("_Item")


@dataclass(slots=True, eq=False)
class ModelRun:
    """One run of a model for a traced request (Triton's model span): a model's request,
    or one step of an ensemble or cascade. Monotonic ns; 0 where not reached."""

    model_name: str
    model_version: str
    # When the request reached the model's batcher, and when it entered its queue.
    request_start_ns: int = 0
    queue_start_ns: int = 0
    # Its batch on the instance: started, inputs gathered, model run, outputs split.
    compute_start_ns: int = 0
    compute_input_end_ns: int = 0
    compute_output_start_ns: int = 0
    compute_end_ns: int = 0
    # When its outputs (or its error) were back with the serving core.
    request_end_ns: int = 0


@dataclass(frozen=True, slots=True)
class RunTimes:
    """A :class:`ModelRun` as wall-clock (Unix epoch) ns, 0 where not reached."""

    model_name: str
    model_version: str
    request_start_ns: int
    queue_start_ns: int
    compute_start_ns: int
    compute_input_end_ns: int
    compute_output_start_ns: int
    compute_end_ns: int
    request_end_ns: int


@dataclass(frozen=True, slots=True)
class RequestTimes:
    """A traced request's timestamps, as they cross from the engine to a front end and
    become spans: wall-clock (Unix epoch) ns."""

    # When the serving core got the request and when it was done with it.
    request_start_ns: int
    request_end_ns: int
    # Each model run, in the order the runs were queued.
    runs: tuple[RunTimes, ...] = ()


class Recording:
    """The timestamps of one traced request being served; see the module docstring."""

    __slots__ = ("_closed", "_runs", "_start_ns", "remote")

    def __init__(self) -> None:
        self._start_ns = time.monotonic_ns()
        self._runs: list[ModelRun] = []
        self._closed = False
        # What the engine process recorded for the request (a front end's recording in
        # the split layout): it stands for this one.
        self.remote: RequestTimes | None = None

    def run(self, model_name: str, model_version: str) -> ModelRun | None:
        """A new run of ``model_name`` to fill; None once the request is done (work it
        left behind, a shadow copy, is not its own)."""
        if self._closed:
            return None
        run = ModelRun(model_name, model_version, request_start_ns=time.monotonic_ns())
        self._runs.append(run)
        return run

    def finish(self) -> RequestTimes:
        """The request is done: its times as wall-clock ns (the engine's, where it sent
        them). Runs added later are not recorded."""
        end_ns = time.monotonic_ns()
        self._closed = True
        if self.remote is not None:
            return self.remote
        offset_ns = time.time_ns() - time.monotonic_ns()

        def wall(ns: int) -> int:
            return ns + offset_ns if ns else 0

        runs = tuple(
            RunTimes(
                run.model_name,
                run.model_version,
                wall(run.request_start_ns),
                wall(run.queue_start_ns),
                wall(run.compute_start_ns),
                wall(run.compute_input_end_ns),
                wall(run.compute_output_start_ns),
                wall(run.compute_end_ns),
                wall(run.request_end_ns),
            )
            for run in self._runs
        )
        return RequestTimes(wall(self._start_ns), wall(end_ns), runs)


# The recording of the traced request being served by this task (None: not traced).
RECORDING: contextvars.ContextVar[Recording | None] = contextvars.ContextVar(
    "slipstream_trace_recording", default=None
)


async def recorded(
    items: AsyncIterator[_Item], recording: Recording
) -> AsyncGenerator[_Item, None]:
    """``items`` (a request's stream of answers), each pulled with :data:`RECORDING` set
    to ``recording``: set only while the stream's own code runs, never while the
    consumer holds an item (it may serve other requests meanwhile: a gRPC stream's)."""
    try:
        while True:
            token = RECORDING.set(recording)
            try:
                item = await anext(items)
            except StopAsyncIteration:
                return
            finally:
                RECORDING.reset(token)
            yield item
    finally:
        aclose = getattr(items, "aclose", None)
        if aclose is not None:
            await aclose()
