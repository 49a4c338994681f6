"""The model config as the V2 REST route writes it: Triton's JSON form throughout."""

from __future__ import annotations

import json

from slipstream.config import parse_model_config
from slipstream.protocol.v2_meta import model_config_json
from slipstream.repository.triton_config import parse_triton_json


def test_warm_up_samples_name_their_datatypes_as_the_tensors_do() -> None:
    config = parse_model_config(
        {
            "max_batch_size": 8,
            "input": [{"name": "x", "data_type": "FP32", "dims": [4]}],
            "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [4]}],
            "model_warmup": [
                {"name": "w", "batch_size": 2, "inputs": {"x": {"data_type": "FP32", "dims": [4],
                                                              "random_data": True}}},
            ],
        },
        "m",
    )  # fmt: skip
    written = model_config_json(config)
    assert written["input"][0]["data_type"] == "TYPE_FP32"
    (sample,) = written["model_warmup"]
    assert sample["inputs"]["x"] == {
        "data_type": "TYPE_FP32", "dims": [4], "zero_data": False, "random_data": True,
    }  # fmt: skip


def test_dynamic_batching_is_shown_only_where_the_model_has_it() -> None:
    tensors = {
        "input": [{"name": "x", "data_type": "FP32", "dims": [4]}],
        "output": [{"name": "y", "data_type": "FP32", "dims": [4]}],
    }

    def written(config: dict[str, object]) -> dict[str, object]:
        return model_config_json(parse_model_config({**tensors, **config}, "m"))

    # Triton's default scheduler: a Python model's execute gets one request at a time.
    python = written({"backend": "python", "max_batch_size": 8})
    assert "dynamic_batching" not in python
    assert "dynamic_batching" not in written({"backend": "onnxruntime", "max_batch_size": 0})
    # Other backends run queued requests together: dynamic_batching {} without delay.
    onnx = written({"backend": "onnxruntime", "max_batch_size": 8})
    assert onnx["dynamic_batching"]["max_queue_delay_microseconds"] == 0  # type: ignore[index]
    asked = written({"backend": "python", "max_batch_size": 8, "dynamic_batching": {}})
    assert "dynamic_batching" in asked
    # Loaded again as written (tritonclient's load_model(config=...)), each keeps it.
    for config in (python, onnx, asked):
        again = parse_model_config(parse_triton_json(json.dumps(config), "m"), "m")
        assert model_config_json(again).keys() == config.keys()
