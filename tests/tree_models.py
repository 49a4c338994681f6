"""Tiny XGBoost and LightGBM models trained on random rows, and Triton FIL configs for
them, for the fil backend's tests (nothing downloaded; each trains in milliseconds)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

FEATURES = 32
CLASSES = 3
TREES = 8


def rows(count: int, seed: int = 0, features: int = FEATURES) -> np.ndarray:
    """FP32 [count, features] standard-normal rows, with a few NaN (missing) values."""
    x = np.random.default_rng(seed).standard_normal((count, features)).astype(np.float32)
    x[::17, 3] = np.nan
    return x


def targets(x: np.ndarray, task: str) -> np.ndarray:
    """Labels that the first features decide: 0/1, 0..CLASSES-1, or a real value."""
    score = np.nan_to_num(x[:, 0] + 0.5 * x[:, 1] - 0.25 * x[:, 2])
    if task == "binary":
        return (score > 0).astype(np.int32)
    if task == "multiclass":
        return np.digitize(score, [-0.5, 0.5]).astype(np.int32)
    return (score * 3 + 1).astype(np.float32)


_XGBOOST_OBJECTIVES = {
    "binary": "binary:logistic",
    "multiclass": "multi:softprob",
    "softmax": "multi:softmax",
    "regression": "reg:squarederror",
}
_LIGHTGBM_OBJECTIVES = {"binary": "binary", "multiclass": "multiclass", "regression": "regression"}


def train_xgboost(task: str, features: int = FEATURES) -> Any:
    """An xgboost.Booster: task binary, multiclass (softprob), softmax or regression."""
    import xgboost

    x = rows(400, seed=1, features=features)
    y = targets(x, "multiclass" if task == "softmax" else task)
    params: dict[str, Any] = {"objective": _XGBOOST_OBJECTIVES[task], "max_depth": 4, "nthread": 1}
    if task in ("multiclass", "softmax"):
        params["num_class"] = CLASSES
    return xgboost.train(params, xgboost.DMatrix(x, y), TREES)


def train_lightgbm(task: str, features: int = FEATURES) -> Any:
    """A lightgbm.Booster: task binary, multiclass or regression."""
    import lightgbm

    x = rows(400, seed=1, features=features)
    y = targets(x, task)
    params: dict[str, Any] = {
        "objective": _LIGHTGBM_OBJECTIVES[task],
        "num_leaves": 8,
        "min_data_in_leaf": 5,
        "verbose": -1,
        "num_threads": 1,
    }
    if task == "multiclass":
        params["num_class"] = CLASSES
    return lightgbm.train(params, lightgbm.Dataset(x, y), TREES)


def fil_config(
    model_type: str,
    features: int,
    output_dims: int,
    parameters: dict[str, str],
    max_batch_size: int = 32768,
) -> str:
    """A Triton FIL config.pbtxt, laid out as FIL's docs/model_config.md example is."""
    listed = ",\n".join(
        f'  {{\n    key: "{key}"\n    value: {{ string_value: "{value}" }}\n  }}'
        for key, value in {"model_type": model_type, **parameters}.items()
    )
    return f"""backend: "fil"
max_batch_size: {max_batch_size}
input [
 {{
    name: "input__0"
    data_type: TYPE_FP32
    dims: [ {features} ]
  }}
]
output [
 {{
    name: "output__0"
    data_type: TYPE_FP32
    dims: [ {output_dims} ]
  }}
]
instance_group [{{ kind: KIND_AUTO }}]
parameters [
{listed}
]

dynamic_batching {{}}
"""


def save(model: Any, version_dir: Path, filename: str) -> Path:
    """``model.save_model`` into ``version_dir/filename``; the path."""
    version_dir.mkdir(parents=True, exist_ok=True)
    path = version_dir / filename
    if filename.endswith(".model"):
        # XGBoost picks the format by extension and warns for .model (UBJSON, as it
        # writes one since 2.1): the bytes are written here instead.
        path.write_bytes(bytes(model.save_raw(raw_format="ubj")))
    else:
        model.save_model(str(path))
    return path
