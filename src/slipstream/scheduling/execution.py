"""What runs on an instance's thread: one batch of queued requests, gathered, run and
split back per request (:func:`execute`).

A batch's inputs are joined along the batch dim and run once; outputs are cut back into
each request's rows. A failure of the joined run is retried request by request, so one
bad request never fails the others, and so is a batch whose outputs do not have a row
per input row (a sum over the batch would hand one client another's data). A backend
that takes requests (``Backend.takes_requests``: Triton's Python backend) gets the
batch as its requests, each with its own tensors and context, as Triton hands a Python
model's ``execute`` its batch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import numpy as np

from slipstream.errors import InternalError, SlipstreamError
from slipstream.runtime.base import Backend, RequestContext

logger = logging.getLogger(__name__)

Arrays = dict[str, np.ndarray]


@dataclass(slots=True, eq=False)
class Pending:
    """One queued request."""

    inputs: Arrays
    # Rows this request adds to a batch (its first dim; 1 for non-batching models).
    rows: int
    # Non-batch shapes of the inputs: only requests with equal keys share a batch.
    shape_key: tuple[tuple[int, ...], ...]
    # Index into Batcher._queues (0 = highest priority).
    level: int
    future: asyncio.Future[Arrays]
    enqueue_ns: int
    timeout_handle: asyncio.TimerHandle | None = None
    # When the request's queue timeout ends (0: none).
    deadline_ns: int = 0
    # Set when the request leaves the queue for an instance.
    dispatch_ns: int = 0
    # Client requests this submission stands for (several stacked by the serving core):
    # each is counted in the queue and compute statistics.
    requests: int = 1
    # Its id, parameters and requested outputs, for backends that take requests.
    context: RequestContext | None = None


@dataclass(slots=True)
class BatchResult:
    """What a worker thread hands back for one batch."""

    # Per request: its outputs, or the exception that failed it.
    outcomes: list[Arrays | BaseException]
    input_ns: int = 0
    infer_ns: int = 0
    output_ns: int = 0
    rows: int = 0
    # When the batch started and ended on the instance's thread (perf_counter_ns).
    started_ns: int = 0
    ended_ns: int = 0


def execute(backend: Backend, batch: list[Pending], output_names: list[str]) -> BatchResult:
    """Worker thread: gather the batch, run it, split the outputs back per request; the
    result says when it started and ended."""
    started_ns = time.perf_counter_ns()
    if backend.takes_requests:
        result = _run_requests(backend, batch, output_names)
    else:
        result = _run(backend, batch, output_names)
    result.started_ns, result.ended_ns = started_ns, time.perf_counter_ns()
    return result


def _run(backend: Backend, batch: list[Pending], output_names: list[str]) -> BatchResult:
    t0 = time.perf_counter_ns()
    if len(batch) == 1:
        inputs = batch[0].inputs
    else:
        inputs = {name: np.concatenate([p.inputs[name] for p in batch]) for name in batch[0].inputs}
    t1 = time.perf_counter_ns()
    try:
        outputs = backend.run(inputs, output_names)
    except Exception as exc:
        if len(batch) == 1:
            return BatchResult(outcomes=[exc])
        # One bad request must not fail the others: rerun them one by one.
        return _isolate_failure(backend, batch, output_names)
    t2 = time.perf_counter_ns()
    outcomes: list[Arrays | BaseException]
    if len(batch) == 1:
        outcomes = [outputs]
    elif not _one_row_per_row(outputs, sum(p.rows for p in batch)):
        # An output without a row per input row (a sum over the batch, say) cannot be
        # split back: its rows would carry other clients' data. Each request alone.
        return _isolate_failure(backend, batch, output_names)
    else:
        outcomes = []
        start = 0
        for pending in batch:
            end = start + pending.rows
            outcomes.append({name: array[start:end] for name, array in outputs.items()})
            start = end
    t3 = time.perf_counter_ns()
    rows = sum(p.rows for p in batch)
    return BatchResult(outcomes, t1 - t0, t2 - t1, t3 - t2, rows)


def _run_requests(backend: Backend, batch: list[Pending], output_names: list[str]) -> BatchResult:
    """The batch as its requests: one call for all of them; where that call itself fails
    (the model raised), each request again alone, so one request's data cannot fail its
    batch mates. Not for requests of sequences (a stateful model would apply a request
    twice to its sequence's state) nor a decoupled model's (it may have sent answers
    already): those fail together, as in Triton."""
    t0 = time.perf_counter_ns()
    # A request queued without a context (warm-up, a shadow copy) gets one of its own:
    # the backend writes its response's parameters there.
    requests = [(p.inputs, p.context or RequestContext()) for p in batch]
    try:
        outcomes = backend.run_requests(requests, output_names)
    except Exception as exc:
        if len(batch) == 1 or any(c.correlation_id or c.respond for _, c in requests):
            outcomes = [exc] * len(batch)
        else:
            outcomes = []
            for request in requests:
                try:
                    outcomes.extend(backend.run_requests([request], output_names))
                except Exception as alone:
                    outcomes.append(alone)
    infer_ns = time.perf_counter_ns() - t0
    return BatchResult(outcomes, 0, infer_ns, 0, sum(p.rows for p in batch))


def _one_row_per_row(outputs: Arrays, rows: int) -> bool:
    """Whether every output has the batch's rows as its first dimension."""
    for name, array in outputs.items():
        if getattr(array, "ndim", 0) == 0 or array.shape[0] != rows:
            if name not in _UNSPLIT_WARNED:
                _UNSPLIT_WARNED.add(name)
                logger.warning(
                    "output %r has shape %s for a batch of %d rows: the model does not "
                    "answer a row per row, so batched requests run one by one; set "
                    "max_batch_size: 0 if it does not batch", name,
                    getattr(array, "shape", ()), rows,
                )  # fmt: skip
            return False
    return True


# Outputs already warned about by _one_row_per_row (once per process, not per batch).
_UNSPLIT_WARNED: set[str] = set()


def _isolate_failure(
    backend: Backend, batch: list[Pending], output_names: list[str]
) -> BatchResult:
    outcomes: list[Arrays | BaseException] = []
    t0 = time.perf_counter_ns()
    for pending in batch:
        try:
            outcomes.append(backend.run(pending.inputs, output_names))
        except Exception as exc:
            outcomes.append(exc)
    infer_ns = time.perf_counter_ns() - t0
    rows = sum(p.rows for p in batch)
    return BatchResult(outcomes, 0, infer_ns, 0, rows)


def as_served_error(exc: BaseException) -> BaseException:
    """Client errors pass through; anything else is logged once and answered generically."""
    if isinstance(exc, SlipstreamError):
        return exc
    logger.error("model execution failed", exc_info=exc)
    return InternalError("model execution failed; see the server log")
