"""Shadow traffic's cost on the primary: p50 latency of `mlp` with and without a 100% shadow.

Prints a ratio (a script, never a test). `mlp` (examples/build_models.py) is served twice
from one repository build: as it is, and as `mlp_shadow`, the same file as versions 1 and
2 with `rollout: {weights: {"1": 100}, shadow: {version: "2", share: 1.0}}`, so every
request answered by version 1 is also run on version 2 after its answer and compared.
The server runs on core 0; this script sends requests one after another (C=1, keep-alive
HTTP, V2 JSON) from core 1, the two models in turns (ABBA) for `--rounds` rounds of
`--requests` each. Target (issue #15): shadow p50 / plain p50 <= 1.05.

    .venv/bin/python benchmarks/rollout_shadow.py              # ~1 min on 2 cores
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from models import build_repository, json_body, sample_inputs
from servers import ServerSpec, free_port, running

ROOT = Path(__file__).resolve().parents[1]
SLIPSTREAM = str(Path(sys.executable).parent / "slipstream")


def build(repo: Path) -> None:
    build_repository(repo, ["mlp"])
    config_path = repo / "mlp" / "config.yaml"
    config = yaml.safe_load(config_path.read_text()) if config_path.exists() else {}
    for version in ("1", "2"):
        target = repo / "mlp_shadow" / version
        target.mkdir(parents=True, exist_ok=True)
        for source in (repo / "mlp" / "1").iterdir():
            if not (target / source.name).exists():
                os.link(source, target / source.name)
    shadowed = {
        **(config or {}),
        "version_policy": {"all": {}},
        "rollout": {"weights": {"1": 100}, "shadow": {"version": "2", "share": 1.0}},
    }
    (repo / "mlp_shadow" / "config.yaml").write_text(yaml.safe_dump(shadowed))  # fmt: skip


def latency_ms(client: httpx.Client, url: str, body: bytes, requests: int) -> tuple[float, float]:
    """(p50, p99) of ``requests`` sent one at a time."""
    timings = []
    headers = {"Content-Type": "application/json"}
    for _ in range(requests):
        started = time.perf_counter()
        reply = client.post(url, content=body, headers=headers)
        timings.append(time.perf_counter() - started)
        reply.raise_for_status()
    timings.sort()
    return statistics.median(timings) * 1e3, timings[int(0.99 * (len(timings) - 1))] * 1e3


def shadow_outcomes(client: httpx.Client, base: str) -> dict[str, float]:
    counts = {}
    for line in client.get(f"{base}/metrics").text.splitlines():
        if line.startswith("slipstream_shadow_requests_total{") and "mlp_shadow" in line:
            counts[line.split('outcome="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=3000)
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs two cores: the server on one, this client on another")
    os.sched_setaffinity(0, {cores[1]})
    print(f"load average at start: {os.getloadavg()}", flush=True)
    body = json_body(sample_inputs("mlp")).body
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        build(repo)
        port = free_port()
        argv = [SLIPSTREAM, "serve", "--model-repository", str(repo), "--http-port", str(port),
                "--grpc-port", "0"]  # fmt: skip
        spec = ServerSpec("slipstream", argv, port, "/v2/health/ready")
        logs = ROOT / "benchmarks" / "results" / "work" / "logs"
        ratios, tails = [], []
        with running(spec, cores[0], logs / "rollout_shadow.log"), httpx.Client() as client:
            base = spec.url("")
            for model in ("mlp", "mlp_shadow"):  # warm-up
                latency_ms(client, f"{base}/v2/models/{model}/infer", body, 500)
            for index in range(args.rounds):
                order = ("mlp", "mlp_shadow") if index % 2 == 0 else ("mlp_shadow", "mlp")
                got = {m: latency_ms(client, f"{base}/v2/models/{m}/infer", body, args.requests)
                       for m in order}  # fmt: skip
                ratios.append(got["mlp_shadow"][0] / got["mlp"][0])
                tails.append(got["mlp_shadow"][1] / got["mlp"][1])
                plain, shadowed = got["mlp"], got["mlp_shadow"]
                print(f"round {index + 1}: mlp p50 {plain[0]:.3f} ms, with a 100% shadow "
                      f"{shadowed[0]:.3f} ms ({ratios[-1]:.3f}); p99 {plain[1]:.3f} ms / "
                      f"{shadowed[1]:.3f} ms ({tails[-1]:.3f})", flush=True)  # fmt: skip
            outcomes = shadow_outcomes(client, base)
    print(f"shadow copies: {outcomes}")
    print(f"100% shadow on mlp at C=1: primary p50 x{statistics.median(ratios):.3f} "
          f"(rounds {min(ratios):.3f}-{max(ratios):.3f}; target <= 1.05); p99 "
          f"x{statistics.median(tails):.3f} (rounds {min(tails):.3f}-{max(tails):.3f}); "
          f"load average at end: {os.getloadavg()}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
