"""One HTTP/1.1 client connection of :class:`~slipstream.server.httpd.HttpServer`: it
parses requests with httptools, runs the handler on them in order, writes the replies,
and enforces the per-connection limits (header size and count, the timeouts the server's
sweeper checks, write back-pressure) and its part of a shutdown (drain, expire). The server
owns what spans connections: listening, admission, the sweeper, the discard budget, and
when a shutdown drains and expires.
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
    BodyRefused,
    ErrorBody,
    Handler,
    HttpLimits,
    HttpRequest,
    HttpResponse,
    StreamingResponse,
    closing_reply,
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
# The answer, during a shutdown, to a request the server will not run: one begun after the
# drain started, or still running (or queued) when --shutdown-timeout-s ran out.
_SHUTTING_DOWN = "the server is shutting down; retry the request (on a new connection)"
_RETRY_AFTER_S = b"1"
_RETRY_AFTER = b"retry-after: " + _RETRY_AFTER_S + b"\r\n"


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
        "_drain_admits", "_expired", "_final_reply", "_finished", "_head_bytes",
        "_head_started_at", "_headers", "_input_closed", "_known_head_bytes",
        "_last_active", "_last_read_at", "_limits", "_loop", "_lost", "_parser", "_phase",
        "_reading_paused", "_received_any", "_requests", "_server", "_streaming",
        "_transport", "_url", "_worker", "_writable", "_write_paused_at",
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
        # Shutdown (see drain): None while serving normally; once draining, how many
        # requests had begun when it started. Those are in flight and answered; one
        # begun later is refused 503.
        self._drain_admits: int | None = None
        # --shutdown-timeout-s ran out: what is left is answered 503, not run (see expire).
        self._expired = False
        # A streamed body is being sent: its head is out, so it can only be cut short.
        self._streaming = False

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
        if self._drain_admits is not None and self._begun > self._drain_admits:
            # Begun after the drain started (a client pipelining): a new request, refused.
            self._reply_and_close(503, _SHUTTING_DOWN, _RETRY_AFTER)
            return
        for name, value in self._headers:
            if name == b"content-length" and value.isdigit():
                if int(value) > self._limits.max_body_bytes:
                    # Refused before a byte of the body is read into memory.
                    self._refuse_body(f"request body of {int(value)} bytes exceeds")
                    return
            elif name == b"expect" and value.lower() == b"100-continue":
                assert self._transport is not None
                self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self._input_closed:
            return
        self._body_size += len(body)
        if self._body_size > self._limits.max_body_bytes:
            self._refuse_body("request body exceeds")
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
            if refused.status == 413:  # too large once decoded: the same limit
                self._server.metrics.count_close("body_too_large")
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
            response = await self._respond(request)
            if isinstance(response, StreamingResponse):
                stays_open = await self._write_stream(request, response, keep_alive)
            else:
                stays_open = await self._write(request, response, keep_alive)
            if not stays_open:
                self._close()
                return
            if self._reading_paused and len(self._requests) < _MAX_PIPELINED:
                self._resume_reading()
        self._last_active = self._loop.time()
        if self._final_reply is not None and not self._closing:
            self._send_final(self._final_reply)
        elif self._phase != _IDLE or self._input_closed:
            return
        elif self._drain_admits is not None:
            # Drained (a stream whose head went out before the drain began ends here).
            self._close()
        else:
            self._server.mark_idle(self)

    async def _respond(self, request: HttpRequest) -> HttpResponse | StreamingResponse:
        """The handler's response; 503 once the shutdown timeout has run out (see expire),
        whose cancellation of the handler is turned into that answer."""
        if self._expired:
            return self._shutdown_response()
        try:
            return await self._server.handler(request)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not self._expired or self._lost or task is None:
                raise  # the client went away, or the task is cancelled from outside
            task.uncancel()
            return self._shutdown_response()
        except Exception:
            logger.exception("unhandled error on %s %s", request.method, request.path)
            return HttpResponse(500, self._server.error_body("internal server error"))

    def _shutdown_response(self) -> HttpResponse:
        body = self._server.error_body(_SHUTTING_DOWN)
        return HttpResponse(503, body, headers=[(b"retry-after", _RETRY_AFTER_S)])

    def _keeps_alive(self, keep_alive: bool) -> bool:
        """Whether the response about to be written leaves the connection open. Draining,
        only while more is to be answered (requests queued or being received, a refusal
        due): the last response says ``connection: close``, so no client sends another
        request on a connection the server is about to close."""
        if not keep_alive or self._drain_admits is None:
            return keep_alive
        return bool(self._requests) or self._final_reply is not None or self._phase != _IDLE

    def _resume_reading(self) -> None:
        # The timeouts measure the client, not the pause: their clocks restart.
        self._reading_paused = False
        now = self._loop.time()
        self._head_started_at = self._last_read_at = self._body_started_at = now
        if self._transport is not None:
            self._transport.resume_reading()

    async def _write(self, request: HttpRequest, response: HttpResponse, keep_alive: bool) -> bool:
        """Send a response; False when the connection is to close (or has) after it."""
        if self._transport is None or self._closing:
            return False
        await self._until_writable()
        if self._transport is None or self._closing:
            return False
        # Decided at the last moment: a drain may have begun while the handler ran.
        keep_alive = self._keeps_alive(keep_alive)
        parts = response_head(response.status, response.content_type, response.headers, keep_alive)
        parts[-1:-1] = (b"content-length: ", str(len(response.body)).encode(), b"\r\n")
        if request.method != "HEAD":
            parts.append(response.body)
        self._transport.write(b"".join(parts))
        return keep_alive

    async def _write_stream(
        self, request: HttpRequest, response: StreamingResponse, keep_alive: bool
    ) -> bool:
        """Send a streamed body; False when the connection is to close (or went away)."""
        chunks = response.chunks
        try:
            if self._transport is None or self._closing:
                return False
            keep_alive = self._keeps_alive(keep_alive)
            parts = response_head(
                response.status, response.content_type, response.headers, keep_alive
            )
            parts[-1:-1] = (b"cache-control: no-cache\r\n", b"transfer-encoding: chunked\r\n")
            self._transport.write(b"".join(parts))
            if request.method == "HEAD":
                return keep_alive
            self._streaming = True
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
            return keep_alive
        except Exception:
            # Headers are out: the only honest signal left is to cut the connection.
            logger.exception("stream for %s %s failed part-way", request.method, request.path)
            self._close()
            return False
        finally:
            self._streaming = False
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()

    # -- closing -------------------------------------------------------------------------

    def _refuse_body(self, what: str) -> None:
        self._server.metrics.count_close("body_too_large")
        limit = self._limits.max_body_bytes
        self._reply_and_close(413, f"{what} the limit of {limit} bytes (--max-request-bytes)")

    def _reply_and_close(self, status: int, message: str, headers: bytes = b"") -> None:
        """Stop reading requests; answer ``status`` after the ones before, then close.
        ``headers``: more header lines for the reply, each ending in CRLF."""
        if self._transport is None or self._input_closed:
            return
        self._input_closed = True
        reply = closing_reply(status, self._server.error_body(message), headers)
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

    def drain(self) -> None:
        """Shutdown began: answer the requests in flight, then close; if none, close now.

        The requests begun so far (running, queued behind it, or still arriving) are
        served; the response after which nothing is left to answer says ``connection:
        close`` and the connection closes after it (_keeps_alive). A request begun later
        is refused 503 (on_headers_complete). An idle keep-alive connection is closed at
        once: the sooner, the smaller the window in which its client may send on it."""
        if self._closing:
            return
        self._drain_admits = self._begun
        if not (self._phase != _IDLE or self._requests or self._serving()):
            self._close()

    def expire(self) -> None:
        """--shutdown-timeout-s ran out: answer what is left 503 with Retry-After, then
        close. A handler still running is cancelled (its queued inference dropped) and
        answered, as are the requests queued behind it; a partly received request is
        answered too. A stream already under way can only be cut short."""
        if self._closing:
            return
        self._expired = True
        if self._drain_admits is None:
            self._drain_admits = self._begun
        if self._streaming and self._worker is not None:
            self._worker.cancel()  # closes the stream's iterator: generation stops
            self._close()
            return
        if self._phase != _IDLE:  # answered after the requests before it
            self._reply_and_close(503, _SHUTTING_DOWN, _RETRY_AFTER)
        if self._serving() and self._worker is not None:
            self._worker.cancel()  # _respond turns the cancellation into the 503
        elif not self._closing:
            self._close()

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
