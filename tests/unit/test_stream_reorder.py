"""The ModelStreamInfer reorder buffer (``grpc_stream.in_request_order``), without sockets:
request order kept while answers run concurrently, a bound on what one stream holds, and
what becomes of the runs when the stream fails or goes away."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from slipstream.protocol.proto import inference_pb2 as pb
from slipstream.server.grpc_stream import in_request_order, serialize_stream_error


async def numbered(
    count: int, pulled: list[int], fail_after: int | None = None
) -> AsyncIterator[pb.ModelInferRequest]:
    """Requests with ids "0".."count-1"; records each one the stream reads."""
    for index in range(count):
        if index == fail_after:
            raise ConnectionError("the client's stream broke")
        pulled.append(index)
        yield pb.ModelInferRequest(id=str(index))


async def test_answers_come_in_request_order_while_they_run_concurrently() -> None:
    running: set[str] = set()
    most_running = 0

    async def answer(request: pb.ModelInferRequest) -> bytes:
        nonlocal most_running
        running.add(request.id)
        most_running = max(most_running, len(running))
        # Later requests finish first.
        await asyncio.sleep(0.001 * (10 - int(request.id)))
        running.discard(request.id)
        return request.id.encode()

    answers = [a async for a in in_request_order(numbered(10, []), answer)]
    assert answers == [str(index).encode() for index in range(10)]
    assert most_running == 10


async def test_a_held_answer_bounds_what_the_stream_reads() -> None:
    release = asyncio.Event()
    started: list[str] = []

    async def answer(request: pb.ModelInferRequest) -> bytes:
        started.append(request.id)
        if request.id == "0":
            await release.wait()
        return request.id.encode()

    pulled: list[int] = []
    answers = in_request_order(numbered(50, pulled), answer, max_in_flight=3)
    first = asyncio.ensure_future(anext(answers))
    for _ in range(20):
        await asyncio.sleep(0)
    # Three answers owed, and one request read that waits for a slot.
    assert pulled == [0, 1, 2, 3]
    assert started == ["0", "1", "2"]
    assert not first.done()
    release.set()
    assert await first == b"0"
    rest = [a async for a in answers]
    assert rest == [str(index).encode() for index in range(1, 50)]


async def test_a_broken_stream_is_raised_after_the_answers_owed() -> None:
    async def answer(request: pb.ModelInferRequest) -> bytes:
        await asyncio.sleep(0.001)
        return request.id.encode()

    received: list[bytes] = []
    with pytest.raises(ConnectionError):
        async for item in in_request_order(numbered(5, [], fail_after=2), answer):
            received.append(item)
    assert received == [b"0", b"1"]


async def test_closing_the_stream_cancels_the_runs_in_flight() -> None:
    cancelled: list[str] = []

    async def answer(request: pb.ModelInferRequest) -> bytes:
        if request.id != "0":
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.append(request.id)
                raise
        return request.id.encode()

    answers = in_request_order(numbered(4, []), answer)
    assert await anext(answers) == b"0"
    await asyncio.sleep(0.01)  # the other runs start and wait
    await answers.aclose()
    for _ in range(5):  # the cancelled tasks run their handlers
        await asyncio.sleep(0)
    assert sorted(cancelled) == ["1", "2", "3"]


def test_an_error_answer_names_its_request_and_is_final() -> None:
    request = pb.ModelInferRequest(id="r7", model_name="m", model_version="2")
    answer = pb.ModelStreamInferResponse.FromString(serialize_stream_error(request, "bad"))
    assert answer.error_message == "bad"
    response = answer.infer_response
    assert (response.id, response.model_name, response.model_version) == ("r7", "m", "2")
    assert response.parameters["triton_final_response"].bool_param
