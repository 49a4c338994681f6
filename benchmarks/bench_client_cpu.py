"""The load generator's own cost: client CPU per request of one `slipstream bench` V2
worker process, closed loop, against a keep-alive HTTP server in another process that
answers every request at once with a fixed 200 (so the figure is the client's, not a
model's). Also the driver alone, against an in-process client that answers at once.

    .venv/bin/python benchmarks/bench_client_cpu.py
    PYTHONPATH=/path/to/other/checkout/src .venv/bin/python benchmarks/bench_client_cpu.py

The second form measures another checkout's bench with the same script, to compare two
versions beside each other (alternate the two a few times: figures taken beside other
work are noisy; the minimum over runs is the least disturbed).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import socket
import time
from typing import Any

import uvloop

from slipstream.bench.v2.clients import InferClient
from slipstream.bench.v2.loadgen import Worker
from slipstream.bench.v2.messages import EncodedRequest, RunLevel, WindowSample, WorkerPlan

RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


class _Answer(asyncio.Protocol):
    """Answers each complete request on the connection with RESPONSE."""

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            head, sep, rest = self.buffer.partition(b"\r\n\r\n")
            if not sep:
                return
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            if len(rest) < length:
                return
            self.buffer = rest[length:]
            self.transport.write(RESPONSE)


def _serve(port: int) -> None:
    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(_Answer, "127.0.0.1", port)
        await server.serve_forever()

    uvloop.run(main())


class _Instant(InferClient):
    async def infer(self, index: int) -> str | None:
        await asyncio.sleep(0)
        return None

    async def close(self) -> None:
        pass


class _Outbox:
    def __init__(self) -> None:
        self.messages: list[Any] = []

    def send(self, obj: Any) -> None:
        self.messages.append(obj)


def _endpoint(port: int) -> Any:
    try:
        from slipstream.bench.core.endpoint import Endpoint
    except ImportError:  # a checkout from before bench/core/endpoint.py
        from slipstream.bench.v2.messages import Endpoint
    return Endpoint(protocol="http", host="127.0.0.1", port=port, tls=False)


def measure(port: int, concurrency: int, instant: bool) -> tuple[float, float]:
    """(client CPU us per request, requests/s) of one worker over 3 windows of 1 s."""
    plan = WorkerPlan(
        worker_id=0, endpoint=_endpoint(port), model="m", version="",
        requests=[EncodedRequest(b'{"inputs": []}', None, 1)], timeout_s=5.0,
        distribution="constant", seed=0,
    )  # fmt: skip
    outbox = _Outbox()
    factory = (lambda p, n: _Instant()) if instant else None
    worker = Worker(outbox, plan, factory) if factory else Worker(outbox, plan)
    level = RunLevel(
        level_id=0, concurrency=concurrency, request_rate=0.0, phase_s=0.0, max_inflight=64,
        first_user=0, start_at=time.monotonic() + 0.05, warmup_s=0.5, window_s=1.0,
        max_windows=3,
    )  # fmt: skip
    uvloop.run(worker.run_level(level))
    windows = [m for m in outbox.messages if isinstance(m, WindowSample) and m.window_index >= 0]
    ok = sum(w.ok_requests for w in windows)
    return sum(w.cpu_s for w in windows) / ok * 1e6, ok / sum(w.end_s - w.start_s for w in windows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = multiprocessing.Process(target=_serve, args=(port,), daemon=True)
    server.start()
    time.sleep(0.5)
    try:
        for name, instant in (("HTTP keep-alive server", False), ("instant client", True)):
            runs = sorted(measure(port, args.concurrency, instant) for _ in range(args.runs))
            cpu = ", ".join(f"{us:.2f}" for us, _ in runs)
            print(
                f"{name}, concurrency {args.concurrency}: client CPU per request min "
                f"{runs[0][0]:.2f} us, median {runs[len(runs) // 2][0]:.2f} us ({cpu}); "
                f"{runs[len(runs) // 2][1]:,.0f} req/s"
            )
    finally:
        server.terminate()


if __name__ == "__main__":
    main()
