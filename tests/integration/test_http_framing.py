"""How the HTTP/1.1 server frames what llhttp lets through, over raw sockets: protocol
upgrades, transfer codings, trailers, odd Content-Length values, request targets, and what
pipelined bodies may hold. Each answer is one clear reply, and the requests around it are
still served."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator

import pytest

from slipstream.observability.metrics import TransportMetrics
from slipstream.server import http_connection
from slipstream.server.httpd import (
    HttpLimits,
    HttpRequest,
    HttpResponse,
    HttpServer,
    StreamingResponse,
)

pytestmark = pytest.mark.timeout(10)


async def events() -> AsyncIterator[bytes]:
    for i in range(3):
        yield b"data: %d\n\n" % i


class Echo:
    """Answers each request with what it received; `/hold` waits for `release`, `/sse`
    streams three events."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.requests: list[HttpRequest] = []

    async def __call__(self, request: HttpRequest) -> HttpResponse | StreamingResponse:
        self.requests.append(request)
        if request.path == "/sse":
            return StreamingResponse(200, events())
        if request.path == "/hold":
            await self.release.wait()
        body = f"{request.method} {request.path} {len(request.body)}".encode()
        return HttpResponse(200, body, b"text/plain")


@pytest.fixture
async def served() -> AsyncIterator[tuple[HttpServer, Echo, TransportMetrics, int]]:
    handler = Echo()
    metrics = TransportMetrics()
    limits = HttpLimits(max_body_bytes=4000, max_header_bytes=8192)
    http = HttpServer(handler, error_body=lambda m: m.encode(), limits=limits, metrics=metrics)
    port = await http.start("127.0.0.1", 0)
    yield http, handler, metrics, port
    handler.release.set()
    await http.shutdown(1.0)


async def exchange(port: int, raw: bytes) -> bytes:
    """Send ``raw``; everything the server answers until it closes or goes quiet (0.5 s)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    received = b""
    try:
        while chunk := await asyncio.wait_for(reader.read(65536), 0.5):
            received += chunk
    except TimeoutError:
        pass
    writer.close()
    await writer.wait_closed()
    return received


def statuses(received: bytes) -> list[bytes]:
    """The status of each response in ``received`` (the echoed bodies hold no status line)."""
    return re.findall(rb"HTTP/1\.1 (\d{3}) ", received)


def post(path: bytes, headers: bytes, body: bytes = b"") -> bytes:
    return b"POST " + path + b" HTTP/1.1\r\nHost: t\r\n" + headers + b"\r\n" + body


GET_NEXT = b"GET /next HTTP/1.1\r\nHost: t\r\n\r\n"


async def test_a_request_asking_to_upgrade_is_answered_once_and_the_next_one_served(
    served: tuple,
) -> None:
    # WebSocket, and the h2c upgrade `curl --http2` sends over plain HTTP: the server
    # ignores the upgrade and answers as HTTP/1.1 (it answered 200, then an unasked 400).
    _, _, _, port = served
    for upgrade in (b"websocket", b"h2c"):
        head = b"Connection: Upgrade\r\nUpgrade: " + upgrade + b"\r\n"
        received = await exchange(
            port, b"GET /up HTTP/1.1\r\nHost: t\r\n" + head + b"\r\n" + GET_NEXT
        )
        assert statuses(received) == [b"200", b"200"], received
        assert received.endswith(b"GET /next 0")


@pytest.mark.parametrize(
    "framing",
    [b"Content-Length: 32\r\n\r\n", b"Transfer-Encoding: chunked\r\n\r\n20\r\n"],
)
async def test_a_request_asking_to_upgrade_with_a_body_is_refused_not_split_in_two(
    served: tuple, framing: bytes
) -> None:
    # httptools ends such a request at its head: its body, parsed as HTTP, was a second
    # request (one a proxy forwarding the body would never have checked).
    _, handler, _, port = served
    head = b"POST /up HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
    smuggled = b"GET /admin HTTP/1.1\r\nHost: t\r\n\r\n"
    assert len(smuggled) == 32
    received = await exchange(port, head + framing + smuggled)
    assert statuses(received) == [b"400"] and b"Upgrade may not have a body" in received
    assert not handler.requests


@pytest.mark.parametrize(
    ("headers", "status", "named"),
    [
        (b"Transfer-Encoding: gzip, chunked\r\n", b"501", b"Transfer-Encoding 'gzip, chunked'"),
        (b"Transfer-Encoding: identity, chunked\r\n", b"501", b"not supported"),
    ],
)
async def test_a_transfer_coding_besides_chunked_is_refused_not_ignored(
    served: tuple, headers: bytes, status: bytes, named: bytes
) -> None:
    # Served as if chunked alone, the body reached the handler still gzip-compressed.
    _, handler, _, port = served
    received = await exchange(port, post(b"/te", headers, b"2\r\nhi\r\n0\r\n\r\n"))
    assert statuses(received) == [status] and named in received
    assert not handler.requests


async def test_transfer_encoding_in_http10_is_refused(served: tuple) -> None:
    _, handler, _, port = served
    raw = b"POST /te HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n"
    received = await exchange(port, raw)
    assert statuses(received) == [b"400"] and b"HTTP/1.0" in received
    assert not handler.requests


async def test_trailer_fields_never_reach_the_handler_as_headers(served: tuple) -> None:
    # A trailer could otherwise add a header a proxy in front had stripped or vetted.
    _, handler, _, port = served
    body = b"2\r\nhi\r\n0\r\nAuthorization: Bearer stolen\r\nContent-Encoding: gzip\r\n\r\n"
    received = await exchange(port, post(b"/tr", b"Transfer-Encoding: chunked\r\n", body))
    assert statuses(received) == [b"200"] and received.endswith(b"POST /tr 2")
    assert handler.requests[0].header(b"authorization") is None
    assert handler.requests[0].header(b"content-encoding") is None


async def test_a_trailer_that_never_ends_is_refused_431(served: tuple) -> None:
    # httptools buffers a trailer line as a header: without a bound, 37 MB of one cost
    # 130 MB and the event loop (quadratic copying) for seconds.
    _, _, metrics, port = served
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(post(b"/tr", b"Transfer-Encoding: chunked\r\n", b"2\r\nhi\r\n0\r\nX-T: "))
    for _ in range(20):  # past twice max_header_bytes (8192), the most it may cost
        writer.write(b"t" * 1000)
        await writer.drain()
    reply = await asyncio.wait_for(reader.read(), 5)
    assert reply.startswith(b"HTTP/1.1 431") and b"trailers" in reply
    assert metrics.closed_by_limit["header_too_large"] == 1
    writer.close()
    await writer.wait_closed()
    assert statuses(await exchange(port, GET_NEXT)) == [b"200"]  # another client is served


async def test_chunk_extensions_and_chunk_size_lines_are_held_to_the_limit(served: tuple) -> None:
    _, _, _, port = served
    extension = b";e=" + b"x" * 20_000
    chunked = post(
        b"/ext", b"Transfer-Encoding: chunked\r\n", b"2" + extension + b"\r\nhi\r\n0\r\n\r\n"
    )
    assert statuses(await exchange(port, chunked)) == [b"431"]
    # Short extensions, and many small chunks, are only framing: served.
    body = b"".join(b"1;n=v\r\nx\r\n" for _ in range(900)) + b"0\r\n\r\n"
    received = await exchange(port, post(b"/ext", b"Transfer-Encoding: chunked\r\n", body))
    assert statuses(received) == [b"200"] and received.endswith(b"POST /ext 900")


async def test_a_content_length_past_the_limit_is_refused_before_its_body_however_written(
    served: tuple,
) -> None:
    # Trailing whitespace (llhttp keeps it in the value) skipped the early refusal: the
    # client was told 100 Continue and sent the body it would then be refused.
    _, handler, _, port = served
    head = b"Content-Length: 5000 \r\nExpect: 100-continue\r\n"
    received = await exchange(port, post(b"/cl", head))
    assert statuses(received) == [b"413"] and b"of 5000 bytes" in received
    # Leading zeros are a legal length; 5,000 of them made int() raise in a callback.
    zeros = post(b"/cl", b"Content-Length: " + b"0" * 5000 + b"3\r\n", b"abc")
    assert statuses(await exchange(port, zeros)) == [b"200"]
    huge = post(b"/cl", b"Content-Length: " + b"0" * 100 + b"1" + b"0" * 18 + b"\r\n")
    received = await exchange(port, huge)
    assert statuses(received) == [b"413"] and b"of 1000000000000000000 bytes" in received
    assert len(handler.requests) == 1


async def test_header_values_lose_trailing_whitespace(served: tuple) -> None:
    _, handler, _, port = served
    await exchange(port, b"GET /ws HTTP/1.1\r\nHost: t\r\nX-Key: secret \t\r\n\r\n")
    assert handler.requests[0].header(b"x-key") == b"secret"


async def test_connect_and_a_target_the_url_parser_refuses_get_400_naming_them(
    served: tuple,
) -> None:
    _, handler, _, port = served
    received = await exchange(port, b"CONNECT evil.example:443 HTTP/1.1\r\nHost: t\r\n\r\n")
    assert statuses(received) == [b"400"] and b"CONNECT is not supported" in received
    assert not handler.requests


async def test_expect_continue_is_ignored_for_http10(served: tuple) -> None:
    _, _, _, port = served
    raw = b"POST /e HTTP/1.0\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\nhi"
    assert statuses(await exchange(port, raw)) == [b"200"]


async def test_pipelined_bodies_pause_reading_past_the_body_limit(served: tuple) -> None:
    # Each queued request holds its whole body: 16 of --max-request-bytes (the old pause
    # point) were 1 GiB per connection at the default limit.
    http, handler, _, port = served
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(post(b"/hold", b"Content-Length: 0\r\n"))
    for _ in range(12):  # in one write: a read of the server's takes several at once
        writer.write(post(b"/b", b"Content-Length: 3000\r\n", b"x" * 3000))
    await writer.drain()
    await asyncio.sleep(0.3)
    (connection,) = http._connections
    # Paused once over 4000 queued body bytes; parsing stops within the piece it was fed
    # (8192 bytes: max_header_bytes), what is left waits unparsed.
    assert len(connection._requests) <= 4
    handler.release.set()
    received = b""
    while received.count(b"HTTP/1.1 200") < 13:
        received += await asyncio.wait_for(reader.read(65536), 5)
    assert received.count(b"POST /b 3000") == 12
    writer.close()
    await writer.wait_closed()


async def test_a_fault_in_a_parser_callback_is_logged_and_answered_500(
    served: tuple, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _, _, _, port = served

    def broken(*_: object) -> bool:
        raise RuntimeError("a bug")

    monkeypatch.setattr(http_connection, "check_head", broken)
    with caplog.at_level(logging.ERROR, logger="slipstream.server.http_connection"):
        received = await exchange(port, GET_NEXT)
    assert statuses(received) == [b"500"] and b"a bug" not in received
    assert any(r.exc_info and "a bug" in str(r.exc_info[1]) for r in caplog.records)


async def test_http10_keep_alive_is_announced_so_the_client_keeps_the_connection(
    served: tuple,
) -> None:
    # Without `connection: keep-alive` an HTTP/1.0 client (ab -k) takes the connection
    # to end with the response, and opens a new one for each request.
    _, _, _, port = served
    ask = b"GET /k HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"
    received = await exchange(port, ask + ask)
    assert statuses(received) == [b"200", b"200"]
    assert received.count(b"connection: keep-alive\r\n") == 2


async def test_a_stream_to_an_http10_client_is_sent_unchunked_and_ended_by_the_close(
    served: tuple,
) -> None:
    # HTTP/1.0 has no chunked coding: its client read the chunk-size lines as data.
    _, _, _, port = served
    received = await exchange(port, b"GET /sse HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    head, _, body = received.partition(b"\r\n\r\n")
    assert b"transfer-encoding" not in head and b"connection: close" in head
    assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    chunked = await exchange(port, b"GET /sse HTTP/1.1\r\nHost: t\r\n\r\n")
    assert b"transfer-encoding: chunked" in chunked and chunked.endswith(b"0\r\n\r\n")


async def test_http2_with_prior_knowledge_is_told_this_port_serves_http11(served: tuple) -> None:
    _, _, _, port = served
    received = await exchange(port, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
    assert statuses(received) == [b"400"] and b"HTTP/2 is not served on this port" in received
