"""One HTTP/1.1 client connection of :class:`~slipstream.server.httpd.HttpServer`: it
parses requests with httptools, runs the handler on them in order, writes the replies,
answers what a half-closed client sent, and takes its part in a shutdown (drain,
expire); what the connection may cost, and how it closes, is
:class:`~slipstream.server.http_guard.ConnectionGuard`'s. The server owns what spans
connections: listening, admission, the sweeper, the discard and body budgets, and when
a shutdown drains and expires.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol, cast

import httptools

from slipstream.server.http_guard import (
    BODY,
    HEAD,
    IDLE,
    RETRY_AFTER,
    RETRY_AFTER_S,
    SHUTTING_DOWN,
    ConnectionGuard,
    GuardOwner,
)
from slipstream.server.http_messages import (
    INLINE_DECODED_BYTES,
    BodyRefused,
    Handler,
    HttpRequest,
    HttpResponse,
    PendingDecode,
    StreamingResponse,
    begin_decoding,
    check_head,
    closing_reply,
    response_head,
)

__all__ = ["Connection", "ConnectionOwner"]

logger = logging.getLogger(__name__)

# How many parsed requests one connection may have waiting before reading pauses.
_MAX_PIPELINED = 16
# Space and tab as the ints bytes indexing gives (half endswith's cost, per header).
_BLANKS = frozenset(b" \t")
# Header names on_header notes as they pass (one set lookup a header), so that a request
# without them skips the passes over its headers that would look for them.
_NOTED = frozenset((b"host", b"content-encoding"))


class ConnectionOwner(GuardOwner, Protocol):
    """What a connection needs of its server (``httpd.HttpServer``)."""

    handler: Handler

    def admit(self, connection: Connection) -> bool: ...
    def forget(self, connection: Connection) -> None: ...
    def mark_idle(self, connection: Connection) -> None: ...
    def mark_busy(self, connection: Connection) -> None: ...
    def may_discard(self, size: int) -> bool: ...


class Connection(ConnectionGuard):
    """One client connection: parse requests, run the handler in order, write replies."""

    __slots__ = ()
    _server: ConnectionOwner  # set by ConnectionGuard.__init__

    def __init__(self, server: ConnectionOwner) -> None:
        super().__init__(server)

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
        if self._phase == IDLE:
            self._phase, self._head_started_at, self._head_bytes = HEAD, now, 0
            self._server.mark_busy(self)
        try:
            self._feed(memoryview(data))
        except httptools.HttpParserCallbackError as exc:
            # A callback below raised: a fault of this server's, not of the request.
            logger.error("failed parsing an HTTP request", exc_info=exc.__context__)
            self._reply_and_close(500, "internal server error")
        except httptools.HttpParserError as exc:
            if data.startswith(b"PRI * HTTP/2"):  # HTTP/2 with prior knowledge (h2c)
                message = "HTTP/2 is not served on this port; send HTTP/1.1 (gRPC: its port)"
            else:
                message = f"malformed HTTP request: {exc}"
            self._reply_and_close(400, message)
        if self._input_closed:
            self._release()
        elif self._phase == BODY and self._body_size != self._body_charged:
            self._charge_partial_body()  # the read ended inside a body

    def _feed(self, view: memoryview) -> None:
        """Feed the parser at most the head's remaining room at a time.

        httptools buffers a header's name and value until its line ends, so a head is
        measured here, on the bytes fed while it is incomplete, and refused as soon as
        it reaches the limit: an unterminated 8 MB header costs at most about twice the
        limit. Pieces past the end of a head (bodies, pipelined requests) are no larger
        than the limit, so a new head begun inside one is bounded the same way. Once
        pipelined requests fill the queue, what is left unfed waits for the queue to drain
        (_resume_reading): a 256 KiB read is no longer parsed into thousands of requests.
        """
        limit = self._limits.max_header_bytes
        start = 0
        while (
            start < len(view)
            and not self._input_closed
            and not self._reading_paused  # the queue is full: the rest waits (_unfed)
            and self._parser is not None
        ):
            size = limit - self._head_bytes if self._phase == HEAD else limit
            piece = view[start : start + size]
            begun, completed, body_size = self._begun, self._completed, self._body_size
            try:
                self._parser.feed_data(piece)
            except httptools.HttpParserUpgrade as upgrade:
                # Asked to switch protocols (WebSocket, h2c), the request was answered as
                # plain HTTP, as a server may (RFC 9110 7.8); llhttp stops at its end, so
                # what follows is parsed, as HTTP/1.1 still, by a fresh parser.
                start += upgrade.args[0]
                if not self._input_closed:
                    self._parser = httptools.HttpRequestParser(self)
                continue
            start += len(piece)
            if self._input_closed:
                continue
            if self._phase == BODY:
                self._measure_framing(len(piece), begun, body_size)
            if self._phase != HEAD:
                continue
            if self._begun == begun:  # the whole piece is more of this head
                self._head_bytes += len(piece)
            elif self._completed == completed:  # the piece started this head
                self._head_bytes = len(piece)
            else:  # begun after another request in the piece: what the callbacks saw
                self._head_bytes = self._known_head_bytes
            if self._head_bytes >= limit:
                self._refuse_head()
        if self._reading_paused and start < len(view) and not self._input_closed:
            self._unfed += bytes(view[start:])

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = self._input_closed = True
        self._server.forget(self)
        # The client is gone: cancel its in-flight request (queued inference is dropped).
        if self._worker is not None and not self._worker.done():
            self._worker.cancel()
        if self._eof_probe is not None:
            self._eof_probe.cancel()
        self._requests.clear()
        self._release()  # the body being received, out of the budget
        # The bodies received whole: queued, and the one with the handler.
        answering = self._answering
        held = self._queued_bytes + (len(answering.body) if answering is not None else 0)
        self._queued_bytes, self._answering = 0, None
        if held:
            self._budget.held_bytes -= held
            self._budget.rebalance()
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

    # -- httptools callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._phase != HEAD:  # pipelined behind the previous request
            self._phase, self._head_started_at = HEAD, self._loop.time()
        self._begun += 1
        self._url = b""
        self._headers = []
        self._known_head_bytes = 0
        self._host_lines = 0
        self._encoded = False
        self._body = []
        self._body_size = 0

    def on_url(self, url: bytes) -> None:
        if self._input_closed:
            return
        self._url += url
        self._known_head_bytes += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._input_closed or self._phase == BODY:
            # Past the head: a chunked body's trailer fields, dropped. Merged into the
            # headers (RFC 9110 6.5.1 forbids it), they would add to or override ones a
            # proxy in front has vetted (authorization, content-encoding).
            return
        if value and value[-1] in _BLANKS:  # llhttp keeps trailing whitespace; it is no
            value = value.rstrip(b" \t")  # part of the value (RFC 9110 5.5)
        name = name.lower()
        if name in _NOTED:
            if name == b"host":
                self._host_lines += 1
            else:
                self._encoded = True
        headers = self._headers
        headers.append((name, value))
        self._known_head_bytes += len(name) + len(value) + 4  # ": " and CRLF
        if len(headers) > self._limits.max_header_count:
            self._server.metrics.count_close("too_many_headers")
            limit = self._limits.max_header_count
            self._reply_and_close(431, f"more than {limit} header lines (--max-header-count)")

    def on_headers_complete(self) -> None:
        self._phase, self._head_bytes, self._framing_bytes = BODY, 0, 0
        self._last_read_at = self._body_started_at = self._loop.time()
        if self._input_closed or self._parser is None:
            return
        if self._drain_admits is not None and self._begun > self._drain_admits:
            # Begun after the drain started (a client pipelining): a new request, refused.
            self._reply_and_close(503, SHUTTING_DOWN, RETRY_AFTER)
            return
        hosts = self._host_lines
        if hosts != 1 and (hosts or self._parser.get_http_version() == "1.1"):
            # RFC 9112 3.2: a server MUST answer 400 to an HTTP/1.1 request without Host
            # and to any request with more than one (which a proxy may route by one and
            # this server read by another).
            if hosts:
                self._reply_and_close(400, f"{hosts} Host header lines; send one (RFC 9112 3.2)")
            else:
                self._reply_and_close(
                    400, "an HTTP/1.1 request needs a Host header (RFC 9112 3.2); send "
                    "Host: <host>[:<port>] naming the server"
                )  # fmt: skip
            return
        try:
            limit = self._limits.max_body_bytes
            expects_continue = check_head(self._headers, limit, self._parser.get_http_version)
        except BodyRefused as refused:
            self._refuse(refused)
            return
        if self._parser.should_upgrade() and _declares_body(self._headers):
            # httptools skips the body of a request asking to upgrade (it would be the
            # new protocol's): parsed as HTTP, it would be a request smuggled past a
            # proxy that forwarded it as this request's body.
            self._reply_and_close(400, "a request asking to Upgrade may not have a body")
            return
        if expects_continue and self._transport is not None:
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
        self._phase = IDLE
        self._completed += 1
        if self._input_closed or self._parser is None:
            return
        method = self._parser.get_method()
        if method == b"CONNECT":  # its target is host:port, which parse_url refuses
            self._reply_and_close(400, "CONNECT is not supported: this is not a proxy")
            return
        try:
            parsed = httptools.parse_url(self._url)
        except httptools.HttpParserInvalidURLError:
            target = self._url[:200].decode("latin-1")
            self._reply_and_close(400, f"malformed request target {target!r}")
            return
        body = decoded = b"".join(self._body) if len(self._body) != 1 else self._body[0]
        pending = None
        limit = self._limits.max_body_bytes
        if self._encoded:
            try:
                decoding = begin_decoding(self._headers, body, limit, INLINE_DECODED_BYTES)
            except BodyRefused as refused:
                self._refuse(refused)
                return
            if isinstance(decoding, PendingDecode):
                pending = decoding  # inflated in the request's turn, off the loop
            else:
                decoded = decoding
        request = HttpRequest(
            method=method.decode("ascii"),
            path=parsed.path.decode("latin-1"),
            headers=self._headers,
            body=decoded,
            query=parsed.query or b"",
            http_version=self._parser.get_http_version(),
        )
        self._requests.append((request, self._parser.should_keep_alive(), pending))
        size = len(decoded)
        self._queued_bytes += size
        if size:  # held (at its decoded size) until its handler returns
            self._budget.held_bytes += size
        if self._body_charged:
            self._body_arrived()  # no longer counted as a body part-received
        # _queue_full(), spelled out: a call a request saved.
        if (
            len(self._requests) >= _MAX_PIPELINED or self._queued_bytes > limit
        ) and self._transport is not None:
            # Bodies are buffered whole: without the byte bound, 16 pipelined requests
            # of --max-request-bytes each (1 GiB at the default) sat in one connection.
            self._transport.pause_reading()
            self._reading_paused = True
        if self._worker is None or self._worker.done():
            self._worker = self._loop.create_task(self._serve_queued())

    # -- serving -----------------------------------------------------------------------

    async def _serve_queued(self) -> None:
        while self._requests and not self._closing:
            request, keep_alive, pending = self._requests.pop(0)
            size = len(request.body)
            self._queued_bytes -= size
            self._answering = request
            if pending is not None:
                if not await self._inflate(request, pending):
                    break  # refused: the reply is _final_reply, sent below
                size = len(request.body)
            response = await self._respond(request)
            self._answering = None
            if size:  # the body is done with: out of the budget
                budget = self._budget
                budget.held_bytes -= size
                if budget.waiters:
                    budget.rebalance()
            if isinstance(response, StreamingResponse):
                stays_open = await self._write_stream(request, response, keep_alive)
            else:
                stays_open = await self._write(request, response, keep_alive)
            if not stays_open:
                self._close()
                return
            if self._reading_paused and not self._queue_full():
                self._resume_reading()
        self._last_active = self._loop.time()
        if self._final_reply is not None and not self._closing:
            self._send_final(self._final_reply)
        elif self._eof and not self._closing:
            self._close()  # half-closed: all it sent is answered
        elif self._phase != IDLE or self._input_closed:
            return
        elif self._drain_admits is not None:
            # Drained (a stream whose head went out before the drain began ends here).
            self._close()
        else:
            self._server.mark_idle(self)

    async def _inflate(self, request: HttpRequest, pending: PendingDecode) -> bool:
        """Inflate a large compressed body in a worker thread, in the request's turn (so
        other clients are served meanwhile); False when it is refused. A refusal ends
        the connection as one found on arrival does: it is the last reply (sent by
        _serve_queued), and the requests pipelined behind it are dropped."""
        try:
            body = await asyncio.to_thread(pending.run)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not self._expired or self._lost or task is None:
                raise
            task.uncancel()
            return True  # --shutdown-timeout-s ran out: _respond answers 503
        except BodyRefused as refused:
            if refused.status == 413:
                self._server.metrics.count_close("body_too_large")
            dropped = len(request.body) + self._queued_bytes  # it, and those behind it
            self._answering = None
            self._requests.clear()
            self._queued_bytes = 0
            self._budget.held_bytes -= dropped
            self._input_closed = True
            self._release()
            self._final_reply = closing_reply(
                refused.status, self._server.error_body(refused.message)
            )
            return False
        self._budget.held_bytes += len(body) - len(request.body)
        request.body = body
        return True

    def _queue_full(self) -> bool:
        """Whether reading pauses: enough pipelined requests (or bytes of them) queued."""
        queued = len(self._requests)
        return queued >= _MAX_PIPELINED or self._queued_bytes > self._limits.max_body_bytes

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
        body = self._server.error_body(SHUTTING_DOWN)
        return HttpResponse(503, body, headers=[(b"retry-after", RETRY_AFTER_S)])

    def _keeps_alive(self, keep_alive: bool) -> bool:
        """Whether the response about to be written leaves the connection open. Draining,
        only while more is to be answered (requests queued or being received, a refusal
        due): the last response says ``connection: close``, so no client sends another
        request on a connection the server is about to close."""
        if not keep_alive or self._drain_admits is None:
            return keep_alive
        return bool(self._requests) or self._final_reply is not None or self._phase != IDLE

    def _resume_reading(self) -> None:
        # The timeouts measure the client, not the pause: their clocks restart.
        self._reading_paused = False
        now = self._loop.time()
        self._head_started_at = self._last_read_at = self._body_started_at = now
        unfed, self._unfed = self._unfed, b""
        if unfed:
            self.data_received(unfed)  # which may fill the queue again
        if self._transport is not None and not (self._reading_paused or self._budget_paused):
            self._transport.resume_reading()

    async def _write(self, request: HttpRequest, response: HttpResponse, keep_alive: bool) -> bool:
        """Send a response; False when the connection is to close (or has) after it."""
        if self._transport is None or self._closing:
            return False
        if self._writable is not None:  # (a coroutine made only then: 0.1 us a response)
            await self._until_writable()
            if self._transport is None or self._closing:
                return False
        # Decided at the last moment: a drain may have begun while the handler ran (the
        # call only then: it cost as much as the budget's count of a body).
        if self._drain_admits is not None:
            keep_alive = self._keeps_alive(keep_alive)
        http10 = request.http_version == "1.0"
        parts = response_head(
            response.status, response.content_type, response.headers, keep_alive, http10
        )
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
            # HTTP/1.0 has no chunked coding: the body is sent as it is, ended by the close.
            chunked = request.http_version == "1.1"
            keep_alive = self._keeps_alive(keep_alive) and chunked
            parts = response_head(
                response.status, response.content_type, response.headers, keep_alive
            )
            parts[-1:-1] = (b"cache-control: no-cache\r\n",)
            if chunked:
                parts[-1:-1] = (b"transfer-encoding: chunked\r\n",)
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
                self._transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunked else chunk)
            if self._transport is None or self._closing:
                return False
            if chunked:
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
        if not (self._phase != IDLE or self._requests or self._serving()):
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
        if self._phase != IDLE:  # answered after the requests before it
            self._reply_and_close(503, SHUTTING_DOWN, RETRY_AFTER)
        if self._serving() and self._worker is not None:
            self._worker.cancel()  # _respond turns the cancellation into the 503
        elif not self._closing:
            self._close()


def _declares_body(headers: list[tuple[bytes, bytes]]) -> bool:
    for name, value in headers:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip(b"0")):
            return True
    return False
