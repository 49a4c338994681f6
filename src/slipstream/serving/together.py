"""Requests a front end sent together (:mod:`slipstream.engine.groups`), served by the
serving core: a group checked and queued in one pass, a stack queued as one request.

:meth:`ModelServer.infer_group` and :meth:`ModelServer.infer_stack` call these; each
request is still answered, and counted in its version's statistics, as
:meth:`ModelServer.infer` would answer and count it alone.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Sequence
from typing import Any, Protocol, cast

import numpy as np

from slipstream.errors import SlipstreamError, Unavailable
from slipstream.serving.model import ModelVersion, PreparedRequest
from slipstream.serving.outcomes import record_failure, record_success
from slipstream.serving.service import cut, unstack
from slipstream.types import InferRequest, InferResponse


class ModelServer(Protocol):
    """What these ask of the serving core (:class:`slipstream.serving.core.ModelServer`)."""

    async def infer(self, request: InferRequest) -> InferResponse: ...

    def plain_model(self, request: InferRequest) -> ModelVersion | None: ...


async def infer_group(
    server: ModelServer, requests: Sequence[InferRequest]
) -> list[InferResponse | Exception]:
    """Requests that arrived together (one front end's turn of its event loop), each
    answered as :meth:`ModelServer.infer` would answer it alone, in order.

    Those on a plain batching model version (no cascade, rollout route, response
    cache or shared memory) are checked and queued here in one pass, without a
    coroutine each: their batcher futures settle their answers. The rest run through
    :meth:`ModelServer.infer`. In the batcher each is a request of its own, as it would have been
    (batches, timeouts, a failure in the model rerun one by one).
    """
    results: list[Any] = [None] * len(requests)
    waits: list[Awaitable[Any]] = []
    for index, request in enumerate(requests):
        model = server.plain_model(request)
        if model is None:
            waits.append(_infer_into(server, index, request, results))
            continue
        started_ns = time.perf_counter_ns()
        try:
            prepared = model.prepare(request)
            queued = model.batcher.enqueue(
                prepared.inputs,
                prepared.rows,
                prepared.shape_key,
                request.priority,
                request.timeout_us,
            )
        except SlipstreamError as exc:
            record_failure(model, exc, time.perf_counter_ns() - started_ns)
            results[index] = exc
            continue
        answer = functools.partial(
            _answer_queued, index, results, model, request.id, prepared, started_ns
        )
        queued.add_done_callback(answer)
        waits.append(queued)
    if waits:
        await asyncio.gather(*waits, return_exceptions=True)
    return results


async def infer_stack(
    server: ModelServer, stacked: InferRequest, parts: Sequence[InferRequest], rows: Sequence[int]
) -> InferResponse | list[InferResponse | Exception]:
    """Requests a front end stacked: ``parts`` alike in model, version, priority,
    timeout, requested outputs and the datatype and shape (batch dim aside) of each
    input, whose inputs are consecutive ``rows`` of ``stacked``'s (``stacked`` is
    the first part with those inputs; the parts' own are empty).

    On a plain batching model the stack is checked once and queued as one request
    per ``max_batch_size`` rows, counted as its parts in the statistics; the answer
    is ``stacked``'s response, outputs stacked the same way (the front end cuts
    them). Wherever that cannot answer each part as :meth:`ModelServer.infer` would
    (a check that fails, a routed or cached model, a run that fails in the model), the
    parts run one by one instead (:func:`infer_group`) and the answer is one per part.
    """
    model = server.plain_model(stacked)
    prepared = None
    if model is not None and model.config.max_batch_size:
        limit = model.config.max_batch_size
        try:
            prepared = model.prepare(stacked)
        except SlipstreamError:
            prepared = None
        if prepared is not None and (
            prepared.rows != sum(rows) or not 0 < min(rows) <= max(rows) <= limit
        ):
            prepared = None
    if model is None or prepared is None:
        return await infer_group(server, unstack(stacked, parts, rows))
    started_ns = time.perf_counter_ns()
    # Consecutive parts, up to max_batch_size rows each: (first part, end part, rows).
    chunks: list[tuple[int, int, int, int]] = []
    first = start_row = row = 0
    for index, count in enumerate(rows):
        if row + count - start_row > limit:
            chunks.append((first, index, start_row, row))
            first, start_row = index, row
        row += count
    chunks.append((first, len(rows), start_row, row))
    runs = [_run_chunk(model, prepared, stacked, a, b, lo, hi) for a, b, lo, hi in chunks]
    outcomes: list[Any]
    if len(runs) == 1:  # the usual case: no task of its own
        try:
            outcomes = [await runs[0]]
        except Exception as exc:
            outcomes = [exc]
    else:
        outcomes = await asyncio.gather(*runs, return_exceptions=True)
    elapsed_ns = time.perf_counter_ns() - started_ns
    if all(isinstance(outcome, dict) for outcome in outcomes):
        record_success(model, elapsed_ns, len(parts))
        merged = cast(list[dict[str, np.ndarray]], outcomes)
        outputs = (
            merged[0]
            if len(merged) == 1
            else {name: np.concatenate([chunk[name] for chunk in merged]) for name in merged[0]}
        )
        return InferResponse(model.name, model.version_str, outputs, id=stacked.id)
    answers: list[InferResponse | Exception] = []
    alone = unstack(stacked, parts, rows)
    for (a, b, _, _), outcome in zip(chunks, outcomes, strict=True):
        if isinstance(outcome, dict):
            record_success(model, elapsed_ns, b - a)
            whole = InferResponse(model.name, model.version_str, outcome)
            answers += cut(whole, [part.id for part in alone[a:b]], rows[a:b])
        elif isinstance(outcome, Unavailable) or not isinstance(outcome, SlipstreamError):
            for _ in range(a, b):
                if isinstance(outcome, SlipstreamError):
                    record_failure(model, outcome, elapsed_ns)
            answers += [cast(Exception, outcome)] * (b - a)
        else:  # failed in the model: each part alone, so only a bad one fails
            answers += await infer_group(server, alone[a:b])
    return answers


async def _run_chunk(
    model: ModelVersion,
    prepared: PreparedRequest,
    stacked: InferRequest,
    first: int,
    end: int,
    start_row: int,
    end_row: int,
) -> dict[str, np.ndarray]:
    whole = start_row == 0 and end_row == prepared.rows
    inputs = (
        prepared.inputs
        if whole
        else {name: array[start_row:end_row] for name, array in prepared.inputs.items()}
    )
    outputs = await model.batcher.submit(
        inputs, end_row - start_row, prepared.shape_key, stacked.priority,
        stacked.timeout_us, requests=end - first,
    )  # fmt: skip
    picked = {name: outputs[name] for name in prepared.output_names}
    if model.tap is not None:
        model.tap.offer(inputs, picked)
    return picked


async def _infer_into(
    server: ModelServer, index: int, request: InferRequest, results: list[Any]
) -> None:
    try:
        results[index] = await server.infer(request)
    except Exception as exc:  # the caller answers each request's own error
        results[index] = exc


def _answer_queued(
    index: int,
    results: list[Any],
    model: ModelVersion,
    request_id: str,
    prepared: PreparedRequest,
    started_ns: int,
    queued: asyncio.Future[dict[str, np.ndarray]],
) -> None:
    """A request of :meth:`ModelServer.infer_group` left its batcher: its answer, as
    :meth:`ModelServer._run` makes it, and its statistics."""
    elapsed_ns = time.perf_counter_ns() - started_ns
    if queued.cancelled():
        model.stats.record_request(ok=False, total_ns=elapsed_ns)
        return
    error = queued.exception()
    if error is not None:
        if isinstance(error, SlipstreamError):
            record_failure(model, error, elapsed_ns)
        results[index] = error
        return
    outputs = queued.result()
    response = InferResponse(
        model_name=model.name,
        model_version=model.version_str,
        outputs={name: outputs[name] for name in prepared.output_names},
        id=request_id,
    )
    results[index] = response
    record_success(model, elapsed_ns)
    if model.tap is not None:
        model.tap.offer(prepared.inputs, response.outputs)
