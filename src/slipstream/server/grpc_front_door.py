"""The gRPC side of the front door: an interceptor doing what ``front_door.py`` does for
HTTP (API keys from the ``authorization`` metadata, per-key rate limits, request ids,
the access log), with the same checks from :mod:`slipstream.security`.

A refusal aborts the RPC with UNAUTHENTICATED, PERMISSION_DENIED or RESOURCE_EXHAUSTED;
a rate limit's Retry-After, RateLimit-Policy and RateLimit travel as trailing metadata.
On ModelStreamInfer every message is checked (its model, the key's rate); a refused
message ends the stream with that status.

The caller's key name reaches the service methods as :data:`KEY_NAME` (a context
variable of the RPC's task, "" without keys): whose shared-memory regions it may use.

:class:`MessageGuard`, installed on every gRPC server whether or not keys are, answers a
request message that is not valid protobuf INVALID_ARGUMENT.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from slipstream.errors import SlipstreamError, TooManyRequests
from slipstream.security.access import GRPC_METHODS
from slipstream.security.gate import AccessRecord, Gate, request_id
from slipstream.security.keys import ApiKey
from slipstream.security.limits import Limiter
from slipstream.server.grpc_stream import Done, Partial

# The name of the API key of the RPC being served ("" without one). grpc.aio runs each
# RPC in a task of its own, and the tasks a handler starts inherit its context.
KEY_NAME: ContextVar[str] = ContextVar("slipstream_key_name", default="")
# The models the RPC's key may use (None: every model): what lists of models (the
# repository index, every model's statistics) show.
KEY_MODELS: ContextVar[frozenset[str] | None] = ContextVar("slipstream_key_models", default=None)
# On ModelStreamInfer: id() of a request message whose answer is an error -> its status
# code name. Each message's answer is one message on an OK stream, so the code is known
# only where it was answered (v2_grpc); the access log reads it here.
# Set by the front door's stream: a decoupled request's answers come marked (the
# grpc_stream.Partial ones are not its last; an empty grpc_stream.Done ends one that has
# nothing more to write), so each message's slot is kept until its last answer.
STREAM_MARKS: ContextVar[bool] = ContextVar("slipstream_stream_marks", default=False)
STREAM_ERRORS: ContextVar[dict[int, str] | None] = ContextVar("slipstream_stream_errors",
                                                             default=None)  # fmt: skip


@dataclass(slots=True)
class _Owed:
    """A stream message admitted and not yet answered."""

    request: Any
    key: ApiKey | None
    # Whether it holds one of the key's concurrency slots (given back with its answer).
    counted: bool
    started: float


class GrpcFrontDoor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Pass to ``build_grpc_server(interceptors=[...])``; see the module docstring."""

    def __init__(self, gate: Gate | None, limiter: Limiter | None, access_log: bool) -> None:
        self._gate = gate
        self._limiter = limiter
        self._access_log = access_log

    async def intercept_service(
        self,
        continuation: Callable[[Any], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method.rsplit("/", 1)[-1]
        need, model_field = GRPC_METHODS.get(method, ("admin", ""))
        metadata = dict(details.invocation_metadata or ())
        authorization = metadata.get("authorization")
        rid = request_id(metadata.get("x-request-id")) if self._access_log else ""

        async def check(request: Any) -> tuple[ApiKey | None, bool]:
            """Admit one request message: its key, and whether it holds a concurrency slot."""
            key = None
            if self._gate is not None:
                key = self._gate.authenticate(_as_bytes(authorization), need)
                if model_field:
                    self._gate.authorize_model(key, getattr(request, model_field))
            counted = False
            if key is not None and self._limiter is not None:
                counted = await self._limiter.admit(key, generative=False)
            return key, counted

        def release(key: ApiKey | None, counted: bool) -> None:
            if counted and key is not None and self._limiter is not None:
                self._limiter.release(key)

        def log(context: Any, request: Any, key: ApiKey | None, started: float,
                status: str, bytes_out: int = 0) -> None:  # fmt: skip
            if rid:
                model = getattr(request, model_field, "") if model_field else ""
                version = getattr(request, "model_version", "") or getattr(request, "version", "")
                latency_ms = (time.perf_counter() - started) * 1e3
                name = key.name if key else ""
                if not name and self._gate is not None:  # refused before it was known: 403
                    name = self._gate.key_name(_as_bytes(authorization))
                AccessRecord(rid, "grpc", method, details.method, name or "-",
                             model, version, status, latency_ms, request.ByteSize(),
                             bytes_out).emit()  # fmt: skip

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request: Any, context: Any) -> Any:
                started = time.perf_counter()
                key: ApiKey | None = None
                status = "OK"
                bytes_out = 0
                if rid:
                    context.set_trailing_metadata((("x-request-id", rid),))
                try:
                    try:
                        key, counted = await check(request)
                    except SlipstreamError as exc:
                        status = exc.grpc_code
                        await _abort(context, exc, rid)
                    if key is not None:
                        KEY_NAME.set(key.name)
                        KEY_MODELS.set(key.models)
                    try:
                        reply = await inner(request, context)
                    finally:
                        release(key, counted)
                    if rid:  # ModelInfer answers bytes serialised already
                        bytes_out = len(reply) if isinstance(reply, bytes) else reply.ByteSize()
                    return reply
                except BaseException:
                    code = context.code()
                    status = code.name if code is not None else status
                    if status == "OK":
                        status = "UNKNOWN"
                    raise
                finally:
                    log(context, request, key, started, status, bytes_out)

            return grpc.unary_unary_rpc_method_handler(
                unary,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:
            inner_stream = handler.stream_stream

            async def stream(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
                # Messages admitted, in arrival order: the stream answers in that order
                # (grpc_stream.in_request_order), one answer each, so the n-th answer is
                # the oldest one owed. Each keeps its concurrency slot until answered.
                owed: deque[_Owed] = deque()
                errors: dict[int, str] = {}

                async def checked() -> AsyncIterator[Any]:
                    async for request in requests:
                        started = time.perf_counter()
                        try:
                            key, counted = await check(request)
                        except SlipstreamError as exc:
                            log(context, request, None, started, exc.grpc_code)
                            await _abort(context, exc, rid)
                        owed.append(_Owed(request, key, counted, started))
                        yield request

                if rid:
                    context.set_trailing_metadata((("x-request-id", rid),))
                    STREAM_ERRORS.set(errors)
                if self._gate is not None:
                    # One key for the whole stream; each message is still checked above.
                    KEY_NAME.set(self._gate.key_name(_as_bytes(authorization)))
                STREAM_MARKS.set(True)
                try:
                    async for answer in inner_stream(checked(), context):
                        if isinstance(answer, Partial):  # its request is still owed more
                            yield answer.data
                            continue
                        if owed:
                            done = owed.popleft()
                            # Given back before the answer is written: a client that
                            # sends its next message on reading it finds the slot free.
                            release(done.key, done.counted)
                            status = errors.pop(id(done.request), "OK")
                            log(context, done.request, done.key, done.started, status,
                                len(answer))  # fmt: skip
                        if not isinstance(answer, Done):
                            yield answer
                finally:
                    while owed:  # the stream ended (a client that left) before these
                        done = owed.popleft()
                        release(done.key, done.counted)
                        log(context, done.request, done.key, done.started, "CANCELLED")

            return grpc.stream_stream_rpc_method_handler(
                stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


def _as_bytes(value: str | bytes | None) -> bytes | None:
    return value.encode() if isinstance(value, str) else value


async def _abort(context: Any, exc: SlipstreamError, rid: str) -> None:
    trailers: list[tuple[str, str]] = [("x-request-id", rid)] if rid else []
    if isinstance(exc, TooManyRequests):
        trailers += [("retry-after", str(exc.retry_after_s)), *exc.headers]
    await context.abort(grpc.StatusCode[exc.grpc_code], exc.message, tuple(trailers))


@dataclass(frozen=True, slots=True)
class _Malformed:
    """What a request message that failed to parse deserialises to (see MessageGuard)."""

    # The protobuf message type it should have been, e.g. "ModelInferRequest".
    expected: str


class MessageGuard(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Answer a request message that is not valid protobuf INVALID_ARGUMENT, naming the
    message type expected. grpc itself answers UNKNOWN ("Unexpected DecodeError") and
    logs a traceback at ERROR for each: a client's mistake as a server fault, and one
    client sending garbage could fill the log. Pass first to
    ``build_grpc_server(interceptors=[...])``, before :class:`GrpcFrontDoor`."""

    def __init__(self) -> None:
        # Each method's handler and its wrapping: the service's handlers are the same
        # objects on every call, so they are wrapped once, not on every ModelInfer.
        self._handlers: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[Any], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        cached = self._handlers.get(details.method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        guarded = _guarded(handler)  # GrpcFrontDoor, after this, makes one per call
        self._handlers[details.method] = (handler, guarded)
        return guarded


def _guarded(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """``handler`` with a deserialiser that never raises, and a refusal of what it marks."""
    parse = handler.request_deserializer
    expected = getattr(getattr(parse, "__self__", None), "__name__", "request message")

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError:
            return _Malformed(expected)

    if handler.unary_unary is not None:
        inner = handler.unary_unary

        async def unary(request: Any, context: Any) -> Any:
            if isinstance(request, _Malformed):
                await _refuse_malformed(context, request)
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary,
            request_deserializer=deserialize,
            response_serializer=handler.response_serializer,
        )
    if handler.stream_stream is not None:
        inner_stream = handler.stream_stream

        async def stream(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
            async def parsed() -> AsyncIterator[Any]:
                async for request in requests:
                    if isinstance(request, _Malformed):
                        await _refuse_malformed(context, request)
                    yield request

            async for answer in inner_stream(parsed(), context):
                yield answer

        return grpc.stream_stream_rpc_method_handler(
            stream,
            request_deserializer=deserialize,
            response_serializer=handler.response_serializer,
        )
    return handler  # unary-stream and stream-unary: none served


async def _refuse_malformed(context: Any, request: _Malformed) -> None:
    message = (
        f"the request message is not a valid protobuf {request.expected} (it could not be "
        "parsed); send the message the method takes (inference.GRPCInferenceService)"
    )
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
