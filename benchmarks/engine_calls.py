"""The engine process alone under load: what one inference costs its event loop
(issues #25 and #12).

On a GPU host the engine's event loop is what the GPU waits on between batches
(docs/gpu.md), so its CPU per request is the figure to cut. This script measures it
without the front ends: it serves ``mlp`` with ``slipstream serve --frontends 1`` on
``--server-core``, then, from a process on ``--client-core``, connects straight to the
engine's socket as a front end does (``EngineClient``) and keeps ``--in-flight`` V2
inference calls outstanding for ``--seconds``. The front end stays idle.

Prints, per round, calls/s and the engine's CPU per call: its event-loop thread, and all
of its threads (ONNX Runtime's run included). With ``--src A,B`` the rounds alternate two
source trees (each a ``src`` directory put first on PYTHONPATH for the server), and the
ratio of their medians is printed: the way to compare a change with the tree before it on
this noisy host. ``--send`` says how the client sends: ``call``, one engine call per
request; ``group``, as a front end does (``RemoteInferenceService``: the requests of one
turn of its loop in one call, answered by the engine's ``infer_group``); ``call,group``
alternates the two on one tree and prints their ratio. ``--front-ends N`` spreads the
calls over N connections (each with its own ``RemoteInferenceService``), as N front ends
would: their groups reach the engine apart, or together in one turn of its loop, where
the engine merges them.

    .venv/bin/python benchmarks/engine_calls.py --rounds 3
    git archive HEAD~1 src | tar -x -C /tmp/before
    .venv/bin/python benchmarks/engine_calls.py --src /tmp/before/src,src --rounds 3
    .venv/bin/python benchmarks/engine_calls.py --send call,group --rounds 3

The load generator is Python too: on two cores it, not the engine, usually sets the
calls/s. Read the CPU per call, which does not depend on who is the bottleneck.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import psutil
from frontends import ROOT, VENV_BIN, build_mlp, free_ports, wait_http


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server-core", type=int, default=0)
    parser.add_argument("--client-core", type=int, default=1)
    parser.add_argument("--in-flight", type=int, default=32, help="calls outstanding")
    parser.add_argument("--seconds", type=float, default=6.0, help="measured per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--src", default="src", help="comma list of source trees to alternate")
    parser.add_argument(
        "--send",
        default="call",
        help="call | group | call,group (alternated): how requests are sent",
    )
    parser.add_argument("--json", type=Path, help="also write the rounds here")
    parser.add_argument(
        "--front-ends", type=int, default=1,
        help="connections to the engine the calls are spread over, as from that many "
        "front ends (their groups reach the engine together)",
    )  # fmt: skip
    parser.add_argument("--client", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        import uvloop

        socket_path, in_flight, seconds, send, front_ends = args.client
        uvloop.run(_drive(socket_path, int(in_flight), float(seconds), send, int(front_ends)))
        return
    sends = args.send.split(",")
    if not set(sends) <= {"call", "group"}:
        parser.error(f"--send {args.send}: expected call, group or call,group")
    cases = [(str(Path(tree).resolve()), send) for tree in args.src.split(",") for send in sends]
    results: dict[str, list[dict[str, float]]] = {f"{t} {s}": [] for t, s in cases}
    with tempfile.TemporaryDirectory(prefix="slipstream-engine-calls-") as tmp:
        repo = build_mlp(Path(tmp) / "repo")
        for index in range(args.rounds):
            order = cases if index % 2 == 0 else cases[::-1]
            for tree, send in order:
                label = f"{tree} {send}"
                figures = measure(tree, send, repo, Path(tmp), args)
                results[label].append(figures)
                print(
                    f"round {index + 1} {label}: {figures['calls_per_s']:8,.0f} calls/s, "
                    f"engine loop {figures['loop_us']:5.1f} us CPU/call, "
                    f"all engine threads {figures['engine_us']:5.1f} us",
                    flush=True,
                )
    print("\nmedians over the rounds (range)")
    medians = {}
    for label, rounds in results.items():
        loop = [r["loop_us"] for r in rounds]
        engine = [r["engine_us"] for r in rounds]
        medians[label] = statistics.median(loop)
        print(f"  {label}: engine loop {statistics.median(loop):.1f} us/call "
              f"({min(loop):.1f}-{max(loop):.1f}), all threads {statistics.median(engine):.1f}"
              f" ({min(engine):.1f}-{max(engine):.1f})")  # fmt: skip
    if len(results) == 2:
        before, after = results
        print(f"  engine loop CPU per call, {after} / {before}: "
              f"{medians[after] / medians[before]:.2f}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


def measure(
    tree: str, send: str, repo: Path, tmp: Path, args: argparse.Namespace
) -> dict[str, float]:
    with engine_server(tree, repo, tmp, args.server_core) as (engine, socket_path, port):
        client = subprocess.Popen(
            ["taskset", "-c", str(args.client_core), sys.executable, __file__, "--client",
             socket_path, str(args.in_flight), str(args.seconds + 3), send,
             str(args.front_ends)],
        )  # fmt: skip
        time.sleep(1.5)  # connected and warm
        answered = _answered(port)
        loop_before = _thread_cpu(engine, engine.pid)
        all_before = sum(engine.cpu_times()[:2])
        started = time.monotonic()
        time.sleep(args.seconds)
        loop_cpu = _thread_cpu(engine, engine.pid) - loop_before
        all_cpu = sum(engine.cpu_times()[:2]) - all_before
        elapsed = time.monotonic() - started
        answered = _answered(port) - answered
        client.wait(60)
    rate = answered / elapsed
    return {
        "calls_per_s": rate,
        "loop_us": loop_cpu / answered * 1e6,
        "engine_us": all_cpu / answered * 1e6,
    }


def _answered(port: int) -> int:
    """Requests the engine has answered (its statistics, through the idle front end)."""
    url = f"http://127.0.0.1:{port}/v2/models/mlp/stats"
    with urllib.request.urlopen(url, timeout=5) as reply:
        stats = json.load(reply)
    return int(stats["model_stats"][0]["inference_stats"]["success"]["count"])


def _thread_cpu(process: psutil.Process, thread_id: int) -> float:
    for thread in process.threads():
        if thread.id == thread_id:
            return float(thread.user_time + thread.system_time)
    raise RuntimeError(f"thread {thread_id} is gone")


@contextmanager
def engine_server(
    tree: str, repo: Path, tmp: Path, core: int
) -> Iterator[tuple[psutil.Process, str, int]]:
    port, grpc_port = free_ports(2)
    command = [
        "taskset", "-c", str(core), str(VENV_BIN / "slipstream"), "serve",
        "--model-repository", str(repo), "--host", "127.0.0.1", "--http-port", str(port),
        "--grpc-port", str(grpc_port), "--frontends", "1", "--log-level", "warning",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": tree, "HF_HUB_OFFLINE": "1"}
    with (tmp / "server.log").open("wb") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_http(f"http://127.0.0.1:{port}/v2/models/mlp/ready")
        engine, socket_path = _find_engine(psutil.Process(server.pid))
        yield engine, socket_path, port
    finally:
        server.terminate()
        server.wait(30)


def _find_engine(supervisor: psutil.Process) -> tuple[psutil.Process, str]:
    """The child listening on the engine's Unix socket, and that socket's path."""
    for child in supervisor.children(recursive=True):
        for connection in child.net_connections(kind="unix"):
            path = connection.laddr
            if isinstance(path, str) and path.endswith("/engine"):
                return child, path
    raise RuntimeError("no process of the server listens on an engine socket")


async def _drive(
    socket_path: str, in_flight: int, seconds: float, send: str, front_ends: int
) -> None:
    """The load: ``in_flight`` callers spread over ``front_ends`` connections, each caller
    sending the next request when its answer is back. It runs this checkout's client,
    whatever tree the server runs."""
    sys.path.insert(0, str(ROOT / "src"))
    from slipstream.engine.client import EngineClient
    from slipstream.engine.remote import RemoteInferenceService
    from slipstream.engine.wire import request_fields
    from slipstream.types import InferRequest

    clients = [EngineClient(socket_path) for _ in range(front_ends)]
    for client in clients:
        client.start()
        if not await client.wait_connected(10):
            raise SystemExit(f"could not connect to {socket_path}")
    metadata = await clients[0].call("model_metadata", "mlp", "")
    inputs = {
        tensor.name: np.zeros([1 if d < 0 else d for d in tensor.shape], np.float32)
        for tensor in metadata.inputs
    }
    request = InferRequest("mlp", "", inputs)
    fields = request_fields(request)
    stop = time.monotonic() + seconds

    services = [RemoteInferenceService([client]) for client in clients]

    async def caller(index: int) -> None:
        client, service = clients[index % front_ends], services[index % front_ends]
        while time.monotonic() < stop:
            if send == "group":
                await service.infer(request)
            else:
                await client.call("infer", fields)

    await asyncio.gather(*(caller(index) for index in range(in_flight)))
    for client in clients:
        await client.close()


if __name__ == "__main__":
    main()
