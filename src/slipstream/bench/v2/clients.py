"""The clients a worker process sends requests with: HTTP/1.1 (JSON or binary tensors)
and gRPC, each sending pre-encoded bytes and reading back no more than the status.

The HTTP client is a small asyncio protocol over keep-alive connections with
``httptools`` parsing the responses, not aiohttp: against a one-core server aiohttp
spent ~300 us of client CPU per request and sent each request's headers and body in two
writes (which costs the server a second read), and reached ~60% of wrk's throughput on
the same core; this client sends each request in one write and measured within a few
percent of wrk (see ``benchmarks/bench_vs_wrk.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
import ssl
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Generic, TypeVar, cast
from urllib.parse import quote, urlsplit

import httptools

from slipstream.bench.v2.messages import EncodedRequest, Endpoint, Protocol

INFER_METHOD = "/inference.GRPCInferenceService/ModelInfer"
# After a failed connect, pause before the next try so a dead server is not spun on.
_RECONNECT_PAUSE_S = 0.01
# Keep at most this much of an error response's body as the example message.
_ERROR_BODY_BYTES = 2048
# gRPC servers commonly allow 100 concurrent streams per connection: one channel (its
# own connection) per this many outstanding requests.
_STREAMS_PER_CHANNEL = 100


def model_path(endpoint: Endpoint, model: str, version: str) -> str:
    """/v2/models/{m}[/versions/{v}] below the endpoint's path prefix."""
    path = f"{endpoint.path_prefix}/v2/models/{quote(model, safe='')}"
    if version:
        path += f"/versions/{quote(version, safe='')}"
    return path


def parse_endpoint(url: str, protocol: Protocol) -> Endpoint:
    """``http://host:port`` for HTTP, ``host:port`` for gRPC (a scheme is tolerated).

    >>> parse_endpoint("localhost:8001", "grpc")
    Endpoint(protocol='grpc', host='localhost', port=8001, tls=False, path_prefix='')
    """
    if "://" not in url:
        url = ("grpc://" if protocol == "grpc" else "http://") + url
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    known = ("grpc", "grpcs", "http", "https")
    if scheme not in known or not parts.hostname:
        raise ValueError(f"URL {url!r}: expected http://host:port or host:port")
    tls = scheme in ("https", "grpcs")
    default_port = 8001 if protocol == "grpc" else (443 if tls else 80)
    try:
        port = parts.port or default_port
    except ValueError:
        raise ValueError(f"URL {url!r}: the port is not a number") from None
    prefix = "" if protocol == "grpc" else parts.path.rstrip("/")
    return Endpoint(protocol=protocol, host=parts.hostname, port=port, tls=tls, path_prefix=prefix)


class InferClient(ABC):
    """Sends one worker's requests. ``infer`` never raises for a failed request: it
    returns an error key (``"http 400"``, ``"grpc UNAVAILABLE"``, ``"timeout"``,
    ``"connect ConnectionRefusedError"``) so failures are counted, not fatal."""

    def __init__(self) -> None:
        # Error key -> the first message seen with it, shown beside the counts.
        self.error_examples: dict[str, str] = {}

    @abstractmethod
    async def infer(self, index: int) -> str | None:
        """Send pre-encoded request ``index``; None on success, else the error key."""

    @abstractmethod
    async def close(self) -> None:
        """Close every connection; requests still outstanding fail."""

    def _note(self, key: str, message: str) -> str:
        if key not in self.error_examples:
            self.error_examples[key] = message.strip()[:_ERROR_BODY_BYTES]
        return key


def make_client(
    endpoint: Endpoint,
    model: str,
    version: str,
    requests: list[EncodedRequest],
    timeout_s: float,
    max_outstanding: int,
) -> InferClient:
    """The client for the endpoint's protocol; call it inside the worker's event loop."""
    if endpoint.protocol == "grpc":
        return GrpcClient(endpoint, requests, timeout_s, max_outstanding)
    return HttpClient(
        endpoint, model_path(endpoint, model, version) + "/infer", requests, timeout_s
    )


# ---------------------------------------------------------------------------- HTTP


def http_request_bytes(endpoint: Endpoint, path: str, request: EncodedRequest) -> bytes:
    """A complete HTTP/1.1 request: request line, headers and body, for one write."""
    if request.header_length is None:
        content_type = "application/json"
        extra = ""
    else:
        content_type = "application/octet-stream"
        extra = f"Inference-Header-Content-Length: {request.header_length}\r\n"
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {endpoint.address}\r\n"
        f"User-Agent: slipstream-bench\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(request.body)}\r\n{extra}\r\n"
    )
    return head.encode("latin-1") + request.body


class _HttpConnection(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time."""

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._waiter: asyncio.Future[int] | None = None
        self._status = 0
        self._error_body: bytearray | None = None
        self.keep_alive = True
        self.closed = False
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
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ConnectionError(f"malformed HTTP response: {exc}"))
            self.close()

    def on_headers_complete(self) -> None:
        self._status = self._parser.get_status_code()
        self.keep_alive = self._parser.should_keep_alive()
        self._error_body = bytearray() if self._status >= 300 else None

    def on_body(self, body: bytes) -> None:
        if self._error_body is not None and len(self._error_body) < _ERROR_BODY_BYTES:
            self._error_body += body

    def on_message_complete(self) -> None:
        waiter, self._waiter = self._waiter, None
        self.sent_at = 0.0
        if waiter is not None and not waiter.done():
            waiter.set_result(self._status)

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
        self._waiter = asyncio.get_running_loop().create_future()
        self.sent_at = time.monotonic()
        self._transport.write(payload)
        return self._waiter

    def error_message(self) -> str:
        return bytes(self._error_body or b"").decode("utf-8", "replace")

    def time_out(self) -> None:
        self._fail(TimeoutError())
        self.close()

    def close(self) -> None:
        self.closed = True
        if self._transport is not None:
            self._transport.abort()


# A connection class of HttpConnections: _HttpConnection or a subclass of it.
C = TypeVar("C", bound=_HttpConnection)


class HttpConnections(Generic[C]):
    """Keep-alive connections to one endpoint: idle ones are reused, new ones opened on
    demand, and one watchdog times out requests outstanding longer than ``timeout_s``."""

    def __init__(self, endpoint: Endpoint, timeout_s: float, factory: Callable[[], C]) -> None:
        self._endpoint = endpoint
        self._timeout_s = timeout_s
        self._factory = factory
        self._idle: list[C] = []
        self._busy: set[C] = set()
        self._ssl = ssl.create_default_context() if endpoint.tls else None
        self._watchdog: asyncio.Task[None] | None = None

    @property
    def tls(self) -> bool:
        return self._ssl is not None

    def take_idle(self) -> C | None:
        """An open idle connection, marked busy; None when there is none."""
        if self._watchdog is None:
            self._watchdog = asyncio.create_task(self._expire_slow_requests())
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                self._busy.add(conn)
                return conn
        return None

    async def connect(self) -> C:
        """A new connection, marked busy; raises OSError when the connect fails."""
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(
            self._factory,
            self._endpoint.host,
            self._endpoint.port,
            ssl=self._ssl,
            server_hostname=self._endpoint.host if self._ssl else None,
        )
        self._busy.add(conn)
        return conn

    def release(self, conn: C) -> None:
        """Back to the idle ones after its response, or closed if it cannot be reused."""
        self._busy.discard(conn)
        if conn.keep_alive and not conn.closed:
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


class HttpClient(InferClient):
    """HTTP/1.1 keep-alive connections, one per outstanding request, opened on demand."""

    def __init__(
        self, endpoint: Endpoint, path: str, requests: list[EncodedRequest], timeout_s: float
    ) -> None:
        super().__init__()
        self._payloads = [http_request_bytes(endpoint, path, r) for r in requests]
        self._timeout_s = timeout_s
        self._connections = HttpConnections(endpoint, timeout_s, _HttpConnection)

    @property
    def payloads(self) -> list[bytes]:
        """Every request as the bytes written to the socket."""
        return self._payloads

    @property
    def blocking_ok(self) -> bool:
        """Plain HTTP: the blocking single-connection user can send these payloads."""
        return not self._connections.tls

    def note(self, key: str, message: str) -> str:
        """Record an error example under ``key`` (for drivers outside this client)."""
        return self._note(key, message)

    async def infer(self, index: int) -> str | None:
        conn = self._connections.take_idle()
        if conn is None:
            try:
                conn = await self._connections.connect()
            except OSError as exc:
                await asyncio.sleep(_RECONNECT_PAUSE_S)
                return self._note(f"connect {type(exc).__name__}", str(exc))
        try:
            status = await conn.send(self._payloads[index])
        except TimeoutError:
            return self._note("timeout", f"no response within {self._timeout_s:g} s")
        except ConnectionError as exc:
            return self._note(f"connection {type(exc).__name__}", str(exc))
        except asyncio.CancelledError:
            conn.close()  # its response may still come: never reuse it
            raise
        finally:
            self._connections.release(conn)
        if 200 <= status < 300:
            return None
        return self._note(f"http {status}", conn.error_message())

    async def close(self) -> None:
        await self._connections.close()


# ---------------------------------------------------------------------------- gRPC


class GrpcClient(InferClient):
    """grpc.aio unary calls with the serialised request as is and the reply left
    undecoded: no protobuf work per request on the client."""

    def __init__(
        self,
        endpoint: Endpoint,
        requests: list[EncodedRequest],
        timeout_s: float,
        max_outstanding: int,
    ) -> None:
        super().__init__()
        import grpc

        self._grpc: Any = grpc
        self._bodies = [r.body for r in requests]
        self._timeout_s = timeout_s
        options = [
            ("grpc.max_send_message_length", -1),
            ("grpc.max_receive_message_length", -1),
            # Each channel its own connection, so streams spread over several.
            ("grpc.use_local_subchannel_pool", 1),
        ]
        count = max(1, math.ceil(max_outstanding / _STREAMS_PER_CHANNEL))
        if endpoint.tls:
            credentials = grpc.ssl_channel_credentials()
            self._channels = [
                grpc.aio.secure_channel(endpoint.address, credentials, options=options)
                for _ in range(count)
            ]
        else:
            self._channels = [
                grpc.aio.insecure_channel(endpoint.address, options=options) for _ in range(count)
            ]
        self._calls = [channel.unary_unary(INFER_METHOD) for channel in self._channels]
        self._next = 0

    async def infer(self, index: int) -> str | None:
        self._next = (self._next + 1) % len(self._calls)
        try:
            await self._calls[self._next](self._bodies[index], timeout=self._timeout_s)
        except self._grpc.aio.AioRpcError as exc:
            return self._note(f"grpc {exc.code().name}", exc.details() or "")
        return None

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
