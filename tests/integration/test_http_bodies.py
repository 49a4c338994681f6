"""Request bodies across HttpServer's connections, in-process over raw sockets: the
bodies held at once stay within --max-buffered-body-bytes while every upload finishes
(back-pressure, not refusals), a body larger than that budget alone is still taken, and
a compressed body too large to inflate on the event loop is inflated in a worker thread
under the same bounds as a small one.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import zlib
from collections.abc import AsyncIterator

import pytest

from slipstream.server.httpd import HttpLimits, HttpRequest, HttpResponse, HttpServer

MIB = 1024 * 1024
BODY_BYTES = 2 * MIB
BUDGET_BYTES = 4 * MIB
UPLOADS = 16
# asyncio's most in one read: what a connection reading a body when the budget was
# passed may bring before it is paused.
READ_BYTES = 256 * 1024


class Holding:
    """Answers a body's length and digest after holding it `hold_s`, as a model's queue
    does; counts the body bytes its calls hold at once."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self.held_bytes = 0
        self.peak_bytes = 0

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        self.held_bytes += len(request.body)
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        try:
            await asyncio.sleep(self.hold_s)
        finally:
            self.held_bytes -= len(request.body)
        digest = hashlib.sha256(request.body).hexdigest()
        return HttpResponse(200, f"{len(request.body)} {digest}".encode(), b"text/plain")


async def serve(handler: Holding, limits: HttpLimits) -> AsyncIterator[tuple[HttpServer, int]]:
    http = HttpServer(handler, error_body=lambda m: m.encode(), limits=limits)
    port = await http.start("127.0.0.1", 0)
    yield http, port
    await http.shutdown(1.0)


@pytest.fixture
async def budgeted() -> AsyncIterator[tuple[HttpServer, Holding, int]]:
    handler = Holding(0.3)
    limits = HttpLimits(max_body_bytes=BODY_BYTES, max_buffered_body_bytes=BUDGET_BYTES)
    async for http, port in serve(handler, limits):
        yield http, handler, port


def payload(index: int, size: int = BODY_BYTES) -> bytes:
    return bytes([index % 251]) * size


async def upload(port: int, body: bytes, chunked: bool = False) -> bytes:
    """POST ``body`` in 64 KiB writes, each waiting for the socket to take it (as chunks
    of that size when ``chunked``); the reply (the connection closes after it)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    framing = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % len(body)
    writer.write(b"POST /u HTTP/1.1\r\nHost: t\r\nConnection: close\r\n" + framing + b"\r\n\r\n")
    for start in range(0, len(body), 65536):
        piece = body[start : start + 65536]
        writer.write(b"%x\r\n%b\r\n" % (len(piece), piece) if chunked else piece)
        await writer.drain()
    if chunked:
        writer.write(b"0\r\n\r\n")
    reply = await asyncio.wait_for(reader.read(), 60)
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return reply


def answer(body: bytes) -> bytes:
    return b"%d %s" % (len(body), hashlib.sha256(body).hexdigest().encode())


async def test_bodies_held_at_once_stay_within_the_budget_and_every_upload_finishes(
    budgeted: tuple,
) -> None:
    """16 uploads of 2 MiB at once (half chunked), each held 0.3 s by its handler, with a
    4 MiB budget: all answered with their bodies intact, and the handlers never hold
    more than the budget allows (without it, all 32 MiB at once)."""
    http, handler, port = budgeted
    bodies = [payload(i) for i in range(UPLOADS)]
    replies = await asyncio.wait_for(
        asyncio.gather(*(upload(port, body, i % 2 == 1) for i, body in enumerate(bodies))), 120
    )
    for body, reply in zip(bodies, replies, strict=True):
        assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(answer(body)), reply[:200]
    # The budget, one body finishing past it, and a read for each connection that was
    # reading a body when the budget filled.
    bound = BUDGET_BYTES + BODY_BYTES + UPLOADS * READ_BYTES
    assert handler.peak_bytes <= bound, f"handlers held {handler.peak_bytes / MIB:.1f} MiB"
    assert http.body_budget.held_bytes == 0 and http.body_budget.receiving_bytes == 0
    assert not http.body_budget.waiters and http.body_budget.privileged is None


async def test_uploads_filling_the_budget_with_partial_bodies_all_finish() -> None:
    """Handlers that answer at once, so only bodies still arriving hold the budget: the
    longest-waiting connection is let past it each time, and none waits forever."""
    limits = HttpLimits(max_body_bytes=BODY_BYTES, max_buffered_body_bytes=BUDGET_BYTES)
    async for http, port in serve(Holding(0.0), limits):
        bodies = [payload(i) for i in range(UPLOADS)]
        replies = await asyncio.wait_for(
            asyncio.gather(*(upload(port, body, i % 3 == 0) for i, body in enumerate(bodies))),
            120,
        )
        for body, reply in zip(bodies, replies, strict=True):
            assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(answer(body)), reply
        assert http.body_budget.held_bytes == 0


async def test_a_body_larger_than_the_whole_budget_is_still_taken() -> None:
    limits = HttpLimits(max_body_bytes=4 * MIB, max_buffered_body_bytes=MIB)
    async for _, port in serve(Holding(0.05), limits):
        bodies = [payload(1, 3 * MIB), payload(2, 3 * MIB + 7)]
        replies = await asyncio.wait_for(
            asyncio.gather(upload(port, bodies[0]), upload(port, bodies[1], chunked=True)), 60
        )
        for body, reply in zip(bodies, replies, strict=True):
            assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(answer(body)), reply


# -- compressed bodies inflated off the event loop ----------------------------------------


@pytest.fixture
async def inflating() -> AsyncIterator[tuple[HttpServer, int]]:
    async for http, port in serve(Holding(0.0), HttpLimits(max_body_bytes=4 * MIB)):
        yield http, port


def zipped(body: bytes, coding: bytes = b"gzip", keep_alive: bool = True) -> bytes:
    head = b"POST /z HTTP/1.1\r\nHost: t\r\nContent-Encoding: %b\r\nContent-Length: %d\r\n"
    close = b"" if keep_alive else b"Connection: close\r\n"
    return head % (coding, len(body)) + close + b"\r\n" + body


async def exchange(port: int, raw: bytes) -> bytes:
    """Send ``raw``; everything the server sends until it closes (bounded)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    reply = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return reply


async def test_a_large_compressed_body_is_inflated_in_order_with_those_around_it(
    inflating: tuple,
) -> None:
    http, port = inflating
    large = bytes(range(256)) * (3 * MIB // 256)  # past what is inflated on the loop
    small = b"s" * 100
    raw = (
        zipped(gzip.compress(small))
        + zipped(gzip.compress(large))
        + zipped(zlib.compress(large), b"deflate")
        + zipped(zlib.compress(large, wbits=-zlib.MAX_WBITS), b"deflate")
        + zipped(gzip.compress(small), keep_alive=False)
    )
    replies = (await exchange(port, raw)).split(b"HTTP/1.1 ")[1:]
    expected = [answer(small), *[answer(large)] * 3, answer(small)]
    assert len(replies) == len(expected), [r[:80] for r in replies]
    for reply, body_answer in zip(replies, expected, strict=True):
        assert reply.startswith(b"200") and reply.endswith(body_answer), reply[:80]
    assert http.body_budget.held_bytes == 0


async def test_a_large_compressed_body_is_held_to_the_limits_as_a_small_one(
    inflating: tuple,
) -> None:
    """Refused once inflated past --max-request-bytes (413), or when cut short (400):
    the requests before it are answered, the one behind it dropped with the connection."""
    _, port = inflating
    before = zipped(gzip.compress(b"b" * 10))
    behind = b"GET /behind HTTP/1.1\r\nHost: t\r\n\r\n"
    bomb = gzip.compress(bytes(4 * MIB + 1))  # 4 KiB sent, one byte past the limit inflated
    reply = await exchange(port, before + zipped(bomb) + behind)
    assert reply.startswith(b"HTTP/1.1 200") and reply.count(b"HTTP/1.1 ") == 2, reply
    assert b"HTTP/1.1 413" in reply and b"once decoded from gzip" in reply
    cut = gzip.compress(bytes(range(256)) * 8192)[:-100]  # 2 MiB once inflated, no end
    reply = await exchange(port, before + zipped(cut) + behind)
    assert reply.count(b"HTTP/1.1 ") == 2 and b"HTTP/1.1 400" in reply, reply
    assert b"truncated" in reply and b"/behind" not in reply
