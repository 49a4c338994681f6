"""The V2 routes of the generative models under ``serve --ray``: the root application
relays them to a replica of the generative application.

Ray's HTTP proxy routes by path prefix, one prefix per application. The generative
models run in one application at ``/v1`` (an OpenAI request names its model in its
body), so ``/v2/models/<generative model>/...`` reaches the root application at ``/``.
The root hands such a request, as it came, to a replica of the generative application
over a Ray Serve handle (that replica's ``relay`` method), rather than running the model
a second time in an application of its own. That replica answers it with the plain
server's V2 front end (:class:`~slipstream.server.v2_llm.GenerativeV2` behind
:class:`~slipstream.server.v2_rest.V2RestApp`: metadata, config, ready, infer, generate,
generate_stream, statistics, trace settings). The answer comes back as a stream of
parts: first its head (:class:`RelayedHead`, with the whole body of an answer that does
not stream), then each chunk of a streamed one (server-sent events) as the replica makes
it. A client that leaves cancels the handle's call, which closes the replica's answer:
its generation stops.

    # the root replica
    relay = GenerativeRelay({"smol"}, open_handle, fallback=root_routes.handle)
    router = Router(fallback=v2_app.handle, routes=[("/v2/", relay.handle)])
    # the generative replica's method the handle calls
    async def relay(self, request):
        async for part in relayed(self._handle, request, replica_headers):
            yield part
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any

from slipstream.errors import InternalError, InvalidRequest
from slipstream.names import path_model_name
from slipstream.protocol import v2
from slipstream.server.http_messages import error_reply
from slipstream.server.httpd import HttpRequest, HttpResponse, StreamingResponse

logger = logging.getLogger(__name__)

Reply = HttpResponse | StreamingResponse
Handler = Callable[[HttpRequest], Awaitable[Reply]]
# The name of the generative replica's method the root calls.
RELAY_METHOD = "relay"
# What a client that is mid-stream reads when the replica fails under it (the plain
# server's generate_stream words a failure after the first event the same way).
_BROKEN_STREAM = (
    b'data: {"error":"the generative model\'s replica stopped answering; see the server log"}\n\n'
)


@dataclass(frozen=True, slots=True)
class RelayedHead:
    """The first part of a relayed answer."""

    # The HTTP status, content type and headers the replica answered with.
    status: int
    content_type: bytes
    headers: list[tuple[bytes, bytes]]
    # The whole body of an answer that does not stream; None: its chunks follow.
    body: bytes | None


async def relayed(
    handler: Handler, request: HttpRequest, headers: list[tuple[bytes, bytes]]
) -> AsyncIterator[RelayedHead | bytes]:
    """``handler``'s answer to ``request`` as relayed parts (see the module doc), with
    ``headers`` added to it (the answering replica's)."""
    reply = await handler(request)
    if isinstance(reply, HttpResponse):
        yield RelayedHead(reply.status, reply.content_type, [*reply.headers, *headers],
                          reply.body)  # fmt: skip
        return
    yield RelayedHead(reply.status, reply.content_type, [*reply.headers, *headers], None)
    try:
        async for chunk in reply.chunks:
            yield chunk
    finally:  # cancelled (the client left): its generation stops now
        aclose = getattr(reply.chunks, "aclose", None)
        if aclose is not None:
            await aclose()


class GenerativeRelay:
    """The root replica's side: requests for ``models`` (the generative ones) go to the
    generative application's replicas, every other request to ``fallback``."""

    def __init__(
        self, models: Collection[str], open_handle: Callable[[], Any], fallback: Handler
    ) -> None:
        """``open_handle``: the generative application's Ray Serve DeploymentHandle,
        opened at the first relayed request (that application is deployed before the
        root, but a handle made in ``__init__`` would tie the root's start to it)."""
        self._models = frozenset(models)
        self._open_handle = open_handle
        self._handle: Any = None
        self._fallback = fallback

    def relays(self, path: str) -> bool:
        """Whether ``path`` is a V2 model route of a generative model."""
        parts = path.split("/", 4)  # "", "v2", "models", <model>, [rest]
        if len(parts) < 4 or parts[:3] != ["", "v2", "models"]:
            return False
        try:
            return path_model_name(parts[3]) in self._models
        except InvalidRequest:  # not a model name: the V2 routes answer it
            return False

    async def handle(self, request: HttpRequest) -> Reply:
        if not self.relays(request.path):
            return await self._fallback(request)
        if self._handle is None:
            self._handle = relay_handle(self._open_handle())
        return await relay(self._handle, request, "the generative model's")


def relay_handle(handle: Any) -> Any:
    """``handle`` (a Ray Serve DeploymentHandle of ``V2Replica`` replicas) set to call
    their ``relay`` method, for :func:`relay`."""
    return handle.options(method_name=RELAY_METHOD, stream=True)


async def relay(handle: Any, request: HttpRequest, whose: str) -> Reply:
    """``request`` answered by a replica of ``handle``'s application (a
    :func:`relay_handle`), as that replica's routes answer it; 500 naming ``whose``
    replica ("the generative model's") where it did not answer."""
    answers = handle.remote(request)
    try:
        head: RelayedHead = await anext(answers)
    except asyncio.CancelledError:  # the client left: so does the replica's work
        answers.cancel()
        raise
    except Exception:  # the replica's fault, not the request's: logged here only
        logger.exception("relaying %s %s to %s replica failed", request.method, request.path,
                         whose)  # fmt: skip
        answers.cancel()
        exc = InternalError(f"{whose} replica did not answer; see the server log")
        return error_reply(exc, v2.encode_error(exc.message))
    if head.body is not None:
        return HttpResponse(head.status, head.body, head.content_type, head.headers)
    return StreamingResponse(head.status, _chunks(answers, request.path), head.content_type,
                             head.headers)  # fmt: skip


async def _chunks(answers: Any, path: str) -> AsyncIterator[bytes]:
    """The streamed chunks of a relayed answer; closing this (the client left) cancels
    the replica's side."""
    ended = False
    try:
        async for chunk in answers:
            yield chunk
        ended = True
    except Exception:
        logger.exception("the generative application's replica failed mid-answer on %s", path)
        ended = True
        yield _BROKEN_STREAM
    finally:
        if not ended:
            answers.cancel()
