"""int8-dynamic models can answer a row as they answer it alone, whatever its batch mates.

ONNX Runtime's dynamic quantization takes one activation scale over a run's whole input,
which in a server is a batch of requests: one request with large values coarsens the
others' answers. ``slipstream optimize --activation-scales row`` writes per-row scales,
and the onnxruntime backend's ``activation_scales: row`` runs a model that has per-run
scales one row at a time. Both are opt-in (speed; see runtime.onnx)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import QuantType, quantize_dynamic

from slipstream.optimize import OptimizeRequest, PassSettings, optimize_model
from slipstream.runtime.onnx import OnnxBackend
from tests.unit.test_optimize_core import build_digits_mlp

WIDTH = 16


def build_mlp(path: Path, opset: int, rank: int) -> Path:
    """x FP32 [batch, (tokens,) 16] -> MatMul -> Relu -> MatMul -> y, fixed weights."""
    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.standard_normal((WIDTH, WIDTH)).astype(np.float32), f"w{i}")
        for i in range(2)
    ]
    every: list[str | int] = ["batch", "tokens", WIDTH]
    dims = every[3 - rank :]
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w0"], ["h"], "mm0"),
            helper.make_node("Relu", ["h"], ["r"], "relu"),
            helper.make_node("MatMul", ["r", "w1"], ["y"], "mm1"),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)],
        weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def quantize_per_run(source: Path, target: Path) -> Path:
    """ONNX Runtime's own dynamic quantization: DynamicQuantizeLinear, a scale per run."""
    quantize_dynamic(source, target, op_types_to_quantize=["MatMul"], weight_type=QuantType.QInt8)
    return target


def _session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _batch_with_loud_mates(rows: int, shape: tuple[int, ...]) -> np.ndarray:
    """Row 0 as it is; its batch mates 100x larger than it."""
    x = np.random.default_rng(1).standard_normal((rows, *shape)).astype(np.float32)
    x[1:] *= 100
    return x


def test_formats_optimized_int8_dynamic_answers_a_row_as_it_answers_it_alone(
    tmp_path: Path,
) -> None:
    _, x, _ = build_digits_mlp(tmp_path / "repo" / "digits" / "1" / "model.onnx")
    np.savez(tmp_path / "val.npz", pixels=x)
    result = optimize_model(
        OptimizeRequest(
            model=tmp_path / "repo" / "digits",
            repository=tmp_path / "repo",
            name="digits",
            passes=["int8-dynamic"],
            validation=tmp_path / "val.npz",
            settings=PassSettings(int8_search=False, activation_scales="row"),
            measure_speed=False,
        )
    )
    assert result.version == 2, result.gate.summary
    session = _session(tmp_path / "repo" / "digits" / "2" / "model.onnx")
    batch = np.concatenate([x[:1], x[1:64] * 100])
    alone = session.run(None, {"pixels": x[:1]})[0]
    together = session.run(None, {"pixels": batch})[0]
    np.testing.assert_array_equal(together[:1], alone)
    assert result.passes[0].settings["activations"].endswith("per row at run time")


@pytest.mark.parametrize(("opset", "rank"), [(17, 2), (18, 3)])
def test_formats_per_row_scales_equal_each_row_quantized_alone(
    tmp_path: Path, opset: int, rank: int
) -> None:
    from slipstream.optimize.row_scales import per_row_activation_scales

    per_run = quantize_per_run(build_mlp(tmp_path / "m.onnx", opset, rank), tmp_path / "q.onnx")
    model = onnx.load(str(per_run))
    assert per_row_activation_scales(model) == []
    assert "DynamicQuantizeLinear" not in {node.op_type for node in model.graph.node}
    onnx.save(model, str(tmp_path / "rows.onnx"))
    x = _batch_with_loud_mates(6, (3, WIDTH) if rank == 3 else (WIDTH,))
    reference = _session(per_run)
    # Each row (each token of a sequence) alone through ONNX Runtime's own per-run
    # scales: its scale is then its own.
    one = (1,) * (rank - 1) + (WIDTH,)
    alone = [reference.run(None, {"x": row.reshape(one)})[0] for row in x.reshape(-1, WIDTH)]
    alone_batch = np.concatenate(alone).reshape(x.shape)
    rows = _session(tmp_path / "rows.onnx").run(None, {"x": x})[0]
    np.testing.assert_array_equal(rows, alone_batch)


def test_formats_a_model_with_per_run_scales_can_be_served_one_row_at_a_time(
    tmp_path: Path,
) -> None:
    per_run = quantize_per_run(build_mlp(tmp_path / "m.onnx", 17, 2), tmp_path / "q.onnx")
    x = _batch_with_loud_mates(8, (WIDTH,))
    alone = _session(per_run).run(None, {"x": x[:1]})[0]

    backend = OnnxBackend.load(per_run, {"activation_scales": "row"}, 1)
    backend.configure({"max_batch_size": 8})
    np.testing.assert_array_equal(backend.run({"x": x}, ["y"])["y"][:1], alone)

    # The default keeps one run per batch (its answers depend on batch mates).
    for parameters in ({}, {"activation_scales": "run"}):
        batched = OnnxBackend.load(per_run, parameters, 1)
        batched.configure({"max_batch_size": 8})
        assert not np.array_equal(batched.run({"x": x}, ["y"])["y"][:1], alone)
