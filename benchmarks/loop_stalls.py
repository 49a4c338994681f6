"""How long hostile connections hold the HTTP server's event loop (issue #18).

    .venv/bin/python benchmarks/loop_stalls.py                        # header bombs
    .venv/bin/python benchmarks/loop_stalls.py --kind slowloris

Slipstream's HTTP transport (`slipstream.server.httpd.HttpServer`, a handler answering
200) runs in this process on core 0, with a probe on its loop that sleeps 1 ms at a time
and records how late it wakes (a stall: every request on the loop waits as long). A
child process on core 1 opens `--connections` hostile connections with
benchmarks/hostile.py's behaviours: `header_bomb` (an unterminated header streamed in
64 KiB writes until the 431 comes) or `slowloris` (a header line every 0.5 s; 408 at
`--header-timeout-s`), holds them `--hold-s`, and prints the statuses they got.

Printed: the server's CPU seconds over the attack, the stalls over 2 ms (count, sum,
largest, the ten largest with the second of the attack at which each ended), and the
bytes the server read after refusals (dropped while lingering) and before them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import uvloop

from slipstream.server import http_connection, httpd
from slipstream.server.http_messages import HttpLimits, HttpRequest, HttpResponse

ATTACK = """
import asyncio, sys
sys.path.insert(0, {benchmarks!r})
import hostile
async def attack(port, kind, connections, hold_s):
    stop = asyncio.Event()
    behave = getattr(hostile, kind)
    tasks = [asyncio.ensure_future(hostile.hostile(port, stop, behave))
             for _ in range(connections)]
    await asyncio.sleep(hold_s)
    stop.set()
    got = await asyncio.gather(*tasks)
    print("statuses the attackers got:", {{s: got.count(s) for s in sorted(set(got))}})
asyncio.run(attack(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4])))
"""


class Probe:
    """Sleeps 1 ms at a time on the loop; keeps (seconds since start, lateness ms) of
    every wake-up more than 2 ms late."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.stalls: list[tuple[float, float]] = []

    async def run(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            late_ms = (now - before) * 1000 - 1
            if late_ms > 2:
                self.stalls.append((now - self.started, late_ms))


# Bytes the server's connections read before and after their refusal.
READ = {"before": 0, "after": 0}


class Counting(http_connection.Connection):
    """The server's connection, counting what it reads before and after a refusal."""

    __slots__ = ()

    def data_received(self, data: bytes) -> None:
        READ["after" if self._input_closed else "before"] += len(data)
        super().data_received(data)


async def handler(request: HttpRequest) -> HttpResponse:
    return HttpResponse(200, b"ok")


async def main(args: argparse.Namespace) -> None:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 1:
        os.sched_setaffinity(0, {cores[0]})
    httpd.Connection = Counting  # type: ignore[misc]
    limits = HttpLimits(header_timeout_s=args.header_timeout_s)
    server = httpd.HttpServer(handler, error_body=lambda m: m.encode(), limits=limits)
    port = await server.start("127.0.0.1", 0)
    probe = Probe()
    watching = asyncio.ensure_future(probe.run())
    cpu = time.process_time()
    argv = [sys.executable, "-c", ATTACK.format(benchmarks=str(Path(__file__).parent)),
            str(port), args.kind, str(args.connections), str(args.hold_s)]  # fmt: skip
    if len(cores) > 1:
        argv = ["taskset", "-c", str(cores[1]), *argv]
    child = await asyncio.create_subprocess_exec(*argv)
    await child.wait()
    cpu = time.process_time() - cpu
    watching.cancel()
    await server.shutdown(1.0)
    stalls = probe.stalls
    worst = sorted(stalls, key=lambda stall: -stall[1])[:10]
    print(f"{args.connections} {args.kind} connections for {args.hold_s:g} s: server CPU "
          f"{cpu:.2f} s; loop stalls over 2 ms: {len(stalls)}, {sum(s for _, s in stalls):.0f} "
          f"ms in all, largest {max((s for _, s in stalls), default=0):.1f} ms")  # fmt: skip
    print("largest (second ended, ms):", [(round(at, 2), round(ms, 1)) for at, ms in worst])
    print(
        f"bytes read before refusals {READ['before'] / 1e6:.0f} MB, "
        f"after them (dropped while lingering) {READ['after'] / 1e6:.0f} MB"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=("header_bomb", "slowloris"), default="header_bomb")
    parser.add_argument("--connections", type=int, default=1000)
    parser.add_argument("--hold-s", type=float, default=6.0)
    parser.add_argument("--header-timeout-s", type=float, default=1.0)
    uvloop.run(main(parser.parse_args()))
