"""A decoupled model's answers to one request, as they come (Triton's decoupled
transaction policy; gRPC ``ModelStreamInfer`` is where clients read them).

A decoupled Python model answers each request through its response sender, any number
of times, during ``execute`` or after it from a thread of its own, the last answer
flagged final. The request is queued and batched as any other (its ``execute`` call may
take other requests too); the sender's answers reach the event loop through a queue and
are yielded here as :data:`StreamItem`: the response (None for a final flag without
one), an error message instead where the model sent an error, and whether it is the
last. A failure of ``execute`` itself ends the stream with the error. The request counts
in the model's statistics once, when its final answer is sent; each answer counts in its
index's ``response_stats`` as it is handed to the front end (Triton's response
statistics: computed from ``execute`` taking the request, or the previous answer, to the
model sending it; its outputs then handed over), and a client that leaves before the
final answer counts a ``cancel`` at the index of the answer it never read.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import numpy as np

from slipstream.errors import SlipstreamError
from slipstream.observability.stats import ResponseOutcome
from slipstream.scheduling.execution import as_served_error
from slipstream.serving.model import ModelVersion
from slipstream.serving.outcomes import record_failure, record_success
from slipstream.serving.service import StreamItem
from slipstream.types import InferRequest, InferResponse


class ErrorMessage(str):
    """An error answer's message (what a stream sends), keeping the error it stands for:
    a Python model reading the stream through BLS gets the error's own code back."""

    error: Exception

    def __new__(cls, error: Exception) -> ErrorMessage:
        made = super().__new__(cls, str(error))
        made.error = error
        return made

    def __reduce__(self) -> tuple[type[str], tuple[str]]:
        # To another process (a front end) it is the message alone, as any error's.
        return str, (str(self),)


# One answer as the model's thread hands it over: outputs, error, final, parameters, and
# when it was sent (perf_counter_ns).
_Answer = tuple[dict[str, np.ndarray] | None, Exception | None, bool, dict[str, Any], int]


async def answers(model: ModelVersion, request: InferRequest) -> AsyncIterator[StreamItem]:
    """``request``'s answers from the decoupled ``model``, ending with its final one."""
    started_ns = time.perf_counter_ns()
    loop = asyncio.get_running_loop()
    sent: asyncio.Queue[_Answer] = asyncio.Queue()

    def respond(
        outputs: dict[str, np.ndarray] | None,
        error: Exception | None,
        final: bool,
        parameters: Mapping[str, Any],
    ) -> None:
        answer = (outputs, error, final, dict(parameters), time.perf_counter_ns())
        loop.call_soon_threadsafe(sent.put_nowait, answer)

    # When the answer awaited began: execute taking the request, then each answer sent.
    begun_ns = started_ns

    def taken() -> None:
        nonlocal begun_ns
        begun_ns = time.perf_counter_ns()

    # Set when the client goes before the last answer: the model's senders say so.
    gone = threading.Event()
    finished = False
    index = 0  # the next answer's index in the model's response_stats
    try:
        prepared = model.prepare(request)
        context = model.context(request, respond, gone.is_set, taken)
        run: asyncio.Future[Any] | None = asyncio.ensure_future(
            model.batcher.submit(
                prepared.inputs,
                prepared.rows,
                prepared.shape_key,
                request.priority,
                request.timeout_us,
                1,
                context,
            )
        )
    except SlipstreamError as exc:
        record_failure(model, exc, time.perf_counter_ns() - started_ns)
        raise
    failed: BaseException | None = None
    try:
        while True:
            next_answer = asyncio.ensure_future(sent.get())
            waiting = {next_answer} if run is None else {next_answer, run}
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if next_answer not in done:
                next_answer.cancel()
                assert run is not None
                error = run.exception()
                if error is not None:  # execute itself failed: nothing more will come
                    end_ns = time.perf_counter_ns()
                    model.stats.record_response(
                        index, outcome="fail", start_ns=begun_ns, end_ns=end_ns
                    )
                    raise as_served_error(error)
                run = None  # execute took the request; its answers may come later
                continue
            outputs, problem, final, parameters, sent_ns = next_answer.result()
            if problem is not None:
                failed = as_served_error(problem)
                assert isinstance(failed, Exception)  # as_served_error keeps it one
                item: StreamItem = (None, ErrorMessage(failed), final)
            else:
                response = None
                if outputs is not None:
                    response = InferResponse(
                        model.name, model.version_str, outputs, request.id, parameters
                    )
                item = (response, "", final)
            # An empty answer: a final flag alone.
            outcome: ResponseOutcome = (
                "fail" if problem is not None else "empty" if outputs is None else "success"
            )
            handed_ns = time.perf_counter_ns()
            model.stats.record_response(
                index,
                outcome=outcome,
                start_ns=begun_ns,
                output_start_ns=sent_ns if outcome == "success" else 0,
                end_ns=handed_ns,
            )
            index += 1
            begun_ns = handed_ns
            finished = final  # before the yield: the client may close the stream on it
            yield item
            if finished:
                break
    except SlipstreamError as exc:
        record_failure(model, exc, time.perf_counter_ns() - started_ns)
        raise
    except (GeneratorExit, asyncio.CancelledError):
        if not finished:
            _cancelled(model, index, gone, run)
        raise
    finally:
        if not finished:
            gone.set()
        if run is not None and not run.done():
            if finished:  # the final answer came before execute returned: it may return
                run.add_done_callback(_retrieved)
            else:
                run.cancel()  # the client left: a request still queued never runs
    elapsed_ns = time.perf_counter_ns() - started_ns
    if isinstance(failed, SlipstreamError):  # an answer was an error: the request failed
        record_failure(model, failed, elapsed_ns)
    else:
        record_success(model, elapsed_ns)


def _cancelled(
    model: ModelVersion, index: int, gone: threading.Event, run: asyncio.Future[Any] | None
) -> None:
    """The client left before answer ``index``: the model's senders are told, a request
    still queued is dropped, and the clean-up counts as that answer's ``cancel``."""
    started_ns = time.perf_counter_ns()
    gone.set()
    if run is not None and not run.done():
        run.cancel()
    model.stats.record_response(
        index, outcome="cancel", start_ns=started_ns, end_ns=time.perf_counter_ns()
    )


def _retrieved(run: asyncio.Future[Any]) -> None:
    """Its outcome read (an error after the last answer reaches no one): no warning."""
    if not run.cancelled():
        run.exception()


async def stream(
    infer: Callable[[InferRequest], Awaitable[InferResponse]],
    resolve: Callable[[InferRequest, str], Awaitable[ModelVersion]],
    request: InferRequest,
) -> AsyncIterator[StreamItem]:
    """The serving core's ``infer_stream``: a decoupled model's :func:`answers`, any
    other model's one answer (``infer``'s, errors raised as ``infer`` raises them)."""
    try:
        model = await resolve(request, request.model_version)
    except SlipstreamError:
        model = None  # not a plain model (a cascade, an ensemble), or none: infer says
    if model is None or not model.decoupled:
        yield await infer(request), "", True
        return
    async for item in answers(model, request):
        yield item
