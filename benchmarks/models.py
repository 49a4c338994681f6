"""Models under test and the V2 request bodies that exercise them.

Models come from `examples/build_models.py`, the same files users get, so the figures
describe the models the README serves.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

REPO_ROOT = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = REPO_ROOT / "examples" / "build_models.py"

MLP_FEATURES = 256
MINILM_SEQ_LEN = 128
MINILM_VOCAB = 30522


@dataclass(frozen=True)
class RequestBody:
    """One pre-encoded request body, sent unchanged by every wrk connection."""

    body: bytes  # the exact HTTP body
    content_type: str  # Content-Type header value
    header_length: int | None  # Inference-Header-Content-Length; None for plain JSON


def model_path(repo: Path, name: str) -> Path:
    return repo / name / "1" / "model.onnx"


def build_repository(repo: Path, names: list[str]) -> dict[str, Path]:
    """Build the named models into `repo` (the script skips built ones); return those present."""
    if BUILD_SCRIPT.exists():
        cmd = [sys.executable, str(BUILD_SCRIPT), str(repo), "--only", ",".join(names)]
        print(f"models: {' '.join(cmd)}", flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            print(f"!! build_models.py failed (rc={done.returncode}):\n{done.stderr[-2000:]}")
    else:
        print(f"!! {BUILD_SCRIPT} not found: only models already in {repo} are used")
    found = {n: model_path(repo, n) for n in names if model_path(repo, n).exists()}
    for name in sorted(set(names) - set(found)):
        print(f"!! model {name} missing from {repo}: its figure is skipped")
    return found


def sample_inputs(model: str) -> dict[str, np.ndarray]:
    """One request's worth of inputs (batch 1), deterministic."""
    rng = np.random.default_rng(1)
    if model == "mlp":
        return {"input": rng.standard_normal((1, MLP_FEATURES), dtype=np.float32)}
    if model == "minilm":
        ids = rng.integers(1000, MINILM_VOCAB, size=(1, MINILM_SEQ_LEN), dtype=np.int64)
        ids[0, 0], ids[0, -1] = 101, 102  # [CLS] ... [SEP]
        return {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    raise ValueError(f"unknown model {model!r}: expected 'mlp' or 'minilm'")


_V2_DTYPES = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64"}


def json_body(inputs: dict[str, np.ndarray]) -> RequestBody:
    """A V2 JSON request: every tensor inline as a flat `data` list."""
    payload = {
        "inputs": [
            {
                "name": name,
                "shape": list(array.shape),
                "datatype": _V2_DTYPES[array.dtype],
                "data": array.ravel().tolist(),
            }
            for name, array in inputs.items()
        ]
    }
    return RequestBody(orjson.dumps(payload), "application/json", None)


def binary_body(inputs: dict[str, np.ndarray], output_names: list[str]) -> RequestBody:
    """A V2 request using Triton's binary tensor extension, inputs and outputs both binary."""
    header = {
        "inputs": [
            {
                "name": name,
                "shape": list(array.shape),
                "datatype": _V2_DTYPES[array.dtype],
                "parameters": {"binary_data_size": array.nbytes},
            }
            for name, array in inputs.items()
        ],
        "outputs": [{"name": n, "parameters": {"binary_data": True}} for n in output_names],
    }
    header_bytes = orjson.dumps(header)
    tensors = b"".join(np.ascontiguousarray(a).tobytes() for a in inputs.values())
    return RequestBody(header_bytes + tensors, "application/octet-stream", len(header_bytes))


def output_names(model: str) -> list[str]:
    return {"mlp": ["output"], "minilm": ["sentence_embedding"]}[model]
