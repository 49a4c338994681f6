"""The V2 REST front end: a plain ASGI application.

It is written against ASGI directly rather than a web framework because the inference
route is the hot path: a framework's routing, request objects and middleware stack cost
more per request than the whole decode-batch-encode path of a small model.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from slipstream.errors import InvalidRequest, ModelNotFound, PayloadTooLarge, SlipstreamError
from slipstream.observability.metrics import ServerMetrics
from slipstream.protocol import v2, v2_meta
from slipstream.serving.service import InferenceService

logger = logging.getLogger(__name__)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_JSON = [(b"content-type", b"application/json")]
_BINARY = b"application/octet-stream"
_HEADER_LENGTH = b"inference-header-content-length"


class _Reply:
    """A finished response: status, body and extra headers."""

    __slots__ = ("body", "headers", "status")

    def __init__(
        self, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
    ) -> None:
        self.status = status
        self.body = body
        self.headers = headers if headers is not None else _JSON


def _json(value: Any, status: int = 200) -> _Reply:
    return _Reply(status, orjson.dumps(value))


_OK_EMPTY = _Reply(200, b"")


class HttpApp:
    """ASGI app serving the V2 REST API, Triton's extensions and /metrics."""

    def __init__(
        self, service: InferenceService, metrics: ServerMetrics, max_request_bytes: int
    ) -> None:
        self._service = service
        self._metrics = metrics
        self._max_request_bytes = max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        try:
            reply = await self._dispatch(scope, receive)
        except SlipstreamError as exc:
            reply = _error_reply(exc)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("unhandled error on %s %s", scope["method"], scope["path"])
            reply = _Reply(500, v2.encode_error("internal server error; see the server log"))
        await send(
            {
                "type": "http.response.start",
                "status": reply.status,
                "headers": [*reply.headers, (b"content-length", str(len(reply.body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": reply.body})

    async def _dispatch(self, scope: Scope, receive: Receive) -> _Reply:
        method: str = scope["method"]
        parts = scope["path"].strip("/").split("/")
        if parts[0] == "v2":
            if len(parts) >= 3 and parts[1] == "models" and parts[2] != "stats":
                return await self._model_route(method, parts[2:], scope, receive)
            return await self._server_route(method, parts[1:], receive)
        if parts == ["metrics"] and method == "GET":
            body = generate_latest(self._metrics.registry)
            return _Reply(200, body, [(b"content-type", CONTENT_TYPE_LATEST.encode())])
        raise ModelNotFound(f"no route for {method} {scope['path']}")

    async def _server_route(self, method: str, parts: list[str], receive: Receive) -> _Reply:
        service = self._service
        route = "/".join(parts)
        if method == "GET":
            if route == "":
                return _json(v2_meta.server_metadata_json(service.server_metadata()))
            if route == "health/live":
                return _OK_EMPTY if service.is_live() else _Reply(503, b"")
            if route == "health/ready":
                return _OK_EMPTY if service.is_ready() else _Reply(503, b"")
            if route == "models/stats":
                return _json(v2_meta.model_stats_json(service.model_statistics()))
        if method == "POST" and parts[:1] == ["repository"]:
            body = await self._read_body(receive, None)
            return await self._repository_route(parts[1:], body)
        raise ModelNotFound(f"no route for {method} /v2/{route}")

    async def _repository_route(self, parts: list[str], body: bytes) -> _Reply:
        service = self._service
        options = _json_object(body) if body.strip() else {}
        if parts == ["index"]:
            ready_only = bool(options.get("ready", False))
            return _json(v2_meta.repository_index_json(service.repository_index(ready_only)))
        if len(parts) == 3 and parts[0] == "models" and parts[2] in ("load", "unload"):
            if parts[2] == "load":
                if options.get("parameters", {}).get("config"):
                    raise InvalidRequest(
                        "parameters.config: loading with an inline config is not supported; "
                        "write REPO/<model>/config.yaml and load again"
                    )
                await service.load_model(parts[1])
            else:
                await service.unload_model(parts[1])
            return _OK_EMPTY
        raise ModelNotFound(f"no route for POST /v2/repository/{'/'.join(parts)}")

    async def _model_route(
        self, method: str, parts: list[str], scope: Scope, receive: Receive
    ) -> _Reply:
        # parts: <model> [versions <v>] [ready|infer|config|stats]
        name, version, rest = parts[0], "", parts[1:]
        if len(rest) >= 2 and rest[0] == "versions":
            version, rest = rest[1], rest[2:]
        action = rest[0] if len(rest) == 1 else ("" if not rest else "?")
        service = self._service
        if method == "POST" and action == "infer":
            return await self._infer(name, version, scope, receive)
        if method == "GET":
            if action == "":
                return _json(v2_meta.model_metadata_json(service.model_metadata(name, version)))
            if action == "ready":
                return _OK_EMPTY if service.model_ready(name, version) else _Reply(400, b"")
            if action == "config":
                return _json(v2_meta.model_config_json(service.model_config(name, version)))
            if action == "stats":
                stats = service.model_statistics(name, version)
                return _json(v2_meta.model_stats_json(stats))
        raise ModelNotFound(f"no route for {method} {scope['path']}")

    async def _infer(self, name: str, version: str, scope: Scope, receive: Receive) -> _Reply:
        header_length = None
        content_length = None
        for key, value in scope["headers"]:
            if key == _HEADER_LENGTH:
                header_length = _int_header(value, "Inference-Header-Content-Length")
            elif key == b"content-length":
                content_length = _int_header(value, "Content-Length")
        body = await self._read_body(receive, content_length)
        request = v2.decode_infer_request(body, header_length, name, version)
        response = await _cancel_on_disconnect(self._service.infer(request), receive)
        payload, json_length = v2.encode_infer_response(response, request)
        if json_length is None:
            return _Reply(200, payload)
        headers = [
            (b"content-type", _BINARY),
            (_HEADER_LENGTH, str(json_length).encode()),
        ]
        return _Reply(200, payload, headers)

    async def _read_body(self, receive: Receive, content_length: int | None) -> bytes:
        limit = self._max_request_bytes
        if content_length is not None and content_length > limit:
            # Refused before a byte of the body is read into memory.
            raise PayloadTooLarge(
                f"request body of {content_length} bytes exceeds the limit of {limit} bytes "
                "(--max-request-bytes)"
            )
        message = await receive()
        body: bytes = message.get("body", b"")
        if not message.get("more_body"):
            return body
        chunks = [body]
        size = len(body)
        while message.get("more_body"):
            message = await receive()
            if message["type"] == "http.disconnect":
                raise asyncio.CancelledError
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(
                    f"request body exceeds the limit of {limit} bytes (--max-request-bytes)"
                )
            chunks.append(chunk)
        return b"".join(chunks)


async def _cancel_on_disconnect(work: Awaitable[Any], receive: Receive) -> Any:
    """Await ``work``; if the client disconnects first, cancel it (dropping queued work)."""
    task = asyncio.current_task()
    assert task is not None
    watcher = asyncio.ensure_future(receive())

    def on_message(done: asyncio.Future[Message]) -> None:
        if not done.cancelled() and done.result().get("type") == "http.disconnect":
            task.cancel()

    watcher.add_done_callback(on_message)
    try:
        return await work
    finally:
        watcher.remove_done_callback(on_message)
        watcher.cancel()


def _error_reply(exc: SlipstreamError) -> _Reply:
    headers = list(_JSON)
    retry_after = getattr(exc, "retry_after_s", None)
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    return _Reply(exc.http_status, v2.encode_error(exc.message), headers)


def _int_header(value: bytes, name: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise InvalidRequest(f"header {name}: {value!r} is not an integer") from None
    if number < 0:
        raise InvalidRequest(f"header {name}: must be >= 0, got {number}")
    return number


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidRequest("request body must be a JSON object")
    return value
