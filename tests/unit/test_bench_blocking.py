"""The blocking single-connection user: keep-alive, error keys, reconnects, stopping."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from slipstream.bench.core.endpoint import Endpoint
from slipstream.bench.v2.blocking import BlockingHttpUser


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like an inference server
    connections: ClassVar[set[int]] = set()

    def do_POST(self) -> None:
        _Handler.connections.add(id(self.connection))
        length = int(self.headers["Content-Length"])
        body = self.rfile.read(length)
        status, reply = (400, b'{"error":"bad input"}') if body == b"bad" else (200, b"{}")
        self.send_response(status)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[int]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield int(httpd.server_address[1])
    httpd.shutdown()
    httpd.server_close()


def payload(body: bytes) -> bytes:
    return b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


class StopAfter:
    def __init__(self, count: int) -> None:
        self.count = count
        self.records: list[tuple[int, float, str | None]] = []

    def is_set(self) -> bool:
        return len(self.records) >= self.count

    def record(self, index: int, latency_s: float, error: str | None) -> None:
        self.records.append((index, latency_s, error))


def test_requests_cycle_over_one_connection_and_errors_are_keyed(server: int) -> None:
    examples: dict[str, str] = {}

    def note(key: str, message: str) -> str:
        examples.setdefault(key, message)
        return key

    endpoint = Endpoint(protocol="http", host="127.0.0.1", port=server, tls=False, path_prefix="")
    user = BlockingHttpUser(endpoint, [payload(b"ok"), payload(b"bad")], 5.0, note)
    _Handler.connections.clear()
    stop = StopAfter(6)
    user.run(stop, stop.record, first=1)
    assert [r[0] for r in stop.records] == [1, 0, 1, 0, 1, 0]
    assert [r[2] for r in stop.records] == ["http 400", None] * 3
    assert all(r[1] > 0 for r in stop.records)
    assert examples == {"http 400": '{"error":"bad input"}'}
    assert len(_Handler.connections) == 1  # keep-alive: one connection for all six


def test_unreachable_server_is_a_connect_error() -> None:
    endpoint = Endpoint(protocol="http", host="127.0.0.1", port=1, tls=False, path_prefix="")
    user = BlockingHttpUser(endpoint, [payload(b"ok")], 1.0, lambda key, message: key)
    stop = StopAfter(2)
    user.run(stop, stop.record, first=0)
    assert [r[2] for r in stop.records] == ["connect ConnectionRefusedError"] * 2
