"""The split layout's transport on its own: what a call through the engine channel costs
against the same call over a plain asyncio Unix socket (issue #25).

Both sides of each transport run in two processes pinned to one core (`--core`), as the
split layout's front end and engine do in `split1@0`. Each call is one round trip at
concurrency 1 (the case where nothing batches) carrying what an `mlp` request carries: a
(1, 256) FP32 tensor out and a (1, 10) FP32 tensor back, pickled by the engine's own
wire format (`engine/wire.py`: protocol 5, large buffers out of band).

- `zmq`: the real thing: `EngineClient.call` in one process, `EngineHost` in the other
  (ZeroMQ DEALER/ROUTER over ipc, each side's channel read from the loop, one task per
  call), on uvloop as `slipstream serve` runs them.
- `unix`: the least a replacement could do: the same pickled frames, length-prefixed, on
  an asyncio Unix-socket protocol (no ZeroMQ I/O thread: the loop writes the socket and
  the peer's loop reads it), calls matched by id to futures, one task per call in the
  server, on uvloop too.

Prints, per transport, round trips a second and the CPU per round trip of both
processes together (psutil: every thread's user + system time), as medians of the
rounds with their range, and the ratio unix / zmq: the most a transport swap could
save per call where it is paid most (C=1, one core).

    .venv/bin/python benchmarks/transport.py --rounds 5 --calls 20000
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import multiprocessing
import os
import statistics
import struct
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
from slipstream.engine.wire import decode, encode  # noqa: E402

_LENGTH = struct.Struct("<I")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--core", type=int, default=0, help="the one core both processes share")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20_000, help="round trips a round")
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.core})
    results: dict[str, list[tuple[float, float]]] = {"zmq": [], "unix": []}
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.rounds):
            for name in ("zmq", "unix") if index % 2 == 0 else ("unix", "zmq"):
                rate, cpu_us = measure(name, Path(tmp), args.calls)
                results[name].append((rate, cpu_us))
                print(f"round {index + 1} {name:4s}: {rate:8,.0f} round trips/s, "
                      f"{cpu_us:5.1f} us CPU each (both processes)", flush=True)  # fmt: skip
    print(f"\n{os.cpu_count()} cores, both processes on core {args.core}, "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    for name, rows in results.items():
        rates = [rate for rate, _ in rows]
        cpus = [cpu for _, cpu in rows]
        print(f"{name:4s}: {statistics.median(rates):8,.0f} round trips/s "
              f"({min(rates):,.0f}-{max(rates):,.0f}), {statistics.median(cpus):.1f} us CPU "
              f"({min(cpus):.1f}-{max(cpus):.1f})")  # fmt: skip
    ratios = [u[1] / z[1] for z, u in zip(results["zmq"], results["unix"], strict=True)]
    print(f"CPU per round trip, unix / zmq: {statistics.median(ratios):.2f} "
          f"({min(ratios):.2f}-{max(ratios):.2f}, per round)")  # fmt: skip


def measure(name: str, tmp: Path, calls: int) -> tuple[float, float]:
    """(round trips/s, CPU us per round trip of both processes) of one transport."""
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    serve = zmq_server if name == "zmq" else unix_server
    address = f"ipc://{tmp}/engine" if name == "zmq" else str(tmp / "engine.sock")
    server = context.Process(target=serve, args=(address, ready), daemon=True)
    server.start()
    try:
        if not ready.wait(60):
            raise RuntimeError(f"the {name} server did not start")
        client = zmq_client if name == "zmq" else unix_client
        return uvloop.run(client(address, calls, psutil.Process(server.pid)))
    finally:
        server.kill()
        server.join()


# -- the call both transports carry ---------------------------------------------------------

_REQUEST = np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32)
_ANSWER = np.zeros((1, 10), np.float32)


async def _echo(tensor: np.ndarray) -> np.ndarray:
    return _ANSWER


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


# -- ZeroMQ: the engine channel as the split layout runs it ---------------------------------


def zmq_server(address: str, ready: Any) -> None:
    async def serve() -> None:
        host = EngineHost(address, {"echo": _echo})
        host.start()
        ready.set()
        await asyncio.Event().wait()

    uvloop.run(serve())


async def zmq_client(address: str, calls: int, server: psutil.Process) -> tuple[float, float]:
    client = EngineClient(address)
    client.start()
    if not await client.wait_connected(30):
        raise RuntimeError("no engine connection")
    try:
        return await _timed(calls, lambda: client.call("echo", _REQUEST), server)
    finally:
        await client.close()


# -- a Unix socket: the same frames, length-prefixed -----------------------------------------


class _Framed(asyncio.BufferedProtocol):
    """Messages of ``wire.encode`` frames over a stream: a frame count, then each frame's
    length and bytes; ``on_message`` gets each decoded value."""

    def __init__(self, on_message: Callable[[Any, _Framed], None]) -> None:
        self._on_message = on_message
        self._buffer = bytearray(1 << 20)
        self._filled = 0
        # uvloop's transports are not asyncio.Transport subclasses.
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def send(self, value: Any) -> None:
        frames = encode(value)
        parts: list[bytes | memoryview] = [_LENGTH.pack(len(frames))]
        for frame in frames:
            view = memoryview(frame).cast("B")
            parts += [_LENGTH.pack(view.nbytes), view]
        self.transport.writelines(parts)

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self._buffer)[self._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        self._filled += nbytes
        view = memoryview(self._buffer)
        start = 0
        while True:
            parsed = _parse(view, start, self._filled)
            if parsed is None:
                break
            frames, start = parsed
            self._on_message(decode([bytes(frame) for frame in frames]), self)
        self._buffer[: self._filled - start] = self._buffer[start : self._filled]
        self._filled -= start


def _parse(view: memoryview, start: int, end: int) -> tuple[list[memoryview], int] | None:
    """The frames of the message at ``start`` and where the next begins; None if partial."""
    if end - start < 4:
        return None
    (count,) = _LENGTH.unpack_from(view, start)
    position = start + 4
    frames = []
    for _ in range(count):
        if end - position < 4:
            return None
        (length,) = _LENGTH.unpack_from(view, position)
        position += 4
        if end - position < length:
            return None
        frames.append(view[position : position + length])
        position += length
    return frames, position


def unix_server(path: str, ready: Any) -> None:
    async def serve() -> None:
        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task[None]] = set()

        def on_message(message: Any, peer: _Framed) -> None:
            _, call_id, _method, args = message
            task = asyncio.create_task(answer(peer, call_id, args))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        async def answer(peer: _Framed, call_id: int, args: Any) -> None:
            peer.send(("ok", call_id, await _echo(*args)))

        await loop.create_unix_server(lambda: _Framed(on_message), path)
        ready.set()
        await asyncio.Event().wait()

    uvloop.run(serve())


async def unix_client(path: str, calls: int, server: psutil.Process) -> tuple[float, float]:
    loop = asyncio.get_running_loop()
    waiting: dict[int, asyncio.Future[Any]] = {}
    ids = itertools.count()

    def on_answer(message: Any, _: _Framed) -> None:
        future = waiting.pop(message[1], None)
        if future is not None:
            future.set_result(message[2])

    _, protocol = await loop.create_unix_connection(lambda: _Framed(on_answer), path)

    async def call() -> Any:
        call_id = next(ids)
        future = loop.create_future()
        waiting[call_id] = future
        protocol.send(("call", call_id, "echo", (_REQUEST,)))
        return await future

    try:
        return await _timed(calls, call, server)
    finally:
        protocol.transport.close()


if __name__ == "__main__":
    main()
