"""A closed-loop HTTP user on a blocking socket, for a worker driving one connection.

With one connection the client's own latency adds straight into every cycle. An asyncio
client wakes through epoll, a protocol callback, a future and a task step before it can
send the next request, which measured ~0.1 ms per request on top of wrk against a
server answering in 0.3 ms (bench / wrk = 0.75 at 1 connection). A blocking ``recv`` in
a thread returns as soon as the response lands, like wrk's loop. It sends the same
pre-encoded bytes as :class:`slipstream.bench.v2.clients.HttpClient` and reports errors
under the same keys.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Protocol

import httptools

from slipstream.bench.core.endpoint import Endpoint
from slipstream.bench.core.http import RECONNECT_PAUSE_S, ResponseReader

_RECV_BYTES = 1 << 16


class StopFlag(Protocol):
    def is_set(self) -> bool: ...


class BlockingHttpUser:
    """One virtual user: send a request, read its response, send the next, until stopped."""

    def __init__(
        self,
        endpoint: Endpoint,
        payloads: list[bytes],
        timeout_s: float,
        note: Callable[[str, str], str],
    ) -> None:
        self._address = (endpoint.host, endpoint.port)
        self._payloads = payloads
        self._timeout_s = timeout_s
        # Records an error example; returns the error key (ErrorExamples.note).
        self._note = note
        self._sock: socket.socket | None = None
        self._response = ResponseReader()
        # Requests sent again after the reused connection failed before its response.
        self.reconnects = 0

    def run(
        self, stop: StopFlag, record: Callable[[int, float, str | None], None], first: int
    ) -> None:
        """Loop until ``stop`` is set; ``record(index, latency_s, error_key)`` per request."""
        count = len(self._payloads)
        index = first % count
        monotonic = time.monotonic
        try:
            while not stop.is_set():
                started = monotonic()
                error = self._request(self._payloads[index])
                if error is not None and error.startswith("connect"):
                    time.sleep(RECONNECT_PAUSE_S)
                record(index, monotonic() - started, error)
                index = (index + 1) % count
        finally:
            self._close()

    def _request(self, payload: bytes) -> str | None:
        if self._sock is not None and not self._response.reuse.reusable():
            self._close()  # the server closes it, or is about to
        reused = self._sock is not None
        try:
            sock = self._sock or self._connect()
        except OSError as exc:
            return self._note(f"connect {type(exc).__name__}", str(exc))
        response = self._response
        try:
            try:
                self._exchange(sock, payload)
            except OSError:
                if not reused or response.started:
                    raise
                # The server closed the idle connection as the request went out.
                self._close()
                self.reconnects += 1
                self._exchange(self._connect(), payload)
        except TimeoutError:
            self._close()
            return self._note("timeout", f"no response within {self._timeout_s:g} s")
        except (OSError, httptools.HttpParserError) as exc:
            self._close()
            return self._note(f"connection {type(exc).__name__}", str(exc))
        response = self._response
        if not response.reuse.keep_alive:
            self._close()
        if 200 <= response.status < 300:
            return None
        return self._note(f"http {response.status}", response.error_message())

    def _exchange(self, sock: socket.socket, payload: bytes) -> None:
        """Write the request and read its whole response into ``self._response``."""
        response = self._response
        response.begin()
        sock.sendall(payload)
        while not response.complete:
            data = sock.recv(_RECV_BYTES)
            if not data:
                raise ConnectionResetError("the server closed the connection")
            response.feed(data)

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(self._address, timeout=self._timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        self._response = ResponseReader()
        return sock

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
