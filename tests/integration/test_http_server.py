"""The HTTP/1.1 server itself, over raw sockets: framing, keep-alive, limits, cancellation."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import zlib
from collections.abc import AsyncIterator, Callable

import pytest

from slipstream.observability.metrics import TransportMetrics
from slipstream.server import http_connection, httpd
from slipstream.server.httpd import (
    HttpLimits,
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
    limits = HttpLimits(max_body_bytes=1000, keep_alive_timeout_s=0.5)
    http = HttpServer(handler, error_body=lambda m: m.encode(), limits=limits)
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


async def test_a_request_without_host_or_with_two_is_refused_400(server: tuple) -> None:
    """RFC 9112 3.2: an HTTP/1.1 request without Host, or any request with two Host
    lines (a proxy may route by one, the server read the other), gets 400."""
    _, _, port = server
    missing = await exchange(port, b"GET /h HTTP/1.1\r\nAccept: */*\r\n\r\n", True)
    assert missing.startswith(b"HTTP/1.1 400") and b"needs a Host header" in missing, missing
    assert b"connection: close" in missing
    two = await exchange(port, b"GET /h HTTP/1.1\r\nHost: a\r\nHOST: b\r\n\r\n", True)
    assert two.startswith(b"HTTP/1.1 400") and b"2 Host header lines" in two, two
    two_old = await exchange(port, b"GET /h HTTP/1.0\r\nHost: a\r\nHost: b\r\n\r\n", True)
    assert two_old.startswith(b"HTTP/1.1 400"), two_old
    # The request before a refused one is answered first.
    both = await exchange(port, b"GET /a HTTP/1.1\r\nHost: t\r\n\r\nGET /b HTTP/1.1\r\n\r\n", True)
    assert both.startswith(b"HTTP/1.1 200") and both.index(b"GET /a 0") < both.index(b" 400 ")
    # Still served: HTTP/1.0 without Host, and an empty Host (a target with no authority).
    old = await exchange(port, b"GET /old HTTP/1.0\r\n\r\n", read_until_close=True)
    assert old.startswith(b"HTTP/1.1 200") and old.endswith(b"GET /old 0"), old
    empty = await exchange(port, b"GET /e HTTP/1.1\r\nHost:\r\n\r\n")
    assert empty.startswith(b"HTTP/1.1 200") and empty.endswith(b"GET /e 0"), empty


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


@pytest.mark.parametrize(
    ("coding", "compress"),
    [
        (b"gzip", gzip.compress),
        (b"deflate", zlib.compress),  # zlib's format: HTTP's deflate, tritonclient's
        (b"deflate", lambda data: zlib.compress(data, wbits=-zlib.MAX_WBITS)),  # raw
    ],
)
async def test_a_compressed_body_reaches_the_handler_decoded_and_held_to_the_limit(
    server: tuple, coding: bytes, compress: Callable[[bytes], bytes]
) -> None:
    _, _, port = server

    def post(body: bytes, encoding: bytes = coding) -> bytes:
        return (
            b"POST /z HTTP/1.1\r\nHost: t\r\nContent-Encoding: " + encoding
            + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )  # fmt: skip

    served = await exchange(port, post(compress(b"x" * 1000)) + post(compress(b"y" * 7)))
    assert served.count(b"HTTP/1.1 200") == 2 and b"POST /z 1000" in served, served
    assert b"POST /z 7" in served
    # 1,001 bytes decoded: past the 1,000-byte limit, though the body sent is tiny.
    bomb = await exchange(port, post(compress(b"x" * 1001)), read_until_close=True)
    assert bomb.startswith(b"HTTP/1.1 413") and b"once decoded from" in bomb, bomb
    corrupt = await exchange(port, post(b"not compressed"), read_until_close=True)
    assert corrupt.startswith(b"HTTP/1.1 400") and b"not valid " + coding in corrupt
    cut = await exchange(port, post(compress(b"z" * 500)[:-6]), read_until_close=True)
    assert cut.startswith(b"HTTP/1.1 400"), cut
    unknown = await exchange(port, post(b"abc", b"br"), read_until_close=True)
    assert unknown.startswith(b"HTTP/1.1 415") and b"'br' is not supported" in unknown
    plain = await exchange(port, post(b"abc", b"identity"))
    assert plain.startswith(b"HTTP/1.1 200") and plain.endswith(b"POST /z 3")


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


# -- limits on what one client may cost ------------------------------------------------

LIMITS = HttpLimits(
    max_body_bytes=1000,
    max_header_bytes=1024,
    max_header_count=10,
    header_timeout_s=0.4,
    body_timeout_s=0.4,
    keep_alive_timeout_s=30.0,
    max_connections=4,
)


@pytest.fixture
async def limited() -> AsyncIterator[tuple[HttpServer, Recorder, TransportMetrics, int]]:
    handler = Recorder()
    metrics = TransportMetrics()
    http = HttpServer(handler, error_body=lambda m: m.encode(), limits=LIMITS, metrics=metrics)
    port = await http.start("127.0.0.1", 0)
    yield http, handler, metrics, port
    handler.release.set()
    await http.shutdown(1.0)


def head_of(size: int, path: bytes = b"/h") -> bytes:
    """A GET whose request line and headers are exactly ``size`` bytes."""
    start = b"GET " + path + b" HTTP/1.1\r\nHost: t\r\nX-Pad: "
    return start + b"a" * (size - len(start) - 4) + b"\r\n\r\n"


async def until_closed(reader: asyncio.StreamReader, timeout_s: float = 5.0) -> bytes:
    """Everything the server sends until it closes (bounded wait)."""
    return await asyncio.wait_for(reader.read(), timeout_s)


async def test_a_head_at_the_limit_is_served_and_one_byte_more_is_refused(limited: tuple) -> None:
    _, _, metrics, port = limited
    assert (await exchange(port, head_of(1024))).startswith(b"HTTP/1.1 200")
    refused = await exchange(port, head_of(1025), read_until_close=True)
    assert refused.startswith(b"HTTP/1.1 431") and b"--max-header-bytes" in refused
    assert b"connection: close" in refused
    long_url = await exchange(port, head_of(600, b"/" + b"u" * 1200), read_until_close=True)
    assert long_url.startswith(b"HTTP/1.1 414")
    assert metrics.closed_by_limit["header_too_large"] == 1
    assert metrics.closed_by_limit["uri_too_long"] == 1


async def test_an_unterminated_header_is_refused_as_it_arrives(limited: tuple) -> None:
    http, _, _, port = limited
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nHost: t\r\nX-Endless: ")
    # In writes of 300 bytes: the refusal must come once the head passes 1024 bytes,
    # counting bytes the parser holds in a header value that has not ended.
    for _ in range(4):
        writer.write(b"b" * 300)
        await writer.drain()
    reply = await until_closed(reader)
    assert reply.startswith(b"HTTP/1.1 431")
    writer.close()
    await writer.wait_closed()
    # One huge header in one write is refused the same way.
    huge = await exchange(port, b"GET / HTTP/1.1\r\nX: " + b"c" * 4_000_000, True)
    assert huge.startswith(b"HTTP/1.1 431")
    await poll(lambda: not http._connections, "connections released")


async def test_a_refused_client_that_keeps_sending_is_reset_past_the_budget(
    limited: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What refused clients send after their refusal is read and dropped (so each can
    read its 431) within a budget the server shares; one that streams past it is reset,
    and nothing more it sends is copied out of the kernel."""
    http, _, metrics, port = limited
    monkeypatch.setattr(httpd, "_DISCARD_BURST_BYTES", 1_000_000)
    monkeypatch.setattr(httpd, "_DISCARD_BYTES_S", 1000)
    http._discard_budget = 1_000_000.0
    discarded = 0
    received = http_connection.Connection.data_received

    def counting(connection: http_connection.Connection, data: bytes) -> None:
        nonlocal discarded
        if connection._input_closed:
            discarded += len(data)
        received(connection, data)

    monkeypatch.setattr(http_connection.Connection, "data_received", counting)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nHost: t\r\nX-Endless: ")
    status = asyncio.ensure_future(reader.readuntil(b"\r\n\r\n"))
    # Until the server resets the connection (or stops reading it: the writes then wait).
    with contextlib.suppress(ConnectionError, TimeoutError):
        for _ in range(64):  # 8 MB in all, far past the budget
            writer.write(b"b" * 131072)
            await asyncio.wait_for(writer.drain(), 0.5)
    assert (await status).startswith(b"HTTP/1.1 431")
    await poll(lambda: metrics.closed_by_limit["discard_budget"] == 1, "reset")
    assert discarded <= 1_000_000 + 2 * 262144  # the budget, and the reads that crossed it
    await poll(lambda: not http._connections, "the connection closed before its linger ended")
    writer.close()


async def test_a_refusal_is_answered_after_the_pipelined_requests_before_it(
    limited: tuple,
) -> None:
    _, handler, _, port = limited
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\nGET / HTTP/1.1\r\nX: " + b"z" * 3000)
    await writer.drain()
    await asyncio.wait_for(handler.started.wait(), 5)
    handler.release.set()
    reply = await until_closed(reader)
    assert reply.startswith(b"HTTP/1.1 200") and reply.index(b"GET /slow 0") < reply.index(
        b"HTTP/1.1 431"
    )
    writer.close()
    await writer.wait_closed()


async def test_each_413_for_body_size_is_counted_as_a_limit_close(limited: tuple) -> None:
    _, _, metrics, port = limited
    declared = await exchange(
        port, b"POST /big HTTP/1.1\r\nHost: t\r\nContent-Length: 5000\r\n\r\n", True
    )
    assert declared.startswith(b"HTTP/1.1 413") and b"connection: close" in declared
    assert metrics.closed_by_limit["body_too_large"] == 1
    chunked = b"".join(b"64\r\n" + b"x" * 100 + b"\r\n" for _ in range(12))
    sent = b"POST /c HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked
    assert (await exchange(port, sent, True)).startswith(b"HTTP/1.1 413")
    assert metrics.closed_by_limit["body_too_large"] == 2
    bomb = gzip.compress(b"x" * 1001)  # within the limit as sent, past it once decoded
    zipped = b"POST /z HTTP/1.1\r\nHost: t\r\nContent-Encoding: gzip\r\nContent-Length: %d"
    assert (await exchange(port, zipped % len(bomb) + b"\r\n\r\n" + bomb, True)).startswith(
        b"HTTP/1.1 413"
    )
    assert metrics.closed_by_limit["body_too_large"] == 3


async def test_too_many_headers_are_refused(limited: tuple) -> None:
    _, _, _, port = limited
    headers = b"Host: t\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(10))  # 11 lines
    reply = await exchange(port, b"GET / HTTP/1.1\r\n" + headers + b"\r\n", True)
    assert reply.startswith(b"HTTP/1.1 431") and b"--max-header-count" in reply
    ten = b"Host: t\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(9))
    assert (await exchange(port, b"GET / HTTP/1.1\r\n" + ten + b"\r\n")).startswith(b"HTTP/1.1 200")


async def test_a_pipelined_burst_far_past_the_header_limit_is_served(limited: tuple) -> None:
    _, _, _, port = limited
    # 100 requests (about 9 KB, nine times the head limit) in one write: each head is
    # small, so none is refused.
    one = b"POST /p HTTP/1.1\r\nHost: t\r\nContent-Length: 20\r\n\r\n" + b"x" * 20
    last = b"GET /last HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    data = await exchange(port, one * 99 + last, read_until_close=True)
    assert data.count(b"HTTP/1.1 200 OK") == 100 and data.endswith(b"GET /last 0")


async def test_slowloris_gets_408_and_a_silent_connection_is_closed(limited: tuple) -> None:
    _, _, metrics, port = limited
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    silent_reader, silent_writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nX-Slow: ")

    async def trickle() -> None:
        with contextlib.suppress(OSError):  # the server closes while we trickle
            for _ in range(200):  # one byte of a header value at a time, 200 at most
                writer.write(b"v")
                await writer.drain()
                await asyncio.sleep(0.05)

    trickling = asyncio.ensure_future(trickle())
    # Header timeout 0.4 s, swept every 0.4 s: closed well within 5 s.
    reply = await until_closed(reader)
    assert reply.startswith(b"HTTP/1.1 408") and b"--header-timeout-s" in reply
    assert await until_closed(silent_reader) == b""
    trickling.cancel()
    for w in (writer, silent_writer):
        w.close()
        await w.wait_closed()
    assert metrics.closed_by_limit["header_timeout"] == 2


async def test_a_stalled_body_gets_408(limited: tuple) -> None:
    _, _, metrics, port = limited
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /b HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\nabc")
    await writer.drain()
    reply = await until_closed(reader)
    assert reply.startswith(b"HTTP/1.1 408") and b"--body-timeout-s" in reply
    writer.close()
    await writer.wait_closed()
    assert metrics.closed_by_limit["body_timeout"] == 1


async def test_at_max_connections_the_idlest_is_closed_or_the_new_one_refused(
    limited: tuple,
) -> None:
    http, handler, metrics, port = limited
    opened = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
    for reader, writer in opened:  # each served once, then idle on keep-alive
        writer.write(b"GET /k HTTP/1.1\r\nHost: t\r\n\r\n")
        assert (await reader.read(1000)).startswith(b"HTTP/1.1 200")
    # A fifth connection closes the first one (the longest idle) and is served.
    reply = await exchange(port, b"GET /new HTTP/1.1\r\nHost: t\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 200")
    assert await until_closed(opened[0][0]) == b""
    opened[0][1].close()
    assert metrics.closed_by_limit["evicted_idle"] == 1
    # With every connection busy (a /slow request on each), a new one is refused.
    await poll(lambda: len(http._connections) == 3, "the evicted connections gone")
    busy = [await asyncio.open_connection("127.0.0.1", port)]
    for _, writer in [*opened[1:], *busy]:
        writer.write(b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n")
        await writer.drain()
    await poll(lambda: not http._idle, "every connection busy")
    refused = await exchange(port, b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n", True)
    assert refused.startswith(b"HTTP/1.1 503") and b"--max-connections" in refused
    assert metrics.closed_by_limit["refused_full"] == 1
    handler.release.set()
    for reader, writer in [*opened[1:], *busy]:
        assert (await reader.read(1000)).startswith(b"HTTP/1.1 200")
        writer.close()
        await writer.wait_closed()
    await opened[0][1].wait_closed()
    await poll(lambda: not http._connections and not http._idle, "connections released")
    assert metrics.open_connections() == 0


async def poll(condition: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    """Wait until ``condition()`` holds; fail naming ``what`` after timeout_s."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"not {what} after {timeout_s} s"
        await asyncio.sleep(0.02)
