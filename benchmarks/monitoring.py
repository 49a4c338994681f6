"""Monitoring's cost on the serving path, and the server's cost gauge against bench's.

Prints ratios (a script, never a test). `mlp` (examples/build_models.py) is served twice
from one repository build: as it is, and as `mlp_watched`, the same file with drift
monitoring on (every request sampled, windows of 500 rows). The server runs on core 0
with `--price-per-hour`, `slipstream bench` on core 1 at concurrency 64 for
`--duration` seconds a level, the two models in turns (ABBA) for `--rounds` rounds.

1. **Drift sampling overhead**: req/s of `mlp_watched` / req/s of `mlp` in the same
   round (target >= 0.98), the median and the spread over rounds.
2. **Cost agreement**: while bench's level runs, the server's
   `slipstream_cost_per_million_inferences` (over `--cost-window-s`) is read from
   /metrics and compared with the cost bench reports for the level from its own side
   (`--price-per-hour`): target within 5%.

    .venv/bin/python benchmarks/monitoring.py                 # ~3 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from models import build_repository
from servers import ServerSpec, free_port, running

ROOT = Path(__file__).resolve().parents[1]
SLIPSTREAM = str(Path(sys.executable).parent / "slipstream")
PRICE_PER_HOUR = 1.0


def build(repo: Path) -> None:
    build_repository(repo, ["mlp"])
    watched = repo / "mlp_watched"
    (watched / "1").mkdir(parents=True, exist_ok=True)
    for source in (repo / "mlp" / "1").iterdir():
        target = watched / "1" / source.name
        if not target.exists():
            os.link(source, target)
    config = (
        (repo / "mlp" / "config.yaml").read_text()
        if (repo / "mlp" / "config.yaml").exists()
        else ""
    )
    monitoring = "monitoring:\n  drift:\n    enable: true\n    window: 500\n"
    (watched / "config.yaml").write_text(config + ("\n" if config else "") + monitoring)


def cost_gauge(url: str, model: str) -> float | None:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == "slipstream_cost_per_million_inferences":
            for sample in family.samples:
                if sample.labels.get("model") == model:
                    return float(sample.value)
    return None


def bench_level(url: str, model: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One closed-loop level; the server's cost gauge read two thirds of the way in."""
    argv = ["taskset", "-c", str(args.client_core), SLIPSTREAM, "bench", url, "-m", model,
            "--concurrency", "64", "--duration", str(args.duration), "--protocol", "http",
            "--price-per-hour", str(PRICE_PER_HOUR), "--json", str(out)]  # fmt: skip
    gauge: list[float | None] = []

    def read_gauge() -> None:
        # Bench warms up first: read once the window holds only measured load.
        time.sleep(args.warmup_s + args.duration * 2 / 3)
        gauge.append(cost_gauge(url, model))

    reader = threading.Thread(target=read_gauge)
    reader.start()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    reader.join()
    level = json.loads(out.read_text())["levels"][0]
    return {
        "req_per_s": level["throughput_req_per_s"],
        "bench_cost_per_1m": level["cost_per_1m_infer"],
        "server_cost_per_1m": gauge[0] if gauge else None,
        "errors": level["errors"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--warmup-s", type=float, default=3.0,
                        help="how long bench warms up before measuring (its default)")  # fmt: skip
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs two cores: the server on one, the load generator on another")
    server_core, args.client_core = cores[0], cores[1]
    print(f"load average at start: {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        build(repo)
        port = free_port()
        argv = [SLIPSTREAM, "serve", "--model-repository", str(repo), "--http-port", str(port),
                "--grpc-port", "0", "--price-per-hour", str(PRICE_PER_HOUR),
                "--cost-window-s", str(args.duration / 2)]  # fmt: skip
        spec = ServerSpec("slipstream", argv, port, "/v2/health/ready")
        logs = ROOT / "benchmarks" / "results" / "work" / "logs"
        rounds: list[dict[str, Any]] = []
        with running(spec, server_core, logs / "monitoring.log"):
            url = spec.url("")
            for index in range(args.rounds):
                entry = {}
                # ABBA: neither model always runs first (a server warms over a run).
                order = ("mlp", "mlp_watched") if index % 2 == 0 else ("mlp_watched", "mlp")
                for model in order:
                    entry[model] = bench_level(
                        url, model, args, Path(tmp) / f"{model}-{index}.json"
                    )
                rounds.append(entry)
                plain, watched = entry["mlp"], entry["mlp_watched"]
                print(f"round {index + 1}: mlp {plain['req_per_s']:.0f} req/s, with drift "
                      f"{watched['req_per_s']:.0f} req/s", flush=True)  # fmt: skip
    report(rounds)
    print(f"load average at end: {os.getloadavg()}")
    if args.json:
        args.json.write_text(json.dumps(rounds, indent=2))
    return 0


def report(rounds: list[dict[str, Any]]) -> None:
    ratios = [r["mlp_watched"]["req_per_s"] / r["mlp"]["req_per_s"] for r in rounds]
    print(f"drift sampling on mlp at C=64: {statistics.median(ratios):.3f} of the req/s without "
          f"it (rounds {[round(x, 3) for x in ratios]}; target >= 0.98)")  # fmt: skip
    agreement = [
        level["server_cost_per_1m"] / level["bench_cost_per_1m"]
        for r in rounds for level in r.values()
        if level["server_cost_per_1m"] and level["bench_cost_per_1m"]
    ]  # fmt: skip
    if agreement:
        print(f"server cost gauge / bench's cost: median {statistics.median(agreement):.3f} "
              f"(levels {[round(x, 3) for x in agreement]}; target within 0.95-1.05)")  # fmt: skip
    else:
        print("no cost gauge read while bench ran")


if __name__ == "__main__":
    raise SystemExit(main())
