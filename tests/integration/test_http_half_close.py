"""A client that shuts down its sending side after its requests (``shutdown(SHUT_WR)``:
``nc -N``, some proxies and load balancers) gets every request it sent in full answered,
then the close; one that closed its socket and went away still has its handler
cancelled. HttpServer in-process, over raw sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from slipstream.server.httpd import HttpRequest, HttpResponse, HttpServer


class Gated:
    """Echoes the request after yielding to the loop for a moment, as a model's handler
    does; `/slow` waits for `release` (noting a cancellation)."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        if request.path == "/slow":
            self.started.set()
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        await asyncio.sleep(0.01)  # the EOF is read meanwhile
        body = f"{request.method} {request.path} {len(request.body)}".encode()
        return HttpResponse(200, body, b"text/plain")


@pytest.fixture
async def server() -> AsyncIterator[tuple[Gated, int]]:
    handler = Gated()
    http = HttpServer(handler, error_body=lambda m: m.encode())
    port = await http.start("127.0.0.1", 0)
    yield handler, port
    handler.release.set()
    await http.shutdown(1.0)


async def half_close(port: int, raw: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Send ``raw``, then shut down the sending side (a FIN), as ``nc -N`` does."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    writer.write_eof()
    await writer.drain()
    return reader, writer


async def until_closed(reader: asyncio.StreamReader, timeout_s: float = 5.0) -> bytes:
    return await asyncio.wait_for(reader.read(), timeout_s)


async def close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


def responses(data: bytes) -> list[bytes]:
    return [b"HTTP/1.1 " + part for part in data.split(b"HTTP/1.1 ")[1:]]


async def test_pipelined_requests_then_a_half_close_are_all_answered_then_closed(
    server: tuple,
) -> None:
    _, port = server
    reader, writer = await half_close(
        port,
        b"POST /a HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\nabc"
        b"POST /b HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n"
        b"GET /c HTTP/1.1\r\nHost: t\r\n\r\n",
    )
    answers = responses(await until_closed(reader))  # the server closes after the last
    assert [a.split(b"\r\n")[0] for a in answers] == [b"HTTP/1.1 200 OK"] * 3, answers
    assert [a.rsplit(b"\r\n\r\n", 1)[1] for a in answers] == [
        b"POST /a 3", b"POST /b 2", b"GET /c 0",
    ]  # fmt: skip
    await close(writer)


async def test_one_request_then_a_half_close_is_answered(server: tuple) -> None:
    _, port = server
    reader, writer = await half_close(port, b"GET /one HTTP/1.1\r\nHost: t\r\n\r\n")
    reply = await until_closed(reader)
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"GET /one 0"), reply
    await close(writer)


async def test_a_half_closed_client_gets_a_slow_answer_after_a_100_continue(
    server: tuple,
) -> None:
    """Still waiting on its handler past the probe delay (0.2 s), the half-closed client
    is sent an interim 100 Continue (what tells a gone client, whose host answers it
    with a reset, from a listening one); its handler is not cancelled."""
    handler, port = server
    reader, writer = await half_close(port, b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n")
    await asyncio.wait_for(handler.started.wait(), 5)
    interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    await asyncio.sleep(0.3)  # the checks after the probe find the client there
    assert not handler.cancelled.is_set()
    handler.release.set()
    reply = await until_closed(reader)
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"GET /slow 0"), reply
    assert b"connection: close" in reply  # written once the EOF was known
    await close(writer)


async def test_an_http10_half_closed_client_is_answered_without_an_interim_response(
    server: tuple,
) -> None:
    handler, port = server
    reader, writer = await half_close(port, b"GET /slow HTTP/1.0\r\n\r\n")
    await asyncio.wait_for(handler.started.wait(), 5)
    await asyncio.sleep(0.5)  # past the probe delay: HTTP/1.0 knows no 1xx
    handler.release.set()
    reply = await until_closed(reader)
    assert reply.startswith(b"HTTP/1.1 200 OK") and reply.endswith(b"GET /slow 0"), reply
    assert b"100 Continue" not in reply and not handler.cancelled.is_set()
    await close(writer)


async def test_a_request_cut_short_by_the_half_close_is_dropped_after_the_ones_before(
    server: tuple,
) -> None:
    _, port = server
    reader, writer = await half_close(
        port,
        b"GET /whole HTTP/1.1\r\nHost: t\r\n\r\n"
        b"POST /cut HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\nabc",
    )
    reply = await until_closed(reader)
    assert responses(reply) == [reply] and reply.endswith(b"GET /whole 0"), reply
    await close(writer)


async def test_a_client_that_closes_its_socket_still_has_its_handler_cancelled(
    server: tuple,
) -> None:
    """The FIN of a full close looks like a half-close; the probe's reset tells them
    apart, and the handler is cancelled (its queued inference dropped)."""
    handler, port = server
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\nGET /next HTTP/1.1\r\nHost: t\r\n\r\n")
    await writer.drain()
    await asyncio.wait_for(handler.started.wait(), 5)
    await close(writer)
    await writer.wait_closed()
    await asyncio.wait_for(handler.cancelled.wait(), 3)
