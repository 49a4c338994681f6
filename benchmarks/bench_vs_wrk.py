"""Cross-check `slipstream bench` against wrk: same server, same body, same core, same load.

If the load generator were the bottleneck, or measured differently, its closed-loop
throughput would fall short of wrk's (a C load generator that needs a fraction of a
core at these rates). The server runs pinned to core 0 (`taskset -c 0`) serving the
`mlp` example model; wrk (`-t1 -cN`) and `slipstream bench --concurrency N` both run
pinned to core 1 in turn, sending byte-for-byte the same V2 JSON body: one [1, 256]
FP32 sample. Each round runs both tools at every concurrency, alternating which goes
first; the figure per concurrency is the median over rounds of bench req/s / wrk req/s.
Target: within 10% (a ratio of 0.90 to 1.10).

    .venv/bin/python benchmarks/bench_vs_wrk.py                     # 1, 8, 64 connections
    .venv/bin/python benchmarks/bench_vs_wrk.py --concurrency 8 --duration 5 --rounds 3

A script that prints numbers, not a test: figures taken beside other work are noisy
(the load average is printed at the start and end), and the spread over rounds is shown.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slipstream.bench.v2.inputs import RemoteModel, RemoteTensor, RequestInputs, read_input_data
from slipstream.bench.v2.payloads import encode_request

from loadgen import (
    WRK_INSTALL_HINT,
    LoadResult,
    measure_level,
    write_lua_script,
    wrk_available,
)
from models import RequestBody, build_repository, sample_inputs
from servers import ServerSpec, free_port, running

RESULTS_DIR = Path(__file__).resolve().parent / "results"
BENCH_EXE = Path(sys.executable).parent / "slipstream"


@dataclass(frozen=True)
class Pair:
    """wrk and slipstream bench at one concurrency in one round."""

    concurrency: int
    wrk_req_per_s: float
    wrk_p50_ms: float
    bench_req_per_s: float
    bench_p50_ms: float
    bench_client_cpu_pct: float
    bench_warnings: list[str]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,8,64", help="comma-separated levels")
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=2.0, help="warm-up seconds per run")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each tool per level")
    parser.add_argument("--server-core", type=int, default=0)
    parser.add_argument("--client-core", type=int, default=1)
    parser.add_argument("--repo", type=Path, default=RESULTS_DIR / "models")
    parser.add_argument("--json", type=Path, dest="json_out", help="write the pairs here")
    return parser.parse_args()


def request_body(work_dir: Path) -> tuple[RequestBody, Path]:
    """The JSON body both tools send, and a file holding it for `--input-data`.

    Encoded by slipstream bench's own encoder, so that bench's decode-and-re-encode of
    the file gives back exactly these bytes (checked below).
    """
    inputs = RequestInputs(tensors=sample_inputs("mlp"), batch_size=1)
    body = encode_request("http", "mlp", "", inputs).body
    path = work_dir / "mlp_request.json"
    path.write_bytes(body)
    signature = RemoteModel("mlp", (RemoteTensor("input", "FP32", (-1, 256)),), batching=True)
    [as_read] = read_input_data(path, signature, batch_size=1)
    if encode_request("http", "mlp", "", as_read).body != body:
        raise RuntimeError("slipstream bench would not send the body wrk sends")
    return RequestBody(body, "application/json", None), path


def run_bench(
    url: str, body_file: Path, args: argparse.Namespace, connections: int
) -> dict[str, Any]:
    out = body_file.parent / f"bench-{connections}.json"
    command = [
        "taskset", "-c", str(args.client_core), str(BENCH_EXE), "bench", url, "-m", "mlp",
        "--input-data", str(body_file), "--concurrency", str(connections),
        "--warmup-s", str(args.warmup), "--duration", str(args.duration), "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"slipstream bench failed (rc={done.returncode}):\n{done.stderr}")
    level: dict[str, Any] = json.loads(out.read_text())["levels"][0]
    return level


def measure_pair(
    url: str,
    script: Path,
    body_file: Path,
    args: argparse.Namespace,
    connections: int,
    wrk_first: bool,
) -> Pair:
    def wrk() -> LoadResult:
        infer_url = f"{url}/v2/models/mlp/infer"
        return measure_level(
            infer_url, script, connections, args.duration, args.warmup, args.client_core
        )

    if wrk_first:
        wrk_result = wrk()
        bench = run_bench(url, body_file, args, connections)
    else:
        bench = run_bench(url, body_file, args, connections)
        wrk_result = wrk()
    return Pair(
        concurrency=connections,
        wrk_req_per_s=wrk_result.ok_per_s,
        wrk_p50_ms=wrk_result.p50_ms,
        bench_req_per_s=bench["throughput_req_per_s"],
        bench_p50_ms=bench["p50_ms"],
        bench_client_cpu_pct=bench["client_cpu_pct"],
        bench_warnings=bench["warnings"],
    )


def print_summary(pairs: list[Pair], levels: list[int]) -> None:
    print()
    header = f"{'conns':>5} {'wrk req/s':>10} {'bench req/s':>11} {'ratio':>6} {'spread':>13}"
    print(header + f" {'wrk p50':>8} {'bench p50':>9} {'bench CPU%':>10}")
    for connections in levels:
        rows = [p for p in pairs if p.concurrency == connections]
        ratios = [p.bench_req_per_s / p.wrk_req_per_s for p in rows if p.wrk_req_per_s > 0]
        ratio = statistics.median(ratios) if ratios else float("nan")
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-"
        verdict = "ok" if 0.9 <= ratio <= 1.1 else "OUTSIDE 10%"
        print(
            f"{connections:>5} {statistics.median(p.wrk_req_per_s for p in rows):>10.0f} "
            f"{statistics.median(p.bench_req_per_s for p in rows):>11.0f} {ratio:>6.3f} "
            f"{spread:>13} {statistics.median(p.wrk_p50_ms for p in rows):>7.3f}  "
            f"{statistics.median(p.bench_p50_ms for p in rows):>8.3f}  "
            f"{statistics.median(p.bench_client_cpu_pct for p in rows):>9.0f}  {verdict}"
        )
    for pair in pairs:
        for warning in pair.bench_warnings:
            print(f"  bench warning at {pair.concurrency} connections: {warning}")


def main() -> int:
    args = parse_args()
    if not wrk_available():
        print(WRK_INSTALL_HINT)
        return 2
    if not {args.server_core, args.client_core} <= os.sched_getaffinity(0):
        print(f"!! cores {args.server_core} and {args.client_core} must both be available")
        return 2
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    print(f"load average at start: {os.getloadavg()} (want ~0 for quiet figures)")
    paths = build_repository(args.repo, ["mlp"])
    if "mlp" not in paths:
        return 2
    with tempfile.TemporaryDirectory(prefix="bench-vs-wrk-") as tmp:
        work_dir = Path(tmp)
        body, body_file = request_body(work_dir)
        script = write_lua_script(body, work_dir, "mlp-json")
        port = free_port()
        argv = [str(BENCH_EXE), "serve", "--model-repository", str(args.repo.resolve())]
        argv += ["--host", "127.0.0.1", "--http-port", str(port), "--grpc-port", "0"]
        spec = ServerSpec("slipstream", argv, port, "/v2/models/mlp/ready")
        pairs = []
        with running(spec, args.server_core, work_dir / "server.log"):
            for round_index in range(args.rounds):
                for connections in levels:
                    pair = measure_pair(
                        spec.url(""), script, body_file, args, connections, round_index % 2 == 0
                    )
                    ratio = pair.bench_req_per_s / pair.wrk_req_per_s if pair.wrk_req_per_s else 0
                    print(
                        f"round {round_index + 1} c={connections}: wrk {pair.wrk_req_per_s:.0f} "
                        f"req/s, bench {pair.bench_req_per_s:.0f} req/s, ratio {ratio:.3f}",
                        flush=True,
                    )
                    pairs.append(pair)
    print_summary(pairs, levels)
    print(f"load average at end: {os.getloadavg()}")
    if args.json_out is not None:
        args.json_out.write_text(json.dumps([pair.__dict__ for pair in pairs], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
