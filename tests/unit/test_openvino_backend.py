"""The OpenVINO backend: IR and ONNX files on OpenVINO's CPU plugin, next to ONNX Runtime."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from slipstream.config import parse_model_config
from slipstream.observability.metrics import ServerMetrics
from slipstream.runtime import backend_for_file, get_backend, model_files
from slipstream.runtime.base import BackendUnavailable, ModelSignature, TensorSpec
from slipstream.serving.model import ModelVersion
from tests.models import build_add_sub, build_identity, run_onnx

ov = pytest.importorskip("openvino")

from slipstream.runtime.openvino import OpenVinoBackend, compile_properties  # noqa: E402

# A MatMul chain slow enough to see who holds the GIL: ~150 ms a run on one thread, far
# above the scheduling hiccups of a loaded machine.
_SLOW_WIDTH = 1024
_SLOW_LAYERS = 4
_SLOW_ROWS = 2048


def _save(graph: onnx.GraphProto, path: Path, opsets: dict[str, int] | None = None) -> Path:
    imports = [helper.make_opsetid(domain, v) for domain, v in (opsets or {"": 17}).items()]
    model = helper.make_model(graph, opset_imports=imports)
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def build_matmul_chain(path: Path, width: int = 16, layers: int = 2) -> Path:
    """x FP32 [-1, width] -> y = relu(...relu(x W1)... W_layers), fixed random weights."""
    rng = np.random.default_rng(0)
    nodes, weights, current = [], [], "x"
    for layer in range(layers):
        weight = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        weights.append(numpy_helper.from_array(weight, f"w{layer}"))
        out = "y" if layer == layers - 1 else f"h{layer}"
        nodes.append(helper.make_node("MatMul", [current, f"w{layer}"], [f"m{layer}"]))
        nodes.append(helper.make_node("Relu", [f"m{layer}"], [out]))
        current = out
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", width])],
        weights,
    )
    return _save(graph, path)


def to_ir(onnx_path: Path, xml_path: Path) -> Path:
    """The ONNX file as OpenVINO IR (model.xml + model.bin), weights kept in FP32."""
    xml_path.parent.mkdir(parents=True, exist_ok=True)
    ov.save_model(ov.convert_model(str(onnx_path)), str(xml_path), compress_to_fp16=False)
    return xml_path


def test_onnx_and_ir_files_answer_as_onnx_runtime_does(tmp_path: Path) -> None:
    onnx_path = build_add_sub(tmp_path)
    xml_path = to_ir(onnx_path, tmp_path / "ir" / "model.xml")
    assert backend_for_file(xml_path) == "openvino" and get_backend("openvino") is OpenVinoBackend
    assert [p.name for p in model_files(xml_path)] == ["model.xml", "model.bin"]
    rng = np.random.default_rng(1)
    inputs = {n: rng.standard_normal((3, 16)).astype(np.float32) for n in ("INPUT0", "INPUT1")}
    expected = run_onnx(onnx_path, inputs)
    for path in (onnx_path, xml_path):
        backend = OpenVinoBackend.load(path, {}, 1)
        spec = (-1, 16)
        assert backend.signature() == ModelSignature(
            inputs=(TensorSpec("INPUT0", "FP32", spec), TensorSpec("INPUT1", "FP32", spec)),
            outputs=(TensorSpec("OUTPUT0", "FP32", spec), TensorSpec("OUTPUT1", "FP32", spec)),
        )
        got = backend.run(inputs, ["OUTPUT1"])
        assert list(got) == ["OUTPUT1"]
        np.testing.assert_allclose(got["OUTPUT1"], expected["OUTPUT1"], rtol=1e-6)
        backend.close()


@pytest.mark.parametrize("datatype", ["INT64", "INT32", "UINT8", "FP16", "BOOL"])
def test_signature_datatypes(tmp_path: Path, datatype: str) -> None:
    backend = OpenVinoBackend.load(build_identity(tmp_path, datatype), {}, 1)
    assert backend.signature().inputs == (TensorSpec("INPUT0", datatype, (-1, -1)),)


def test_read_only_inputs_run_and_outputs_outlive_the_next_run(tmp_path: Path) -> None:
    backend = OpenVinoBackend.load(build_matmul_chain(tmp_path / "m.onnx"), {}, 1)
    # Read-only, as an array over a gRPC request's bytes is.
    ones = np.frombuffer(np.ones((2, 16), np.float32).tobytes(), np.float32).reshape(2, 16)
    first = backend.run({"x": ones}, ["y"])["y"]
    kept = first.copy()
    backend.run({"x": np.full((2, 16), 3.0, np.float32)}, ["y"])
    np.testing.assert_array_equal(first, kept)


def test_threads_precision_and_instances_reach_the_compiled_model(tmp_path: Path) -> None:
    assert compile_properties({}, instance_count=64)["INFERENCE_NUM_THREADS"] == 1
    backend = OpenVinoBackend.load(
        build_matmul_chain(tmp_path / "m.onnx"),
        {"intra_op_thread_count": "1", "inference_precision": "bf16"},
        1,
    )
    compiled = backend._compiled
    assert compiled.get_property("INFERENCE_NUM_THREADS") == 1
    # f32 by default (OpenVINO's own default is bf16 on CPUs with BF16 units).
    default = OpenVinoBackend.load(build_matmul_chain(tmp_path / "m.onnx"), {}, 1)
    assert str(default._compiled.get_property("INFERENCE_PRECISION_HINT")) == "<Type: 'float32'>"
    for key, value in [
        ("intra_op_thread_count", "0"),
        ("inference_precision", "int4"),
        ("performance_hint", "fastest"),
    ]:
        with pytest.raises(ValueError, match=f"parameters.{key}: "):
            compile_properties({key: value}, 1)


async def test_a_served_version_completes_its_config_and_loads_each_instance(
    tmp_path: Path,
) -> None:
    path = to_ir(build_matmul_chain(tmp_path / "m.onnx"), tmp_path / "1" / "model.xml")
    config = parse_model_config(
        {"max_batch_size": 8, "instance_group": [{"count": 2}]}, "config.yaml"
    )
    metrics = ServerMetrics().for_model("chain", "1")
    model = await ModelVersion.load("chain", 1, path, config, metrics)
    try:
        assert model.config.backend == model.config.platform == "openvino"
        assert [(t.name, t.data_type, t.dims) for t in model.config.input] == [("x", "FP32", [16])]
        assert len(model._instances) == 2
    finally:
        await model.batcher.close(1.0)


def test_a_run_releases_the_gil(tmp_path: Path) -> None:
    path = build_matmul_chain(tmp_path / "slow.onnx", _SLOW_WIDTH, _SLOW_LAYERS)
    backend = OpenVinoBackend.load(path, {"intra_op_thread_count": "1"}, 1)
    x = np.ones((_SLOW_ROWS, _SLOW_WIDTH), np.float32)
    backend.run({"x": x}, ["y"])
    started = time.perf_counter()
    backend.run({"x": x}, ["y"])
    one_run_s = time.perf_counter() - started
    done = threading.Event()
    runner = threading.Thread(target=lambda: (backend.run({"x": x}, ["y"]), done.set()))
    ticks, last = 0, time.perf_counter()
    longest_gap = 0.0
    runner.start()
    while not done.is_set():
        now = time.perf_counter()
        longest_gap, last, ticks = max(longest_gap, now - last), now, ticks + 1
    runner.join()
    # Held for the whole run, the GIL would stall this loop once for about one_run_s.
    assert one_run_s > 0.05 and longest_gap < one_run_s / 2, (one_run_s, longest_gap, ticks)


def test_a_file_openvino_cannot_read_names_its_operators(tmp_path: Path) -> None:
    node = helper.make_node("Scaler", ["x"], ["y"], domain="ai.onnx.ml", scale=[2.0], offset=[0.0])
    graph = helper.make_graph(
        [node],
        "ml",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 1])],
    )
    path = _save(graph, tmp_path / "model.onnx", {"": 17, "ai.onnx.ml": 3})
    with pytest.raises(ValueError, match=r"OpenVINO cannot read it: .*ai\.onnx\.ml\.Scaler"):
        OpenVinoBackend.load(path, {}, 1)
    xml_path = to_ir(build_matmul_chain(tmp_path / "m.onnx"), tmp_path / "ir" / "model.xml")
    xml_path.with_suffix(".bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.bin: the IR's weights are missing"):
        OpenVinoBackend.load(xml_path, {}, 1)


def test_without_the_extra_the_error_names_the_install_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # None in sys.modules is how Python spells "this module cannot be imported".
    monkeypatch.setitem(sys.modules, "openvino", None)
    monkeypatch.delitem(sys.modules, "slipstream.runtime.openvino")
    with pytest.raises(BackendUnavailable, match=r"pip install 'slipstream\[openvino\]'"):
        get_backend("openvino")
