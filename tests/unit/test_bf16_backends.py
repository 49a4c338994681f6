"""bfloat16 tensors in and out of the ONNX Runtime and OpenVINO backends, whose Python
APIs take no ml_dtypes bfloat16 (ORT refuses it; OpenVINO shows a bf16 tensor's bits as
float16 numbers): each answer checked against the values the graph computes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

from slipstream.datatypes import BF16
from slipstream.runtime.onnx import OnnxBackend
from slipstream.runtime.openvino import OpenVinoBackend
from tests.models import run_onnx, write_graph

# Exact in bfloat16, doubled exactly; 0.1 is rounded on the way in.
X = np.array([[1.5, -2.0, 0.1, 1.0e38], [0.0, 7.0, -0.25, 1e-3]], np.float32).astype(BF16)


def _double_bf16(repo: Path) -> Path:
    """x BF16 [-1, 4] -> y BF16 = 2x (computed in FP32, rounded back) and z FP32 = x."""
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["x"], ["z"], to=TensorProto.FLOAT),
            helper.make_node("Add", ["z", "z"], ["wide"]),
            helper.make_node("Cast", ["wide"], ["y"], to=TensorProto.BFLOAT16),
        ],
        "double_bf16",
        [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, ["batch", 4])],
        [
            helper.make_tensor_value_info("y", TensorProto.BFLOAT16, ["batch", 4]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", 4]),
        ],
    )
    return write_graph(graph, repo, "double_bf16")


@pytest.mark.parametrize("backend", [OnnxBackend, OpenVinoBackend], ids=["onnx", "openvino"])
def test_bf16_inputs_and_outputs_hold_their_values(
    tmp_path: Path, backend: type[OnnxBackend] | type[OpenVinoBackend]
) -> None:
    path = _double_bf16(tmp_path)
    model = backend.load(path, {}, 1)
    signature = model.signature()
    assert [s.datatype for s in signature.inputs] == ["BF16"]
    assert [s.datatype for s in signature.outputs] == ["BF16", "FP32"]
    outputs = model.run({"x": X}, ["y", "z"])
    assert outputs["y"].dtype == BF16 and outputs["z"].dtype == np.float32
    np.testing.assert_array_equal(outputs["z"], X.astype(np.float32))
    doubled = (2 * X.astype(np.float32)).astype(BF16)
    np.testing.assert_array_equal(outputs["y"].view(np.uint16), doubled.view(np.uint16))
    reference = run_onnx(path, {"x": X})  # ONNX Runtime's own answer
    np.testing.assert_array_equal(outputs["y"].view(np.uint16), reference["y"].view(np.uint16))
    empty = model.run({"x": X[:0]}, ["y"])["y"]
    assert empty.shape == (0, 4) and empty.dtype == BF16
