"""The KServe V1 codec (protocol/kserve_v1.py) on what a served model rarely shows: BYTES
outputs that must travel as base64, bfloat16 outputs, outputs that cannot be answered
row by row. The served paths are in tests/integration/test_kserve_v1.py."""

from __future__ import annotations

import doctest

import ml_dtypes
import numpy as np
import orjson
import pytest

from slipstream.errors import InvalidRequest
from slipstream.protocol import kserve_v1
from slipstream.protocol.kserve_v1 import decode_predict, encode_predict
from slipstream.types import InferResponse, ModelMetadata, TensorMetadata


def metadata(*inputs: TensorMetadata) -> ModelMetadata:
    return ModelMetadata("m", ["1"], "onnx", list(inputs), [])


def encoded(outputs: dict[str, np.ndarray], columnar: bool = False) -> object:
    return orjson.loads(encode_predict(InferResponse("m", "1", outputs), columnar))


def test_the_module_examples_hold() -> None:
    assert doctest.testmod(kserve_v1).failed == 0


def test_bytes_outputs_are_strings_unless_binary_or_named_bytes() -> None:
    text = np.array([[b"caf\xc3\xa9"], [b"\xff\x00"]], dtype=object)  # [2, 1]
    assert encoded({"label": text}) == {"predictions": [["café"], [{"b64": "/wA="}]]}
    # TensorFlow Serving's rule: an output named *_bytes is base64 whatever it holds.
    assert encoded({"image_bytes": text[:1]}, columnar=True) == {"outputs": [[{"b64": "Y2Fmw6k="}]]}


def test_bfloat16_outputs_are_written_as_numbers() -> None:
    values = np.array([[1.5, -2.0]], dtype=ml_dtypes.bfloat16)
    assert encoded({"y": values}) == {"predictions": [[1.5, -2.0]]}


def test_rows_of_several_outputs_hold_numbers_of_every_type() -> None:
    """An ONNX INT64 output is a numpy.longlong array, whose scalars orjson refuses."""
    label = np.array([0, 7], dtype=np.longlong)
    scores = np.array([[0.5, 0.5], [0.0, 1.0]], dtype=np.float32)
    assert encoded({"label": label, "scores": scores}) == {
        "predictions": [{"label": 0, "scores": [0.5, 0.5]}, {"label": 7, "scores": [0.0, 1.0]}]
    }


def test_rows_need_outputs_with_rows() -> None:
    with pytest.raises(InvalidRequest, match=r"scalar.*columnar"):
        encode_predict(InferResponse("m", "1", {"y": np.array(3.0)}), False)
    ragged = {"y": np.zeros((2, 3)), "z": np.zeros((3,))}
    with pytest.raises(InvalidRequest, match=r"rows differ \('y': 2, 'z': 3\)"):
        encode_predict(InferResponse("m", "1", ragged), False)
    assert encoded(ragged, columnar=True) == {"outputs": {"y": [[0.0] * 3] * 2, "z": [0.0] * 3}}


def test_a_b64_object_is_a_value_unless_the_model_has_an_input_named_b64() -> None:
    image = TensorMetadata("image", "BYTES", [-1])
    body = b'{"instances": [{"b64": "aGk="}]}'
    assert decode_predict(body, metadata(image), "m", "").request.inputs["image"].tolist() == [
        b"hi"
    ]
    named = TensorMetadata("b64", "BYTES", [-1])
    request = decode_predict(body, metadata(named), "m", "").request
    assert request.inputs["b64"].tolist() == [b"aGk="]


def test_is_predict_path() -> None:
    assert kserve_v1.is_predict_path("/v1/models/m/versions/2:predict/")
    assert not kserve_v1.is_predict_path("/v2/models/m:predict")
