"""The gRPC side of the front door: an interceptor doing what ``front_door.py`` does for
HTTP (API keys from the ``authorization`` metadata, per-key rate limits, request ids,
the access log), with the same checks from :mod:`slipstream.security`.

A refusal aborts the RPC with UNAUTHENTICATED, PERMISSION_DENIED or RESOURCE_EXHAUSTED;
a rate limit's Retry-After, RateLimit-Policy and RateLimit travel as trailing metadata.
On ModelStreamInfer every message is checked (its model, the key's rate); a refused
message ends the stream with that status.

The caller's key name reaches the service methods as :data:`KEY_NAME` (a context
variable of the RPC's task, "" without keys): whose shared-memory regions it may use.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextvars import ContextVar
from typing import Any

import grpc

from slipstream.errors import SlipstreamError, TooManyRequests
from slipstream.security.access import GRPC_METHODS
from slipstream.security.gate import AccessRecord, Gate, request_id
from slipstream.security.keys import ApiKey
from slipstream.security.limits import Limiter

# The name of the API key of the RPC being served ("" without one). grpc.aio runs each
# RPC in a task of its own, and the tasks a handler starts inherit its context.
KEY_NAME: ContextVar[str] = ContextVar("slipstream_key_name", default="")


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
                status: str) -> None:  # fmt: skip
            if rid:
                model = getattr(request, model_field, "") if model_field else ""
                version = getattr(request, "model_version", "") or getattr(request, "version", "")
                latency_ms = (time.perf_counter() - started) * 1e3
                name = key.name if key else ""
                if not name and self._gate is not None:  # refused before it was known: 403
                    name = self._gate.key_name(_as_bytes(authorization))
                AccessRecord(rid, "grpc", method, details.method, name or "-",
                             model, version, status, latency_ms, request.ByteSize(),
                             0).emit()  # fmt: skip

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request: Any, context: Any) -> Any:
                started = time.perf_counter()
                key: ApiKey | None = None
                status = "OK"
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
                    try:
                        return await inner(request, context)
                    finally:
                        release(key, counted)
                except BaseException:
                    code = context.code()
                    status = code.name if code is not None else status
                    if status == "OK":
                        status = "UNKNOWN"
                    raise
                finally:
                    log(context, request, key, started, status)

            return grpc.unary_unary_rpc_method_handler(
                unary,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:
            inner_stream = handler.stream_stream

            async def stream(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
                async def checked() -> AsyncIterator[Any]:
                    async for request in requests:
                        started = time.perf_counter()
                        try:
                            key, counted = await check(request)
                        except SlipstreamError as exc:
                            log(context, request, None, started, exc.grpc_code)
                            await _abort(context, exc, rid)
                        release(key, counted)
                        log(context, request, key, started, "OK")
                        yield request

                if rid:
                    context.set_trailing_metadata((("x-request-id", rid),))
                if self._gate is not None:
                    # One key for the whole stream; each message is still checked above.
                    KEY_NAME.set(self._gate.key_name(_as_bytes(authorization)))
                async for answer in inner_stream(checked(), context):
                    yield answer

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
