"""ModelStreamInfer's answers: concurrent runs, written in the order the requests came.

Triton writes the answers of a stream to a non-decoupled model in request order, holding
a finished answer until those before it are written; clients (perf_analyzer, loops that
pair the n-th answer with the n-th request) rely on that order, on every answer naming
its request (errors too) and on Triton's ``triton_final_response`` parameter. Slipstream
serves no decoupled model over V2 gRPC, so every request has exactly one answer, its
final one.

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


async def in_request_order(
    requests: AsyncIterator[pb.ModelInferRequest],
    answer: Callable[[pb.ModelInferRequest], Coroutine[Any, Any, bytes]],
    max_in_flight: int = MAX_STREAM_IN_FLIGHT,
) -> AsyncGenerator[bytes, None]:
    """``answer(request)`` for each request, run concurrently, yielded in request order.

    ``answer`` must answer every failure itself (an error message on the stream). One
    task reads the stream while this generator is the only writer, since grpc.aio allows
    one write at a time. A slow request holds back the answers after it, not their runs.
    A failure to read the stream is raised once the answers already owed are written.
    """
    # Each request's answer, in arrival order: the reorder buffer. None ends the stream.
    pending: asyncio.Queue[asyncio.Task[bytes] | None] = asyncio.Queue()
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
    head: asyncio.Task[bytes] | None = None
    try:
        while (head := await pending.get()) is not None:
            # Done answers after the head are yielded without waiting on the loop again.
            yield await head
            slots.release()
        await reader  # re-raises a failure to read the stream
    finally:
        reader.cancel()
        if head is not None:
            head.cancel()
        while not pending.empty():
            if (task := pending.get_nowait()) is not None:
                task.cancel()


def serialize_stream_error(request: pb.ModelInferRequest, message: str) -> bytes:
    """A failed request's answer: the message, and the id, model name and version as sent.

    Without the id a client with several requests in flight cannot tell which one failed
    (Triton fills these in on failures too); the answer is the request's final one.
    """
    answer = pb.ModelStreamInferResponse(error_message=message)
    infer_response = answer.infer_response
    infer_response.id = request.id
    infer_response.model_name = request.model_name
    infer_response.model_version = request.model_version
    infer_response.parameters[FINAL_RESPONSE].bool_param = True
    return answer.SerializeToString()
