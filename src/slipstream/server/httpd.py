"""A lean HTTP/1.1 server on asyncio and httptools (the parser uvicorn uses).

Why not uvicorn: for a small model, a generic ASGI server's per-request machinery (scope
and message dicts, a task per receive, two socket writes per response) cost as much as
the whole decode-batch-encode path. This server hands the handler one
:class:`HttpRequest` with the full body and writes each :class:`HttpResponse` in one
``write``. A client that disconnects cancels its in-flight handler directly, so queued
inference work is dropped without a watcher task per request (a close, whose FIN reads
as a half-close, once a probe draws its reset: ``ConnectionGuard._probe_client``).

Covered: keep-alive and HTTP/1.0, pipelined requests (answered in order), chunked
request bodies, gzip and deflate request bodies (a large one inflated in a worker thread,
``http_messages.PendingDecode``), ``Expect: 100-continue``, HEAD, write back-pressure, a
client that half-closes after its requests (they are answered, then the connection
closes; ``http_guard.ConnectionGuard.eof_received``), a graceful shutdown
(:meth:`HttpServer.shutdown`), and streamed responses (:class:`StreamingResponse`,
chunked; sent as they are to an HTTP/1.0 client) for server-sent events. Framing is
strict, as a server behind a proxy must be against request smuggling: what llhttp refuses
(Content-Length with Transfer-Encoding, two lengths, line folding, bare LF) is a 400, a
transfer coding other than chunked a 501 (``http_messages.check_head``), an HTTP/1.1
request without Host or any with two a 400 (RFC 9112 3.2); trailer fields are dropped,
never merged into the headers; a request asking to upgrade (WebSocket, h2c) is answered
as plain HTTP/1.1.

What one client may cost is bounded (:class:`HttpLimits`): the size and count of a
request's headers, checked on the bytes fed to the parser before it buffers them; a
header-read timeout (slowloris), a body-stall timeout and a minimum body rate (a body
trickled a byte at a time), a send timeout (a client that stops reading its responses)
and the keep-alive idle timeout, all enforced by one sweeper timer; the body size,
refused from the headers before the body is read; the bytes of a chunked body's framing
and trailers (as a head's); the bodies of pipelined requests queued on one connection
(reading pauses past the body limit); and the number of open connections. What all
clients together may cost is bounded too: the bodies held at once
(--max-buffered-body-bytes; past it, connections receiving a body stop being read until
bodies are released, :class:`~slipstream.server.http_guard.BodyBudget`), and the bytes
lingering connections discard.
Unsent response bytes are bounded too: a response is written only once the transport's
buffer has drained below its high-water mark, so one connection holds at most that plus
one response, and for at most --send-timeout-s when its client reads nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from ssl import SSLContext

from slipstream.observability.metrics import TransportMetrics
from slipstream.runtime import heap
from slipstream.server.http_connection import Connection
from slipstream.server.http_guard import BodyBudget
from slipstream.server.http_messages import (
    ErrorBody,
    Handler,
    HttpLimits,
    HttpRequest,
    HttpResponse,
    StreamingResponse,
    encode_body,
    error_reply,
)

__all__ = [
    "ErrorBody",
    "Handler",
    "HttpLimits",
    "HttpRequest",
    "HttpResponse",
    "HttpServer",
    "StreamingResponse",
    "encode_body",
    "error_reply",
]

logger = logging.getLogger(__name__)

# What all lingering connections together may discard: a burst, then a rate. A refused
# client that goes on sending (an 8 MB header, a body past the limit) is read and its
# bytes dropped so that it can read its refusal; a thousand of them streaming as fast as
# they can made the server copy 3.9 GB out of the kernel to discard it (1.8 s of CPU, the
# event loop held up to 340 ms). Past the budget a lingering connection is reset at once.
# (Only to stop reading it was dearer: the kernel then queued megabytes for each, freed by
# the closes at the end of the lingering, a thousand at once: 600-900 ms of loop stalls
# over a round of 1,000 header bombs, against 190 ms when they are reset.) A client that
# reads while it sends may still lose its refusal to the reset; one sending that much
# after its refusal is not waiting for it.
_DISCARD_BURST_BYTES = 64 * 1024 * 1024
_DISCARD_BYTES_S = 32 * 1024 * 1024
# Connections the sweeper visits in one turn of the event loop: measured, 0.03 ms of work,
# or 2 ms when every one of them has timed out and is answered 408 (15 ms for a thousand
# at once before the sweep was sliced).
_SWEEP_SLICE = 128
# Once --shutdown-timeout-s has run out and the requests left were answered 503, how long
# their clients get to read that before the connections still open are aborted.
_EXPIRE_GRACE_S = 1.0


class HttpServer:
    """Serves ``handler`` on host:port; see the module docstring."""

    def __init__(
        self,
        handler: Handler,
        *,
        error_body: ErrorBody,
        limits: HttpLimits | None = None,
        metrics: TransportMetrics | None = None,
    ) -> None:
        # Read by its connections (http_connection.Connection), as are the methods below.
        self.handler = handler
        self.error_body = error_body
        self.limits = limits or HttpLimits()
        self.metrics = metrics or TransportMetrics()
        self.body_budget = BodyBudget(self.limits.buffered_body_bytes)
        self.metrics.open_connections = lambda: len(self._connections)
        self._connections: set[Connection] = set()
        # Connections waiting for a request, longest-waiting first (dicts keep order):
        # the ones to close when --max-connections is reached.
        self._idle: dict[Connection, None] = {}
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        self._sweeper_slice: asyncio.Handle | None = None  # the rest of a sweep
        # Connections closed since freed memory was last handed back (runtime.heap.trim).
        self._closed_since_trim = 0
        # The lingering connections' discard budget (bytes) and when it was last filled.
        self._discard_budget = float(_DISCARD_BURST_BYTES)
        self._discard_filled_at = time.monotonic()

    async def start(
        self, host: str, port: int, ssl: SSLContext | None = None, reuse_port: bool = False
    ) -> int:
        """Bind and listen (HTTPS with ``ssl``); returns the bound port (for port 0).
        ``reuse_port``: share the port with other processes (SO_REUSEPORT; the kernel
        spreads new connections over them). OSError if it cannot."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: Connection(self), host, port, backlog=4096, reuse_address=True, ssl=ssl,
            reuse_port=reuse_port or None,
        )  # fmt: skip
        self._sweep()
        return int(self._server.sockets[0].getsockname()[1])

    def _sweep(self) -> None:
        """Close connections past a timeout: header read, body stall, keep-alive idle.

        One timer for the whole server instead of one per request: re-arming a timer on
        every response showed up in profiles of small-model serving. A timeout of T is
        enforced between T and T + the sweep interval. The connections are visited
        :data:`_SWEEP_SLICE` at a time, one slice a turn of the event loop: a thousand
        slowloris connections timing out at once are answered 408 in slices, and the
        requests of other clients are served in between.
        """
        loop = asyncio.get_running_loop()
        limits = self.limits
        interval = min(
            5.0,
            limits.keep_alive_timeout_s,
            limits.header_timeout_s,
            limits.body_timeout_s,
            limits.send_timeout_s,
        )
        self._sweeper = loop.call_later(interval, self._sweep)
        # Connections resumed by the body budget that sent nothing leave room unused.
        self.body_budget.rebalance()
        self._sweep_slice(list(self._connections), 0)

    def _sweep_slice(self, connections: list[Connection], start: int) -> None:
        now = asyncio.get_running_loop().time()
        end = start + _SWEEP_SLICE
        for connection in connections[start:end]:
            connection.enforce_timeouts(now)
        if end < len(connections):
            self._sweeper_slice = asyncio.get_running_loop().call_soon(
                self._sweep_slice, connections, end
            )
            return
        self._sweeper_slice = None
        # What closed connections freed (their buffers: up to the header limit each) goes
        # back to the OS rather than staying in the allocator's free lists.
        if self._closed_since_trim and heap.trim():
            self._closed_since_trim = 0

    def may_discard(self, size: int) -> bool:
        """Take ``size`` bytes from the discard budget; False when it has not got them."""
        now = time.monotonic()
        budget = self._discard_budget + (now - self._discard_filled_at) * _DISCARD_BYTES_S
        self._discard_budget = min(budget, _DISCARD_BURST_BYTES)
        self._discard_filled_at = now
        if self._discard_budget < size:
            return False
        self._discard_budget -= size
        return True

    def admit(self, connection: Connection) -> bool:
        """Take a new connection in, closing the longest-idle one to make room for it at
        --max-connections; False (refused) when none is idle."""
        if len(self._connections) >= self.limits.max_connections:
            if not self._idle:
                self.metrics.count_close("refused_full")
                return False
            idlest = next(iter(self._idle))
            del self._idle[idlest]
            self.metrics.count_close("evicted_idle")
            idlest.close_for_limit()
        self._connections.add(connection)
        self.mark_idle(connection)
        return True

    def forget(self, connection: Connection) -> None:
        """A connection is gone."""
        self._connections.discard(connection)
        self._closed_since_trim += 1
        self.mark_busy(connection)

    def mark_idle(self, connection: Connection) -> None:
        self._idle.pop(connection, None)
        self._idle[connection] = None

    def mark_busy(self, connection: Connection) -> None:
        self._idle.pop(connection, None)

    async def shutdown(self, timeout_s: float) -> None:
        """Stop accepting and drain; returns within ``timeout_s`` plus about a second.

        Idle connections close at once. The requests in flight (running, pipelined
        behind, or arriving) are served, the last response on each connection saying
        ``connection: close``; a request begun after this is answered 503. What is still
        running at ``timeout_s`` is cancelled and answered 503 with Retry-After (a stream
        under way is cut short); a connection still open a grace later is aborted.
        """
        if self._server is not None:
            self._server.close()
        for handle in (self._sweeper, self._sweeper_slice):
            if handle is not None:
                handle.cancel()
        for connection in list(self._connections):
            connection.drain()
        if await self._all_closed(timeout_s):
            return
        logger.warning(
            "%d connections still busy after %.0f s (--shutdown-timeout-s): answering "
            "their requests 503", len(self._connections), timeout_s,
        )  # fmt: skip
        for connection in list(self._connections):
            connection.expire()
        if not await self._all_closed(_EXPIRE_GRACE_S):
            for connection in list(self._connections):
                connection.abort()

    async def _all_closed(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every connection to close; whether they all did."""
        waiting = [c.finished() for c in self._connections]
        if not waiting:
            return True
        _, pending = await asyncio.wait(waiting, timeout=timeout_s)
        return not pending
