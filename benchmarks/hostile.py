"""Hostile connections against a real `slipstream serve`: the latency a legitimate client
keeps, and the server's memory during and after (issue #18's targets).

    .venv/bin/python benchmarks/hostile.py                  # 10 rounds, ~7 min on 2 cores
    .venv/bin/python benchmarks/hostile.py --rounds 2 --connections 300

The server serves `mlp` (examples/build_models.py), pinned to core 0; the legitimate
client and the attackers run on core 1 (on a 1-core host everything shares it), the
attackers at nice 19: on a real network they would not share the legitimate client's
CPU, and at equal priority their ~2,000 writes a second delay the client's own wake-ups
by milliseconds, which the client would count against the server (`--attackers-nice 0`
to see it). The legitimate client sends V2 JSON inference on `mlp` over one keep-alive
connection in a closed loop and records every latency. First a quiet phase (the client alone), then
rounds of, all at once (with `--gap-s` of quiet again between rounds; the quiet p99 is of
every quiet window together, since this machine's own latency drifts over minutes):

- `--connections` connections each sending an unterminated 8 MB header (431 at the
  64 KiB limit);
- `--connections` slowloris connections: a partial head, then a header line every
  0.5 s (408 at --header-timeout-s);
- `--connections` idle keep-alive connections: one request answered, then silence.

Each round holds the attack for `--hold-s`, then closes everything and waits for the
server to settle. Printed (and in --json): the quiet p99 and each round's p99 of the
legitimate client, their ratio (target <= 2), RSS at baseline, its peak during each round
(target: growth <= 150 MB), and RSS a minute after the last round closed (target: within
10% of baseline), so ten rounds in a row show whether memory ratchets up. Statuses the
attackers got are counted, to show the limits answered them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil

from models import REPO_ROOT, build_repository, json_body, sample_inputs
from servers import free_port

HOST = "127.0.0.1"


class Legitimate:
    """V2 JSON inference on one keep-alive connection, closed loop, in a process of its
    own (the attackers' event loop would hold this process's GIL and starve it), paced
    at 100 requests/s at most. Each request is kept as (end time, latency, ok) on the
    system-wide monotonic clock, so phases are cut by time afterwards."""

    def __init__(self, url: str, body: bytes) -> None:
        self._stop = multiprocessing.Event()
        self._receive, send = multiprocessing.Pipe(duplex=False)
        self._process = multiprocessing.Process(
            target=_legitimate_user, args=(url, body, self._stop, send), daemon=True
        )
        self.requests: list[tuple[float, float, bool]] = []

    def start(self) -> None:
        self._process.start()

    def stop(self) -> None:
        self._stop.set()
        self.requests = self._receive.recv()
        self._process.join(30)

    def latencies(self, start: float, end: float) -> list[float]:
        return [lat for at, lat, ok in self.requests if ok and start <= at < end]

    def slowest(self, start: float, end: float, count: int) -> list[tuple[float, float]]:
        """The ``count`` slowest requests that ended in [start, end): (seconds into the
        window at which each began, latency in ms), slowest first."""
        during = [(at - lat, lat) for at, lat, ok in self.requests if ok and start <= at < end]
        during.sort(key=lambda item: -item[1])
        return [(round(began - start, 3), round(lat * 1000, 2)) for began, lat in during[:count]]

    def failures(self) -> int:
        return sum(not ok for _, _, ok in self.requests)


def _legitimate_user(url: str, body: bytes, stop: Any, send: Any) -> None:
    headers = {"Content-Type": "application/json"}
    requests: list[tuple[float, float, bool]] = []
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            start = time.monotonic()
            try:
                ok = client.post(url, content=body, headers=headers).is_success
            except httpx.HTTPError:
                ok = False
            end = time.monotonic()
            requests.append((end, end - start, ok))
            stop.wait(0.01)
    send.send(requests)


async def _open(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
    try:
        return await asyncio.open_connection(HOST, port)
    except OSError:
        return None


async def _status(reader: asyncio.StreamReader) -> str:
    try:
        data = await reader.read(64)
    except OSError as exc:
        return type(exc).__name__
    return data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/") else "closed"


Behaviour = Callable[[asyncio.StreamReader, asyncio.StreamWriter, asyncio.Event], Awaitable[str]]


async def hostile(port: int, stop: asyncio.Event, behave: Behaviour) -> str:
    """One connection that ``behave``s, then stays open until ``stop``; what it got."""
    opened = await _open(port)
    if opened is None:
        return "refused"
    reader, writer = opened
    result = await behave(reader, writer, stop)
    await stop.wait()
    writer.close()
    return result


async def header_bomb(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, stop: asyncio.Event
) -> str:
    writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\nX-Big: ")
    status = asyncio.ensure_future(_status(reader))
    with contextlib.suppress(OSError):
        for _ in range(128):  # 8 MB in 64 KiB pieces, until the server answers
            if status.done():
                break
            writer.write(b"a" * 65536)
            await writer.drain()
    return await status


async def slowloris(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, stop: asyncio.Event
) -> str:
    writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n")
    status = asyncio.ensure_future(_status(reader))
    with contextlib.suppress(OSError):
        line = 0
        while not status.done() and not stop.is_set():
            await asyncio.sleep(0.5)
            writer.write(b"X-Slow-%d: v\r\n" % line)
            line += 1
    result = await status if status.done() else "held"
    status.cancel()
    return result


async def idle(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, stop: asyncio.Event
) -> str:
    writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n")
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        return head.split(b" ", 2)[1].decode()
    except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
        return type(exc).__name__


async def attack(port: int, connections: int, hold_s: float) -> dict[str, dict[str, int]]:
    stop = asyncio.Event()
    kinds = {"header_bomb": header_bomb, "slowloris": slowloris, "idle": idle}
    tasks = {
        kind: [asyncio.ensure_future(hostile(port, stop, behave)) for _ in range(connections)]
        for kind, behave in kinds.items()
    }
    await asyncio.sleep(hold_s)
    stop.set()
    counts: dict[str, dict[str, int]] = {}
    for kind, started in tasks.items():
        for status in await asyncio.gather(*started):
            counts.setdefault(kind, {}).setdefault(status, 0)
            counts[kind][status] += 1
    return counts


def p99_ms(latencies: list[float]) -> float:
    return float(np.percentile(latencies, 99) * 1000) if latencies else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=1000, help="of each kind")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--hold-s", type=float, default=15.0, help="each round's attack")
    parser.add_argument("--quiet-s", type=float, default=15.0)
    parser.add_argument(
        "--gap-s", type=float, default=10.0, help="quiet between rounds, part of the quiet baseline"
    )
    parser.add_argument("--settle-s", type=float, default=60.0, help="after the last round")
    parser.add_argument(
        "--attackers-nice",
        type=int,
        default=19,
        help="the attackers' niceness on the client's core (0: the client's)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    server_core, client_core = (cores[0], cores[1]) if len(cores) > 1 else (None, None)
    work = Path(tempfile.mkdtemp(prefix="hostile-"))
    build_repository(work / "repo", ["mlp"])
    port = free_port()
    argv = [str(Path(sys.executable).parent / "slipstream"), "serve", "--model-repository",
            str(work / "repo"), "--host", HOST, "--http-port", str(port), "--grpc-port", "0",
            "--header-timeout-s", "5"]  # fmt: skip
    if server_core is not None:
        argv = ["taskset", "-c", str(server_core), *argv]
    log = (work / "server.log").open("wb")
    server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    try:
        deadline = time.monotonic() + 60
        while not _ready(port):
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit(f"the server did not start; see {work / 'server.log'}")
            time.sleep(0.2)
        if client_core is not None:
            os.sched_setaffinity(0, {client_core})
        result = run(args, port, psutil.Process(server.pid))
    finally:
        server.terminate()
        server.wait(30)
    result["server_core"], result["client_core"] = server_core, client_core
    report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://{HOST}:{port}/v2/health/ready", timeout=2).is_success
    except httpx.HTTPError:
        return False


def run(args: argparse.Namespace, port: int, server: psutil.Process) -> dict[str, Any]:
    body = json_body(sample_inputs("mlp")).body
    legit = Legitimate(f"http://{HOST}:{port}/v2/models/mlp/infer", body)
    legit.start()
    os.nice(args.attackers_nice)  # this process attacks; the client is a child started before
    time.sleep(3)  # warm the paths before the baseline
    baseline = server.memory_info().rss
    quiet = [(time.monotonic(), time.monotonic() + args.quiet_s)]
    time.sleep(args.quiet_s)
    rounds = []
    windows = []
    for index in range(args.rounds):
        peak = [server.memory_info().rss]
        sampling = threading.Event()

        def sample(peak: list[int] = peak, sampling: threading.Event = sampling) -> None:
            while not sampling.wait(0.25):
                peak.append(server.memory_info().rss)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        started = time.monotonic()
        statuses = asyncio.run(attack(port, args.connections, args.hold_s))
        windows.append((started, time.monotonic()))
        sampling.set()
        sampler.join()
        time.sleep(3)  # lingering closes end
        rounds.append({
            "round": index + 1,
            "rss_peak_mb": max(peak) / 1e6,
            "rss_after_mb": server.memory_info().rss / 1e6,
            "statuses": statuses,
        })  # fmt: skip
        print(f"round {index + 1}: RSS peak {max(peak) / 1e6:.0f} MB", flush=True)
        if index + 1 < args.rounds:  # quiet again between rounds: the baseline drifts
            quiet.append((time.monotonic(), time.monotonic() + args.gap_s))
            time.sleep(args.gap_s)
    time.sleep(args.settle_s)
    settled = server.memory_info().rss
    legit.stop()
    for entry, window in zip(rounds, windows, strict=True):
        during = legit.latencies(*window)
        entry["p99_ms"], entry["requests"] = p99_ms(during), len(during)
        entry["slowest"] = legit.slowest(*window, 20)
    calm = [lat for window in quiet for lat in legit.latencies(*window)]
    return {
        "connections_per_kind": args.connections,
        "attackers_nice": args.attackers_nice,
        "quiet_p99_ms": p99_ms(calm),
        "quiet_requests": len(calm),
        "legitimate_failures": legit.failures(),
        "rss_baseline_mb": baseline / 1e6,
        "rss_settled_mb": settled / 1e6,
        "rounds": rounds,
    }


def report(result: dict[str, Any]) -> None:
    quiet = result["quiet_p99_ms"]
    base = result["rss_baseline_mb"]
    worst_p99 = max(r["p99_ms"] for r in result["rounds"])
    worst_peak = max(r["rss_peak_mb"] for r in result["rounds"])
    print(f"{result['connections_per_kind']} connections of each kind, "
          f"{len(result['rounds'])} rounds; server on core {result['server_core']}, "
          f"clients on core {result['client_core']} (attackers at nice "
          f"{result['attackers_nice']})")  # fmt: skip
    failures = result["legitimate_failures"]
    print(f"legitimate p99: quiet {quiet:.2f} ms, worst round {worst_p99:.2f} ms: "
          f"{worst_p99 / quiet:.2f}x (target <= 2); failures {failures}")  # fmt: skip
    print(f"RSS: baseline {base:.0f} MB, worst peak {worst_peak:.0f} MB "
          f"({worst_peak - base:+.0f} MB, target <= +150), after each round "
          f"{[round(r['rss_after_mb']) for r in result['rounds']]} MB, "
          f"{result['rss_settled_mb']:.0f} MB a minute after the last "
          f"({100 * (result['rss_settled_mb'] / base - 1):+.1f}%, target <= +10%)")  # fmt: skip
    per_round = [(round(r["p99_ms"], 1), r["requests"]) for r in result["rounds"]]
    print(f"legitimate (p99 ms, requests) per round: {per_round}; quiet "
          f"{result['quiet_requests']} requests")  # fmt: skip
    ratios = [r["p99_ms"] / quiet for r in result["rounds"]]
    print(f"p99 / quiet p99 per round: {[round(x, 2) for x in ratios]}; "
          f"{sum(x <= 2 for x in ratios)} of {len(ratios)} within 2x")  # fmt: skip
    print(f"statuses of the last round: {result['rounds'][-1]['statuses']}")


if __name__ == "__main__":
    raise SystemExit(main())
