"""One HTTP/1.1 client connection of :class:`~slipstream.server.httpd.HttpServer`: it
parses requests with httptools, runs the handler on them in order, writes the replies,
and enforces the per-connection limits (header size and count, the timeouts the server's
sweeper checks, write back-pressure). The server owns what spans connections: listening,
admission, the sweeper, the discard budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from typing import Protocol, cast

import httptools

from slipstream.observability.metrics import TransportMetrics
from slipstream.server.http_messages import (
    STATUS_LINES,
    BodyRefused,
    ErrorBody,
    Handler,
    HttpLimits,
    HttpRequest,
    HttpResponse,
    StreamingResponse,
    decode_body,
    response_head,
)

logger = logging.getLogger(__name__)

# How many parsed requests one connection may have waiting before reading pauses.
_MAX_PIPELINED = 16
# Bytes of a request line besides its URL ("DELETE " and " HTTP/1.1\r\n", with slack):
# a head refused with no header parsed and no more than this beside its URL gets 414.
_REQUEST_LINE_OVERHEAD = 32
# After an error reply, how long a connection's input is read and discarded before closing.
_LINGER_S = 2.0
# Where the parser is in a connection's current request.
_IDLE, _HEAD, _BODY = 0, 1, 2


class ConnectionOwner(Protocol):
    """What a connection needs of its server (``httpd.HttpServer``)."""

    handler: Handler
    error_body: ErrorBody
    limits: HttpLimits
    metrics: TransportMetrics

    def admit(self, connection: Connection) -> bool: ...
    def forget(self, connection: Connection) -> None: ...
    def mark_idle(self, connection: Connection) -> None: ...
    def mark_busy(self, connection: Connection) -> None: ...
    def may_discard(self, size: int) -> bool: ...


class Connection(asyncio.Protocol):
    """One client connection: parse requests, run the handler in order, write replies.

    Slotted, and its futures made only when something waits on them: thousands of open
    connections (idle keep-alive, slowloris) cost little memory and give the garbage
    collector little to walk."""

    __slots__ = (
        "_begun", "_body", "_body_size", "_body_started_at", "_closing", "_completed",
        "_final_reply", "_finished", "_head_bytes", "_head_started_at", "_headers",
        "_input_closed", "_known_head_bytes", "_last_active", "_last_read_at", "_limits",
        "_loop", "_lost", "_parser", "_phase", "_reading_paused", "_received_any",
        "_requests", "_server", "_transport", "_url", "_worker", "_writable",
        "_write_paused_at",
    )  # fmt: skip

    def __init__(self, server: ConnectionOwner) -> None:
        self._server = server
        self._limits = server.limits
        self._loop = asyncio.get_running_loop()
        # None once the connection is gone: the parser holds the partial header it has
        # buffered, and it and this protocol refer to each other (a cycle the garbage
        # collector would free only later).
        self._parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        # Bytes of the current head the callbacks have seen (URL, complete headers).
        self._known_head_bytes = 0
        self._body: list[bytes] = []
        self._body_size = 0
        # Pipelined requests waiting for their turn (at most _MAX_PIPELINED).
        self._requests: list[tuple[HttpRequest, bool]] = []
        self._worker: asyncio.Task[None] | None = None
        self._closing = False
        # No more requests are parsed (an error reply is due, or the connection closes).
        self._input_closed = False
        # The error reply that ends the connection once the requests before it are answered.
        self._final_reply: bytes | None = None
        # Set while the transport's buffer is full (pause_writing): the writer waits on it.
        self._writable: asyncio.Future[None] | None = None
        now = self._loop.time()
        # Loop time of the last response (or of the connection's start).
        self._last_active = now
        # _IDLE, _HEAD or _BODY; with the head's start and size so far, and the last read.
        self._phase = _IDLE
        self._head_started_at = now  # a new connection owes a head from its start
        self._head_bytes = 0
        self._last_read_at = now
        self._body_started_at = now  # when the current request's headers completed
        # Loop time the transport asked to stop writing (its buffer is full); None: it
        # takes writes. A client that reads nothing keeps it set: --send-timeout-s.
        self._write_paused_at: float | None = None
        self._received_any = False
        self._reading_paused = False
        # Messages begun and completed so far: data_received compares them around a feed.
        self._begun = 0
        self._completed = 0
        self._lost = False
        self._finished: asyncio.Future[None] | None = None  # made by finished()

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = cast(asyncio.Transport, transport)
        if not self._server.admit(self):
            limit = self._limits.max_connections
            self._reply_and_close(
                503, f"the server has {limit} open connections (--max-connections); retry"
            )

    def data_received(self, data: bytes) -> None:
        if self._input_closed:
            # After an error reply: discarded (see _send_final), within the budget.
            if not self._server.may_discard(len(data)):
                self._server.metrics.count_close("discard_budget")
                self._reset()
            return
        now = self._loop.time()
        self._last_read_at = now
        self._received_any = True
        if self._phase == _IDLE:
            self._phase, self._head_started_at, self._head_bytes = _HEAD, now, 0
            self._server.mark_busy(self)
        try:
            self._feed(memoryview(data))
        except httptools.HttpParserUpgrade:
            self._reply_and_close(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            self._reply_and_close(400, f"malformed HTTP request: {exc}")
        if self._input_closed:
            self._release()

    def _feed(self, view: memoryview) -> None:
        """Feed the parser at most the head's remaining room at a time.

        httptools buffers a header's name and value until its line ends, so a head is
        measured here, on the bytes fed while it is incomplete, and refused as soon as
        it reaches the limit: an unterminated 8 MB header costs at most about twice the
        limit. Pieces past the end of a head (bodies, pipelined requests) are no larger
        than the limit, so a new head begun inside one is bounded the same way.
        """
        limit = self._limits.max_header_bytes
        while view and not self._input_closed and self._parser is not None:
            size = limit - self._head_bytes if self._phase == _HEAD else limit
            piece, view = view[:size], view[size:]
            begun, completed = self._begun, self._completed
            self._parser.feed_data(piece)
            if self._phase != _HEAD or self._input_closed:
                continue
            if self._begun == begun:  # the whole piece is more of this head
                self._head_bytes += len(piece)
            elif self._completed == completed:  # the piece started this head
                self._head_bytes = len(piece)
            else:  # begun after another request in the piece: what the callbacks saw
                self._head_bytes = self._known_head_bytes
            if self._head_bytes >= limit:
                self._refuse_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = self._input_closed = True
        self._server.forget(self)
        # The client is gone: cancel its in-flight request (queued inference is dropped).
        if self._worker is not None and not self._worker.done():
            self._worker.cancel()
        self._requests.clear()
        self._release()
        self._lost = True
        self._wake_writer()
        if self._finished is not None and not self._finished.done():
            self._finished.set_result(None)

    def finished(self) -> asyncio.Future[None]:
        """Done once the connection is gone."""
        if self._finished is None:
            self._finished = self._loop.create_future()
            if self._lost:
                self._finished.set_result(None)
        return self._finished

    def _release(self) -> None:
        """Drop the parser (with the partial header it buffers) and request buffers."""
        self._parser = None
        self._url, self._headers, self._body = b"", [], []

    def pause_writing(self) -> None:
        if self._writable is None:
            self._writable = self._loop.create_future()
        self._write_paused_at = self._loop.time()

    def resume_writing(self) -> None:
        self._wake_writer()
        self._write_paused_at = None

    def _wake_writer(self) -> None:
        writable, self._writable = self._writable, None
        if writable is not None and not writable.done():
            writable.set_result(None)

    async def _until_writable(self) -> None:
        if self._writable is not None:
            await asyncio.shield(self._writable)

    # -- httptools callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._phase != _HEAD:  # pipelined behind the previous request
            self._phase, self._head_started_at = _HEAD, self._loop.time()
        self._begun += 1
        self._url = b""
        self._headers = []
        self._known_head_bytes = 0
        self._body = []
        self._body_size = 0

    def on_url(self, url: bytes) -> None:
        if self._input_closed:
            return
        self._url += url
        self._known_head_bytes += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._input_closed:
            return
        self._headers.append((name.lower(), value))
        self._known_head_bytes += len(name) + len(value) + 4  # ": " and CRLF
        if len(self._headers) > self._limits.max_header_count:
            self._server.metrics.count_close("too_many_headers")
            limit = self._limits.max_header_count
            self._reply_and_close(431, f"more than {limit} header lines (--max-header-count)")

    def on_headers_complete(self) -> None:
        self._phase, self._head_bytes = _BODY, 0
        self._last_read_at = self._body_started_at = self._loop.time()
        if self._input_closed:
            return
        for name, value in self._headers:
            if name == b"content-length" and value.isdigit():
                if int(value) > self._limits.max_body_bytes:
                    # Refused before a byte of the body is read into memory.
                    self._reply_and_close(413, self._too_large(int(value)))
                    return
            elif name == b"expect" and value.lower() == b"100-continue":
                assert self._transport is not None
                self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self._input_closed:
            return
        self._body_size += len(body)
        if self._body_size > self._limits.max_body_bytes:
            self._reply_and_close(413, self._too_large(None))
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._phase = _IDLE
        self._completed += 1
        if self._input_closed or self._parser is None:
            return
        parsed = httptools.parse_url(self._url)
        body = b"".join(self._body) if len(self._body) != 1 else self._body[0]
        try:
            body = decode_body(self._headers, body, self._limits.max_body_bytes)
        except BodyRefused as refused:
            self._reply_and_close(refused.status, refused.message)
            return
        request = HttpRequest(
            method=self._parser.get_method().decode("ascii"),
            path=parsed.path.decode("latin-1"),
            headers=self._headers,
            body=body,
            query=parsed.query or b"",
        )
        self._requests.append((request, self._parser.should_keep_alive()))
        if len(self._requests) >= _MAX_PIPELINED and self._transport is not None:
            self._transport.pause_reading()
            self._reading_paused = True
        if self._worker is None or self._worker.done():
            self._worker = self._loop.create_task(self._serve_queued())

    # -- serving -----------------------------------------------------------------------

    async def _serve_queued(self) -> None:
        while self._requests and not self._closing:
            request, keep_alive = self._requests.pop(0)
            try:
                response = await self._server.handler(request)
            except Exception:
                logger.exception("unhandled error on %s %s", request.method, request.path)
                response = HttpResponse(500, self._server.error_body("internal server error"))
            if isinstance(response, StreamingResponse):
                if not await self._write_stream(request, response, keep_alive):
                    return
            else:
                await self._write(request, response, keep_alive)
            if not keep_alive:
                self._close()
                return
            if self._reading_paused and len(self._requests) < _MAX_PIPELINED:
                self._resume_reading()
        self._last_active = self._loop.time()
        if self._final_reply is not None and not self._closing:
            self._send_final(self._final_reply)
        elif self._phase == _IDLE and not self._input_closed:
            self._server.mark_idle(self)

    def _resume_reading(self) -> None:
        # The timeouts measure the client, not the pause: their clocks restart.
        self._reading_paused = False
        now = self._loop.time()
        self._head_started_at = self._last_read_at = self._body_started_at = now
        if self._transport is not None:
            self._transport.resume_reading()

    async def _write(self, request: HttpRequest, response: HttpResponse, keep_alive: bool) -> None:
        if self._transport is None or self._closing:
            return
        await self._until_writable()
        parts = response_head(response.status, response.content_type, response.headers, keep_alive)
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
            parts = response_head(
                response.status, response.content_type, response.headers, keep_alive
            )
            parts[-1:-1] = (b"cache-control: no-cache\r\n", b"transfer-encoding: chunked\r\n")
            self._transport.write(b"".join(parts))
            if request.method == "HEAD":
                return True
            async for chunk in chunks:
                if not chunk:
                    continue
                await self._until_writable()
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
        limit = self._limits.max_body_bytes
        what = f"request body of {size} bytes" if size is not None else "request body"
        return f"{what} exceeds the limit of {limit} bytes (--max-request-bytes)"

    def _reply_and_close(self, status: int, message: str) -> None:
        """Stop reading requests; answer ``status`` after the ones before, then close."""
        if self._transport is None or self._input_closed:
            return
        self._input_closed = True
        body = self._server.error_body(message)
        reply = (
            STATUS_LINES[status] + b"content-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body
        )  # fmt: skip
        if self._requests or self._serving():
            self._final_reply = reply  # pipelined requests before it are answered first
        else:
            self._send_final(reply)

    def _send_final(self, reply: bytes) -> None:
        assert self._transport is not None
        self._transport.write(reply)
        self._closing = True
        if self._reading_paused:
            self._transport.resume_reading()  # to drain what the client still sends
        if not self._transport.can_write_eof():
            self._transport.close()
            return
        # A lingering close: closing a socket with unread input makes the kernel send a
        # reset, which can destroy the reply before the client reads it. So stop writing,
        # discard input for a bounded time, then close (an error path: one timer each).
        self._transport.write_eof()
        self._loop.call_later(_LINGER_S, self._transport.close)

    def _close(self) -> None:
        self._closing = self._input_closed = True
        if self._transport is not None:
            self._transport.close()

    def _serving(self) -> bool:
        return self._worker is not None and not self._worker.done()

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

    def _reset(self) -> None:
        """Abort with a TCP reset (as nginx's reset_timedout_connection): the kernel drops
        what it still buffers for the client at once instead of trickling it out."""
        if self._transport is None:
            return
        sock = self._transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self._transport.abort()

    def close_for_limit(self) -> None:
        """Close an idle connection to make room for a new one (--max-connections)."""
        self._close()

    def _body_too_slow(self, now: float) -> bool:
        """A body must arrive at min_body_rate_bytes_s on average once it has had
        body_timeout_s of grace: by T seconds, (T - grace) x rate bytes. A byte every 20 s
        keeps clear of the stall timeout, never of this."""
        rate, grace = self._limits.min_body_rate_bytes_s, self._limits.body_timeout_s
        elapsed = now - self._body_started_at
        return rate > 0 and elapsed > grace and self._body_size < (elapsed - grace) * rate

    def _refuse_head(self) -> None:
        limit = self._limits.max_header_bytes
        if not self._headers and self._head_bytes - len(self._url) <= _REQUEST_LINE_OVERHEAD:
            self._server.metrics.count_close("uri_too_long")
            self._reply_and_close(414, f"request URL exceeds {limit} bytes (--max-header-bytes)")
        else:
            self._server.metrics.count_close("header_too_large")
            self._reply_and_close(
                431, f"request line and headers exceed {limit} bytes (--max-header-bytes)"
            )

    def enforce_timeouts(self, now: float) -> None:
        """The sweeper's visit: close this connection if a timeout has passed."""
        limits, metrics = self._limits, self._server.metrics
        paused_at = self._write_paused_at
        if paused_at is not None and now - paused_at > limits.send_timeout_s:
            # The client reads nothing: no reply can reach it, so drop the connection
            # (its pending responses, pipelined requests, a stream's generation) at once.
            metrics.count_close("send_timeout")
            self._write_paused_at = None
            self._closing = self._input_closed = True
            self._reset()
            return
        if self._input_closed or self._reading_paused:
            return  # while reading is paused, the server is the slow side
        if self._phase == _HEAD and now - self._head_started_at > limits.header_timeout_s:
            metrics.count_close("header_timeout")
            message = f"request headers not received within {limits.header_timeout_s:g} s"
            self._reply_and_close(408, message + " (--header-timeout-s)")
        elif self._phase == _BODY and now - self._last_read_at > limits.body_timeout_s:
            metrics.count_close("body_timeout")
            message = f"request body stalled for {limits.body_timeout_s:g} s"
            self._reply_and_close(408, message + " (--body-timeout-s)")
        elif self._phase == _BODY and self._body_too_slow(now):
            metrics.count_close("body_too_slow")
            elapsed = now - self._body_started_at
            self._reply_and_close(
                408,
                f"request body arrived at {self._body_size / elapsed:.0f} bytes/s over "
                f"{elapsed:.0f} s, below {limits.min_body_rate_bytes_s:g} "
                "(--min-body-rate-bytes-s)",
            )
        elif self._phase != _IDLE or self._requests or self._serving():
            return
        elif not self._received_any:
            # Connected and never sent a byte: no request to answer, so just close.
            if now - self._head_started_at > limits.header_timeout_s:
                metrics.count_close("header_timeout")
                self._close()
        elif now - self._last_active > limits.keep_alive_timeout_s:
            metrics.count_close("keep_alive_timeout")
            self._close()
