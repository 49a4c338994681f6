"""`slipstream edge` against `slipstream serve`: idle memory and time to ready, per bundle.

For each model (`digits` as it is, FP32, and MiniLM as an INT8 `edge` bundle made with
`slipstream export`'s API; both from `examples/build_models.py`), a fleet
repository is made and the bundle published, `slipstream fleet serve` serves it, and
`--rounds` times each of:

- **serve**: `slipstream serve` on a repository holding the bundle (its defaults: HTTP and
  gRPC);
- **edge**: `slipstream edge` on a device repository that already holds the bundle (as
  after its first sync), following the fleet (HTTP only, the agent polling every 60 s);

is spawned and timed until `/v2/health/ready` answers 200, then left idle for `--idle-s`
(the edge agent's first sync and report done) and its resident memory read from
/proc/<pid>/status (VmRSS; one process each). Medians over the rounds, with the range.

    .venv/bin/python benchmarks/edge_footprint.py                 # ~3 min on 2 cores
    .venv/bin/python benchmarks/edge_footprint.py --models digits --rounds 5 --json fp.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from slipstream.edge.export import ExportRequest, export_bundle
from slipstream.edge.fleet_repo import FleetPaths, init_repository, publish_bundle
from slipstream.edge.manifest import MANIFEST_NAME, Manifest, SampleFiles, file_entries
from slipstream.edge.targets import TargetOptions

import models
from optimize import CALIBRATION_STRIDE, SENTENCES, tokenize
from servers import free_port

SLIPSTREAM = Path(sys.executable).parent / "slipstream"


def validation_rows(repo: Path, name: str, work: Path) -> TargetOptions:
    """The gate's rows: MiniLM on the benchmark sentences, digits on random pixels."""
    if name == "minilm":
        sentences = [s.strip() for s in SENTENCES.read_text().splitlines() if s.strip()]
        rows = tokenize(repo / "minilm" / "tokenizer" / "tokenizer.json", sentences)
        calibration = np.arange(len(sentences)) % CALIBRATION_STRIDE == 0
        np.savez(work / "cal.npz", **{k: v[calibration] for k, v in rows.items()})
        np.savez(work / "val.npz", **{k: v[~calibration] for k, v in rows.items()})
        return TargetOptions(validation=work / "val.npz", calibration=work / "cal.npz")
    import onnxruntime as ort

    (spec,) = ort.InferenceSession(str(models.model_path(repo, name))).get_inputs()
    pixels = np.random.default_rng(0).uniform(0, 16, (256, spec.shape[1])).astype(np.float32)
    np.savez(work / "val.npz", **{spec.name: pixels})
    return TargetOptions(validation=work / "val.npz")


def fp32_bundle(model_dir: Path, bundle: Path) -> None:
    """The model as it is, in a bundle (samples and manifest as export writes them)."""
    import onnxruntime as ort

    shutil.copytree(model_dir, bundle)
    session = ort.InferenceSession(str(bundle / "1" / "model.onnx"))
    (spec,) = session.get_inputs()
    rows = np.random.default_rng(0).uniform(0, 16, (4, spec.shape[1])).astype(np.float32)
    outputs = dict(
        zip(
            [o.name for o in session.get_outputs()],
            session.run(None, {spec.name: rows}),
            strict=True,
        )
    )
    np.savez(bundle / "sample_inputs.npz", **{spec.name: rows})
    np.savez(bundle / "sample_outputs.npz", **outputs)
    manifest = Manifest(
        name=bundle.name,
        version=1,
        target="edge",
        backend="onnxruntime",
        created="",
        files=file_entries(bundle),
        samples=SampleFiles("sample_inputs.npz", "sample_outputs.npz", 4),
        gate={},
        minimum_runtime_versions={},
        size={},
    )
    (bundle / MANIFEST_NAME).write_text(manifest.to_json())


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def measure(argv: list[str], port: int, idle_s: float, log: Path) -> tuple[float, float]:
    """(seconds to ready, idle RSS in MB) of one spawned server."""
    with log.open("wb") as out:
        started = time.perf_counter()
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        with httpx.Client(timeout=2) as client:
            while True:
                try:
                    if client.get(f"http://127.0.0.1:{port}/v2/health/ready").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if process.poll() is not None or time.perf_counter() - started > 120:
                    raise RuntimeError(f"{argv[1]} did not get ready; see {log}")
                time.sleep(0.01)
        ready_s = time.perf_counter() - started
        time.sleep(idle_s)
        return ready_s, rss_mb(process.pid)
    finally:
        process.terminate()
        process.wait(30)


def run_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    work = args.work / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    bundle = work / "served" / name
    if name == "digits":  # ONNX Runtime's int8 pass does not take skl2onnx's graph
        fp32_bundle(args.repo / name, bundle)
    else:
        export_bundle(
            ExportRequest(args.repo / name, "edge", bundle, validation_rows(args.repo, name, work))
        )
    paths = FleetPaths.of(work / "fleet")
    init_repository(paths)
    publish_bundle(paths, bundle)
    fleet_port = free_port()
    publisher = subprocess.Popen(
        [
            str(SLIPSTREAM),
            "fleet",
            "serve",
            "--repo",
            str(paths.repo),
            "--host",
            "127.0.0.1",
            "--port",
            str(fleet_port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    figures: dict[str, list[tuple[float, float]]] = {"serve": [], "edge": []}
    try:
        for round_ in range(args.rounds):
            port, grpc = free_port(), free_port()
            serve = [
                str(SLIPSTREAM),
                "serve",
                "--model-repository",
                str(bundle.parent),
                "--host",
                "127.0.0.1",
                "--http-port",
                str(port),
                "--grpc-port",
                str(grpc),
            ]
            figures["serve"].append(measure(serve, port, args.idle_s, work / "serve.log"))
            device = work / f"device{round_}"
            shutil.copytree(bundle, device / name)
            port = free_port()
            edge = [
                str(SLIPSTREAM),
                "edge",
                "--fleet",
                f"http://127.0.0.1:{fleet_port}",
                "--repository",
                str(device),
                "--root",
                str(paths.metadata / "1.root.json"),
                "--host",
                "127.0.0.1",
                "--http-port",
                str(port),
            ]
            figures["edge"].append(measure(edge, port, args.idle_s, work / "edge.log"))
    finally:
        publisher.terminate()
        publisher.wait(30)
    result: dict[str, Any] = {"model": name}
    for kind, rows in figures.items():
        ready = [r for r, _ in rows]
        rss = [m for _, m in rows]
        result[kind] = {
            "ready_s": statistics.median(ready),
            "ready_range_s": [min(ready), max(ready)],
            "idle_rss_mb": statistics.median(rss),
            "rss_range_mb": [min(rss), max(rss)],
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=Path("models"), help="example repository")
    parser.add_argument("--work", type=Path, default=Path("/tmp/slipstream-edge-footprint"))
    parser.add_argument("--models", default="digits,minilm")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--idle-s", type=float, default=3.0, help="idle time before RSS")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    names = args.models.split(",")
    found = models.build_repository(args.repo, names)
    results = []
    for name in names:
        if name not in found:
            sys.exit(f"{name} is needed: pip install 'slipstream[examples]'")
        result = run_model(name, args)
        results.append(result)
        for kind in ("serve", "edge"):
            f = result[kind]
            print(
                f"{name:<7} {kind:<6} ready {f['ready_s']:.2f} s "
                f"({f['ready_range_s'][0]:.2f}-{f['ready_range_s'][1]:.2f}), idle RSS "
                f"{f['idle_rss_mb']:.0f} MB ({f['rss_range_mb'][0]:.0f}-"
                f"{f['rss_range_mb'][1]:.0f})"
            )
        serve, edge = result["serve"], result["edge"]
        print(
            f"{name:<7} edge/serve: ready {edge['ready_s'] / serve['ready_s']:.2f}x, "
            f"RSS {edge['idle_rss_mb'] / serve['idle_rss_mb']:.2f}x"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
