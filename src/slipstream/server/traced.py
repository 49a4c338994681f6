"""Where the front ends meet request tracing (:mod:`slipstream.observability.tracing`):
the incoming trace context taken from HTTP headers (:class:`TraceMiddleware`) and gRPC
metadata (:class:`TraceInterceptor`), a span per traced V2 inference
(:class:`TracedService`, around what the V2 routes call) with the model and compute
spans of the timestamps the serving core records for it (the engine's, brought back
with the answer, in the split layout: :mod:`slipstream.engine.traced`), and a span per
traced OpenAI route request (the middleware). All run in the process that answers the
client (a front end in the split layout), so each trace starts where the request came in.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import orjson

from slipstream.observability.timestamps import RECORDING, Recording, recorded
from slipstream.observability.tracing import INCOMING, Incoming, Tracing, incoming_headers
from slipstream.server.httpd import HttpRequest, HttpResponse, StreamingResponse
from slipstream.serving.forwarding import ForwardingService
from slipstream.serving.service import InferenceService, StreamItem
from slipstream.types import InferRequest, InferResponse

Reply = HttpResponse | StreamingResponse
Handler = Callable[[HttpRequest], Awaitable[Reply]]

# The OpenAI routes' operation, as OpenTelemetry's GenAI conventions name them.
_OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "chat",
}


class TracedService(ForwardingService):
    """``inner`` with a span ``InferRequest`` (Triton's name) around each traced V2
    inference, and under it Triton's model and compute spans with the request's
    timestamps (recorded by the serving core: :mod:`slipstream.observability.timestamps`);
    see the module docstring."""

    def __init__(self, inner: InferenceService, tracing: Tracing) -> None:
        super().__init__(inner)
        self._tracing = tracing

    async def infer(self, request: InferRequest) -> InferResponse:
        if not self._tracing.sampled(request.model_name):
            return await self._inner.infer(request)
        with self._tracing.span("InferRequest", _attributes(request)) as span:
            recording = Recording()
            token = RECORDING.set(recording)
            response = None
            try:
                response = await self._inner.infer(request)
            finally:
                RECORDING.reset(token)
                version = response.model_version if response is not None else ""
                self._tracing.add_timestamps(
                    span, recording.finish(), request.model_name, version, response is not None
                )
            span.set_attribute("triton.model_version", version)
            return response

    async def infer_stream(self, request: InferRequest) -> AsyncIterator[StreamItem]:
        if not self._tracing.sampled(request.model_name):
            async for item in super().infer_stream(request):
                yield item
            return
        with self._tracing.span("InferRequest", _attributes(request)) as span:
            recording = Recording()
            answers = 0
            version = ""
            ok = False
            items = recorded(self._inner.infer_stream(request), recording)
            try:
                async with contextlib.aclosing(items):
                    async for item in items:
                        if answers == 0:
                            span.add_event("FIRST_RESPONSE")
                        answers += 1
                        if item[0] is not None:
                            version = item[0].model_version
                        yield item
                ok = True
            finally:
                times = recording.finish()
                self._tracing.add_timestamps(span, times, request.model_name, version, ok)
            span.set_attribute("slipstream.responses", answers)


def _attributes(request: InferRequest) -> dict[str, Any]:
    incoming = INCOMING.get()
    attributes: dict[str, Any] = {
        "triton.model_name": request.model_name,
        "triton.model_version": request.model_version or "",
        "slipstream.protocol": incoming.protocol if incoming else "",
    }
    if request.id:
        attributes["slipstream.request_id"] = request.id
    return attributes


class TraceMiddleware:
    """The router's first layer: each request's trace context for the spans made while
    serving it, and a span around each traced OpenAI route request."""

    def __init__(self, tracing: Tracing) -> None:
        self._tracing = tracing

    async def __call__(self, request: HttpRequest, call_next: Handler) -> Reply:
        INCOMING.set(Incoming("http", incoming_headers(request.headers)))
        operation = _OPERATIONS.get(request.path)
        if operation is None or request.method != "POST":
            return await call_next(request)
        model = _model_of(request.body)
        if not self._tracing.sampled(model):
            return await call_next(request)
        attributes = {
            "http.request.method": "POST",
            "url.path": request.path,
            "gen_ai.operation.name": operation,
            "gen_ai.request.model": model,
        }
        span = self._tracing.start(f"POST {request.path}", attributes)
        try:
            reply = await call_next(request)
        except BaseException as exc:
            self._tracing.end(span, exc)
            raise
        span.set_attribute("http.response.status_code", reply.status)
        if isinstance(reply, StreamingResponse):
            reply.chunks = _ending(reply.chunks, span, self._tracing)
            return reply
        _usage(span, reply)
        self._tracing.end(span)
        return reply


async def _ending(
    chunks: AsyncIterator[bytes], span: Any, tracing: Tracing
) -> AsyncIterator[bytes]:
    """The stream's chunks, its span ended after the last (or when the client leaves);
    the first chunk's time is an event, the time to first token a client sees."""
    started = time.perf_counter()
    first = True
    try:
        async for chunk in chunks:
            if first:
                span.add_event("FIRST_CHUNK")
                span.set_attribute(
                    "slipstream.time_to_first_chunk_s", time.perf_counter() - started
                )
                first = False
            yield chunk
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()
        tracing.end(span)


def _model_of(body: bytes) -> str:
    try:
        model = orjson.loads(body).get("model")
    except (orjson.JSONDecodeError, AttributeError):
        return ""
    return model if isinstance(model, str) else ""


def _usage(span: Any, reply: HttpResponse) -> None:
    """A JSON answer's token usage as the GenAI conventions' attributes."""
    if reply.status != 200:
        return
    try:
        usage = orjson.loads(reply.body).get("usage") or {}
    except (orjson.JSONDecodeError, AttributeError, TypeError):
        return
    for ours, theirs in (("prompt_tokens", "input"), ("input_tokens", "input"),
                         ("completion_tokens", "output"), ("output_tokens", "output")):  # fmt: skip
        if isinstance(usage.get(ours), int):
            span.set_attribute(f"gen_ai.usage.{theirs}_tokens", usage[ours])


class TraceInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Each gRPC call's trace context (from its metadata) for the spans made while
    serving it."""

    async def intercept_service(
        self,
        continuation: Callable[[Any], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        INCOMING.set(Incoming("grpc", incoming_headers(details.invocation_metadata or ())))
        return await continuation(details)
