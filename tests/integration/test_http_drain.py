"""HttpServer's graceful shutdown over raw sockets: what each client gets while the server
drains (README: in-flight requests finish, new ones are refused) and when
--shutdown-timeout-s runs out (503 with Retry-After, never a connection cut unanswered).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest

from slipstream.server.httpd import HttpRequest, HttpResponse, HttpServer, StreamingResponse

GET_SLOW = b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n"


class Gated:
    """Echoes the request; `/slow` waits for `release`, `/stubborn` ignores cancellation,
    `/endless` streams until the stream is closed."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.stream_closed = asyncio.Event()
        self.paths: list[str] = []

    async def events(self) -> AsyncIterator[bytes]:
        try:
            while True:
                yield b"data: x\n\n"
                await asyncio.sleep(0.01)
        finally:
            self.stream_closed.set()

    async def __call__(self, request: HttpRequest) -> HttpResponse | StreamingResponse:
        self.paths.append(request.path)
        if request.path == "/endless":
            return StreamingResponse(200, self.events())
        if request.path == "/slow":
            self.started.set()
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        if request.path == "/stubborn":
            self.started.set()
            with contextlib.suppress(asyncio.CancelledError):
                await self.release.wait()
            await self.release.wait()
        body = f"{request.method} {request.path} {len(request.body)}".encode()
        return HttpResponse(200, body, b"text/plain")


@pytest.fixture
async def server() -> AsyncIterator[tuple[HttpServer, Gated, int]]:
    handler = Gated()
    http = HttpServer(handler, error_body=lambda m: m.encode())
    port = await http.start("127.0.0.1", 0)
    yield http, handler, port
    handler.release.set()
    await http.shutdown(1.0)


async def connect(port: int, raw: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    return reader, writer


async def until_closed(reader: asyncio.StreamReader, timeout_s: float = 5.0) -> bytes:
    """Everything the server sends until it closes (bounded wait)."""
    return await asyncio.wait_for(reader.read(), timeout_s)


def responses(data: bytes) -> list[bytes]:
    """The responses in ``data``, each from its status line."""
    return [b"HTTP/1.1 " + part for part in data.split(b"HTTP/1.1 ")[1:]]


async def poll(condition: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)
    assert condition(), what


async def test_a_response_finished_during_the_drain_says_close(server: tuple) -> None:
    http, handler, port = server
    # A pooled client: one request answered, the connection kept, then one in flight.
    reader, writer = await connect(port, b"GET /a HTTP/1.1\r\nHost: t\r\n\r\n")
    first = await asyncio.wait_for(reader.readuntil(b"GET /a 0"), 5)
    assert b"connection: close" not in first
    writer.write(GET_SLOW)
    await asyncio.wait_for(handler.started.wait(), 5)
    stopping = asyncio.ensure_future(http.shutdown(5.0))
    await asyncio.sleep(0)
    handler.release.set()
    reply = await until_closed(reader)
    # Without the header the client would reuse the connection the server then closes.
    assert reply.startswith(b"HTTP/1.1 200") and b"\r\nconnection: close\r\n" in reply, reply
    assert reply.endswith(b"GET /slow 0")
    await asyncio.wait_for(stopping, 5)
    writer.close()


async def test_an_idle_keep_alive_connection_closes_at_once(server: tuple) -> None:
    http, handler, port = server
    idle_reader, idle_writer = await connect(port, b"GET /a HTTP/1.1\r\nHost: t\r\n\r\n")
    await asyncio.wait_for(idle_reader.readuntil(b"GET /a 0"), 5)
    _, busy_writer = await connect(port, GET_SLOW)
    await asyncio.wait_for(handler.started.wait(), 5)
    stopping = asyncio.ensure_future(http.shutdown(30.0))
    # Closed while the other connection still drains, not when the drain ends.
    assert await until_closed(idle_reader) == b""
    assert not stopping.done()
    handler.release.set()
    await asyncio.wait_for(stopping, 5)
    idle_writer.close()
    busy_writer.close()


async def test_pipelined_requests_received_before_the_drain_are_answered(server: tuple) -> None:
    http, handler, port = server
    pipelined = GET_SLOW + (
        b"GET /a HTTP/1.1\r\nHost: t\r\n\r\n"
        b"POST /b HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\nabc"
    )
    reader, writer = await connect(port, pipelined)
    await asyncio.wait_for(handler.started.wait(), 5)
    stopping = asyncio.ensure_future(http.shutdown(5.0))
    await asyncio.sleep(0)
    handler.release.set()
    answers = responses(await until_closed(reader))
    assert [a.split(b"\r\n\r\n")[1] for a in answers] == [
        b"GET /slow 0", b"GET /a 0", b"POST /b 3",
    ]  # fmt: skip
    # Only the last says close: the client reads the other answers on the connection.
    assert [b"connection: close" in a for a in answers] == [False, False, True]
    await asyncio.wait_for(stopping, 5)
    writer.close()


async def test_a_request_half_received_when_the_drain_starts_is_served(server: tuple) -> None:
    http, _, port = server
    head = b"POST /p HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n"
    reader, writer = await connect(port, head)
    # The 100 Continue says the server has parsed the head; the body is still to come.
    await asyncio.wait_for(reader.readuntil(b"100 Continue\r\n\r\n"), 5)
    stopping = asyncio.ensure_future(http.shutdown(5.0))
    await asyncio.sleep(0)
    writer.write(b"abc")
    reply = await until_closed(reader)
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"POST /p 3"), reply
    assert b"connection: close" in reply
    await asyncio.wait_for(stopping, 5)
    writer.close()


async def test_a_request_begun_after_the_drain_starts_is_refused_503(server: tuple) -> None:
    http, handler, port = server
    reader, writer = await connect(port, GET_SLOW)
    await asyncio.wait_for(handler.started.wait(), 5)
    stopping = asyncio.ensure_future(http.shutdown(5.0))
    await asyncio.sleep(0)
    writer.write(b"POST /late HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\nhi")
    (connection,) = http._connections
    await poll(lambda: connection._final_reply is not None, "the late request refused")
    handler.release.set()
    slow, late = responses(await until_closed(reader))
    assert slow.startswith(b"HTTP/1.1 200") and slow.endswith(b"GET /slow 0")
    assert late.startswith(b"HTTP/1.1 503") and b"shutting down" in late, late
    assert b"\r\nretry-after: 1\r\n" in late and b"\r\nconnection: close\r\n" in late
    assert handler.paths == ["/slow"]  # the refused request never reached the handler
    writer.close()  # a client done reading closes: the server stops lingering
    await asyncio.wait_for(stopping, 5)


async def test_at_the_shutdown_timeout_what_is_left_is_answered_503(server: tuple) -> None:
    http, handler, port = server
    running, running_writer = await connect(port, GET_SLOW + b"GET /a HTTP/1.1\r\nHost: t\r\n\r\n")
    await asyncio.wait_for(handler.started.wait(), 5)
    head = b"POST /p HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n"
    partial, partial_writer = await connect(port, head)
    await asyncio.wait_for(partial.readuntil(b"100 Continue\r\n\r\n"), 5)
    stopping = asyncio.ensure_future(http.shutdown(0.2))
    # The running request and the one pipelined behind it: each answered, in order.
    answers = responses(await until_closed(running))
    assert [a[:12] for a in answers] == [b"HTTP/1.1 503"] * 2, answers
    assert all(b"retry-after: 1" in a and b"shutting down" in a for a in answers)
    assert b"connection: close" in answers[-1]
    assert handler.cancelled.is_set()  # its inference was dropped, not left running
    assert handler.paths == ["/slow"]
    # The request whose body never came is answered too.
    late = await until_closed(partial)
    assert late.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in late, late
    running_writer.close()
    partial_writer.close()
    await asyncio.wait_for(stopping, 5)


async def test_at_the_shutdown_timeout_a_stream_is_cut_short(server: tuple) -> None:
    http, handler, port = server
    reader, writer = await connect(port, b"GET /endless HTTP/1.1\r\nHost: t\r\n\r\n")
    await asyncio.wait_for(reader.readuntil(b"data: x"), 5)
    await asyncio.wait_for(http.shutdown(0.2), 5)
    rest = await until_closed(reader)
    assert not rest.endswith(b"0\r\n\r\n")  # no last chunk: the client sees it cut short
    await asyncio.wait_for(handler.stream_closed.wait(), 2)
    writer.close()


async def test_a_handler_that_ignores_cancellation_cannot_hold_the_shutdown(
    server: tuple,
) -> None:
    http, handler, port = server
    reader, writer = await connect(port, b"GET /stubborn HTTP/1.1\r\nHost: t\r\n\r\n")
    await asyncio.wait_for(handler.started.wait(), 5)
    await asyncio.wait_for(http.shutdown(0.2), 5)  # the timeout, then a grace: aborted
    assert not http._connections
    with contextlib.suppress(ConnectionError):
        assert await until_closed(reader) == b""
    writer.close()
