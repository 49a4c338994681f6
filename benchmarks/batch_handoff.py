"""A device that waits on the server between batches, emulated on the CPU (issue #12).

On a GPU the model runs off the CPU, and what the server adds between two batches is
device time lost: on an H200 the FP16 encoder was served at 0.27-0.34 of torch alone
with neither the GPU nor the engine's event loop saturated (docs/gpu.md). This script
makes that regime on a CPU host: ``tests/flaky.py``'s backend sleeps ``--delay-ms`` a
batch whatever its size (the GIL released, no CPU used, like a GPU kernel), one
``slipstream serve`` process on ``--server-cores`` batches up to ``--max-batch`` rows,
and ``perf_analyzer`` (HTTP, ``--concurrency`` requests in flight) on ``--client-cores``
keeps it busy.

Prints, per case and round: infer/s, rows per batch, the share of the time the "device"
was busy (batches x delay / wall time), and, from ``slipstream_instance_idle_seconds``,
how long the instance sat between two batches while requests were queued, per hand-off
and as a share of the time. With ``--src A,B`` the rounds alternate two source trees.

    .venv/bin/python benchmarks/batch_handoff.py --delay-ms 3,5 --rounds 2
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from frontends import ROOT, free_ports, model_metrics, wait_http
from peers.perf_analyzer import ensure_perf_analyzer

sys.path.insert(0, str(ROOT))

from tests.flaky import build_flaky, flaky_command


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delay-ms", default="3,5", help="comma list: the device's ms a batch")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--measurement-ms", type=int, default=4000)
    parser.add_argument("--server-cores", default="0")
    parser.add_argument("--client-cores", default="1")
    parser.add_argument("--src", default="src", help="comma list of source trees to alternate")
    args = parser.parse_args()
    tool = ensure_perf_analyzer()
    if tool is None:
        raise SystemExit("perf_analyzer is not available (see benchmarks/peers/perf_analyzer.py)")
    trees = [str(Path(tree).resolve()) for tree in args.src.split(",")]
    figures: dict[tuple[str, float], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="slipstream-handoff-") as tmp:
        for delay_ms in (float(d) for d in args.delay_ms.split(",")):
            for index in range(args.rounds):
                for tree in trees if index % 2 == 0 else trees[::-1]:
                    result = measure(tool, tree, delay_ms, Path(tmp), args)
                    figures.setdefault((tree, delay_ms), []).append(result)
                    print(f"{delay_ms:g} ms a batch, round {index + 1}, {tree}: "
                          f"{result['infer_per_s']:7,.0f} infer/s, "
                          f"{result['rows_per_batch']:5.1f} rows a batch, "
                          f"device busy {result['busy']:4.0%}, idle with work queued "
                          f"{result['idle_ms']:5.2f} ms a hand-off "
                          f"({result['idle_share']:4.0%} of the time)", flush=True)  # fmt: skip
    print("\nmedians over the rounds")
    for (tree, delay_ms), rounds in figures.items():
        busy = statistics.median(r["busy"] for r in rounds)
        idle = statistics.median(r["idle_ms"] for r in rounds)
        rate = statistics.median(r["infer_per_s"] for r in rounds)
        print(f"  {delay_ms:g} ms, {tree}: {rate:7,.0f} infer/s, device busy {busy:4.0%}, "
              f"{idle:5.2f} ms idle a hand-off")  # fmt: skip


def measure(
    tool: tuple[Path, dict[str, str]], tree: str, delay_ms: float, tmp: Path,
    args: argparse.Namespace,
) -> dict[str, float]:  # fmt: skip
    repo = tmp / f"repo-{delay_ms:g}"
    if not repo.exists():
        build_flaky(repo, tmp / "runs.log", delay_ms=delay_ms,
                    config={"max_batch_size": args.max_batch})  # fmt: skip
    with flaky_server(tree, repo, tmp, args.server_cores) as port:
        before, started = _scrape(port), time.monotonic()
        binary, env = tool
        out = tmp / "pa.csv"
        command = [
            "taskset", "-c", args.client_cores, str(binary), "-m", "flaky", "-x", "1",
            "-i", "http", "-u", f"127.0.0.1:{port}",
            "--concurrency-range", str(args.concurrency), "--input-data", "zero",
            "--measurement-interval", str(args.measurement_ms),
            "--stability-percentage", "999", "--max-trials", "3", "-f", str(out),
        ]  # fmt: skip
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"perf_analyzer failed: {(done.stdout + done.stderr)[-600:]}")
        wall = time.monotonic() - started
        after = _scrape(port)
    with out.open() as f:
        rate = float(next(csv.DictReader(f))["Inferences/Second"])
    batches = after["executions"] - before["executions"]
    handoffs = after["idle_count"] - before["idle_count"]
    idle_s = after["idle_sum"] - before["idle_sum"]
    return {
        "infer_per_s": rate,
        "rows_per_batch": (after["inferences"] - before["inferences"]) / max(batches, 1),
        "busy": batches * delay_ms / 1e3 / wall,
        "idle_ms": idle_s / max(handoffs, 1) * 1e3,
        "idle_share": idle_s / wall,
    }


@contextmanager
def flaky_server(tree: str, repo: Path, tmp: Path, cores: str) -> Iterator[int]:
    """``slipstream serve`` with the flaky backend registered: one process (a split
    layout's engine would not have it)."""
    port, grpc_port = free_ports(2)
    command = [
        "taskset", "-c", cores, *flaky_command(), "serve", "--model-repository", str(repo),
        "--host", "127.0.0.1", "--http-port", str(port), "--grpc-port", str(grpc_port),
        "--log-level", "warning",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": tree}
    with (tmp / "server.log").open("wb") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_http(f"http://127.0.0.1:{port}/v2/models/flaky/ready")
        yield port
    finally:
        server.terminate()
        server.wait(30)


def _scrape(port: int) -> dict[str, float]:
    return model_metrics(port, "flaky", {
        "slipstream_instance_idle_seconds_sum": "idle_sum",
        "slipstream_instance_idle_seconds_count": "idle_count",
        "slipstream_execution_count_total": "executions",
        "slipstream_inference_count_total": "inferences",
    })  # fmt: skip


if __name__ == "__main__":
    main()
