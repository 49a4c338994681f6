"""HTTP/1.1 keep-alive connections of both bench modes: one write per request, the
response parsed by ``httptools``, idle connections reused the way real clients reuse
them.

The client is a small asyncio protocol, not aiohttp: against a one-core server aiohttp
spent ~300 us of client CPU per request and sent each request's headers and body in two
writes (which costs the server a second read), and reached ~60% of wrk's throughput on
the same core; this client sends each request in one write and measured within a few
percent of wrk (see ``benchmarks/bench_vs_wrk.py``).

Reuse follows the server: a response with ``Connection: close`` (or HTTP/1.0 without
keep-alive) ends its connection; ``Keep-Alive: timeout=N, max=M`` (llama.cpp's server
sends ``timeout=5, max=100`` and closes idle connections after 5 s) makes an idle
connection expire before the server would close it, and allows at most M more requests
on it. A server may still close an idle connection just as a request goes out: a
request that fails on a reused connection before any byte of its response arrived is
sent once more on a fresh connection and counted in ``reconnects``, not as an error,
as urllib3 and httpx retry idempotent requests.

Example::

    connections = HttpConnections(parse_endpoint("http://localhost:8000", "http"),
                                  timeout_s=30, factory=HttpConnection)
    conn = await connections.request(post_request(endpoint, "/v2/models/m/infer", body))
    print(conn.status, connections.reconnects)
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import ssl
import time
from collections.abc import Callable
from typing import Generic, TypeVar, cast

import httptools

from slipstream.bench.core.endpoint import Endpoint

# Keep at most this much of an error response's body as the example message.
ERROR_BODY_BYTES = 2048
# After a failed connect, pause before the next try so a dead server is not spun on.
RECONNECT_PAUSE_S = 0.01
# An idle connection is dropped this long before the server's keep-alive timeout (at
# most half the timeout), so a request never races the server's close.
_IDLE_MARGIN_S = 1.0
_NEVER = float("inf")
_KEEP_ALIVE_PARAM = re.compile(rb"(timeout|max)\s*=\s*(\d+)", re.IGNORECASE)


def post_request(
    endpoint: Endpoint,
    path: str,
    body: bytes,
    content_type: str = "application/json",
    extra_headers: str = "",
) -> bytes:
    """A complete HTTP/1.1 POST: request line, headers and body, for one write.
    ``extra_headers`` are whole lines, each ending in CRLF."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {endpoint.address}\r\n"
        f"User-Agent: slipstream-bench\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n{extra_headers}\r\n"
    )
    return head.encode("latin-1") + body


class KeepAlive:
    """Whether a connection may carry another request, from its last response's headers.

    >>> reuse = KeepAlive()
    >>> reuse.response_done(keep_alive=True, header=b"timeout=5, max=100", now_s=10.0)
    >>> reuse.reusable(now_s=13.9), reuse.reusable(now_s=14.1), reuse.requests_left
    (True, False, 100)
    """

    __slots__ = ("expires_s", "keep_alive", "requests_left")

    def __init__(self) -> None:
        self.keep_alive = True
        # time.monotonic() past which the connection is not reused (its server's
        # keep-alive timeout, less a margin); infinite when the server named none.
        self.expires_s = _NEVER
        # Requests the server still allows on the connection; None: no limit named.
        self.requests_left: int | None = None

    def response_done(
        self, keep_alive: bool, header: bytes | None, now_s: float | None = None
    ) -> None:
        """Take a complete response: its keep-alive verdict and ``Keep-Alive`` header
        (``now_s``: when it ended, time.monotonic() by default)."""
        self.keep_alive = keep_alive
        if self.requests_left is not None:
            self.requests_left -= 1
        if not header:  # the common case: no clock read, no parsing
            return
        now_s = time.monotonic() if now_s is None else now_s
        for name, value in _KEEP_ALIVE_PARAM.findall(header):
            if name.lower() == b"max":
                self.requests_left = int(value)
            else:
                timeout_s = int(value)
                self.expires_s = now_s + timeout_s - min(_IDLE_MARGIN_S, timeout_s / 2)

    def reusable(self, now_s: float | None = None) -> bool:
        """Whether to send another request on the connection (``now_s``: as above)."""
        left = self.requests_left
        if left is None and self.expires_s == _NEVER:  # the common case, per request
            return self.keep_alive
        if not self.keep_alive or (left is not None and left <= 0):
            return False
        if self.expires_s == _NEVER:
            return True
        return (time.monotonic() if now_s is None else now_s) < self.expires_s


class ResponseReader:
    """httptools callbacks for one response at a time: the status, an error body
    (status >= 300, kept for the error example), whether the connection may be reused.
    A mode reads 2xx bodies by overriding :meth:`begin` (fresh per-request state) and
    :meth:`on_body`. Shared by the asyncio connections and the blocking user.
    """

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._error_body: bytearray | None = None
        self._keep_alive_header: bytes | None = None
        self.status = 0
        self.reuse = KeepAlive()
        # Some byte of the response arrived; the whole response did.
        self.started = False
        self.complete = False
        # An asyncio connection's request in flight: resolved with the status.
        self._waiter: asyncio.Future[int] | None = None

    def begin(self) -> None:
        """Fresh per-request state, before a request is written."""
        self.status = 0
        self._error_body = None
        self._keep_alive_header = None
        self.started = self.complete = False

    def feed(self, data: bytes) -> None:
        """Parse bytes as they arrive; httptools.HttpParserError when malformed."""
        self.started = True
        self._parser.feed_data(data)

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) == 10 and name.lower() == b"keep-alive":
            self._keep_alive_header = value

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self._error_body = bytearray() if self.status >= 300 else None

    def on_body(self, body: bytes) -> None:
        if self._error_body is not None and len(self._error_body) < ERROR_BODY_BYTES:
            self._error_body += body

    def on_message_complete(self) -> None:
        # should_keep_alive() is only meaningful while the parser is in the message.
        keep_alive = self._parser.should_keep_alive()
        reuse = self.reuse
        if self._keep_alive_header is None and reuse.requests_left is None:
            reuse.keep_alive = keep_alive  # the common case, per request
        else:
            reuse.response_done(keep_alive, self._keep_alive_header)
        self.complete = True
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(self.status)

    def error_message(self) -> str:
        return bytes(self._error_body or b"").decode("utf-8", "replace")


class HttpConnection(ResponseReader, asyncio.Protocol):
    """One keep-alive connection carrying one request at a time."""

    def __init__(self) -> None:
        super().__init__()
        self._transport: asyncio.Transport | None = None
        self.closed = False
        # Requests written on this connection, the one in flight included.
        self.requests = 0
        # When the request in flight was written (time.monotonic()); 0.0 when idle.
        self.sent_at = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # One write per request: no reason to let Nagle hold it back.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self.feed(data)
        except httptools.HttpParserError as exc:
            self._fail(ConnectionError(f"malformed HTTP response: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(ConnectionResetError("the server closed the connection"))

    def _fail(self, exc: BaseException) -> None:
        waiter, self._waiter = self._waiter, None
        self.sent_at = 0.0
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def send(self, payload: bytes) -> asyncio.Future[int]:
        """Write a request; the future holds its response status."""
        assert self._transport is not None and self._waiter is None
        self.begin()
        self.requests += 1
        self._waiter = asyncio.get_running_loop().create_future()
        self.sent_at = time.monotonic()
        if self.closed:
            self._fail(ConnectionResetError("the connection was closed before the request"))
        else:
            self._transport.write(payload)
        return self._waiter

    def time_out(self) -> None:
        self._fail(TimeoutError())
        self.close()

    def close(self) -> None:
        self.closed = True
        if self._transport is not None:
            self._transport.abort()


class RequestFailed(Exception):
    """A request got no complete response; ``key`` names why, as error counts do:
    ``timeout``, ``connect ConnectionRefusedError``, ``connection ConnectionResetError``."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(key, message)
        self.key = key
        self.message = message


# A connection class of HttpConnections: HttpConnection or a subclass of it.
C = TypeVar("C", bound=HttpConnection)


class HttpConnections(Generic[C]):
    """Keep-alive connections to one endpoint: idle ones are reused while their server
    allows it, new ones opened on demand, and one watchdog times out requests
    outstanding longer than ``timeout_s``."""

    def __init__(self, endpoint: Endpoint, timeout_s: float, factory: Callable[[], C]) -> None:
        self._endpoint = endpoint
        self._timeout_s = timeout_s
        self._factory = factory
        self._idle: list[C] = []
        self._busy: set[C] = set()
        self._ssl = ssl.create_default_context() if endpoint.tls else None
        self._watchdog: asyncio.Task[None] | None = None
        # Connections opened, and requests sent again after a reused connection failed
        # before its response began.
        self.opened = 0
        self.reconnects = 0

    @property
    def tls(self) -> bool:
        return self._ssl is not None

    async def request(self, payload: bytes) -> C:
        """Send ``payload`` and wait for its whole response; the connection it came on
        (``status``, the mode's parsed body) is returned, already released. Raises
        :class:`RequestFailed` when no complete response came."""
        conn = self._take_idle() or await self._connect()
        try:
            try:
                await conn.send(payload)
            except ConnectionError:
                if conn.requests == 1 or conn.started:
                    raise
                # The server closed the reused connection as the request went out.
                self._release(conn)
                self.reconnects += 1
                conn = await self._connect()
                await conn.send(payload)
        except TimeoutError:
            raise RequestFailed("timeout", f"no response within {self._timeout_s:g} s") from None
        except ConnectionError as exc:
            raise RequestFailed(f"connection {type(exc).__name__}", str(exc)) from None
        except asyncio.CancelledError:
            conn.close()  # its response may still come: never reuse it
            raise
        finally:
            self._release(conn)
        return conn

    def _take_idle(self) -> C | None:
        """An idle connection its server still accepts requests on, marked busy."""
        if self._watchdog is None:
            self._watchdog = asyncio.create_task(self._expire_slow_requests())
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and conn.reuse.reusable():
                self._busy.add(conn)
                return conn
            conn.close()
        return None

    async def _connect(self) -> C:
        """A new connection, marked busy; RequestFailed when the connect fails."""
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(
                self._factory,
                self._endpoint.host,
                self._endpoint.port,
                ssl=self._ssl,
                server_hostname=self._endpoint.host if self._ssl else None,
            )
        except OSError as exc:
            await asyncio.sleep(RECONNECT_PAUSE_S)
            raise RequestFailed(f"connect {type(exc).__name__}", str(exc)) from None
        self.opened += 1
        self._busy.add(conn)
        return conn

    def _release(self, conn: C) -> None:
        """Back to the idle ones after its response, or closed if it cannot be reused."""
        self._busy.discard(conn)
        conn.sent_at = 0.0
        # Expiry and Keep-Alive max are checked when it is taken again.
        if not conn.closed and conn.reuse.keep_alive:
            self._idle.append(conn)
        else:
            conn.close()

    async def _expire_slow_requests(self) -> None:
        """One timer for every connection instead of a wait_for per request."""
        period_s = min(1.0, self._timeout_s / 4)
        while True:
            await asyncio.sleep(period_s)
            deadline = time.monotonic() - self._timeout_s
            for conn in list(self._busy):
                if 0.0 < conn.sent_at < deadline:
                    conn.time_out()

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
        for conn in [*self._idle, *self._busy]:
            conn.close()
        self._idle.clear()
        self._busy.clear()
