"""Shadow traffic's cost on the primary: p50 latency of `mlp` with and without a 100% shadow.

Prints a ratio (a script, never a test). `mlp` (examples/build_models.py) is served three
times from one repository build: as it is; as `mlp_routed`, the same file as versions 1
and 2 with `rollout: {weights: {"1": 100}}` (the route alone); and as `mlp_shadow`, with
`rollout: {weights: {"1": 100}, shadow: {version: "2", share: 1.0}}`, so every request
answered by version 1 is also run on version 2 after its answer and compared.

The server runs on core 0; this script sends requests one after another (C=1, keep-alive
HTTP, V2 JSON) from core 1. This machine's latency drifts by 20% over seconds, so the
models take turns in short blocks (`--block` requests, the order reversed every other
turn) with a pause after each block for shadow copies still queued to finish (they must
not land on the next model's block); a round pools `--blocks` blocks of each model.
Target (issue #15): shadow p50 / plain p50 <= 1.05.

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
    (repo / "mlp_routed").mkdir()
    (repo / "mlp_routed" / "config.yaml").write_text(
        yaml.safe_dump({**shadowed, "rollout": {"weights": {"1": 100}}})
    )
    for version in ("1", "2"):
        (repo / "mlp_routed" / version).mkdir()
        for source in (repo / "mlp_shadow" / version).iterdir():
            os.link(source, repo / "mlp_routed" / version / source.name)


def timings_s(client: httpx.Client, url: str, body: bytes, requests: int) -> list[float]:
    """Latencies of ``requests`` sent one at a time."""
    timings = []
    headers = {"Content-Type": "application/json"}
    for _ in range(requests):
        started = time.perf_counter()
        reply = client.post(url, content=body, headers=headers)
        timings.append(time.perf_counter() - started)
        reply.raise_for_status()
    return timings


def p50_p99_ms(timings: list[float]) -> tuple[float, float]:
    ordered = sorted(timings)
    return statistics.median(ordered) * 1e3, ordered[int(0.99 * (len(ordered) - 1))] * 1e3


def shadow_outcomes(client: httpx.Client, base: str) -> dict[str, float]:
    counts = {}
    for line in client.get(f"{base}/metrics").text.splitlines():
        if line.startswith("slipstream_shadow_requests_total{") and "mlp_shadow" in line:
            counts[line.split('outcome="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return counts


MODELS = ("mlp", "mlp_routed", "mlp_shadow")
# After each block: long enough for the shadow's gathering (20 ms), its wait for a
# primary answer (20 ms at most) and the copies' run.
PAUSE_S = 0.1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--blocks", type=int, default=8, help="blocks of each model a round")
    parser.add_argument("--block", type=int, default=150, help="requests a block")
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
        shadow_ratios, routed_ratios, tails = [], [], []
        with running(spec, cores[0], logs / "rollout_shadow.log"), httpx.Client() as client:
            base = spec.url("")
            url = {model: f"{base}/v2/models/{model}/infer" for model in MODELS}
            for model in MODELS:  # warm-up
                timings_s(client, url[model], body, 500)
            time.sleep(PAUSE_S)
            for index in range(args.rounds):
                pooled: dict[str, list[float]] = {model: [] for model in MODELS}
                for turn in range(args.blocks):
                    for model in MODELS if turn % 2 == 0 else reversed(MODELS):
                        pooled[model] += timings_s(client, url[model], body, args.block)
                        time.sleep(PAUSE_S)
                got = {model: p50_p99_ms(pooled[model]) for model in MODELS}
                plain, routed, shadowed = got["mlp"], got["mlp_routed"], got["mlp_shadow"]
                shadow_ratios.append(shadowed[0] / plain[0])
                routed_ratios.append(routed[0] / plain[0])
                tails.append(shadowed[1] / plain[1])
                print(f"round {index + 1}: p50 mlp {plain[0]:.3f} ms, routed {routed[0]:.3f} "
                      f"ms ({routed_ratios[-1]:.3f}), with a 100% shadow {shadowed[0]:.3f} ms "
                      f"({shadow_ratios[-1]:.3f}); p99 {plain[1]:.3f} ms / {shadowed[1]:.3f} ms "
                      f"({tails[-1]:.3f})", flush=True)  # fmt: skip
            outcomes = shadow_outcomes(client, base)
    print(f"shadow copies: {outcomes}")

    def spread(ratios: list[float]) -> str:
        return f"x{statistics.median(ratios):.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f})"

    print(f"100% shadow on mlp at C=1: primary p50 {spread(shadow_ratios)}, target <= 1.05; "
          f"the route alone p50 {spread(routed_ratios)}; p99 {spread(tails)}; "
          f"load average at end: {os.getloadavg()}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
