"""GPU serving (issue #12): a MiniLM-shaped encoder served by Slipstream against torch
alone, in the same run on the same GPU.

    PYTHONPATH=src python3 benchmarks/gpu.py --json gpu.json

Needs a CUDA host. Builds the model from a config (BERT, 6 layers x 384, random weights,
mean pooling: all-MiniLM-L6-v2's shape; no download), exports it to ``.pt2`` **on the
CPU**, as people do, and serves that file with ``parameters: {device: cuda}``. Inputs are
128 tokens (ids drawn inside the vocabulary), one sequence per request.

* **torch alone**: the same ``.pt2`` on the GPU, called from one Python thread at batch
  1, 64 and 256: host arrays in, host arrays out (what a server must do too), FP32 and
  FP16 (weights cast, as ``model.half()``).
* **served**: ``slipstream serve`` pinned to three quarters of the cores, driven by
  ``slipstream bench`` (HTTP binary tensors and gRPC) pinned to the rest, closed
  loop at C = 1, 64, 256. Each ``--served`` case is a layout: precision, CUDA graphs or
  eager, instances, and 0 (one process) or N front-end processes in front of an engine
  process.

The ratios printed are issue #12's targets: served at C=256 over torch alone at batch 256
(same precision), gRPC over HTTP, and the C=1 p50 against torch's batch-1 latency.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SEQ = 128
VOCAB = 30522
BATCHES = (1, 64, 256)
# Batch sizes the graph cases capture: steps of 16 from 32, so a batch of 129 pads to 144
# rather than 256.
GRAPH_SIZES = ",".join(map(str, [1, 2, 4, 8, 16, *range(32, 257, 16)]))


@dataclass(frozen=True)
class Served:
    """One served layout, named ``<fp32|fp16>-<graphs|eager>-i<instances>-<1proc|split<N>>``
    (``split4``: four front-end processes in front of an engine process), optionally
    ``-q<us>``: a queue delay."""

    name: str
    precision: str
    graphs: bool
    instances: int
    frontends: int  # 0 = front end and engine in one process
    # dynamic_batching.max_queue_delay_microseconds
    delay_us: int = 0
    max_batch: int = 256

    @classmethod
    def parse(cls, name: str) -> Served:
        try:
            precision, execution, instances, layout, *rest = name.split("-")
            if precision not in ("fp32", "fp16") or execution not in ("graphs", "eager"):
                raise ValueError(name)
            frontends = 0 if layout == "1proc" else int(layout.removeprefix("split"))
            delay = int(rest[0].removeprefix("q")) if rest else 0
            graphs = execution == "graphs"
            return cls(name, precision, graphs, int(instances[1:]), frontends, delay)
        except (ValueError, IndexError):
            raise SystemExit(
                f"--served {name!r}: expected "
                "<fp32|fp16>-<graphs|eager>-i<N>-<1proc|split<N>>[-q<queue delay us>]"
            ) from None


DEFAULT_SERVED = ",".join(
    (
        "fp32-eager-i2-1proc",
        "fp32-graphs-i1-1proc",
        "fp32-graphs-i1-split4",
        "fp16-graphs-i1-split4",
    )
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--served", default=DEFAULT_SERVED, help="served cases, in order")
    parser.add_argument("--concurrency", default="1,64,256")
    parser.add_argument("--protocols", default="http-binary,grpc")
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per level")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py needs a CUDA GPU (torch.cuda.is_available() is false)")
    with tempfile.TemporaryDirectory(prefix="slipstream-gpu-") as tmp:
        work = Path(tmp)
        model_file = build_encoder(work / "encoder.pt2")
        inputs = work / "inputs.npz"
        rng = np.random.default_rng(0)
        np.savez(
            inputs,
            input_ids=rng.integers(0, VOCAB, (1, SEQ), dtype=np.int64),
            attention_mask=np.ones((1, SEQ), dtype=np.int64),
        )
        result: dict[str, Any] = {
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "cores": len(os.sched_getaffinity(0)),
            "alone": torch_alone(model_file),
            "served": {},
        }
        print_alone(result["alone"])
        for name in args.served.split(","):
            case = Served.parse(name)
            levels = serve_and_measure(case, model_file, inputs, work, args)
            result["served"][name] = levels
        print_served(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


# -- the model -----------------------------------------------------------------------


def build_encoder(path: Path) -> Path:
    """all-MiniLM-L6-v2's shape with random weights, exported on the CPU to ``path``."""
    import torch
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=12,
        intermediate_size=1536,
        max_position_embeddings=512,
    )

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = BertModel(config, add_pooling_layer=False)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask)
            mask = attention_mask.unsqueeze(-1).to(hidden.last_hidden_state.dtype)
            return (hidden.last_hidden_state * mask).sum(1) / mask.sum(1).clamp(min=1e-9)

    torch.manual_seed(0)
    model = Encoder().eval()
    example = (torch.zeros(2, SEQ, dtype=torch.int64), torch.ones(2, SEQ, dtype=torch.int64))
    batch = torch.export.Dim("batch", min=1, max=1024)
    with torch.no_grad():
        program = torch.export.export(
            model,
            example,
            dynamic_shapes={"input_ids": {0: batch}, "attention_mask": {0: batch}},
        )
    torch.export.save(program, str(path))
    return path


# -- torch alone ---------------------------------------------------------------------


def torch_alone(path: Path) -> dict[str, dict[str, float]]:
    """Sequences/s and ms per call at each batch size, FP32 and FP16, one thread."""
    import torch
    from torch.export.passes import move_to_device_pass

    figures: dict[str, dict[str, float]] = {}
    rng = np.random.default_rng(1)
    for precision in ("fp32", "fp16"):
        program = move_to_device_pass(torch.export.load(str(path)), "cuda")
        model = program.module()
        if precision == "fp16":
            model = model.half()
        for batch in BATCHES:
            ids = rng.integers(0, VOCAB, (batch, SEQ), dtype=np.int64)
            seconds = _time_calls(_host_call(model, ids, np.ones_like(ids)))
            figures[f"{precision}_b{batch}"] = {
                "ms_per_call": seconds * 1e3,
                "seq_per_s": batch / seconds,
            }
        del model, program
        torch.cuda.empty_cache()
    return figures


def _host_call(model: Any, ids: np.ndarray, mask: np.ndarray) -> Any:
    import torch

    def call() -> np.ndarray:
        with torch.inference_mode():
            out = model(torch.from_numpy(ids).cuda(), torch.from_numpy(mask).cuda())
            result: np.ndarray = out.float().cpu().numpy()
            return result

    return call


def _time_calls(call: Any, min_s: float = 2.0) -> float:
    """Median seconds of one call over rounds of at least ``min_s`` / 5 each."""
    for _ in range(5):
        call()
    rounds = []
    for _ in range(5):
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < min_s / 5:
            call()
            count += 1
        rounds.append((time.perf_counter() - start) / count)
    return float(np.median(rounds))


# -- served ---------------------------------------------------------------------------


def write_repository(case: Served, model_file: Path, repo: Path) -> None:
    version = repo / "encoder" / "1"
    version.mkdir(parents=True)
    os.link(model_file, version / "model.pt2")
    parameters = {"device": "cuda", "precision": case.precision}
    if case.graphs:
        parameters["cuda_graph_batch_sizes"] = GRAPH_SIZES
    config = {
        "backend": "torch",
        "trust_pickle": True,
        "max_batch_size": case.max_batch,
        "dynamic_batching": {"max_queue_delay_microseconds": case.delay_us},
        "instance_group": [{"count": case.instances, "kind": "KIND_GPU"}],
        "parameters": parameters,
    }
    (repo / "encoder" / "config.yaml").write_text(json.dumps(config))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _cores() -> tuple[str, str]:
    """Server and load generator cores: three quarters for the server (front ends and
    engine), the rest for ``slipstream bench`` (one worker keeps up with ~12k req/s)."""
    cores = sorted(os.sched_getaffinity(0))
    split = max(1, len(cores) * 3 // 4)
    server, client = cores[:split], cores[split:] or cores[:split]
    return ",".join(map(str, server)), ",".join(map(str, client))


@contextlib.contextmanager
def running_server(case: Served, repo: Path, log: Path) -> Iterator[tuple[int, int]]:
    http, grpc = _free_port(), _free_port()
    server_cores, _ = _cores()
    command = ["taskset", "-c", server_cores, sys.executable, "-m", "slipstream", "serve"]
    command += ["--model-repository", str(repo), "--http-port", str(http)]
    command += ["--grpc-port", str(grpc), "--host", "127.0.0.1"]
    if case.frontends:
        command += ["--frontends", str(case.frontends)]
    with log.open("wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
            with contextlib.suppress(OSError):
                url = f"http://127.0.0.1:{http}/v2/models/encoder/ready"
                with urllib.request.urlopen(url, timeout=2) as reply:
                    if reply.status == 200:
                        break
            time.sleep(0.5)
        else:
            raise RuntimeError(f"server not ready in 180 s: {log.read_text()[-2000:]}")
        yield http, grpc
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def serve_and_measure(
    case: Served, model_file: Path, inputs: Path, work: Path, args: argparse.Namespace
) -> dict[str, Any]:
    repo = work / f"repo-{case.name}"
    write_repository(case, model_file, repo)
    log = work / f"{case.name}.log"
    levels: dict[str, Any] = {}
    _, client_cores = _cores()
    print(f"== {case.name}", flush=True)
    try:
        with running_server(case, repo, log) as (http, grpc):
            for protocol in args.protocols.split(","):
                url = f"127.0.0.1:{grpc}" if protocol == "grpc" else f"http://127.0.0.1:{http}"
                for concurrency in args.concurrency.split(","):
                    out = work / f"{case.name}-{protocol}-{concurrency}.json"
                    command = ["taskset", "-c", client_cores, sys.executable, "-m", "slipstream"]
                    command += ["bench", url, "-m", "encoder", "-i", protocol]
                    command += ["--concurrency", concurrency, "--input-data", str(inputs)]
                    command += ["--duration", str(args.duration), "--warmup-s", "2"]
                    command += ["--json", str(out)]
                    before = _scrape(http)
                    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
                    after = _scrape(http)
                    if done.returncode != 0:
                        levels[f"{protocol}_c{concurrency}"] = {"error": done.stderr[-800:]}
                        print(f"   {protocol} C={concurrency}: failed {done.stderr[-300:]}")
                        continue
                    level = json.loads(out.read_text())["levels"][0]
                    level["instance"] = _instance_figures(before, after)
                    levels[f"{protocol}_c{concurrency}"] = level
                    instance = level["instance"]
                    print(
                        f"   {protocol:11} C={concurrency:>3}: "
                        f"{level['throughput_infer_per_s']:9.0f} seq/s  "
                        f"p50 {level['p50_ms']:7.2f} ms  batch {level['server_avg_batch_size']}"
                        f"  errors {level['errors']}  instance: compute "
                        f"{instance['compute_ms_per_batch']:.2f} ms/batch, idle with work "
                        f"queued {instance['idle_ms_per_handoff']:.2f} ms/hand-off over "
                        f"{instance['handoffs_per_batch']:.0%} of batches",
                        flush=True,
                    )
    except RuntimeError as exc:
        levels["error"] = str(exc)
        print(f"   failed: {exc}")
    levels["log_tail"] = log.read_text()[-3000:] if log.exists() else ""
    return levels


def _scrape(http: int) -> dict[str, float]:
    """The encoder's batch and hand-off counters from the server's /metrics (the whole
    run so far; the engine's, in the split layout)."""
    from frontends import model_metrics

    return model_metrics(http, "encoder", {
        "slipstream_instance_idle_seconds_sum": "idle_s",
        "slipstream_instance_idle_seconds_count": "handoffs",
        "slipstream_compute_duration_seconds_sum": "compute_s",
        "slipstream_compute_duration_seconds_count": "batches",
    })  # fmt: skip


def _instance_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the instance did during one level: compute per batch (the device, copies
    included), and the time it sat between batches while requests were queued."""
    delta = {key: after[key] - before[key] for key in after}
    batches = max(delta["batches"], 1.0)
    handoffs = max(delta["handoffs"], 1.0)
    return {
        "batches": delta["batches"],
        "compute_ms_per_batch": delta["compute_s"] / batches * 1e3,
        "handoffs_per_batch": delta["handoffs"] / batches,
        "idle_ms_per_handoff": delta["idle_s"] / handoffs * 1e3,
        "idle_s": delta["idle_s"],
        "compute_s": delta["compute_s"],
    }


# -- tables ----------------------------------------------------------------------------


def print_alone(alone: dict[str, dict[str, float]]) -> None:
    print("torch alone (one thread, host arrays in and out):")
    for key, figure in alone.items():
        print(f"   {key:10} {figure['seq_per_s']:9.0f} seq/s  {figure['ms_per_call']:7.2f} ms/call")


def print_served(result: dict[str, Any]) -> None:
    alone = result["alone"]
    print("\nratios (issue #12's targets):")
    for name, levels in result["served"].items():
        precision = Served.parse(name).precision
        ceiling = alone[f"{precision}_b256"]["seq_per_s"]
        http = levels.get("http-binary_c256", {}).get("throughput_infer_per_s")
        grpc = levels.get("grpc_c256", {}).get("throughput_infer_per_s")
        p50 = levels.get("http-binary_c1", {}).get("p50_ms")
        parts = [f"{name:20}"]
        if http:
            parts.append(f"HTTP C=256 / torch b256 = {http / ceiling:.2f}")
        if http and grpc:
            parts.append(f"gRPC / HTTP = {grpc / http:.2f}")
        if p50:
            extra = p50 - alone[f"{precision}_b1"]["ms_per_call"]
            parts.append(f"C=1 p50 - torch b1 = {extra:+.2f} ms")
        print("   " + "  ".join(parts))


if __name__ == "__main__":
    main()
