"""The HTTP/1.1 server itself, over raw sockets: framing, keep-alive, limits, cancellation."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from slipstream.server.httpd import (
    HttpRequest,
    HttpResponse,
    HttpServer,
    StreamingResponse,
)


class Recorder:
    """Echoes the request; `/slow` waits until released or cancelled."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        # Set when a /slow request reaches the handler (and starts waiting for release).
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.stream_closed = asyncio.Event()

    async def events(self, count: int | None) -> AsyncIterator[bytes]:
        """``count`` events, or endless ones (until the client goes away)."""
        sent = 0
        try:
            while count is None or sent < count:
                yield b"data: %d\n\n" % sent
                sent += 1
                await asyncio.sleep(0.01)
        finally:
            self.stream_closed.set()

    async def __call__(self, request: HttpRequest) -> HttpResponse | StreamingResponse:
        if request.path == "/stream":
            return StreamingResponse(200, self.events(3))
        if request.path == "/endless":
            return StreamingResponse(200, self.events(None))
        if request.path == "/slow":
            self.started.set()
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        if request.path == "/boom":
            raise RuntimeError("handler bug")
        body = f"{request.method} {request.path} {len(request.body)}".encode()
        return HttpResponse(200, body, b"text/plain", [(b"x-echo", request.query or b"-")])


@pytest.fixture
async def server() -> AsyncIterator[tuple[HttpServer, Recorder, int]]:
    handler = Recorder()
    http = HttpServer(
        handler, max_body_bytes=1000, error_body=lambda m: m.encode(), keep_alive_timeout_s=0.5
    )
    port = await http.start("127.0.0.1", 0)
    yield http, handler, port
    await http.shutdown(1.0)


async def exchange(port: int, raw: bytes, read_until_close: bool = False) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    if read_until_close:
        data = await asyncio.wait_for(reader.read(), 5)
    else:
        data = await asyncio.wait_for(reader.read(65536), 5)
    writer.close()
    await writer.wait_closed()
    return data


async def test_pipelined_requests_are_answered_in_order(server: tuple) -> None:
    _, _, port = server
    raw = (
        b"POST /a?x=1 HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\nabc"
        b"GET /b HTTP/1.1\r\nHost: t\r\n\r\n"
        b"POST /c HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"2\r\nhi\r\n3\r\nyou\r\n0\r\n\r\n"
        b"GET /d HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    )
    data = await exchange(port, raw, read_until_close=True)
    bodies = [part.split(b"\r\n\r\n", 1)[1][:20] for part in data.split(b"HTTP/1.1 200 OK")[1:]]
    assert [b.split(b"HTTP")[0] for b in bodies] == [
        b"POST /a 3", b"GET /b 0", b"POST /c 5", b"GET /d 0",
    ]  # fmt: skip
    assert b"x-echo: x=1" in data
    assert data.rstrip().endswith(b"GET /d 0") and b"connection: close" in data


async def test_expect_continue_head_and_http10(server: tuple) -> None:
    _, _, port = server
    data = await exchange(
        port, b"POST /e HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\nok"
    )
    assert data.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK")
    head = await exchange(port, b"HEAD /h HTTP/1.1\r\nHost: t\r\n\r\n")
    assert b"content-length: 9\r\n" in head and head.endswith(b"\r\n\r\n")
    old = await exchange(port, b"GET /old HTTP/1.0\r\n\r\n", read_until_close=True)
    assert old.endswith(b"GET /old 0")  # HTTP/1.0 without keep-alive: closed after reply


async def test_oversized_and_malformed_requests_are_refused(server: tuple) -> None:
    _, _, port = server
    big = await exchange(
        port, b"POST /big HTTP/1.1\r\nHost: t\r\nContent-Length: 5000\r\n\r\n", True
    )
    assert big.startswith(b"HTTP/1.1 413") and b"exceeds the limit of 1000 bytes" in big
    chunked = b"".join(b"64\r\n" + b"x" * 100 + b"\r\n" for _ in range(12))
    data = await exchange(
        port,
        b"POST /c HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked,
        read_until_close=True,
    )
    assert data.startswith(b"HTTP/1.1 413")
    bad = await exchange(port, b"NOT HTTP AT ALL\r\n\r\n", read_until_close=True)
    assert bad.startswith(b"HTTP/1.1 400") and b"malformed" in bad
    boom = await exchange(port, b"GET /boom HTTP/1.1\r\nHost: t\r\n\r\n")
    assert boom.startswith(b"HTTP/1.1 500") and b"handler bug" not in boom


async def test_disconnect_cancels_the_handler(server: tuple) -> None:
    _, handler, port = server
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n")
    await writer.drain()
    await asyncio.wait_for(handler.started.wait(), 5)
    writer.close()
    await writer.wait_closed()
    await asyncio.wait_for(handler.cancelled.wait(), 2)


async def test_streamed_responses_are_chunked_and_keep_the_connection(server: tuple) -> None:
    _, _, port = server
    reply = await exchange(
        port,
        b"GET /stream HTTP/1.1\r\nHost: t\r\n\r\nGET /after HTTP/1.1\r\nHost: t\r\n"
        b"Connection: close\r\n\r\n",
        read_until_close=True,
    )
    head, _, rest = reply.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head and b"text/event-stream" in head
    events = b"".join(b"%x\r\ndata: %d\n\n\r\n" % (len(b"data: 0\n\n"), i) for i in range(3))
    assert rest.startswith(events + b"0\r\n\r\n")
    # The next pipelined request on the same connection is still answered.
    assert rest.endswith(b"GET /after 0")


async def test_a_disconnect_mid_stream_closes_the_stream(server: tuple) -> None:
    _, handler, port = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /endless HTTP/1.1\r\nHost: t\r\n\r\n")
    await writer.drain()
    assert b"data: 0" in await asyncio.wait_for(reader.read(4096), 5)
    writer.close()
    await writer.wait_closed()
    await asyncio.wait_for(handler.stream_closed.wait(), 2)


async def test_idle_keep_alive_connections_are_closed(server: tuple) -> None:
    _, _, port = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n")
    assert (await reader.read(1000)).startswith(b"HTTP/1.1 200")
    # The sweep runs every min(5, timeout) s; the connection goes within two sweeps.
    assert await asyncio.wait_for(reader.read(), 3) == b""
    writer.close()
    await writer.wait_closed()


async def test_shutdown_lets_the_request_in_flight_finish(server: tuple) -> None:
    http, handler, port = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n")
    await writer.drain()
    await asyncio.wait_for(handler.started.wait(), 5)
    stopping = asyncio.ensure_future(http.shutdown(5.0))
    await asyncio.sleep(0)  # one loop turn: shutdown has stopped accepting and now waits
    handler.release.set()
    reply = await asyncio.wait_for(reader.read(), 3)
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"GET /slow 0")
    await stopping
    writer.close()
    await writer.wait_closed()
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)
