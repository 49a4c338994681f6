"""Which ONNX Runtime errors are the request's fault (a 400 with the kernel's words) and
which are the server's (None: a 500, details in the log only), on errors ORT raises."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnxruntime.capi.onnxruntime_pybind11_state import Fail

from slipstream.runtime.data_errors import ort_data_error


def _ort_error(op: str, a: tuple[int, ...], b: tuple[int, ...], **attrs: int) -> Exception:
    """What ORT raises running ``op`` on float tensors of shapes ``a`` and ``b``."""
    inputs = [
        helper.make_tensor_value_info(name, TensorProto.FLOAT, ["d0", f"{name}1"])
        for name in ("a", "b")
    ]
    output = helper.make_tensor_value_info("c", TensorProto.FLOAT, None)
    node = helper.make_node(op, ["a", "b"], ["c"], name=f"my_{op.lower()}", **attrs)
    model = helper.make_model(
        helper.make_graph([node], "g", inputs, [output]),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    model.ir_version = 8
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    options = ort.RunOptions()
    options.log_severity_level = 4
    feed = {"a": np.ones(a, np.float32), "b": np.ones(b, np.float32)}
    with pytest.raises(Exception) as raised:
        session.run(None, feed, options)
    return raised.value


@pytest.mark.parametrize(
    ("op", "a", "b", "attrs", "words"),
    [
        ("Add", (1, 2), (1, 3), {}, "Add node 'my_add': Attempting to broadcast an axis"),
        ("Mul", (1, 0), (1, 3), {}, "Mul node 'my_mul': Can broadcast 0 by 0 or 1. 3 is"),
        ("MatMul", (2, 3), (4, 5), {}, "MatMul node 'my_matmul': MatMul dimension mismatch"),
        ("Concat", (2, 3), (4, 5), {"axis": 0}, "Concat node 'my_concat': Non concat axis"),
    ],
)
def test_a_kernel_refusing_shapes_is_the_request_s_fault(
    op: str, a: tuple[int, ...], b: tuple[int, ...], attrs: dict[str, int], words: str
) -> None:
    error = _ort_error(op, a, b, **attrs)
    assert isinstance(error, Fail)  # ORT's FAIL: the status it also gives its own faults
    refused = ort_data_error(error)
    assert refused is not None, error
    message = str(refused)
    assert message.startswith(f"the model refused the request's data: {words}"), message
    assert "ONNXRuntimeError" not in message and "onnxruntime" not in message
    assert ".h:" not in message  # no source file and line


def test_other_failures_stay_faults() -> None:
    for message in (
        "[ONNXRuntimeError] : 1 : FAIL : Failed to allocate memory for requested buffer",
        "[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running Conv "
        "node. Name:'c' Status Message: some kernel fault",
        "[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Attempting to broadcast an axis",
    ):
        assert ort_data_error(Fail(message)) is None, message


@pytest.mark.parametrize(
    ("shape", "words"),
    [
        ([-1, 3], "ConstantOfShape node: a shape computed from the request's data has a negative"),
        ([2**40, 2**40], "ConstantOfShape node: a shape computed from the request's data is too"),
    ],
)
def test_a_shape_made_from_the_request_s_data_is_the_request_s_fault(
    shape: list[int], words: str
) -> None:
    """ConstantOfShape fed a negative or huge shape: ORT's FAIL, the client's 400."""
    graph = helper.make_graph(
        [helper.make_node("ConstantOfShape", ["shape"], ["y"])],
        "g",
        [helper.make_tensor_value_info("shape", TensorProto.INT64, [None])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    options = ort.RunOptions()
    options.log_severity_level = 4
    with pytest.raises(Fail) as raised:
        session.run(None, {"shape": np.array(shape, np.int64)}, options)
    refused = ort_data_error(raised.value)
    assert refused is not None, raised.value
    assert str(refused).startswith(f"the model refused the request's data: {words}")
