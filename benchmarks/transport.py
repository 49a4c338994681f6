"""The split layout's transport on its own: what a call through the engine link costs,
against the least a round trip between two processes costs (issue #25).

Both processes are pinned to one core (`--core`), as the split layout's front end and
engine are in `split1@0`. Each call is one round trip at concurrency 1 (the case where
nothing batches), on uvloop as `slipstream serve` runs it:

- `link`: the real thing: `EngineClient.call` in one process, `EngineHost` in the other
  (`engine/channel.py` on a Unix socket), carrying what an `mlp` request carries: a
  (1, 256) FP32 tensor out and a (1, 10) FP32 tensor back, pickled by the engine's wire
  format, one task per call in the host.
- `floor`: the same number of bytes each way over a Unix socket, echoed by a bare
  asyncio protocol: no framing, no pickling, no task.

Prints, per transport, round trips a second and the CPU per round trip of both
processes together (psutil: every thread's user + system time), as medians of the rounds
with their range, and the ratio floor / link (1.0: the link adds nothing).

Until 2026-11-27 the link was ZeroMQ (DEALER/ROUTER over ipc, read from the loop on
ZeroMQ's descriptor). This script at commit 0d8895b measured it against the same frames
over a Unix socket: 207 against 112 us of CPU a round trip (0.54), 4,800 against 9,200
round trips/s; the link moved to the Unix socket.

    .venv/bin/python benchmarks/transport.py --rounds 5 --calls 20000
    .venv/bin/python benchmarks/transport.py --rounds 3 --calls 2000 --tensor-bytes 1048576

With ``--tensor-bytes N`` the call carries a FP32 tensor of N bytes each way instead: a
message over 64 KB is received into a buffer of its own and its tensor read over it.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from slipstream.engine.client import EngineClient  # noqa: E402
from slipstream.engine.host import EngineHost  # noqa: E402
from slipstream.engine.wire import encode  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--core", type=int, default=0, help="the one core both processes share")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20_000, help="round trips a round")
    parser.add_argument(
        "--tensor-bytes", type=int, default=0,
        help="a tensor of this many bytes out and the same back (default: mlp's)",
    )  # fmt: skip
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.core})
    results: dict[str, list[tuple[float, float]]] = {"link": [], "floor": []}
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.rounds):
            for name in ("link", "floor") if index % 2 == 0 else ("floor", "link"):
                rate, cpu_us = measure(name, Path(tmp), args.calls, args.tensor_bytes)
                results[name].append((rate, cpu_us))
                print(f"round {index + 1} {name:5s}: {rate:8,.0f} round trips/s, "
                      f"{cpu_us:5.1f} us CPU each (both processes)", flush=True)  # fmt: skip
    print(f"\n{os.cpu_count()} cores, both processes on core {args.core}, "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    for name, rows in results.items():
        rates = [rate for rate, _ in rows]
        cpus = [cpu for _, cpu in rows]
        print(f"{name:5s}: {statistics.median(rates):8,.0f} round trips/s "
              f"({min(rates):,.0f}-{max(rates):,.0f}), {statistics.median(cpus):.1f} us CPU "
              f"({min(cpus):.1f}-{max(cpus):.1f})")  # fmt: skip
    ratios = [f[1] / k[1] for k, f in zip(results["link"], results["floor"], strict=True)]
    print(f"CPU per round trip, floor / link: {statistics.median(ratios):.2f} "
          f"({min(ratios):.2f}-{max(ratios):.2f}, per round)")  # fmt: skip


def measure(name: str, tmp: Path, calls: int, tensor_bytes: int) -> tuple[float, float]:
    """(round trips/s, CPU us per round trip of both processes) of one transport."""
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    serve = link_server if name == "link" else floor_server
    path = str(tmp / f"{name}.sock")
    server = context.Process(target=serve, args=(path, ready, tensor_bytes), daemon=True)
    server.start()
    try:
        if not ready.wait(60):
            raise RuntimeError(f"the {name} server did not start")
        client = link_client if name == "link" else floor_client
        return uvloop.run(client(path, calls, psutil.Process(server.pid), tensor_bytes))
    finally:
        server.kill()
        server.join()


# -- the call both transports carry ---------------------------------------------------------


def _tensors(tensor_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """The call's tensor and its answer's: mlp's by default, else one of each size."""
    if tensor_bytes:
        tensor = np.ones(tensor_bytes // 4, np.float32)
        return tensor, tensor
    rng = np.random.default_rng(0)
    return rng.standard_normal((1, 256)).astype(np.float32), np.zeros((1, 10), np.float32)


def _wire_bytes(message: Any) -> int:
    """What the link writes for ``message`` alone: prefix, frame lengths, frames."""
    frames = encode([message])
    return 12 + 8 * len(frames) + sum(memoryview(frame).nbytes for frame in frames)


async def _timed(
    calls: int, call: Callable[[], Coroutine[Any, Any, Any]], server: psutil.Process
) -> tuple[float, float]:
    for _ in range(500):  # warm-up
        await call()
    me = psutil.Process()
    cpu0 = sum(me.cpu_times()[:2]) + sum(server.cpu_times()[:2])
    start = time.perf_counter()
    for _ in range(calls):
        await call()
    elapsed = time.perf_counter() - start
    cpu = sum(me.cpu_times()[:2]) + sum(server.cpu_times()[:2]) - cpu0
    return calls / elapsed, cpu / calls * 1e6


# -- the engine link ------------------------------------------------------------------------


def link_server(path: str, ready: Any, tensor_bytes: int) -> None:
    answer = _tensors(tensor_bytes)[1]

    async def echo(tensor: np.ndarray) -> np.ndarray:
        return answer

    async def serve() -> None:
        host = EngineHost(path, {"echo": echo})
        await host.start()
        ready.set()
        await asyncio.Event().wait()

    uvloop.run(serve())


async def link_client(
    path: str, calls: int, server: psutil.Process, tensor_bytes: int
) -> tuple[float, float]:
    request = _tensors(tensor_bytes)[0]
    client = EngineClient(path)
    client.start()
    if not await client.wait_connected(30):
        raise RuntimeError("no engine connection")
    try:
        return await _timed(calls, lambda: client.call("echo", request), server)
    finally:
        await client.close()


# -- the floor: bytes echoed ----------------------------------------------------------------


class _Echo(asyncio.Protocol):
    """Answers every whole call (``call_bytes``) with ``answer_bytes``."""

    def __init__(self, call_bytes: int, answer_bytes: int) -> None:
        self.transport: Any = None
        self._call_bytes = call_bytes
        self._answer = b"a" * answer_bytes
        self._have = 0

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._have += len(data)
        while self._have >= self._call_bytes:
            self._have -= self._call_bytes
            self.transport.write(self._answer)


class _Caller(asyncio.Protocol):
    def __init__(self, answer_bytes: int) -> None:
        self.transport: Any = None
        self.waiting: asyncio.Future[None] | None = None
        self._answer_bytes = answer_bytes
        self._have = 0

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._have += len(data)
        if self._have >= self._answer_bytes and self.waiting is not None:
            self._have -= self._answer_bytes
            self.waiting.set_result(None)


def _sizes(tensor_bytes: int) -> tuple[int, int]:
    request, answer = _tensors(tensor_bytes)
    return _wire_bytes(("call", 0, "echo", (request,))), _wire_bytes(("ok", 0, answer))


def floor_server(path: str, ready: Any, tensor_bytes: int) -> None:
    call_bytes, answer_bytes = _sizes(tensor_bytes)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        await loop.create_unix_server(lambda: _Echo(call_bytes, answer_bytes), path)
        ready.set()
        await asyncio.Event().wait()

    uvloop.run(serve())


async def floor_client(
    path: str, calls: int, server: psutil.Process, tensor_bytes: int
) -> tuple[float, float]:
    call_bytes, answer_bytes = _sizes(tensor_bytes)
    loop = asyncio.get_running_loop()
    _, caller = await loop.create_unix_connection(lambda: _Caller(answer_bytes), path)
    message = b"c" * call_bytes

    async def call() -> None:
        caller.waiting = loop.create_future()
        caller.transport.write(message)
        await caller.waiting

    try:
        return await _timed(calls, call, server)
    finally:
        caller.transport.close()


if __name__ == "__main__":
    main()
