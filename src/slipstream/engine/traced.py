"""Traced requests across the process boundary: the timestamps the engine records (its
batcher runs the request) brought back to the front end, whose span they go under.

A front end's traced request (its ``TracedService`` set
:data:`~slipstream.observability.timestamps.RECORDING`) goes to the engine on its own, as
``infer_traced`` or ``infer_stream_traced``, never grouped or stacked with others
(:mod:`slipstream.engine.groups`): the engine records it as the one-process server
would and answers its timestamps with it. Untraced requests travel as before, nothing
added to their messages. Beside the other engine calls (:mod:`slipstream.engine.host`):

    ("call", id, "infer_traced", (request fields,))
        -> ("ok", id, (True, response fields, times) | (False, error state, times))
    ("stream", id, "infer_stream_traced", (request fields,))
        -> ("item", id, (response fields | None, message, final, times | None))...

``times`` is a :class:`~slipstream.observability.timestamps.RequestTimes` (wall-clock
ns, taken in the engine), sent with the answer and with a stream's final item. A failed
request's times come back with its error, so a request that timed out in the queue
still shows its queue start.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from slipstream.engine.client import EngineClient
from slipstream.engine.host import Call, Stream
from slipstream.engine.wire import (
    error_state,
    rebuild_error,
    request_fields,
    request_from,
    response_fields,
    response_from,
)
from slipstream.errors import SlipstreamError
from slipstream.observability.timestamps import RECORDING, Recording, recorded
from slipstream.serving.service import InferenceService, StreamItem
from slipstream.types import InferRequest, InferResponse


async def infer_traced(
    client: EngineClient, request: InferRequest, recording: Recording
) -> InferResponse:
    """The front end's side: ``request`` answered by the engine of ``client``, its
    timestamps into ``recording``."""
    ok, value, times = await client.call("infer_traced", request_fields(request))
    recording.remote = times
    if not ok:
        raise rebuild_error(value)
    return response_from(value)


async def infer_stream_traced(
    client: EngineClient, request: InferRequest, recording: Recording
) -> AsyncGenerator[StreamItem, None]:
    """:func:`infer_traced` for a stream: its answers as they come."""
    answers = client.stream("infer_stream_traced", request_fields(request))
    try:
        async for fields, message, final, times in answers:
            if times is not None:
                recording.remote = times
            yield (None if fields is None else response_from(fields)), message, final
    finally:
        aclose = getattr(answers, "aclose", None)
        if aclose is not None:  # the engine's side is cancelled at once
            await aclose()


def traced_calls(service: InferenceService) -> dict[str, Call]:
    """The engine's side: ``infer_traced``, run on its ``service`` and recorded."""

    async def infer(fields: tuple[Any, ...]) -> tuple[bool, Any, Any]:
        recording = Recording()
        token = RECORDING.set(recording)  # this call's own task
        try:
            response = await service.infer(request_from(fields))
        except SlipstreamError as exc:
            return False, error_state(exc), recording.finish()
        finally:
            RECORDING.reset(token)
        return True, response_fields(response), recording.finish()

    return {"infer_traced": infer}


def traced_streams(service: InferenceService) -> dict[str, Stream]:
    """The engine's side: ``infer_stream_traced``, run on its ``service`` and recorded."""

    async def infer_stream(fields: tuple[Any, ...]) -> AsyncIterator[tuple[Any, ...]]:
        recording = Recording()
        answers = recorded(service.infer_stream(request_from(fields)), recording)
        async with contextlib.aclosing(answers):
            async for response, message, final in answers:
                sent = None if response is None else response_fields(response)
                yield sent, message, final, recording.finish() if final else None

    return {"infer_stream_traced": infer_stream}
