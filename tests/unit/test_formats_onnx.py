"""ONNX Runtime and OpenVINO backend parameters: a value either backend would misread, or
a key neither reads, fails the model's load naming the key and what it takes."""

from __future__ import annotations

from pathlib import Path

import pytest

from slipstream.runtime.onnx import OnnxBackend, session_options
from tests.models import build_identity


@pytest.mark.parametrize(
    ("parameters", "named"),
    [
        ({"intra_op_thread_count": "four"}, r"parameters\.intra_op_thread_count: 'four'; expected"),
        ({"intra_op_thread_count": "-2"}, r"parameters\.intra_op_thread_count: '-2'; expected"),
        ({"inter_op_thread_count": "1.5"}, r"parameters\.inter_op_thread_count: '1\.5'; expected"),
        ({"denormal_as_zero": "yes"}, r"parameters\.denormal_as_zero: 'yes'; expected \"1\""),
        ({"activation_scales": "tensor"}, r"parameters\.activation_scales: 'tensor'; expected"),
        (
            {"device": "cuda"},
            r"parameters\.device: 'cuda'; the onnxruntime backend runs on the CPU",
        ),
        (
            {"intra_op_threads": "2"},
            r"unknown onnxruntime backend parameter\(s\) intra_op_threads; expected "
            r"intra_op_thread_count, ",
        ),
    ],
)
def test_formats_onnx_parameter_errors_name_the_key_and_its_values(
    tmp_path: Path, parameters: dict[str, str], named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        OnnxBackend.load(build_identity(tmp_path, "FP32"), parameters, 1)


def _flushes_denormals(value: str) -> bool:
    options = session_options({"denormal_as_zero": value}, 1)
    try:
        entry: str = options.get_session_config_entry("session.set_denormal_as_zero")
        return entry == "1"
    except RuntimeError:  # ORT: no such entry set
        return False


def test_formats_onnx_parameters_take_their_documented_spellings(tmp_path: Path) -> None:
    assert [_flushes_denormals(v) for v in ("1", "true", "False", "0")] == [1, 1, 0, 0]
    # 0: ONNX Runtime's own default thread count, as Triton's onnxruntime backend takes it.
    assert session_options({"intra_op_thread_count": "0"}, 1).intra_op_num_threads == 0
    path = build_identity(tmp_path, "FP32")
    OnnxBackend.load(path, {"activation_scales": "run", "device": "cpu"}, 1)


def test_formats_onnx_a_triton_repositorys_keys_are_applied_or_said_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import onnxruntime as ort

    options = session_options(
        {
            "enable_mem_arena": "0",
            "enable_mem_pattern": "0",
            "execution_mode": "1",
            "memory.enable_memory_arena_shrinkage": "cpu:0",
            "session.intra_op.allow_spinning": "1",  # by name: wins over allow_spinning
            "gpu_mem_limit": "4294967296",
        },
        1,
    )
    assert not options.enable_cpu_mem_arena and not options.enable_mem_pattern
    assert options.execution_mode == ort.ExecutionMode.ORT_PARALLEL
    assert options.get_session_config_entry("memory.enable_memory_arena_shrinkage") == "cpu:0"
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "1"
    assert "gpu_mem_limit ignored" in caplog.text
    # ...and a model with them loads and runs.
    backend = OnnxBackend.load(build_identity(tmp_path, "FP32"), {"enable_mem_arena": "1"}, 1)
    assert backend.signature().inputs
    with pytest.raises(ValueError, match=r"parameters\.enable_mem_arena: 'off'; expected"):
        session_options({"enable_mem_arena": "off"}, 1)
    with pytest.raises(ValueError, match=r"parameters\.execution_mode: '2'; expected"):
        session_options({"execution_mode": "2"}, 1)


@pytest.mark.parametrize(
    ("parameters", "named"),
    [
        (
            {"denormal_as_zero": "1"},
            r"unknown openvino backend parameter\(s\) denormal_as_zero; expected "
            r"intra_op_thread_count, inference_precision, performance_hint",
        ),
        ({"intra_op_thread_count": "²"}, r"parameters\.intra_op_thread_count: '²'; expected"),
        ({"performance_hint": "fast"}, r"parameters\.performance_hint: 'fast'; expected one of"),
    ],
)
def test_formats_openvino_parameter_errors_name_the_key(
    parameters: dict[str, str], named: str
) -> None:
    pytest.importorskip("openvino")
    from slipstream.runtime.openvino import compile_properties

    with pytest.raises(ValueError, match=named):
        compile_properties(parameters, 1)
