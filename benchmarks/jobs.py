"""Asynchronous jobs (issue #17): throughput of 2 `slipstream worker`s over 1 (target >= 1.7x).

Each worker is its own process with its own serving core, pinned to its own core
(`taskset`) when the machine has one per worker, running the model with one intra-op
thread; `minilm` (default: ~25 ms a sequence on one core) keeps the workers' time in the
model rather than in Redis. For each worker count: start the workers, run a warm-up
batch of jobs (discarded), then submit `--jobs` jobs straight into the stream (the
server's own submission code, jobs/queue.py) and time until the last one ended. The
ceiling beside it: ONNX Runtime in-process on one thread at the model's preferred batch.
Beside other work (2 shared cores) the figures are noisy: the load average is printed.

    .venv/bin/python benchmarks/jobs.py                     # minilm, 240 jobs a level
    .venv/bin/python benchmarks/jobs.py --model mlp --jobs 5000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "src"))

from slipstream.jobs.codec import encode_stored_request  # noqa: E402
from slipstream.jobs.queue import STREAM, JobQueue  # noqa: E402
from slipstream.types import InferRequest  # noqa: E402

from models import build_repository, sample_inputs  # noqa: E402

WARMUP_JOBS = 16


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def one_thread_repository(source: Path, model: str, into: Path) -> Path:
    """A copy of ``model`` whose config runs one instance on one intra-op thread."""
    shutil.copytree(source / model, into / model)
    config_path = into / model / "config.yaml"
    config = yaml.safe_load(config_path.read_text()) if config_path.exists() else {}
    config = config or {}
    config["instance_group"] = [{"count": 1}]
    config["parameters"] = {"intra_op_thread_count": "1", "inter_op_thread_count": "1"}
    config_path.write_text(yaml.safe_dump(config))
    return into


def start_workers(count: int, url: str, repo: Path, logs: Path) -> list[subprocess.Popen[bytes]]:
    cores = os.cpu_count() or 1
    procs = []
    for index in range(count):
        argv = [str(Path(sys.executable).parent / "slipstream"), "worker", "--redis", url,
                "--repository", str(repo), "--consumer", f"bench-{index}",
                "--prefetch", "16", "--log-level", "warning"]  # fmt: skip
        if count <= cores and shutil.which("taskset"):
            argv = ["taskset", "-c", str(index), *argv]
        log = (logs / f"worker-{count}-{index}.log").open("wb")
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "src")}
        procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env))
    return procs


async def submit(url: str, model: str, count: int, prefix: str) -> None:
    queue = JobQueue(url, max_pending=10**7)
    request = InferRequest(model, "", sample_inputs(model))
    body, header_length = encode_stored_request(request)
    try:
        for index in range(count):
            await queue.submit(f"{prefix}-{index}", model, "", body, header_length)
    finally:
        await queue.close()


async def wait_empty(url: str, timeout_s: float = 600) -> None:
    """Until every job submitted has ended (the stream holds the unfinished ones)."""
    import redis.asyncio

    client = redis.asyncio.Redis.from_url(url)
    deadline = time.monotonic() + timeout_s
    try:
        while await client.xlen(STREAM):
            if time.monotonic() > deadline:
                raise TimeoutError("jobs still pending; see the worker logs")
            await asyncio.sleep(0.005)
    finally:
        await client.aclose()


def measure(workers: int, url: str, repo: Path, model: str, jobs: int, logs: Path) -> float:
    procs = start_workers(workers, url, repo, logs)
    try:
        # Warm-up: the first jobs wait for the workers to load (not timed).
        asyncio.run(submit(url, model, WARMUP_JOBS * workers, f"warm{workers}"))
        asyncio.run(wait_empty(url))
        started = time.perf_counter()
        asyncio.run(submit(url, model, jobs, f"run{workers}"))
        asyncio.run(wait_empty(url))
        return jobs / (time.perf_counter() - started)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(60)


def ceiling(path: Path, model: str, batch: int, seconds: float = 3.0) -> float:
    """Sequences/s of ONNX Runtime in-process on one thread at ``batch``."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    inputs = {k: np.repeat(v, batch, axis=0) for k, v in sample_inputs(model).items()}
    session.run(None, inputs)
    runs, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        session.run(None, inputs)
        runs += 1
    return runs * batch / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="minilm", choices=["minilm", "mlp"])
    parser.add_argument("--jobs", type=int, default=240)
    parser.add_argument("--models-dir", type=Path, default=REPO_ROOT / "models")
    args = parser.parse_args()
    found = build_repository(args.models_dir, [args.model])
    if args.model not in found:
        sys.exit(f"model {args.model} is missing: build it with examples/build_models.py")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        repo = one_thread_repository(args.models_dir, args.model, root / "models")
        port = free_port()
        redis = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", tmp], stdout=subprocess.DEVNULL,
        )  # fmt: skip
        url = f"redis://127.0.0.1:{port}"
        try:
            time.sleep(0.5)
            one = measure(1, url, repo, args.model, args.jobs, root)
            two = measure(2, url, repo, args.model, args.jobs, root)
        finally:
            redis.terminate()
            redis.wait(10)
        batch = 4 if args.model == "minilm" else 64
        limit = ceiling(found[args.model], args.model, batch)
    print(f"model {args.model}, {args.jobs} jobs a level, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")  # fmt: skip
    print(f"1 worker : {one:8.1f} jobs/s  ({one / limit:.2f} of ORT on one thread, "
          f"{limit:.1f}/s at batch {batch})")  # fmt: skip
    print(f"2 workers: {two:8.1f} jobs/s")
    print(f"2 workers / 1 worker: {two / one:.2f}x (target >= 1.7x)")


if __name__ == "__main__":
    main()
