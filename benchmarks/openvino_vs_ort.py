"""OpenVINO against ONNX Runtime on the same models, one pinned core, in one run.

Prints ratios (a script, never a test): for each model and batch size, throughput of
Slipstream's OpenVINO backend over its ONNX Runtime backend (both as `slipstream serve`
loads them, one intra-op thread, the process pinned to one core with
`os.sched_setaffinity`), timed in alternating order, the median over `--rounds` rounds
and the range; and how far the outputs differ.

Models (built by `examples/build_models.py`, nothing downloaded):

- `digits`: the example's scikit-learn pipeline (StandardScaler + LogisticRegression,
  `digits_sklearn/1/model.joblib`) written with standard ONNX operators (Sub, Div,
  MatMul, Add, Softmax, ArgMax): OpenVINO cannot read the example's `digits/1/model.onnx`,
  whose ONNX-ML operators (Scaler, LinearClassifier, Normalizer) it has no conversion for;
  the script shows that error once;
- `minilm fp32`: `minilm/1/model.onnx`, sentences of `benchmarks/data/sentences.txt`
  padded to 128 tokens;
- `minilm int8`: the INT8 ONNX model of `slipstream export --target edge` (optimize's
  int8-dynamic, MatMul and Gather, every third sentence calibrating the search as in
  `optimize.py`), the file both runtimes read;
- `minilm bf16`: the FP32 file, OpenVINO with `inference_precision: bf16` (its own
  default on CPUs with BF16 units) against ONNX Runtime in FP32.

The script is not named `openvino.py`: run from `benchmarks/`, that name would shadow
the `openvino` package for every script there.

Usage (from the repository root):
    .venv/bin/python benchmarks/openvino_vs_ort.py                 # ~4 min on 2 cores
    .venv/bin/python benchmarks/openvino_vs_ort.py --rounds 5 --seconds 2 --json ov.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from slipstream.edge.export import ExportRequest, export_bundle
from slipstream.edge.manifest import verify_bundle
from slipstream.edge.targets import TargetOptions
from slipstream.runtime import get_backend
from slipstream.runtime.base import Backend

import models
from optimize import CALIBRATION_STRIDE, SENTENCES, tokenize

WARMUP_RUNS = 2
MIN_RUNS = 3
BATCH_SIZES = (1, 32)


@dataclass(frozen=True)
class Case:
    """One model file, run by both backends on the same rows."""

    label: str
    path: Path
    # The backends' config.yaml parameters beside one intra-op thread.
    openvino_parameters: dict[str, str]
    rows: dict[str, np.ndarray]
    output: str


@dataclass
class Row:
    label: str
    batch_size: int
    onnxruntime_per_s: list[float]
    openvino_per_s: list[float]
    # Largest absolute difference of the outputs, and the lowest cosine of a row.
    max_abs_diff: float
    min_cosine: float

    @property
    def ratios(self) -> list[float]:
        return [o / r for o, r in zip(self.openvino_per_s, self.onnxruntime_per_s, strict=True)]


def plain_digits(repo: Path, work: Path) -> Path:
    """The example's fitted digits pipeline as standard ONNX ops; labels checked."""
    import joblib
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    pipeline = joblib.load(repo / "digits_sklearn" / "1" / "model.joblib")
    scaler, classifier = pipeline[0], pipeline[-1]
    constants = {
        "mean": scaler.mean_.astype(np.float32),
        "scale": scaler.scale_.astype(np.float32),
        "coef": classifier.coef_.T.astype(np.float32),  # [64, 10]
        "intercept": classifier.intercept_.astype(np.float32),
    }
    nodes = [
        helper.make_node("Sub", ["input", "mean"], ["centred"]),
        helper.make_node("Div", ["centred", "scale"], ["scaled"]),
        helper.make_node("MatMul", ["scaled", "coef"], ["product"]),
        helper.make_node("Add", ["product", "intercept"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probabilities"], axis=1),
        helper.make_node("ArgMax", ["logits"], ["label"], axis=1, keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "digits_plain",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 64])],
        [
            helper.make_tensor_value_info("label", TensorProto.INT64, ["batch"]),
            helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", 10]),
        ],
        [numpy_helper.from_array(value, name) for name, value in constants.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = work / "digits_plain.onnx"
    onnx.save(model, str(path))
    rows = digits_rows()
    plain = _run_once("onnxruntime", path, {}, rows, "label")
    example = _run_once("onnxruntime", repo / "digits" / "1" / "model.onnx", {}, rows, "label")
    agree = float(np.mean(plain == example))
    print(f"digits: standard-op export agrees with the example model on {100 * agree:.1f}% "
          f"of {len(plain)} labels")  # fmt: skip
    return path


def digits_rows() -> dict[str, np.ndarray]:
    from sklearn.datasets import load_digits

    return {"input": load_digits().data[:64].astype(np.float32)}


def minilm_rows(repo: Path) -> dict[str, np.ndarray]:
    sentences = [line.strip() for line in SENTENCES.read_text().splitlines() if line.strip()]
    return tokenize(repo / "minilm" / "tokenizer" / "tokenizer.json", sentences)


def minilm_int8(repo: Path, work: Path, rows: dict[str, np.ndarray]) -> Path:
    """The edge bundle's INT8 model (exported once; reused while it verifies)."""
    bundle = work / "minilm_edge"
    try:
        verify_bundle(bundle)
        return bundle / "1" / "model.onnx"
    except ValueError:
        pass
    calibration = np.arange(len(rows["input_ids"])) % CALIBRATION_STRIDE == 0
    np.savez(work / "calibration.npz", **{k: v[calibration] for k, v in rows.items()})
    np.savez(work / "validation.npz", **{k: v[~calibration] for k, v in rows.items()})
    options = TargetOptions(
        validation=work / "validation.npz", calibration=work / "calibration.npz"
    )
    started = time.perf_counter()
    result = export_bundle(ExportRequest(repo / "minilm", "edge", bundle, options, overwrite=True))
    print(f"minilm int8: exported in {time.perf_counter() - started:.0f} s; {result.gate.summary}")
    return bundle / "1" / "model.onnx"


def _load(backend: str, path: Path, parameters: dict[str, str]) -> Backend:
    return get_backend(backend).load(path, {"intra_op_thread_count": "1", **parameters}, 1)


def _run_once(
    backend: str, path: Path, parameters: dict[str, str], rows: dict[str, np.ndarray], output: str
) -> np.ndarray:
    model = _load(backend, path, parameters)
    try:
        return model.run(rows, [output])[output]
    finally:
        model.close()


def median_latency_s(run: Callable[[], object], seconds: float) -> float:
    for _ in range(WARMUP_RUNS):
        run()
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(latencies) < MIN_RUNS:
        started = time.perf_counter()
        run()
        latencies.append(time.perf_counter() - started)
    return statistics.median(latencies)


def measure(case: Case, batch_size: int, rounds: int, seconds: float) -> Row:
    feed = {name: array[:batch_size] for name, array in case.rows.items()}
    ort_model = _load("onnxruntime", case.path, {})
    ov_model = _load("openvino", case.path, case.openvino_parameters)
    try:
        speeds: dict[str, list[float]] = {"onnxruntime": [], "openvino": []}
        pair = [("onnxruntime", ort_model), ("openvino", ov_model)]
        for round_number in range(rounds):
            # Alternating order: a slow stretch of the machine hits both in turn.
            for name, model in pair if round_number % 2 == 0 else pair[::-1]:
                latency = median_latency_s(lambda m=model: m.run(feed, [case.output]), seconds)
                speeds[name].append(batch_size / latency)
        before = np.asarray(ort_model.run(feed, [case.output])[case.output], np.float64)
        after = np.asarray(ov_model.run(feed, [case.output])[case.output], np.float64)
    finally:
        ort_model.close()
        ov_model.close()
    a, b = before.reshape(len(before), -1), after.reshape(len(after), -1)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    cosines = np.sum(a * b, axis=1) / np.where(norms == 0, 1.0, norms)
    return Row(
        case.label, batch_size, speeds["onnxruntime"], speeds["openvino"],
        float(np.max(np.abs(a - b))), float(np.min(cosines)),
    )  # fmt: skip


def print_table(rows: list[Row]) -> None:
    header = (
        f"{'model':<22}{'batch':>6}{'ORT infer/s':>13}{'OV infer/s':>12}"
        f"{'OV/ORT':>8}  {'range':<11}{'max diff':>10}{'min cos':>10}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        ratios = row.ratios
        print(
            f"{row.label:<22}{row.batch_size:>6}"
            f"{statistics.median(row.onnxruntime_per_s):>13.1f}"
            f"{statistics.median(row.openvino_per_s):>12.1f}"
            f"{statistics.median(ratios):>8.2f}  {min(ratios):.2f}-{max(ratios):<6.2f}"
            f"{row.max_abs_diff:>10.2e}{row.min_cosine:>10.6f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=Path("models"), help="example repository")
    parser.add_argument("--work", type=Path, default=Path("/tmp/slipstream-openvino-bench"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=1.0, help="timed per measurement")
    parser.add_argument("--core", type=int, help="core to pin to [default: the last usable]")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    core = args.core if args.core is not None else max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    args.work.mkdir(parents=True, exist_ok=True)
    found = models.build_repository(args.repo, ["digits", "minilm"])
    if set(found) != {"digits", "minilm"}:
        sys.exit("digits and minilm are needed: pip install 'slipstream[examples]'")
    try:
        _load("openvino", found["digits"], {})
    except ValueError as exc:
        print(f"digits (example file) on OpenVINO: {exc}")
    sentences = minilm_rows(args.repo)
    int8 = minilm_int8(args.repo, args.work, sentences)
    digits = plain_digits(args.repo, args.work)
    cases = [
        Case("digits", digits, {}, digits_rows(), "probabilities"),
        Case("minilm fp32", found["minilm"], {}, sentences, "sentence_embedding"),
        Case("minilm int8", int8, {}, sentences, "sentence_embedding"),
        Case("minilm bf16 (OV) / fp32", found["minilm"], {"inference_precision": "bf16"},
             sentences, "sentence_embedding"),
    ]  # fmt: skip
    load = os.getloadavg()[0]
    print(f"pinned to core {core}; {args.rounds} rounds of {args.seconds:g} s per figure; "
          f"load average {load:.2f} on {os.cpu_count()} cores")  # fmt: skip
    rows = [measure(c, b, args.rounds, args.seconds) for c in cases for b in BATCH_SIZES]
    print_table(rows)
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    if args.json:
        document: dict[str, Any] = {"core": core, "rounds": args.rounds, "rows": []}
        for row in rows:
            document["rows"].append({**asdict(row), "ratios": row.ratios})
        args.json.write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
