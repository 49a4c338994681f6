"""What one HTTP/1.1 connection of :class:`~slipstream.server.httpd.HttpServer` may
cost, and how it ends: its state, the refusals of a request past a limit (head and body
size, the framing of a chunked body), the timeouts the server's sweeper checks, write
back-pressure, its share of the server's :class:`BodyBudget`, and closing (a lingering
close after an error reply, a reset past a timeout).
:mod:`slipstream.server.http_connection` parses and serves requests on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from typing import Protocol

import httptools

from slipstream.observability.metrics import TransportMetrics
from slipstream.server.http_messages import (
    BodyRefused,
    ErrorBody,
    HttpLimits,
    HttpRequest,
    PendingDecode,
    closing_reply,
)

# Bytes of a request line besides its URL ("DELETE " and " HTTP/1.1\r\n", with slack):
# a head refused with no header parsed and no more than this beside its URL gets 414.
_REQUEST_LINE_OVERHEAD = 32
# After an error reply, how long a connection's input is read and discarded before closing.
_LINGER_S = 2.0
# Where the parser is in a connection's current request.
IDLE, HEAD, BODY = 0, 1, 2
# The answer, during a shutdown, to a request the server will not run: one begun after the
# drain started, or still running (or queued) when --shutdown-timeout-s ran out.
SHUTTING_DOWN = "the server is shutting down; retry the request (on a new connection)"
RETRY_AFTER_S = b"1"
RETRY_AFTER = b"retry-after: " + RETRY_AFTER_S + b"\r\n"
# What a connection resumed by the body budget is taken to read before it is checked
# again (asyncio's and uvloop's most in one read): a release resumes no more waiting
# connections than the room it made holds at this much each.
_READ_BYTES = 256 * 1024


# A client that half-closes (shutdown(SHUT_WR) after its request: nc -N, some proxies)
# sends the same FIN as one that closed its socket and went away, and only a write tells
# them apart: the gone one's host answers it with a reset. So when a handler has run
# this long past the FIN, the client is sent an interim "100 Continue" (which an HTTP/1.1
# client must accept unasked, RFC 9110 15.2), and the socket's error is checked after
# it, then every twice as long, up to _PROBE_MAX_S: a reset cancels the handler (its
# queued inference is dropped) as a close did at once before half-closes were answered.
# Short, since closes (a client's timeout) are common and half-closes rare; long enough
# that a half-closing client's quick requests are answered without the interim line.
_PROBE_AFTER_S = 0.2
_PROBE_FIRST_CHECK_S = 0.05
_PROBE_MAX_S = 5.0
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class BudgetClient(Protocol):
    """A connection as :class:`BodyBudget` pauses and resumes it."""

    def pause_for_budget(self) -> None: ...
    def resume_for_budget(self) -> None: ...


class BodyBudget:
    """The request-body bytes all connections of one server (one process) hold, held to
    --max-buffered-body-bytes by back-pressure rather than by refusals.

    A body counts from its first read until its handler returns (decoded size once
    decoded; a body that arrives in one read is counted once it is whole, one that takes
    several as each read ends). A connection that reads while the total is past the
    limit, with a body part-received, stops being read (:meth:`wait`); TCP flow control
    then holds its client. Releases resume the waiting connections, oldest first, as
    many as the room made has reads for; the server's sweeper does the same, in case
    those resumed send nothing. Bodies received whole are never paused for, so small
    requests (body and head in one read) keep flowing.

    No deadlock: when only part-received bodies hold the budget (none queued or with a
    handler, so no release is coming), the longest-waiting connection is resumed past
    the limit (:attr:`privileged`) until its body is in, so a body alone larger than the
    whole budget is still only held to --max-request-bytes. What the process holds is
    then at most the limit, plus one body of --max-request-bytes, plus one read (256
    KiB) for each connection reading a body when the limit was passed.
    """

    __slots__ = ("held_bytes", "limit_bytes", "privileged", "receiving_bytes", "waiters")

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        # Bytes held now: bodies being received, queued behind another request, or with
        # their handler.
        self.held_bytes = 0
        # Of those, the bodies part-received; the rest (received whole: queued, or with
        # their handler) are released without anything more read.
        self.receiving_bytes = 0
        # Connections paused for room, longest-waiting first (dicts keep order).
        self.waiters: dict[BudgetClient, None] = {}
        # The one connection reading past the limit, when only part-received bodies
        # held the budget (see the class docstring); None most of the time.
        self.privileged: BudgetClient | None = None

    def wait(self, client: BudgetClient) -> None:
        """``client`` read while the budget was spent, its body part-received: pause it
        until there is room (unless it is the one finishing past the limit)."""
        if client is self.privileged or client in self.waiters:
            return
        self.waiters[client] = None
        client.pause_for_budget()
        self.rebalance()

    def forget(self, client: BudgetClient) -> None:
        """``client`` no longer waits or finishes a body past the limit (its body is in,
        refused, or the connection is gone); it is not resumed here."""
        if client is self.privileged:
            self.privileged = None
        self.waiters.pop(client, None)
        self.rebalance()

    def rebalance(self) -> None:
        """Resume waiting connections the room allows; or, when only part-received
        bodies hold the budget, let the longest-waiting one finish past the limit."""
        waiters = self.waiters
        if not waiters:
            return
        room = self.limit_bytes - self.held_bytes
        if room > 0:
            for _ in range(max(1, room // _READ_BYTES)):
                if not waiters:
                    break
                client = next(iter(waiters))
                del waiters[client]
                client.resume_for_budget()
        elif self.privileged is None and self.held_bytes <= self.receiving_bytes:
            client = next(iter(waiters))
            del waiters[client]
            self.privileged = client
            client.resume_for_budget()


class GuardOwner(Protocol):
    """What the guard needs of its server (``httpd.HttpServer``); a connection needs
    more (``http_connection.ConnectionOwner``)."""

    error_body: ErrorBody
    limits: HttpLimits
    metrics: TransportMetrics
    body_budget: BodyBudget


class ConnectionGuard(asyncio.Protocol):
    """A connection's state, the limits it holds its client to, and its ways of closing;
    :class:`~slipstream.server.http_connection.Connection` reads and serves requests on it.

    Slotted, and its futures made only when something waits on them: thousands of open
    connections (idle keep-alive, slowloris) cost little memory and give the garbage
    collector little to walk."""

    __slots__ = (
        "_answering", "_begun", "_body", "_body_charged", "_body_size", "_body_started_at",
        "_budget", "_budget_paused", "_closing", "_completed", "_drain_admits", "_encoded",
        "_eof", "_eof_probe", "_expired", "_final_reply", "_finished", "_framing_bytes",
        "_head_bytes", "_head_started_at", "_headers", "_host_lines", "_input_closed",
        "_known_head_bytes", "_last_active", "_last_read_at", "_limits", "_loop", "_lost",
        "_parser", "_phase", "_probe_delay_s", "_queued_bytes", "_reading_paused",
        "_received_any", "_requests", "_server", "_streaming", "_transport", "_unfed",
        "_url", "_worker", "_writable", "_write_paused_at",
    )  # fmt: skip

    def __init__(self, server: GuardOwner) -> None:
        self._server = server
        self._limits = server.limits
        self._budget = server.body_budget
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
        # Host header lines of the current head (RFC 9112 3.2 wants one), and whether it
        # has a Content-Encoding.
        self._host_lines = 0
        self._encoded = False
        self._body: list[bytes] = []
        self._body_size = 0
        # Of the current request's body, what the budget (BodyBudget) counts so far (as
        # reads end); the bodies received whole are _queued_bytes and _answering's.
        self._body_charged = 0
        # Reading is paused until the budget has room (BodyBudget.wait).
        self._budget_paused = False
        # Pipelined requests waiting for their turn (at most _MAX_PIPELINED), with
        # whether each keeps the connection alive and, for a large compressed body, its
        # inflation still to run; and the bytes of their bodies (reading pauses past
        # --max-request-bytes of them).
        self._requests: list[tuple[HttpRequest, bool, PendingDecode | None]] = []
        self._queued_bytes = 0
        # What a read brought past the request that filled the queue: fed on resuming.
        self._unfed = b""
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
        # IDLE, HEAD or BODY; with the head's start and size so far, and the last read.
        self._phase = IDLE
        self._head_started_at = now  # a new connection owes a head from its start
        self._head_bytes = 0
        # Bytes fed in the body phase since body data last arrived: chunk-size lines,
        # extensions, trailers (which httptools buffers); held to --max-header-bytes.
        self._framing_bytes = 0
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
        # The request whose handler runs (or whose body inflates): what a 100 Continue
        # probe may precede (_probe_client), and a body the budget counts.
        self._answering: HttpRequest | None = None
        # The client shut down its sending side (eof_received): what it sent in full is
        # answered, then the connection closes. While that runs, a timer checks whether
        # the client is still there (_probe_client), every _probe_delay_s (0: no probe
        # sent yet).
        self._eof = False
        self._eof_probe: asyncio.TimerHandle | None = None
        self._probe_delay_s = 0.0

    def _release(self) -> None:
        """Drop the parser (with the partial header it buffers) and request buffers."""
        self._parser = None
        self._url, self._headers, self._body, self._unfed = b"", [], [], b""
        self._drop_partial_body()

    # -- the body budget ---------------------------------------------------------------

    def _charge_partial_body(self) -> None:
        """A read ended inside a body: count what came of it, and wait for room if the
        budget is spent."""
        budget = self._budget
        grown = self._body_size - self._body_charged
        self._body_charged = self._body_size
        budget.held_bytes += grown
        budget.receiving_bytes += grown
        if budget.held_bytes > budget.limit_bytes:
            budget.wait(self)

    def _body_arrived(self) -> None:
        """The body counted part by part is whole (and counted as such by the caller)."""
        charged, self._body_charged = self._body_charged, 0
        budget = self._budget
        budget.held_bytes -= charged
        budget.receiving_bytes -= charged
        if budget.privileged is self:
            budget.forget(self)

    def _drop_partial_body(self) -> None:
        """The body being received will never be complete: out of the budget."""
        charged, self._body_charged = self._body_charged, 0
        budget = self._budget
        if charged:
            budget.held_bytes -= charged
            budget.receiving_bytes -= charged
        if budget.privileged is self or self._budget_paused:
            budget.forget(self)
        elif charged and budget.waiters:
            budget.rebalance()

    def pause_for_budget(self) -> None:
        self._budget_paused = True
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_for_budget(self) -> None:
        self._budget_paused = False
        if self._reading_paused or self._transport is None or self._closing:
            return
        # The timeouts measure the client, not the pause: their clocks restart.
        now = self._loop.time()
        self._head_started_at = self._last_read_at = self._body_started_at = now
        self._transport.resume_reading()

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

    def _measure_framing(self, fed: int, begun: int, body_size: int) -> None:
        """Hold what a body's framing may cost, as _feed does a head's: httptools buffers
        trailer fields as it does headers, and a trailer line that never ends cost memory
        without bound and CPU quadratic in its length (37 MB of it: 130 MB, and the event
        loop too busy to answer another client within 5 s)."""
        if self._begun != begun or self._body_size != body_size:
            self._framing_bytes = 0  # body data (or a new request) came in the piece
            return
        self._framing_bytes += fed
        limit = self._limits.max_header_bytes
        if self._framing_bytes >= limit:
            self._server.metrics.count_close("header_too_large")
            self._reply_and_close(
                431, f"chunked body framing (chunk-size lines, extensions, trailers) past "
                f"the body data exceeds {limit} bytes (--max-header-bytes)"
            )  # fmt: skip

    def _refuse(self, refused: BodyRefused) -> None:
        if refused.status == 413:
            self._server.metrics.count_close("body_too_large")
        self._reply_and_close(refused.status, refused.message)

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
        self._drop_partial_body()
        reply = closing_reply(status, self._server.error_body(message), headers)
        if self._requests or self._serving():
            self._final_reply = reply  # pipelined requests before it are answered first
        else:
            self._send_final(reply)

    def _send_final(self, reply: bytes) -> None:
        assert self._transport is not None
        self._transport.write(reply)
        self._closing = True
        if self._reading_paused or self._budget_paused:
            self._transport.resume_reading()  # to drain what the client still sends
        if self._eof or not self._transport.can_write_eof():
            self._transport.close()  # (after EOF from the client, nothing is to drain)
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

    def eof_received(self) -> bool:
        """The client sent its last byte (shutdown of its sending side, or a close):
        answer the requests it sent in full, then close; True keeps the transport open
        for that. A request cut short by the EOF is dropped. Over TLS asyncio cannot keep
        the transport half-open, so the connection ends as it did before."""
        if self._closing or self._transport is None or not (self._requests or self._serving()):
            return False  # nothing to answer
        if self._transport.get_extra_info("ssl_object") is not None:
            return False
        self._eof = self._input_closed = True
        self._phase = IDLE
        self._release()
        if self._drain_admits is None:
            self._drain_admits = self._begun  # so the last response says connection: close
        self._eof_probe = self._loop.call_later(_PROBE_AFTER_S, self._probe_client)
        return True

    def _probe_client(self) -> None:
        """Whether a half-closed client is still there (see _PROBE_AFTER_S): abort the
        connection, cancelling its handler, once a probe drew a reset."""
        self._eof_probe = None
        transport = self._transport
        if transport is None or self._closing or not (self._requests or self._serving()):
            return
        sock = transport.get_extra_info("socket")
        if sock is None:
            return
        if self._probe_delay_s:
            with contextlib.suppress(OSError):
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    transport.abort()  # connection_lost cancels the handler
                    return
            self._probe_delay_s = min(2 * self._probe_delay_s, _PROBE_MAX_S)
        elif (
            self._answering is not None
            and self._answering.http_version == "1.1"
            and not self._streaming  # a stream's own writes find a gone client
        ):
            transport.write(_CONTINUE)
            self._probe_delay_s = _PROBE_FIRST_CHECK_S
        else:
            self._probe_delay_s = 0.0  # not now (HTTP/1.0, or between responses)
        self._eof_probe = self._loop.call_later(
            self._probe_delay_s or _PROBE_AFTER_S, self._probe_client
        )

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
        if self._input_closed or self._reading_paused or self._budget_paused:
            return  # while reading is paused, the server is the slow side
        if self._phase == HEAD and now - self._head_started_at > limits.header_timeout_s:
            metrics.count_close("header_timeout")
            message = f"request headers not received within {limits.header_timeout_s:g} s"
            self._reply_and_close(408, message + " (--header-timeout-s)")
        elif self._phase == BODY and now - self._last_read_at > limits.body_timeout_s:
            metrics.count_close("body_timeout")
            message = f"request body stalled for {limits.body_timeout_s:g} s"
            self._reply_and_close(408, message + " (--body-timeout-s)")
        elif self._phase == BODY and self._body_too_slow(now):
            metrics.count_close("body_too_slow")
            elapsed = now - self._body_started_at
            self._reply_and_close(
                408,
                f"request body arrived at {self._body_size / elapsed:.0f} bytes/s over "
                f"{elapsed:.0f} s, below {limits.min_body_rate_bytes_s:g} "
                "(--min-body-rate-bytes-s)",
            )
        elif self._phase != IDLE or self._requests or self._serving():
            return
        elif not self._received_any:
            # Connected and never sent a byte: no request to answer, so just close.
            if now - self._head_started_at > limits.header_timeout_s:
                metrics.count_close("header_timeout")
                self._close()
        elif now - self._last_active > limits.keep_alive_timeout_s:
            metrics.count_close("keep_alive_timeout")
            self._close()
