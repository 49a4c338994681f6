"""`slipstream serve --ray` (issue #17): throughput of 2 Ray Serve replicas of `minilm`
over 1 (target >= 1.7x).

For 1 and then 2 replicas (`ray_serve: {min_replicas: N, max_replicas: N}`, one CPU
each, one intra-op thread per replica, one instance), start `slipstream serve --ray` on
a local Ray cluster and drive it with `slipstream bench` (V2 binary tensors, closed
loop at `--concurrency`, `--duration` seconds after a warm-up). Ray does not pin a
replica to a core; the load generator, Ray's proxy and the replicas share the machine's
cores, so on two shared cores the figure is a floor and noisy: the load average is
printed with it.

    .venv/bin/python benchmarks/ray_serve.py                    # minilm, C=8, 10 s a level
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import yaml

from models import build_repository, sample_inputs

REPO_ROOT = Path(__file__).resolve().parent.parent
SLIPSTREAM = str(Path(sys.executable).parent / "slipstream")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def repository(source: Path, model: str, replicas: int, into: Path) -> Path:
    shutil.copytree(source / model, into / model)
    config_path = into / model / "config.yaml"
    config = (yaml.safe_load(config_path.read_text()) if config_path.exists() else {}) or {}
    config["instance_group"] = [{"count": 1}]
    config["parameters"] = {"intra_op_thread_count": "1", "inter_op_thread_count": "1"}
    config["ray_serve"] = {"min_replicas": replicas, "max_replicas": replicas, "num_cpus": 1}
    config_path.write_text(yaml.safe_dump(config))
    return into


def measure(repo: Path, model: str, args: argparse.Namespace, work: Path) -> float:
    port = free_port()
    log = (work / f"serve-{port}.log").open("wb")
    server = subprocess.Popen(
        [SLIPSTREAM, "serve", "--ray", "--model-repository", str(repo), "--host", "127.0.0.1",
         "--http-port", str(port)], stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/v2/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                sys.exit(f"server did not start; see {log.name}")
            time.sleep(0.5)
        data = work / "inputs.npz"
        np.savez(data, **sample_inputs(model))
        out = work / f"bench-{port}.json"
        subprocess.run(
            [SLIPSTREAM, "bench", url, "-m", model, "--protocol", "http-binary",
             "--input-data", str(data), "--concurrency", str(args.concurrency),
             "--warmup-s", "3", "--duration", str(args.duration), "--json", str(out)],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        level = json.loads(out.read_text())["levels"][0]
        return float(level["throughput_infer_per_s"])
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(120)
        except subprocess.TimeoutExpired:
            server.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--models-dir", type=Path, default=REPO_ROOT / "models")
    args = parser.parse_args()
    if args.model not in build_repository(args.models_dir, [args.model]):
        sys.exit(f"model {args.model} is missing: build it with examples/build_models.py")
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        for replicas in (1, 2):
            work = Path(tmp) / str(replicas)
            repo = repository(args.models_dir, args.model, replicas, work / "models")
            figures[replicas] = measure(repo, args.model, args, work)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"model {args.model}, C={args.concurrency}, {args.duration:.0f} s a level, "
          f"load average {load} on {os.cpu_count()} cores")  # fmt: skip
    print(f"1 replica : {figures[1]:8.1f} req/s")
    print(f"2 replicas: {figures[2]:8.1f} req/s")
    print(f"2 replicas / 1 replica: {figures[2] / figures[1]:.2f}x (target >= 1.7x)")


if __name__ == "__main__":
    main()
