"""How long a large repository's index takes to answer (``POST /v2/repository/index``).

Listing the repository (the index, every poll in poll mode, the LLM lane's and the
cascades' views, each engine's share under ``--engines per-device``) reads every
model's directory and config on the event loop: with hundreds of models that time is
taken from every request in flight. This builds ``--models`` model directories (a
config.yaml each, torch models half on ``cuda:0``; no model files: nothing is loaded,
in explicit model-control mode), serves them, and times the index ``--calls`` times
after a first call (which parses every config).

    .venv/bin/python benchmarks/repository_index.py --models 500
    git archive HEAD~3 src | tar -x -C /tmp/before
    .venv/bin/python benchmarks/repository_index.py --src /tmp/before/src,src

With ``--src A,B`` each tree serves in turn (its ``src`` first on PYTHONPATH) and the
ratio of their median index times is printed.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def build(repository: Path, count: int) -> None:
    for index in range(count):
        (repository / f"m{index}" / "1").mkdir(parents=True)
        config = {
            "backend": "torch", "max_batch_size": 64,
            "parameters": {"device": "cuda:0" if index % 2 else "cpu", "precision": "fp16"},
            "instance_group": [{"count": 2, "kind": "KIND_GPU"}],
            "dynamic_batching": {"preferred_batch_size": [8, 16],
                                 "max_queue_delay_microseconds": 100},
        }  # fmt: skip
        (repository / f"m{index}" / "config.yaml").write_text(yaml.safe_dump(config))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def index_times(repository: Path, tree: str, calls: int) -> list[float]:
    """Seconds per index call against a server running ``tree``'s source."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())} if tree else dict(os.environ)
    command = [sys.executable, "-m", "slipstream", "serve", "--model-repository",
               str(repository), "--host", "127.0.0.1", "--http-port", str(port),
               "--grpc-port", "0", "--model-control-mode", "explicit",
               "--log-level", "warning"]  # fmt: skip
    with subprocess.Popen(command, env=env, stderr=subprocess.DEVNULL) as server:
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    urllib.request.urlopen(f"{url}/v2/health/live", timeout=2).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            times = []
            for _ in range(calls + 1):
                started = time.perf_counter()
                request = urllib.request.Request(f"{url}/v2/repository/index", b"", method="POST")
                urllib.request.urlopen(request, timeout=60).read()
                times.append(time.perf_counter() - started)
            return times[1:]
        finally:
            server.terminate()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=500)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--src", default="", help="A,B: two src trees to compare")
    args = parser.parse_args()
    trees = args.src.split(",") if args.src else [""]
    with tempfile.TemporaryDirectory() as tmp:
        repository = Path(tmp) / "models"
        build(repository, args.models)
        medians = []
        for tree in trees:
            times = index_times(repository, tree, args.calls)
            medians.append(statistics.median(times))
            print(f"{tree or 'installed'}: index of {args.models} models "
                  f"{medians[-1] * 1e3:.0f} ms median ({min(times) * 1e3:.0f}-"
                  f"{max(times) * 1e3:.0f} ms over {args.calls} calls)")  # fmt: skip
    if len(medians) == 2:
        print(f"ratio {trees[1]} / {trees[0]}: {medians[1] / medians[0]:.2f}")


if __name__ == "__main__":
    main()
