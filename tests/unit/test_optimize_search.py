"""The int8-dynamic search: smoothing leaves FP32 outputs unchanged and rescues a model
whose activations have outlier channels; a node that no smoothing can save is found by
its sensitivity and kept in FP32; a model that passes plainly is left plain. All on
small models built here, with the gate's default cosine limits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from slipstream.optimize import OptimizeRequest, PassSettings, optimize_model
from slipstream.optimize.data import Dataset
from slipstream.optimize.smoothing import channel_absmax, smooth_model

WIDTH = 32
ROWS = 96
OUTLIER = 60.0


def _save(nodes: list[Any], weights: dict[str, np.ndarray], path: Path) -> Path:
    graph = helper.make_graph(
        nodes,
        "model",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", WIDTH])],
        [numpy_helper.from_array(value, name) for name, value in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _weights(count: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        f"W{i}": (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
        for i in range(count)
    }


def build_two_layer_model(path: Path) -> Path:
    """x [batch, 32] -> MatMul (mm0) -> Relu -> MatMul (mm1) -> y [batch, 32].

    mm0's first two weight rows are 60x smaller than the rest, as trained transformers
    pair outlier activation channels with small weights: every channel matters to y."""
    weights = _weights(2)
    weights["W0"][:2] /= OUTLIER
    nodes = [
        helper.make_node("MatMul", ["x", "W0"], ["h"], "mm0"),
        helper.make_node("Relu", ["h"], ["r"], "relu"),
        helper.make_node("MatMul", ["r", "W1"], ["y"], "mm1"),
    ]
    return _save(nodes, weights, path)


def build_normalized_model(path: Path) -> Path:
    """x -> MatMul (mm0) -> divided by its row's L2 norm -> MatMul (mm1) -> Relu ->
    MatMul (mm2) -> y: only mm0 sees rows of very different sizes."""
    nodes = [
        helper.make_node("MatMul", ["x", "W0"], ["h"], "mm0"),
        helper.make_node("ReduceL2", ["h"], ["norm"], "norm", axes=[1], keepdims=1),
        helper.make_node("Add", ["norm", "eps"], ["safe"], "eps"),
        helper.make_node("Div", ["h", "safe"], ["n"], "div"),
        helper.make_node("MatMul", ["n", "W1"], ["m"], "mm1"),
        helper.make_node("Relu", ["m"], ["r"], "relu"),
        helper.make_node("MatMul", ["r", "W2"], ["y"], "mm2"),
    ]
    weights = _weights(3) | {"eps": np.array(1e-6, np.float32)}
    return _save(nodes, weights, path)


def outlier_channel_rows() -> np.ndarray:
    """Rows whose first two channels are 60x the rest: one int8 scale per tensor leaves
    the other channels a handful of levels."""
    x = np.random.default_rng(1).standard_normal((ROWS, WIDTH)).astype(np.float32)
    x[:, :2] *= OUTLIER
    return x


def mixed_size_rows() -> np.ndarray:
    """Every other row 1000x smaller: quantized per tensor, those rows vanish, whatever
    the channel scales."""
    x = np.random.default_rng(2).standard_normal((ROWS, WIDTH)).astype(np.float32)
    x[::2] *= 1e-3
    return x


def _run(path: Path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {"x": x})[0])


def _optimize(model: Path, x: np.ndarray, tmp_path: Path, **settings: Any) -> dict[str, Any]:
    np.savez(tmp_path / "val.npz", x=x)
    result = optimize_model(
        OptimizeRequest(
            model=model,
            repository=tmp_path / "repo",
            name="m",
            passes=["int8-dynamic"],
            validation=tmp_path / "val.npz",
            settings=PassSettings(**settings),
            measure_speed=False,
        )
    )
    assert result.gate.metric == "cosine"
    record = result.to_record()
    record["int8"] = result.passes[-1].settings
    return record


def test_smoothing_keeps_fp32_outputs_and_adds_one_mul_per_input(tmp_path: Path) -> None:
    model = build_two_layer_model(tmp_path / "m.onnx")
    x = outlier_channel_rows()
    absmax = channel_absmax(model, Dataset({"x": x}, None, "rows"))
    assert sorted(absmax) == ["r", "x"]
    np.testing.assert_allclose(absmax["x"], np.abs(x).max(axis=0))

    smoothed = smooth_model(model, tmp_path / "s.onnx", absmax, alpha=0.5)

    assert smoothed == ["mm0", "mm1"]
    np.testing.assert_allclose(_run(tmp_path / "s.onnx", x), _run(model, x), rtol=1e-4, atol=1e-4)
    op_types = [node.op_type for node in onnx.load(str(tmp_path / "s.onnx")).graph.node]
    assert op_types.count("Mul") == 2


def test_outlier_channels_fail_plain_int8_and_smoothing_passes(tmp_path: Path) -> None:
    model = build_two_layer_model(tmp_path / "m.onnx")
    record = _optimize(model, outlier_channel_rows(), tmp_path)

    assert record["gate"]["passed"]
    search = record["int8"]["search"]
    plain, *smoothed = search["candidates"]
    assert plain["smoothing_alpha"] is None and not plain["passed"]
    assert record["int8"]["smoothing_alpha"] in PassSettings().smoothing_alphas
    assert record["int8"]["excluded_nodes"] == [] and search["sensitivity"] == {}
    chosen = [c for c in smoothed if c["smoothing_alpha"] == record["int8"]["smoothing_alpha"]]
    assert chosen[0]["passed"] and chosen[0]["margin"] == max(c["margin"] for c in smoothed)
    written = json.loads((tmp_path / "repo" / "m" / "1" / "optimization.json").read_text())
    assert written["passes"][0]["settings"]["smoothing_alpha"] == record["int8"]["smoothing_alpha"]


def test_a_node_no_smoothing_saves_is_kept_in_fp32(tmp_path: Path) -> None:
    model = build_normalized_model(tmp_path / "m.onnx")
    record = _optimize(model, mixed_size_rows(), tmp_path)

    assert record["gate"]["passed"]
    assert record["int8"]["excluded_nodes"] == ["mm0"]
    sensitivity = record["int8"]["search"]["sensitivity"]
    assert set(sensitivity) == {"mm0", "mm1", "mm2"}
    assert sensitivity["mm0"] > 10 * max(sensitivity["mm1"], sensitivity["mm2"])
    graph = onnx.load(str(tmp_path / "repo" / "m" / "1" / "model.onnx")).graph
    still_fp32 = {node.name for node in graph.node if node.op_type == "MatMul"}
    assert "mm0" in still_fp32 and not {"mm1", "mm2"} & still_fp32
    assert any("1 nodes in FP32" in note for note in record["passes"][0]["notes"])


def test_a_model_that_passes_plainly_stays_plain_and_without_value_info(tmp_path: Path) -> None:
    model = build_two_layer_model(tmp_path / "m.onnx")
    x = np.random.default_rng(3).standard_normal((ROWS, WIDTH)).astype(np.float32)
    record = _optimize(model, x, tmp_path)

    assert record["gate"]["passed"]
    assert len(record["int8"]["search"]["candidates"]) == 1
    assert record["int8"]["smoothing_alpha"] is None and record["int8"]["excluded_nodes"] == []
    assert record["data"]["calibration_rows"] == ROWS // 2  # split off the validation rows
    written = onnx.load(str(tmp_path / "repo" / "m" / "1" / "model.onnx"))
    assert len(written.graph.value_info) == 0


def test_without_the_search_int8_dynamic_is_plain_and_uses_every_row(tmp_path: Path) -> None:
    model = build_two_layer_model(tmp_path / "m.onnx")
    record = _optimize(model, outlier_channel_rows(), tmp_path, int8_search=False)

    assert "search" not in record["int8"] and record["int8"]["int8_search"] is False
    assert record["data"]["calibration_rows"] is None
    assert record["data"]["validation_rows"] == ROWS
    assert not record["gate"]["passed"]  # what the search rescues above


@pytest.mark.parametrize("alpha", [-0.1, 1.5])
def test_smoothing_alpha_out_of_range_is_refused(alpha: float, tmp_path: Path) -> None:
    model = build_two_layer_model(tmp_path / "m.onnx")
    with pytest.raises(ValueError, match="expected 0 <= alpha <= 1"):
        smooth_model(model, tmp_path / "s.onnx", {}, alpha)
