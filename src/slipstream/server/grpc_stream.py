"""ModelStreamInfer's answers: concurrent runs, written in the order the requests came.

Triton writes the answers of a stream to a non-decoupled model in request order, holding
a finished answer until those before it are written; clients (perf_analyzer, loops that
pair the n-th answer with the n-th request) rely on that order, on every answer naming
its request (errors too) and on Triton's ``triton_final_response`` parameter. A request
to most models has exactly one answer, its final one; a decoupled model's request has
any number (:class:`Answers`), written as they come while it is the oldest unanswered
request, the last flagged final.

Example::

    async def answer(request: pb.ModelInferRequest) -> bytes: ...

    async for wire_bytes in in_request_order(requests, answer):
        yield wire_bytes
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from typing import Any

from slipstream.protocol.grpc_codec import FINAL_RESPONSE
from slipstream.protocol.proto import inference_pb2 as pb

# Requests read from one stream whose answers are not yet written. Past this the stream
# stops reading, so HTTP/2 flow control holds the client back: answers held behind a slow
# one, and the runs in flight, stay bounded whatever the client sends. Far above what
# clients keep in flight (perf_analyzer and tritonclient loops: one per concurrency slot).
MAX_STREAM_IN_FLIGHT = 1024

# The request parameter with which tritonclient asks for an empty final answer. Triton
# sends one only for decoupled models and consumes the parameter; so does this server,
# so that the model and the response cache see the request a unary call would send.
ENABLE_EMPTY_FINAL_RESPONSE = "triton_enable_empty_final_response"


class Partial:
    """A decoupled request's answer that is not its last, marked for the front door
    (``STREAM_MARKS``), which keeps the request's concurrency slot until the final one
    and writes ``data``."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


class Done:
    """A decoupled request's answers are all sent, its final flag having come without a
    response to write: for the front door to count; nothing is written."""

    __slots__ = ()


# What a stream's answers may be: wire bytes, or (to the front door) the marks above.
Answer = bytes | Partial | Done


class Answers:
    """A decoupled request's answers on the wire, gathered while they wait their turn:
    ``items`` runs (and is read) from the start, so a request behind a slow one still
    runs; :meth:`close` stops it (the client left)."""

    def __init__(self, items: AsyncIterator[Answer]) -> None:
        self._queue: asyncio.Queue[Answer | BaseException | None] = asyncio.Queue()
        self._task = asyncio.create_task(self._gather(items))

    async def _gather(self, items: AsyncIterator[Answer]) -> None:
        try:
            async for item in items:
                self._queue.put_nowait(item)
        except Exception as exc:  # answered by the writer, after what came before it
            self._queue.put_nowait(exc)
        self._queue.put_nowait(None)

    async def __aiter__(self) -> AsyncIterator[Answer]:
        while (item := await self._queue.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        self._task.cancel()


async def in_request_order(
    requests: AsyncIterator[pb.ModelInferRequest],
    answer: Callable[[pb.ModelInferRequest], Coroutine[Any, Any, bytes | Answers]],
    max_in_flight: int = MAX_STREAM_IN_FLIGHT,
) -> AsyncGenerator[Answer, None]:
    """``answer(request)`` for each request, run concurrently, yielded in request order.

    ``answer`` must answer every failure itself (an error message on the stream). One
    task reads the stream while this generator is the only writer, since grpc.aio allows
    one write at a time. A slow request holds back the answers after it, not their runs.
    A failure to read the stream is raised once the answers already owed are written.
    """
    # Each request's answer, in arrival order: the reorder buffer. None ends the stream.
    pending: asyncio.Queue[asyncio.Task[bytes | Answers] | None] = asyncio.Queue()
    # A slot per request read and not yet answered on the wire: bounds `pending`.
    slots = asyncio.Semaphore(max_in_flight)

    async def read_requests() -> None:
        try:
            async for request in requests:
                await slots.acquire()
                pending.put_nowait(asyncio.create_task(answer(request)))
        finally:
            pending.put_nowait(None)

    reader = asyncio.create_task(read_requests())
    head: asyncio.Task[bytes | Answers] | None = None
    try:
        while (head := await pending.get()) is not None:
            # Done answers after the head are yielded without waiting on the loop again.
            answered = await head
            if isinstance(answered, Answers):
                async for item in answered:
                    yield item
            else:
                yield answered
            slots.release()
        await reader  # re-raises a failure to read the stream
    finally:
        reader.cancel()
        unanswered = [head] if head is not None else []
        while not pending.empty():
            if (task := pending.get_nowait()) is not None:
                unanswered.append(task)
        for task in unanswered:
            task.cancel()
            finished = task.done() and not task.cancelled() and task.exception() is None
            if finished and isinstance(answers := task.result(), Answers):
                answers.close()


def serialize_stream_error(
    request: pb.ModelInferRequest, message: str, final: bool = True
) -> bytes:
    """A failed request's answer: the message, and the id, model name and version as sent.

    Without the id a client with several requests in flight cannot tell which one failed
    (Triton fills these in on failures too); the answer is the request's final one,
    unless a decoupled model sent it and more may follow.
    """
    answer = pb.ModelStreamInferResponse(error_message=message)
    infer_response = answer.infer_response
    infer_response.id = request.id
    infer_response.model_name = request.model_name
    infer_response.model_version = request.model_version
    infer_response.parameters[FINAL_RESPONSE].bool_param = final
    return answer.SerializeToString()


def serialize_empty_final(request: pb.ModelInferRequest) -> bytes:
    """A decoupled request's empty final answer (sent where the client asked for one
    with ``triton_enable_empty_final_response``)."""
    answer = pb.ModelStreamInferResponse()
    infer_response = answer.infer_response
    infer_response.id = request.id
    infer_response.model_name = request.model_name
    infer_response.model_version = request.model_version
    infer_response.parameters[FINAL_RESPONSE].bool_param = True
    return answer.SerializeToString()
