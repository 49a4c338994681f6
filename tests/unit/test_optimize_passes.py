"""The passes of ``slipstream optimize``: each writes a loadable model that still computes
nearly the same function, int8 makes weights smaller, and pass lists are validated."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from slipstream.optimize.data import Dataset
from slipstream.optimize.passes import (
    PassContext,
    PassError,
    PassSettings,
    even_batch_size,
    order_passes,
    run_pass,
)

WIDTH = 128


def build_matmul_model(path: Path, layers: int = 3) -> Path:
    """x FP32 [batch, 128] -> (MatMul -> Add -> Relu) x layers -> y FP32 [batch, 128]."""
    rng = np.random.default_rng(0)
    nodes, initializers, current = [], [], "x"
    for i in range(layers):
        weight = (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
        bias = (0.1 * rng.standard_normal(WIDTH)).astype(np.float32)
        initializers += [
            numpy_helper.from_array(weight, f"W{i}"),
            numpy_helper.from_array(bias, f"b{i}"),
        ]
        out = "y" if i == layers - 1 else f"r{i}"
        nodes += [
            helper.make_node("MatMul", [current, f"W{i}"], [f"m{i}"]),
            helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"]),
            helper.make_node("Relu", [f"a{i}"], [out]),
        ]
        current = out
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", WIDTH])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _run(path: Path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].type == "tensor(float)"  # clients keep sending FP32
    return np.asarray(session.run(None, {"x": x})[0])


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_matmul_model(tmp_path_factory.mktemp("passes") / "model.onnx")


@pytest.fixture(scope="module")
def rows() -> np.ndarray:
    return np.random.default_rng(1).standard_normal((64, WIDTH)).astype(np.float32)


@pytest.mark.parametrize("name", ["graph", "fp16", "int8-dynamic", "int8-static"])
def test_each_pass_writes_a_loadable_model_close_to_the_original(
    name: str, model: Path, rows: np.ndarray, tmp_path: Path
) -> None:
    context = PassContext(PassSettings(), calibration=Dataset({"x": rows}, None, "rows"))
    target = tmp_path / "out.onnx"
    record = run_pass(name, model, target, context)

    assert record.name == name and record.seconds >= 0
    expected, got = _run(model, rows), _run(target, rows)
    assert got.shape == expected.shape
    relative = np.abs(got - expected).mean() / np.abs(expected).mean()
    assert relative < (1e-6 if name == "graph" else 0.05)


def test_int8_dynamic_makes_a_matmul_model_smaller(model: Path, tmp_path: Path) -> None:
    target = tmp_path / "int8.onnx"
    record = run_pass("int8-dynamic", model, target, PassContext(PassSettings()))

    assert target.stat().st_size < 0.4 * model.stat().st_size
    assert record.settings["op_types"] == ["MatMul"]
    op_types = {node.op_type for node in onnx.load(str(target)).graph.node}
    assert "MatMulInteger" in op_types or "DynamicQuantizeMatMul" in op_types


def test_the_quantizers_preprocessing_hint_is_not_logged(
    model: Path, rows: np.ndarray, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # ONNX Runtime logs it on the root logger for every model it quantizes (a line per
    # int8 search candidate on the user's terminal); other root warnings still pass.
    caplog.set_level(logging.WARNING)
    calibration = Dataset({"x": rows}, None, "rows")
    run_pass("int8-dynamic", model, tmp_path / "d.onnx", PassContext(PassSettings()))
    run_pass("int8-static", model, tmp_path / "s.onnx", PassContext(PassSettings(), calibration))
    logging.warning("another warning")
    messages = [record.getMessage() for record in caplog.records]
    assert not [m for m in messages if "pre-processing" in m]
    assert "another warning" in messages


def test_int8_static_records_its_calibration(model: Path, rows: np.ndarray, tmp_path: Path) -> None:
    seen: list[tuple[str, int, int]] = []
    context = PassContext(
        PassSettings(calibration_method="percentile", calibration_batch_size=16),
        calibration=Dataset({"x": rows[:32]}, None, "rows"),
        on_progress=lambda task, done, total: seen.append((task, done, total)),
    )
    record = run_pass("int8-static", model, tmp_path / "q.onnx", context)

    assert record.settings["calibration_method"] == "percentile"
    assert record.settings["format"] == "QDQ" and record.settings["calibration_rows"] == 32
    assert seen[-1] == ("calibrating", 32, 32)
    op_types = {node.op_type for node in onnx.load(str(tmp_path / "q.onnx")).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= op_types


def test_int8_static_without_calibration_data_names_the_option(model: Path, tmp_path: Path) -> None:
    with pytest.raises(PassError, match="--calibration"):
        run_pass("int8-static", model, tmp_path / "q.onnx", PassContext(PassSettings()))


def test_graph_pass_records_its_level_and_why(model: Path, tmp_path: Path) -> None:
    record = run_pass("graph", model, tmp_path / "g.onnx", PassContext(PassSettings()))

    assert record.settings == {"graph_level": "basic", "disabled_optimizers": []}
    assert "any ONNX runtime" in record.notes[0]


def test_graph_pass_keeps_matmuls_for_a_later_int8_pass(tmp_path: Path) -> None:
    model = build_matmul_model(tmp_path / "m.onnx", layers=2)
    alone, before_int8 = tmp_path / "alone.onnx", tmp_path / "before_int8.onnx"
    run_pass("graph", model, alone, PassContext(PassSettings()))
    context = PassContext(PassSettings(), later_passes=("int8-dynamic",))
    record = run_pass("graph", model, before_int8, context)

    assert record.settings["disabled_optimizers"] == ["MatMulAddFusion"]
    assert "MatMul" not in {node.op_type for node in onnx.load(str(alone)).graph.node}
    assert "MatMul" in {node.op_type for node in onnx.load(str(before_int8)).graph.node}


def test_fp16_keeps_fp32_io_and_halves_the_weights(model: Path, tmp_path: Path) -> None:
    target = tmp_path / "fp16.onnx"
    record = run_pass("fp16", model, target, PassContext(PassSettings()))

    assert record.settings == {"keep_io_types": True}
    assert target.stat().st_size < 0.6 * model.stat().st_size
    graph = onnx.load(str(target)).graph
    assert graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT


def test_passes_run_in_a_fixed_order() -> None:
    assert order_passes(["int8-dynamic", "graph"]) == ["graph", "int8-dynamic"]
    assert order_passes([" FP16 ", "graph"]) == ["graph", "fp16"]
    assert order_passes(["int8-dynamic", "distill"]) == ["distill", "int8-dynamic"]


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (["prune", "distill"], "choose one of them"),
        (["int4"], "unknown pass int4"),
        (["fp16", "int8-dynamic"], "choose one of them"),
        ([""], "name at least one pass"),
    ],
)
def test_bad_pass_lists_are_refused(names: list[str], message: str) -> None:
    with pytest.raises(PassError, match=message):
        order_passes(names)


@pytest.mark.parametrize("method", ["entropy", "percentile"])
def test_histogram_calibration_takes_any_row_count(
    method: str, model: Path, rows: np.ndarray, tmp_path: Path
) -> None:
    # 30 rows in batches of 16 once left a short last batch that ORT's histogram
    # calibrators could not stack; every row must still be used.
    context = PassContext(
        PassSettings(calibration_method=method, calibration_batch_size=16),
        calibration=Dataset({"x": rows[:30]}, None, "rows"),
    )
    record = run_pass("int8-static", model, tmp_path / "q.onnx", context)
    assert record.settings["calibration_rows"] == 30


def test_even_batch_size() -> None:
    assert [even_batch_size(total, 16) for total in (32, 30, 17, 5, 0)] == [16, 15, 1, 5, 1]
