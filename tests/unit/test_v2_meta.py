"""The model config as the V2 REST route writes it: Triton's JSON form throughout."""

from __future__ import annotations

from slipstream.config import parse_model_config
from slipstream.protocol.v2_meta import model_config_json


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
