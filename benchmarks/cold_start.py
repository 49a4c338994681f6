"""Cold starts (issue #24): how long a user waits, per example model.

For each model (`digits`, `minilm`, `smollm2` from `examples/build_models.py`), a server
holding only that model is started `--rounds` times (pinned to `--core`), and each round
measures:

1. **start to ready**: `slipstream serve` spawned until `/v2/health/ready` answers 200
   (polled every 10 ms), with the server's own start-up trace beside it (imports, listening,
   the model's load and warm-up: `--trace-startup`);
2. **first answer, loaded**: one request once ready (what a warm request costs);
3. **first answer after an idle unload**: the server runs with `--idle-unload-seconds 1`;
   once the model is listed `idle`, one request is sent and timed until its answer (the
   load it triggers included).

`llama-server` (llama.cpp's own, built once by `benchmarks/peers/llama_server.py`) is
started on the same SmolLM2 file the same way: spawned until `/health` answers 200.

With `--ray`, each model is also served by `slipstream serve --ray` with
`ray_serve: {min_replicas: 0}`: once Ray reports no replica of it running, one request
is timed until its answer (a replica started for it, its model loaded); V2 models only.

Figures are medians over the rounds, with the range. Requests: V2 JSON of zeros shaped
from the model's metadata (batch 1, variable dims 8); SmolLM2: one chat message,
`max_tokens` 1.

    .venv/bin/python benchmarks/cold_start.py               # 3 rounds
    .venv/bin/python benchmarks/cold_start.py --rounds 5 --json cold_start.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from peers.llama_server import ensure_llama_server

from servers import free_port

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
SLIPSTREAM = Path(sys.executable).parent / "slipstream"
MODELS = ("digits", "minilm", "smollm2")
# Under Ray the generative models are one application (/v1) of their own, not one per
# model: its scale to zero is not timed here.
RAY_MODELS = ("digits", "minilm")
_DTYPES = {"FP32": 0.0, "FP16": 0.0, "FP64": 0.0, "INT64": 0, "INT32": 0, "INT8": 0, "BOOL": False}


def build_examples(work: Path) -> Path:
    repo = work / "examples"
    subprocess.run(
        [sys.executable, str(REPO_ROOT / "examples" / "build_models.py"), str(repo),
         "--only", ",".join(MODELS)],
        check=True, capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    return repo


def wait_for(url: str, deadline_s: float, started: float) -> float:
    """Seconds from ``started`` until ``url`` answers 200."""
    with httpx.Client(timeout=2) as client:
        while True:
            try:
                if client.get(url).status_code == 200:
                    return time.perf_counter() - started
            except httpx.TransportError:
                pass
            if time.perf_counter() - started > deadline_s:
                raise TimeoutError(f"{url} not 200 after {deadline_s} s")
            time.sleep(0.01)


def request_for(
    client: httpx.Client, base: str, model: str, meta: dict[str, Any] | None = None
) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of one small request to ``model`` (``meta``: its V2 metadata,
    else asked of the server)."""
    if model == "smollm2":
        body = {"model": model, "max_tokens": 1,
                "messages": [{"role": "user", "content": "Hello"}]}  # fmt: skip
        return "/v1/chat/completions", body
    meta = meta or client.get(f"{base}/v2/models/{model}").json()
    inputs = []
    for tensor in meta["inputs"]:
        shape = [1 if i == 0 and d == -1 else (8 if d == -1 else d)
                 for i, d in enumerate(tensor["shape"])]  # fmt: skip
        count = 1
        for d in shape:
            count *= d
        zero = _DTYPES.get(tensor["datatype"], 0)
        inputs.append({"name": tensor["name"], "datatype": tensor["datatype"], "shape": shape,
                       "data": [zero] * count})  # fmt: skip
    return f"/v2/models/{model}/infer", {"inputs": inputs}


def timed_request(client: httpx.Client, base: str, path: str, body: dict[str, Any]) -> float:
    started = time.perf_counter()
    reply = client.post(f"{base}{path}", json=body)
    elapsed = time.perf_counter() - started
    if reply.status_code != 200:
        raise RuntimeError(f"{path}: {reply.status_code} {reply.text[:300]}")
    return elapsed


def wait_idle(client: httpx.Client, base: str, model: str, deadline_s: float = 30) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        entries = client.post(f"{base}/v2/repository/index", json={}).json()
        if any(e["name"] == model and e.get("reason") == "idle" for e in entries):
            return
        time.sleep(0.05)
    raise TimeoutError(f"{model} was never unloaded for being idle")


def slipstream_round(repo: Path, model: str, work: Path, core: int) -> dict[str, Any]:
    single = work / f"only-{model}"
    single.mkdir(exist_ok=True)
    if not (single / model).exists():  # hard links: a symlinked model is refused
        shutil.copytree(repo / model, single / model, copy_function=os.link)
    port = free_port()
    trace = work / f"trace-{model}.json"
    trace.unlink(missing_ok=True)
    argv = ["taskset", "-c", str(core), str(SLIPSTREAM), "serve", "--model-repository",
            str(single), "--host", "127.0.0.1", "--http-port", str(port), "--grpc-port", "0",
            "--idle-unload-seconds", "1", "--trace-startup", str(trace)]  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    with open(work / f"{model}.log", "wb") as log:
        started = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            ready_s = wait_for(f"{base}/v2/health/ready", 120, started)
            with httpx.Client(timeout=120) as client:
                path, body = request_for(client, base, model)
                loaded_s = timed_request(client, base, path, body)
                wait_idle(client, base, model)
                woken_s = timed_request(client, base, path, body)
        finally:
            proc.terminate()
            proc.wait(60)
    traced = json.loads(trace.read_text()) if trace.exists() else {}
    return {"ready_s": ready_s, "first_loaded_s": loaded_s, "first_after_idle_s": woken_s,
            "trace": traced}  # fmt: skip


def ray_round(repo: Path, model: str, work: Path) -> float:
    """Seconds a request waits for a Ray Serve replica started for it from zero."""
    single = work / f"ray-{model}"
    if not single.exists():
        shutil.copytree(repo / model, single / model, copy_function=os.link)
        config = single / model / "config.yaml"
        text = config.read_text() if config.exists() else ""
        config.unlink(missing_ok=True)  # a hard link: the original stays as it was
        config.write_text(text + "\nray_serve:\n  min_replicas: 0\n  max_replicas: 1\n"
                          "  downscale_delay_s: 1\n  look_back_period_s: 1\n")  # fmt: skip
    port = free_port()
    argv = [str(SLIPSTREAM), "serve", "--ray", "--model-repository", str(single), "--host",
            "127.0.0.1", "--http-port", str(port)]  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    log_path = work / f"ray-{model}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while f"model {model}: 0 replicas running" not in log_path.read_text():
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise TimeoutError(f"{model} never at zero replicas: see {log_path}")
                time.sleep(0.2)
            with httpx.Client(timeout=120) as client:
                path, body = request_for(client, base, model, _metadata(repo / model))
                return timed_request(client, base, path, body)
        finally:
            proc.terminate()
            proc.wait(120)


def _metadata(model_dir: Path) -> dict[str, Any]:
    """The V2 metadata of an ONNX model directory, read from its file (no server needed:
    at zero replicas, asking would start one)."""
    import onnxruntime

    session = onnxruntime.InferenceSession(str(next(model_dir.rglob("*.onnx"))))
    kinds = {"tensor(float)": "FP32", "tensor(int64)": "INT64", "tensor(int32)": "INT32"}
    return {"inputs": [{"name": i.name, "datatype": kinds[i.type],
                        "shape": [d if isinstance(d, int) else -1 for d in i.shape]}
                       for i in session.get_inputs()]}  # fmt: skip


def llama_server_round(repo: Path, work: Path, core: int) -> dict[str, Any]:
    port = free_port()
    gguf = next((repo / "smollm2").rglob("*.gguf"))
    argv = ["taskset", "-c", str(core), str(ensure_llama_server()), "--model", str(gguf),
            "--host", "127.0.0.1", "--port", str(port), "--threads", "1"]  # fmt: skip
    with open(work / "llama-server.log", "wb") as log:
        started = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            ready_s = wait_for(f"http://127.0.0.1:{port}/health", 120, started)
        finally:
            proc.terminate()
            proc.wait(60)
    return {"ready_s": ready_s}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):6.3f} s [{min(values):.3f}..{max(values):.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--core", type=int, default=0, help="the servers' core")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--ray", action="store_true", help="also Ray Serve from zero replicas")
    args = parser.parse_args()
    os.sched_setaffinity(0, {(args.core + 1) % os.cpu_count()})  # type: ignore[operator]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        repo = build_examples(work)
        results: dict[str, list[dict[str, Any]]] = {}
        for _ in range(args.rounds):
            for model in MODELS:
                results.setdefault(model, []).append(slipstream_round(repo, model, work, args.core))
            results.setdefault("llama-server", []).append(llama_server_round(repo, work, args.core))
        if args.ray:  # once: each start of Ray takes tens of seconds
            for model in RAY_MODELS:
                results.setdefault(f"ray-{model}", []).append(
                    {"first_from_zero_s": ray_round(repo, model, work)}
                )
    print(f"cold starts, median of {args.rounds} rounds [range]; server on core {args.core}, "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    print(f"{'':<14} {'start to ready':<26} {'first answer, loaded':<26} "
          f"{'first answer after idle':<26} load + warm-up (trace)")  # fmt: skip
    for model in MODELS:
        rounds = results[model]
        loads = [sum(t["trace"].get("models", {}).get(k, {}).get("load_s", 0)
                     + t["trace"].get("models", {}).get(k, {}).get("warmup_s", 0)
                     for k in t["trace"].get("models", {})) for t in rounds]  # fmt: skip
        print(f"{model:<14} {spread([r['ready_s'] for r in rounds]):<26} "
              f"{spread([r['first_loaded_s'] for r in rounds]):<26} "
              f"{spread([r['first_after_idle_s'] for r in rounds]):<26} "
              f"{statistics.median(loads):.3f} s")  # fmt: skip
    llama = [r["ready_s"] for r in results["llama-server"]]
    smol = [r["first_after_idle_s"] for r in results["smollm2"]]
    print(f"{'llama-server':<14} {spread(llama):<26}")
    print(f"smollm2 first answer after idle / llama-server start: "
          f"{statistics.median(smol) / statistics.median(llama):.2f} "
          "(target: <= 3 s, or <= 1.5x llama-server's start)")  # fmt: skip
    for model in RAY_MODELS if args.ray else ():
        seconds = results[f"ray-{model}"][0]["first_from_zero_s"]
        print(f"Ray Serve, {model}: first answer from zero replicas {seconds:.2f} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
