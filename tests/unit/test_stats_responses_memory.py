"""Triton's response statistics as Triton's core records a backend's report, and the
memory each backend says its instances hold."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from slipstream.observability.stats import ModelStatsRecorder, ResponseStats, StatDuration
from slipstream.runtime.onnx import OnnxBackend
from slipstream.runtime.onnx_weights import initializer_bytes
from slipstream.types import MemoryUsage, total_memory


def _recorded() -> dict[str, ResponseStats]:
    recorder = ModelStatsRecorder("m", "1")
    # Request A: an answer, an error, then request B: an answer, a final flag alone.
    recorder.record_response(0, outcome="success", start_ns=0, output_start_ns=30, end_ns=40)
    recorder.record_response(1, outcome="fail", start_ns=40, end_ns=45)
    recorder.record_response(0, outcome="success", start_ns=100, output_start_ns=110, end_ns=112)
    recorder.record_response(1, outcome="empty", start_ns=112, end_ns=120)
    # Request C: its client left before its first answer; 3 ns to clean up.
    recorder.record_response(0, outcome="cancel", start_ns=200, end_ns=203)
    return recorder.snapshot().response_stats


def test_each_outcome_counts_what_tritons_core_counts_for_it() -> None:
    stats = _recorded()
    assert list(stats) == ["0", "1"]
    first, second = stats["0"], stats["1"]
    assert first.compute_infer == StatDuration(2, 30 + 10)
    assert first.compute_output == StatDuration(2, 10 + 2)
    assert first.success == StatDuration(2, 40 + 12)
    assert first.cancel == StatDuration(1, 3)
    # A failed or empty answer has no outputs: all of it is compute_infer.
    assert second.compute_infer == StatDuration(2, 5 + 8)
    assert second.compute_output == StatDuration()
    assert (second.fail, second.empty_response) == (StatDuration(1, 5), StatDuration(1, 8))


def test_a_snapshot_is_not_changed_by_later_responses() -> None:
    recorder = ModelStatsRecorder("m", "1")
    recorder.record_response(0, outcome="success", start_ns=0, output_start_ns=1, end_ns=2)
    snapshot = recorder.snapshot()
    recorder.record_response(0, outcome="success", start_ns=0, output_start_ns=1, end_ns=2)
    assert snapshot.response_stats["0"].success.count == 1


def test_memory_is_summed_per_kind_and_device_in_tritons_order() -> None:
    usages = [MemoryUsage("GPU", 1, 5), MemoryUsage("CPU", 0, 7), MemoryUsage("GPU", 0, 3),
              MemoryUsage("GPU", 1, 5), MemoryUsage("CPU_PINNED", 0, 2)]  # fmt: skip
    summed = [MemoryUsage("CPU", 0, 7), MemoryUsage("CPU_PINNED", 0, 2),
              MemoryUsage("GPU", 0, 3), MemoryUsage("GPU", 1, 10)]  # fmt: skip
    assert total_memory(usages) == summed


def _dense(path: Path, external: bool) -> int:
    """An ONNX model with a weight, a bias and a Constant node; its weights' bytes."""
    weight = np.ones((32, 4), np.float32)
    bias = np.arange(4, dtype=np.float32)
    scale = np.full(4, 3.0, np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Constant", [], ["S"], value=numpy_helper.from_array(scale)),
            helper.make_node("Gemm", ["X", "W", "B"], ["XW"]),
            helper.make_node("Mul", ["XW", "S"], ["Y"]),
        ],
        "dense",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 32])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 4])],
        [numpy_helper.from_array(weight, "W"), numpy_helper.from_array(bias, "B")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path), save_as_external_data=external, size_threshold=64,
              location="weights.bin")  # fmt: skip
    return weight.nbytes + bias.nbytes + scale.nbytes


@pytest.mark.parametrize("external", [False, True], ids=["inline", "external-data"])
def test_an_onnx_instance_holds_its_initializers_on_the_cpu(tmp_path: Path, external: bool) -> None:
    path = tmp_path / "model.onnx"
    weights = _dense(path, external)
    if external:  # the weight's bytes are beside the model, not in it
        assert (tmp_path / "weights.bin").stat().st_size >= 32 * 4 * 4
    backend = OnnxBackend.load(path, {}, 1)
    try:
        assert backend.memory_usage() == [MemoryUsage("CPU", 0, weights)]
    finally:
        backend.close()


def test_an_ort_format_file_reports_nothing(tmp_path: Path) -> None:
    path = tmp_path / "model.ort"
    path.write_bytes(b"not read")
    assert initializer_bytes(path) is None


# torch 2.13 deprecates torch.jit; TorchScript files are what the torch backend serves.
@pytest.mark.filterwarnings(r"ignore:`torch\.jit\.\w+` is deprecated:DeprecationWarning")
def test_a_torch_module_holds_its_parameters_and_buffers_once(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from slipstream.runtime.torch import TorchBackend

    class Tied(torch.nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.encode = torch.nn.Linear(8, 8)
            self.decode = torch.nn.Linear(8, 8, bias=False)
            self.decode.weight = self.encode.weight  # one storage, two names
            self.register_buffer("scale", torch.ones(5, dtype=torch.float64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.decode(self.encode(x)) * self.scale[0]  # type: ignore[no-any-return]

    path = tmp_path / "model.pt"
    torch.jit.script(Tied()).save(str(path))
    backend = TorchBackend.load(path, {}, 1)
    try:
        # The tied weight once (8x8 fp32), the bias (8 fp32), the buffer (5 fp64).
        assert backend.memory_usage() == [MemoryUsage("CPU", 0, 64 * 4 + 8 * 4 + 5 * 8)]
    finally:
        backend.close()
