"""What per-row int8 activation scales cost beside ONNX Runtime's per-run ones.

ONNX Runtime's ``quantize_dynamic`` scales a MatMul's activations once per run, which in
a server is a batch of requests (a row's answer moves with its batch mates);
``slipstream optimize --activation-scales row`` rewrites each scale per row
(:mod:`slipstream.optimize.row_scales`). This measures, on one ORT thread, the FP32
model, the per-run int8 one and the per-row one at a few batch sizes, the per-run model
run one row at a time (the ORT backend's ``activation_scales: row``), and how far each
int8 model's outputs are from FP32's.

    .venv/bin/python benchmarks/int8_activation_scales.py [--model models/minilm/1/model.onnx]

Pin it to a core of its own (``taskset -c 1``) on a busy host.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.quantization import QuantType, quantize_dynamic

from slipstream.optimize.row_scales import per_row_activation_scales


def _session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _feed(
    session: ort.InferenceSession, rows: int, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    feed: dict[str, np.ndarray] = {}
    for tensor in session.get_inputs():
        dims = [rows] + [d if isinstance(d, int) else 128 for d in tensor.shape[1:]]
        if tensor.type == "tensor(int64)":
            low, high = (
                (1000, 2000) if "ids" in tensor.name and "type" not in tensor.name else (1, 2)
            )
            if "token_type" in tensor.name:
                low, high = 0, 1
            feed[tensor.name] = rng.integers(low, high, dims).astype(np.int64)
        else:
            feed[tensor.name] = rng.standard_normal(dims).astype(np.float32)
    return feed


def _ms(session: ort.InferenceSession, feed: dict[str, np.ndarray], seconds: float) -> float:
    session.run(None, feed)
    runs, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        session.run(None, feed)
        runs += 1
    return (time.perf_counter() - started) / runs * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("models/minilm/1/model.onnx"))
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--seconds", type=float, default=1.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        per_run = Path(scratch) / "run.onnx"
        per_row = Path(scratch) / "row.onnx"
        quantize_dynamic(
            args.model, per_run, op_types_to_quantize=["MatMul"], weight_type=QuantType.QInt8,
            per_channel=True,
        )  # fmt: skip
        model = onnx.load(str(per_run))
        left = per_row_activation_scales(model)
        onnx.save(model, str(per_row))
        sessions = {name: _session(path) for name, path in
                    (("fp32", args.model), ("run", per_run), ("row", per_row))}  # fmt: skip
        rng = np.random.default_rng(0)
        print(f"{args.model}: {len(left)} activations left per run; ms per batch, one thread")
        print(f"{'batch':>5} {'fp32':>8} {'int8 run':>9} {'int8 row':>9} {'run rows alone':>15}"
              f" {'row/run':>8} {'|run-fp32|':>11} {'|row-fp32|':>11}")  # fmt: skip
        for rows in (int(b) for b in args.batch_sizes.split(",")):
            feed = _feed(sessions["fp32"], rows, rng)
            ms = {name: _ms(session, feed, args.seconds) for name, session in sessions.items()}
            one = {name: array[:1] for name, array in feed.items()}
            alone = _ms(sessions["run"], one, args.seconds) * rows
            out = {name: session.run(None, feed)[0] for name, session in sessions.items()}
            run_err = float(np.abs(out["run"] - out["fp32"]).max())
            row_err = float(np.abs(out["row"] - out["fp32"]).max())
            print(f"{rows:>5} {ms['fp32']:>8.2f} {ms['run']:>9.2f} {ms['row']:>9.2f} {alone:>15.2f}"
                  f" {ms['row'] / ms['run']:>8.2f} {run_err:>11.4f} {row_err:>11.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
