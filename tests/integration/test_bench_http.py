"""The bench's keep-alive connections against a real little HTTP server on loopback that
closes connections the way servers do: ``Connection: close``, ``Keep-Alive: timeout=N,
max=M`` (llama.cpp's server answers ``timeout=5, max=100``), and closing a reused
connection just as a request arrives on it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import pytest

from slipstream.bench.core.endpoint import Endpoint, parse_endpoint
from slipstream.bench.core.http import (
    HttpConnection,
    HttpConnections,
    KeepAlive,
    RequestFailed,
    post_request,
)
from slipstream.bench.core.levels import LoadLevel
from slipstream.bench.openai.client import OpenAIClient
from slipstream.bench.openai.runner import run_bench_async
from slipstream.bench.openai.settings import OpenAIBenchSettings, TokenRange
from slipstream.bench.v2.blocking import BlockingHttpUser
from slipstream.bench.v2.loadgen import Worker
from slipstream.bench.v2.messages import EncodedRequest, RunLevel, WindowSample, WorkerPlan
from slipstream.bench.v2.results import LevelInputs, level_result, merge_samples

SSE_BODY = b'data: {"choices": [{"text": "hi"}]}\n\ndata: [DONE]\n\n'


@dataclass
class LittleServer:
    """HTTP/1.1 on a free port. Each connection's requests are answered in turn, except:
    ``drop_reused``: a connection's second request closes it unanswered (a server closing
    an idle connection as the request arrives); ``half_answer``: every answer stops after
    its status line; ``idle_close_s``: idle connections are closed after that long;
    ``max_requests``: a connection is closed after that many, each answer saying how
    many are left in ``Keep-Alive: max=N`` (as Apache does) but none ``Connection:
    close``."""

    headers: bytes = b""
    drop_reused: bool = False
    half_answer: bool = False
    idle_close_s: float | None = None
    max_requests: int | None = None
    body: bytes = b"ok"
    # Requests answered or dropped on each connection, in the order they were opened.
    requests: list[int] = field(default_factory=list)
    port: int = 0
    handlers: set[asyncio.Task[None]] = field(default_factory=set)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        number = len(self.requests)
        self.requests.append(0)
        try:
            while await self._one(reader, writer, number):
                pass
        finally:
            writer.close()

    async def stop(self, listening: asyncio.Server) -> None:
        """Stop listening; wait for each connection's handler to see its client go."""
        listening.close()
        if self.handlers:
            await asyncio.wait(self.handlers, timeout=5.0)

    async def _one(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int
    ) -> bool:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.idle_close_s)
        except (asyncio.IncompleteReadError, TimeoutError):
            return False
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        await reader.readexactly(length)
        self.requests[number] += 1
        if self.drop_reused and self.requests[number] > 1:
            return False
        if self.half_answer:
            writer.write(b"HTTP/1.1 200 OK\r\n")
            await writer.drain()
            return False
        headers = self.headers
        if self.max_requests is not None:
            headers += b"Keep-Alive: timeout=5, max=%d\r\n" % (
                self.max_requests - self.requests[number]
            )
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s"
            % (len(self.body), headers, self.body)
        )
        await writer.drain()
        if self.max_requests is not None and self.requests[number] >= self.max_requests:
            return False
        return b"connection: close" not in headers.lower()

    @property
    def endpoint(self) -> Endpoint:
        return parse_endpoint(f"http://127.0.0.1:{self.port}", "http")


async def start(server: LittleServer) -> asyncio.Server:
    listening = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    server.port = listening.sockets[0].getsockname()[1]
    return listening


async def _requests(
    server: LittleServer, count: int, pause_s: float = 0.0
) -> HttpConnections[HttpConnection]:
    """``count`` requests one after another, ``pause_s`` apart, each answered 200."""
    listening = await start(server)
    connections = HttpConnections(server.endpoint, 5.0, HttpConnection)
    payload = post_request(server.endpoint, "/x", b"{}")
    try:
        for i in range(count):
            if i and pause_s:
                await asyncio.sleep(pause_s)
            conn = await connections.request(payload)
            assert conn.status == 200
    finally:
        await connections.close()
        await server.stop(listening)
    return connections


async def test_plain_keep_alive_reuses_one_connection() -> None:
    server = LittleServer()
    connections = await _requests(server, 3)
    assert server.requests == [3] and connections.reconnects == 0


async def test_connection_close_is_honoured() -> None:
    server = LittleServer(headers=b"Connection: close\r\n")
    connections = await _requests(server, 3)
    assert server.requests == [1, 1, 1] and connections.reconnects == 0


async def test_keep_alive_max_limits_the_requests_on_a_connection() -> None:
    # Each connection closes after 2 requests: max=1 after the first, max=0 after the
    # second, so the client never sends a third on it (no retry needed).
    server = LittleServer(max_requests=2)
    connections = await _requests(server, 5)
    assert server.requests == [2, 2, 1] and connections.reconnects == 0


async def test_an_idle_connection_past_the_keep_alive_timeout_is_not_reused() -> None:
    # timeout=1: reused up to 0.5 s idle (half the timeout, at most 1 s before it).
    server = LittleServer(headers=b"Keep-Alive: timeout=1\r\n")
    await _requests(server, 2, pause_s=0.7)
    assert server.requests == [1, 1]
    server = LittleServer(headers=b"Keep-Alive: timeout=1\r\n")
    await _requests(server, 2, pause_s=0.1)
    assert server.requests == [2]


async def test_a_server_that_closes_idle_connections_costs_no_error() -> None:
    server = LittleServer(headers=b"Keep-Alive: timeout=5, max=100\r\n", idle_close_s=0.2)
    connections = await _requests(server, 3, pause_s=0.4)
    assert server.requests == [1, 1, 1]
    assert connections.opened == 3


async def test_a_reused_connection_closed_under_a_request_is_retried_once() -> None:
    server = LittleServer(drop_reused=True)
    connections = await _requests(server, 3)
    # Each reused connection took the next request and closed unanswered; the request
    # went again on a new connection.
    assert server.requests == [2, 2, 1]
    assert connections.reconnects == 2 and connections.opened == 3


async def test_a_fresh_connection_that_fails_is_an_error_not_a_retry() -> None:
    server = LittleServer(half_answer=True)
    listening = await start(server)
    connections = HttpConnections(server.endpoint, 5.0, HttpConnection)
    try:
        with pytest.raises(RequestFailed) as failed:
            await connections.request(post_request(server.endpoint, "/x", b"{}"))
    finally:
        await connections.close()
        await server.stop(listening)
    assert failed.value.key == "connection ConnectionResetError"
    assert connections.reconnects == 0 and server.requests == [1]


async def test_a_response_cut_after_its_first_bytes_is_an_error_not_a_retry() -> None:
    server = LittleServer()
    listening = await start(server)
    connections = HttpConnections(server.endpoint, 5.0, HttpConnection)
    payload = post_request(server.endpoint, "/x", b"{}")
    try:
        await connections.request(payload)
        server.half_answer = True  # the reused connection's answer begins, then stops
        with pytest.raises(RequestFailed, match="ConnectionResetError"):
            await connections.request(payload)
    finally:
        await connections.close()
        await server.stop(listening)
    assert connections.reconnects == 0 and server.requests == [2]


async def test_the_openai_stream_client_retries_with_a_fresh_stream() -> None:
    server = LittleServer(drop_reused=True, body=SSE_BODY)
    listening = await start(server)
    client = OpenAIClient(server.endpoint, "/v1/completions", timeout_s=5.0)
    payload = client.encode(b'{"prompt": "a"}')
    try:
        streams = [await client.send(payload) for _ in range(3)]
    finally:
        await client.close()
        await server.stop(listening)
    assert [s.error for s in streams] == [None, None, None]
    assert [len(s.chunk_times_s) for s in streams] == [1, 1, 1]
    assert client.error_examples == {}
    assert client.reconnects == 2  # the second and third each went again, once


class _StopAfter:
    def __init__(self, count: int) -> None:
        self.count = count
        self.errors: list[str | None] = []

    def is_set(self) -> bool:
        return len(self.errors) >= self.count

    def record(self, index: int, latency_s: float, error: str | None) -> None:
        self.errors.append(error)


@pytest.mark.parametrize(
    ("server", "connections", "reconnects"),
    [
        (LittleServer(drop_reused=True), [2, 2, 2, 1], 3),
        (LittleServer(max_requests=2), [2, 2], 0),
        (LittleServer(headers=b"Connection: close\r\n"), [1, 1, 1, 1], 0),
    ],
    ids=["closed-under-request", "keep-alive-max", "connection-close"],
)
async def test_the_blocking_user_reuses_connections_as_the_server_allows(
    server: LittleServer, connections: list[int], reconnects: int
) -> None:
    listening = await start(server)
    payload = post_request(server.endpoint, "/x", b"{}")
    user = BlockingHttpUser(server.endpoint, [payload], 5.0, lambda key, message: key)
    stop = _StopAfter(4)
    try:
        await asyncio.to_thread(user.run, stop, stop.record, 0)
    finally:
        await server.stop(listening)
    assert stop.errors == [None] * 4
    assert server.requests == connections and user.reconnects == reconnects


def test_keep_alive_header_parsing() -> None:
    reuse = KeepAlive()
    reuse.response_done(keep_alive=True, header=b"timeout=5, max=100", now_s=0.0)
    assert reuse.requests_left == 100 and reuse.reusable(3.9) and not reuse.reusable(4.0)
    reuse.response_done(keep_alive=True, header=b"max=0", now_s=1.0)
    assert not reuse.reusable(1.0)
    closing = KeepAlive()
    closing.response_done(keep_alive=False, header=None, now_s=0.0)
    assert not closing.reusable(0.0)


async def test_an_openai_level_reports_its_reconnects_apart_from_errors() -> None:
    """A whole level against a server that drops reused connections: no errors, the
    reconnects counted in the level's result (JSON) and said in a warning."""
    server = LittleServer(drop_reused=True, body=SSE_BODY)
    listening = await start(server)
    settings = OpenAIBenchSettings(
        url=f"http://127.0.0.1:{server.port}", model="m", protocol="openai-completions",
        concurrency=[1], num_requests=4, prompt_tokens=TokenRange.of(8),
        output_tokens=TokenRange.of(1),
    )  # fmt: skip
    try:
        result = await run_bench_async(settings)
    finally:
        await server.stop(listening)
    [level] = result.levels
    assert (level.requests, level.errors) == (4, 0)
    assert level.reconnects == 4  # every request found its pooled connection dropped
    assert any("fresh connection" in warning for warning in level.warnings)


class _Outbox:
    """Stands in for a V2 worker's pipe: keeps what the worker sends."""

    def __init__(self) -> None:
        self.messages: list[object] = []

    def send(self, obj: object) -> None:
        self.messages.append(obj)


@pytest.mark.parametrize("concurrency", [1, 2], ids=["blocking-user", "asyncio-client"])
async def test_a_v2_level_reports_its_reconnects_apart_from_errors(concurrency: int) -> None:
    """A whole V2 level (a worker with its real HTTP client, its windows, the level's
    result) against a server that drops every reused connection: no errors, the
    reconnects counted per window and in the level's result, and said in a warning.
    Concurrency 1 runs the blocking single-connection user, 2 the asyncio client."""
    server = LittleServer(drop_reused=True)
    listening = await start(server)
    plan = WorkerPlan(
        worker_id=0, endpoint=server.endpoint, model="m", version="",
        requests=[EncodedRequest(b"{}", None, batch_size=1)], timeout_s=5.0,
        distribution="constant", seed=0,
    )  # fmt: skip
    command = RunLevel(
        level_id=0, concurrency=concurrency, request_rate=0.0, phase_s=0.0, max_inflight=1,
        first_user=0, start_at=time.monotonic() + 0.05, warmup_s=0.0, window_s=0.3,
        max_windows=2,
    )  # fmt: skip
    outbox = _Outbox()
    try:
        await Worker(outbox, plan).run_level(command)
    finally:
        await server.stop(listening)
    windows = [merge_samples([m]) for m in outbox.messages if isinstance(m, WindowSample)]
    assert len(windows) == 2 and all(window.reconnects > 0 for window in windows)
    result = level_result(
        LevelInputs(
            level=LoadLevel(concurrency=concurrency), workers=1, windows=windows,
            windows_measured=2, stable=False, stability_required=False, stability_pct=10.0,
            server=None, server_process=None, price_per_hour=None, workers_capped=False,
        )
    )  # fmt: skip
    assert result.errors == 0 and result.requests > 10
    # Each connection answers one request: every request after each user's first went
    # again on a fresh connection (a user's request in flight at a cut may have been
    # counted before its window recorded it).
    assert result.requests - concurrency <= result.reconnects <= result.requests + concurrency
    assert any("fresh connection" in w and "not errors" in w for w in result.warnings)
