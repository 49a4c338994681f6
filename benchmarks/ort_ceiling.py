"""In-process ONNX Runtime throughput at each batch size: the ceiling a server can reach.

`serving.py` runs this in a subprocess pinned to the server's core, so the ceiling and
the served figures share one core and one ORT build. One session, one intra-op thread
(the server gets one core), every batch size timed for a fixed budget; throughput is
batch / median run time, so a noisy neighbour's burst moves the result less than a mean.

Example:
    taskset -c 0 .venv/bin/python benchmarks/ort_ceiling.py --model minilm \
        --path models/minilm/1/model.onnx --batch-sizes 1,2,4,8 --seconds 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
import orjson

from models import sample_inputs


def _session(path: str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def samples_per_s(
    session: ort.InferenceSession, inputs: dict[str, np.ndarray], seconds: float
) -> float:
    """Batch size / median wall time of one `run`, after two warm-up runs."""
    batch = next(iter(inputs.values())).shape[0]
    for _ in range(2):
        session.run(None, inputs)
    times_s: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times_s) < 5:
        start = time.perf_counter()
        session.run(None, inputs)
        times_s.append(time.perf_counter() - start)
    return float(batch / statistics.median(times_s))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="'mlp' or 'minilm' (picks the inputs)")
    parser.add_argument("--path", required=True, help="path to model.onnx")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    parser.add_argument("--seconds", type=float, default=2.0, help="timing budget per batch")
    args = parser.parse_args()
    session = _session(args.path)
    one = sample_inputs(args.model)
    per_batch: dict[str, float] = {}
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        inputs = {name: np.repeat(array, batch, axis=0) for name, array in one.items()}
        per_batch[str(batch)] = samples_per_s(session, inputs, args.seconds)
    print(orjson.dumps({"samples_per_s": per_batch}).decode())


if __name__ == "__main__":
    main()
