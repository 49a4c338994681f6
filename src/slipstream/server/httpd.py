"""A lean HTTP/1.1 server on asyncio and httptools (the parser uvicorn uses).

Why not uvicorn: for a small model, a generic ASGI server's per-request machinery (scope
and message dicts, a task per receive, two socket writes per response) cost as much as
the whole decode-batch-encode path. This server hands the handler one
:class:`HttpRequest` with the full body and writes each :class:`HttpResponse` in one
``write``. A client that disconnects cancels its in-flight handler directly, so queued
inference work is dropped without a watcher task per request.

Covered: keep-alive and HTTP/1.0, pipelined requests (answered in order), chunked
request bodies, ``Expect: 100-continue``, HEAD, a body size limit enforced from the
headers before the body is read, write back-pressure, an idle keep-alive timeout, and a
graceful shutdown that lets in-flight requests finish, and streamed responses
(:class:`StreamingResponse`, chunked) for server-sent events.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import cast

import httptools

from slipstream.errors import SlipstreamError

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class HttpRequest:
    method: str
    # The path without the query string, percent-decoding not applied.
    path: str
    # Lower-cased header names, as sent.
    headers: list[tuple[bytes, bytes]]
    body: bytes
    query: bytes = b""

    def header(self, name: bytes) -> bytes | None:
        """The first value of a (lower-case) header, or None."""
        for key, value in self.headers:
            if key == name:
                return value
        return None


@dataclass(slots=True)
class HttpResponse:
    status: int
    body: bytes = b""
    content_type: bytes = b"application/json"
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)


@dataclass(slots=True)
class StreamingResponse:
    """A response whose body is produced while it is sent (server-sent events).

    Written with chunked transfer encoding, one chunk per item, each flushed as it comes.
    If the client disconnects, the iterator is closed, so its ``finally`` blocks run at
    once (the LLM engine frees the sequence's KV-cache blocks there).
    """

    status: int
    chunks: AsyncIterator[bytes]
    content_type: bytes = b"text/event-stream"
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)


Handler = Callable[[HttpRequest], Awaitable[HttpResponse | StreamingResponse]]
ErrorBody = Callable[[str], bytes]

_STATUS_LINES = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in HTTPStatus}
# How many parsed requests one connection may have waiting before reading pauses.
_MAX_PIPELINED = 16


class HttpServer:
    """Serves ``handler`` on host:port; see the module docstring."""

    def __init__(
        self,
        handler: Handler,
        *,
        max_body_bytes: int,
        error_body: ErrorBody,
        keep_alive_timeout_s: float = 75.0,
    ) -> None:
        self._handler = handler
        self._max_body_bytes = max_body_bytes
        self._error_body = error_body
        self._keep_alive_timeout_s = keep_alive_timeout_s
        self._connections: set[_Connection] = set()
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.TimerHandle | None = None

    async def start(self, host: str, port: int) -> int:
        """Bind and listen; returns the bound port (for port 0). OSError if it cannot."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self), host, port, backlog=4096, reuse_address=True
        )
        self._sweep()
        return int(self._server.sockets[0].getsockname()[1])

    def _sweep(self) -> None:
        """Close keep-alive connections idle past the timeout.

        One timer for the whole server instead of one per request: re-arming a timer on
        every response showed up in profiles of small-model serving.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() - self._keep_alive_timeout_s
        for connection in list(self._connections):
            connection.close_if_idle_since(deadline)
        self._sweeper = loop.call_later(min(5.0, self._keep_alive_timeout_s), self._sweep)

    async def shutdown(self, timeout_s: float) -> None:
        """Stop accepting, let in-flight requests finish (bounded), close every connection."""
        if self._server is not None:
            self._server.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        for connection in list(self._connections):
            connection.close_when_idle()
        waiting = [c.finished for c in self._connections]
        if waiting:
            _, pending = await asyncio.wait(waiting, timeout=timeout_s)
            if pending:
                logger.warning("%d connections still busy after %.0f s", len(pending), timeout_s)
            for connection in list(self._connections):
                connection.abort()


class _Connection(asyncio.Protocol):
    """One client connection: parse requests, run the handler in order, write replies."""

    def __init__(self, server: HttpServer) -> None:
        self._server = server
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._body_size = 0
        self._requests: deque[tuple[HttpRequest, bool]] = deque()
        self._worker: asyncio.Task[None] | None = None
        self._closing = False
        self._writable = asyncio.Event()
        self._writable.set()
        # Loop time of the last response (or of the connection's start).
        self._last_active = self._loop.time()
        self.finished: asyncio.Future[None] = self._loop.create_future()

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = cast(asyncio.Transport, transport)
        self._server._connections.add(self)

    def data_received(self, data: bytes) -> None:
        self._last_active = self._loop.time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reply_and_close(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            self._reply_and_close(400, f"malformed HTTP request: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self._server._connections.discard(self)
        # The client is gone: cancel its in-flight request (queued inference is dropped).
        if self._worker is not None and not self._worker.done():
            self._worker.cancel()
        self._requests.clear()
        self._writable.set()
        if not self.finished.done():
            self.finished.set_result(None)

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    # -- httptools callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._body = []
        self._body_size = 0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        for name, value in self._headers:
            if name == b"content-length" and value.isdigit():
                if int(value) > self._server._max_body_bytes:
                    # Refused before a byte of the body is read into memory.
                    self._reply_and_close(413, self._too_large(int(value)))
                    return
            elif name == b"expect" and value.lower() == b"100-continue":
                assert self._transport is not None
                self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self._closing:
            return
        self._body_size += len(body)
        if self._body_size > self._server._max_body_bytes:
            self._reply_and_close(413, self._too_large(None))
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._closing:
            return
        parsed = httptools.parse_url(self._url)
        request = HttpRequest(
            method=self._parser.get_method().decode("ascii"),
            path=parsed.path.decode("latin-1"),
            headers=self._headers,
            body=b"".join(self._body) if len(self._body) != 1 else self._body[0],
            query=parsed.query or b"",
        )
        self._requests.append((request, self._parser.should_keep_alive()))
        if len(self._requests) >= _MAX_PIPELINED and self._transport is not None:
            self._transport.pause_reading()
        if self._worker is None or self._worker.done():
            self._worker = self._loop.create_task(self._serve_queued())

    # -- serving -----------------------------------------------------------------------

    async def _serve_queued(self) -> None:
        while self._requests and not self._closing:
            request, keep_alive = self._requests.popleft()
            try:
                response = await self._server._handler(request)
            except Exception:
                logger.exception("unhandled error on %s %s", request.method, request.path)
                response = HttpResponse(500, self._server._error_body("internal server error"))
            if isinstance(response, StreamingResponse):
                if not await self._write_stream(request, response, keep_alive):
                    return
            else:
                await self._write(request, response, keep_alive)
            if not keep_alive:
                self._close()
                return
            if self._transport is not None and len(self._requests) < _MAX_PIPELINED:
                self._transport.resume_reading()
        self._last_active = self._loop.time()

    async def _write(self, request: HttpRequest, response: HttpResponse, keep_alive: bool) -> None:
        if self._transport is None or self._closing:
            return
        if not self._writable.is_set():
            await self._writable.wait()
        parts = _head(response.status, response.content_type, response.headers, keep_alive)
        parts[-1:-1] = (b"content-length: ", str(len(response.body)).encode(), b"\r\n")
        if request.method != "HEAD":
            parts.append(response.body)
        self._transport.write(b"".join(parts))

    async def _write_stream(
        self, request: HttpRequest, response: StreamingResponse, keep_alive: bool
    ) -> bool:
        """Send a streamed body; False when the connection went away part-way."""
        chunks = response.chunks
        try:
            if self._transport is None or self._closing:
                return False
            parts = _head(response.status, response.content_type, response.headers, keep_alive)
            parts[-1:-1] = (b"cache-control: no-cache\r\n", b"transfer-encoding: chunked\r\n")
            self._transport.write(b"".join(parts))
            if request.method == "HEAD":
                return True
            async for chunk in chunks:
                if not chunk:
                    continue
                if not self._writable.is_set():
                    await self._writable.wait()
                if self._transport is None or self._closing:
                    return False
                self._transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
            if self._transport is None or self._closing:
                return False
            self._transport.write(b"0\r\n\r\n")
            return True
        except Exception:
            # Headers are out: the only honest signal left is to cut the connection.
            logger.exception("stream for %s %s failed part-way", request.method, request.path)
            self._close()
            return False
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()

    # -- closing -------------------------------------------------------------------------

    def _too_large(self, size: int | None) -> str:
        limit = self._server._max_body_bytes
        what = f"request body of {size} bytes" if size is not None else "request body"
        return f"{what} exceeds the limit of {limit} bytes (--max-request-bytes)"

    def _reply_and_close(self, status: int, message: str) -> None:
        if self._transport is None or self._closing:
            return
        body = self._server._error_body(message)
        self._transport.write(
            _STATUS_LINES[status] + b"content-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body
        )  # fmt: skip
        self._close()

    def _close(self) -> None:
        self._closing = True
        if self._transport is not None:
            self._transport.close()

    def close_when_idle(self) -> None:
        """Shutdown: close now if nothing is in flight, else after the current reply."""
        if self._worker is None or self._worker.done():
            self._close()
        else:
            self._requests.clear()
            self._worker.add_done_callback(lambda _: self._close())

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def close_if_idle_since(self, deadline: float) -> None:
        idle = (self._worker is None or self._worker.done()) and not self._requests
        if idle and self._last_active < deadline:
            self._close()


def _head(
    status: int, content_type: bytes, headers: list[tuple[bytes, bytes]], keep_alive: bool
) -> list[bytes]:
    """Status line and headers, ending with the blank line (the last item)."""
    line = _STATUS_LINES.get(status) or f"HTTP/1.1 {status} Unknown\r\n".encode()
    parts = [line, b"content-type: ", content_type, b"\r\n"]
    for name, value in headers:
        parts += (name, b": ", value, b"\r\n")
    if not keep_alive:
        parts.append(b"connection: close\r\n")
    parts.append(b"\r\n")
    return parts


def error_reply(exc: SlipstreamError, body: bytes) -> HttpResponse:
    """``exc``'s status with ``body``, and Retry-After when the error carries one."""
    headers = []
    retry_after = getattr(exc, "retry_after_s", None)
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    return HttpResponse(exc.http_status, body, headers=headers)
