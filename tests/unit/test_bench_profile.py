"""``slipstream.profile.measure``: the in-process runtime profile on small ONNX models."""

from __future__ import annotations

import base64
import csv
import io
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from slipstream.profile.measure import (
    ProfileError,
    ProfileResult,
    plan_inputs,
    profile_model,
    summarize_ort_trace,
)
from slipstream.profile.results import write_csv, write_json, write_report
from slipstream.runtime.base import ModelSignature, TensorSpec

VOCAB = 1000


def fast_profile(path: Path, batch_sizes: list[int], **options: Any) -> ProfileResult:
    """A short budget: these tests check the figures' shape, not their values."""
    return profile_model(path, batch_sizes, seconds=0.05, warmup_runs=1, **options)


def _save(graph: onnx.GraphProto, path: Path) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def _weights(name: str, shape: tuple[int, ...]) -> onnx.TensorProto:
    array = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    return numpy_helper.from_array(array, name)


def build_mlp(path: Path) -> Path:
    """x FP32 [batch, 64] -> MatMul -> Relu -> MatMul -> y [batch, 8]."""
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W1"], ["h"], name="fc1"),
            helper.make_node("Relu", ["h"], ["r"], name="relu1"),
            helper.make_node("MatMul", ["r", "W2"], ["y"], name="fc2"),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        [_weights("W1", (64, 128)), _weights("W2", (128, 8))],
    )
    return _save(graph, path)


def build_embedding(path: Path) -> Path:
    """input_ids, attention_mask INT64 [batch, seq] -> masked mean of embeddings [batch, 8].

    The Gather fails on ids outside [0, VOCAB), so the run also checks the id range.
    """
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["E", "input_ids"], ["emb"], name="lookup"),
            helper.make_node("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),
            helper.make_node("Unsqueeze", ["m", "last"], ["m3"]),
            helper.make_node("Mul", ["emb", "m3"], ["masked"]),
            helper.make_node("ReduceMean", ["masked"], ["y"], axes=[1], keepdims=0),
        ],
        "embedding",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        [_weights("E", (VOCAB, 8)), numpy_helper.from_array(np.array([-1], np.int64), "last")],
    )
    return _save(graph, path)


def build_fixed(path: Path) -> Path:
    """x FP32 [2, 4] -> Relu -> y [2, 4]: no batch axis."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "fixed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
    )
    return _save(graph, path)


def build_batch_two_only(path: Path) -> Path:
    """x FP32 [batch, 4] reshaped to a constant [2, 4]: every batch but 2 fails at run time."""
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"])],
        "two_only",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [numpy_helper.from_array(np.array([2, 4], np.int64), "shape")],
    )
    return _save(graph, path)


@pytest.fixture(scope="module")
def mlp_result(tmp_path_factory: pytest.TempPathFactory) -> ProfileResult:
    path = build_mlp(tmp_path_factory.mktemp("mlp") / "model.onnx")
    return fast_profile(path, [1, 4, 16], top_ops=5)


def test_mlp_figures_are_sane_and_the_best_batch_is_the_argmax(mlp_result: ProfileResult) -> None:
    assert [b.batch_size for b in mlp_result.batches] == [1, 4, 16]
    for batch in mlp_result.batches:
        assert batch.status == "ok"
        assert batch.runs >= 3
        assert batch.throughput_infer_per_s is not None and batch.throughput_infer_per_s > 0
        assert batch.p50_ms is not None and batch.p90_ms is not None and batch.p99_ms is not None
        assert 0 < batch.p50_ms <= batch.p90_ms <= batch.p99_ms
        assert batch.min_ms is not None and batch.max_ms is not None
        assert batch.min_ms <= batch.p50_ms <= batch.max_ms
        expected = batch.batch_size * 1000.0 / batch.p50_ms
        assert batch.p50_throughput_infer_per_s == pytest.approx(expected)
    best = max(mlp_result.batches, key=lambda b: b.throughput_infer_per_s or 0.0)
    assert mlp_result.best_batch_size == best.batch_size
    assert mlp_result.best_throughput_infer_per_s == best.throughput_infer_per_s
    assert mlp_result.threads == 1
    assert mlp_result.batching


def test_mlp_memory_and_environment(mlp_result: ProfileResult, tmp_path: Path) -> None:
    assert mlp_result.model_size_mb == pytest.approx(
        Path(mlp_result.model_path).stat().st_size / 2**20
    )
    assert mlp_result.peak_rss_mb >= mlp_result.baseline_rss_mb > 0
    assert mlp_result.environment["onnxruntime"]
    assert int(mlp_result.environment["usable_cores"]) >= 1


def test_op_profile_lists_matmul_and_its_nodes(mlp_result: ProfileResult) -> None:
    ops = mlp_result.op_profile
    assert ops is not None
    assert ops.batch_size == mlp_result.best_batch_size
    assert ops.runs >= 3
    by_type = {op.name: op for op in ops.top_ops}
    assert "MatMul" in by_type
    assert by_type["MatMul"].calls == 2 * ops.runs  # two MatMul nodes per run
    assert {op.name for op in ops.top_nodes} >= {"fc1", "fc2"}
    assert sum(op.share for op in ops.top_ops) == pytest.approx(1.0)
    totals = [op.total_ms for op in ops.top_ops]
    assert totals == sorted(totals, reverse=True)
    assert 0 < ops.kernel_mean_ms <= ops.run_mean_ms


def test_top_ops_limits_the_tables(tmp_path: Path) -> None:
    path = build_mlp(tmp_path / "model.onnx")
    result = fast_profile(path, [2], top_ops=1)
    assert result.op_profile is not None
    assert len(result.op_profile.top_ops) == 1
    assert len(result.op_profile.top_nodes) == 1


def test_no_op_profile(tmp_path: Path) -> None:
    result = fast_profile(build_mlp(tmp_path / "m.onnx"), [1], op_profile=False)
    assert result.op_profile is None


def test_variable_dims_need_a_shape(tmp_path: Path) -> None:
    path = build_embedding(tmp_path / "model.onnx")
    with pytest.raises(ProfileError, match=re.escape("--shape input_ids:128")):
        fast_profile(path, [1])


def test_variable_dims_with_shapes_and_int_heuristics(tmp_path: Path) -> None:
    path = build_embedding(tmp_path / "model.onnx")
    shapes = {"input_ids": [16], "attention_mask": [16]}
    result = fast_profile(path, [1, 8], shapes=shapes, op_profile=False)
    assert all(b.status == "ok" for b in result.batches)
    inputs = {item.name: item for item in result.inputs}
    assert inputs["input_ids"].shape == (-1, 16)
    assert inputs["input_ids"].source == "random integers in [0, 1000)"
    assert inputs["attention_mask"].source == "ones (mask)"


def test_a_shape_of_the_wrong_rank_is_refused(tmp_path: Path) -> None:
    path = build_embedding(tmp_path / "model.onnx")
    shapes = {"input_ids": [16, 2], "attention_mask": [16]}
    with pytest.raises(ProfileError, match="input 'input_ids'"):
        fast_profile(path, [1], shapes=shapes)


def test_a_shape_for_an_unknown_input_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="'tokens' is not an input"):
        fast_profile(build_mlp(tmp_path / "m.onnx"), [1], shapes={"tokens": [4]})


def test_fixed_batch_model_profiles_only_its_batch_size(tmp_path: Path) -> None:
    result = fast_profile(build_fixed(tmp_path / "m.onnx"), [1, 4], op_profile=False)
    assert not result.batching
    statuses = {b.batch_size: b.status for b in result.batches}
    assert statuses == {1: "not_applicable", 2: "ok", 4: "not_applicable"}
    assert result.best_batch_size == 2
    assert "fixed at 2" in result.batches[0].reason
    assert result.inputs[0].shape == (2, 4)


def test_a_failing_batch_size_is_reported_and_the_rest_still_run(tmp_path: Path) -> None:
    path = build_batch_two_only(tmp_path / "m.onnx")
    result = fast_profile(path, [1, 2], op_profile=False)
    first, second = result.batches
    assert first.status == "failed" and first.reason and first.throughput_infer_per_s is None
    assert second.status == "ok"
    assert result.best_batch_size == 2
    with pytest.raises(ProfileError, match="no batch size could run"):
        fast_profile(path, [1, 3], op_profile=False)


def test_input_data_rows_are_tiled_to_the_batch(tmp_path: Path) -> None:
    path = build_embedding(tmp_path / "model.onnx")
    ids = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]], np.int64)
    data = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    result = fast_profile(path, [8], input_data=data, op_profile=False)
    assert result.batches[0].status == "ok"
    assert result.inputs[0].shape == (-1, 3)
    assert "--input-data" in result.inputs[0].source
    with pytest.raises(ProfileError, match="no array 'attention_mask'"):
        fast_profile(path, [1], input_data={"input_ids": ids})


def test_a_signature_less_model_takes_its_inputs_from_shapes() -> None:
    signature = ModelSignature(inputs=(), outputs=())
    plans, batching = plan_inputs(signature, {"ids": [8], "x": [3, 2]}, {"ids": "INT64"}, None)
    assert batching
    assert [(p.name, p.datatype, p.shape) for p in plans] == [
        ("ids", "INT64", (-1, 8)),
        ("x", "FP32", (-1, 3, 2)),
    ]
    with pytest.raises(ProfileError, match="declares no inputs"):
        plan_inputs(signature, {}, {}, None)


def test_int8_inputs_stay_in_their_range() -> None:
    signature = ModelSignature(inputs=(TensorSpec("codes", "INT8", (-1, 4)),), outputs=())
    plans, _ = plan_inputs(signature, {}, {}, None)
    assert plans[0].source == "random integers in [0, 128)"


def _event(name: str, ts: int, dur: int, op: str | None = None) -> dict[str, object]:
    if op is None:
        return {"cat": "Session", "name": name, "ts": ts, "dur": dur}
    return {
        "cat": "Node",
        "name": f"{name}_kernel_time",
        "ts": ts,
        "dur": dur,
        "args": {"op_name": op},
    }


def test_summarize_ort_trace_skips_warm_up_runs_by_timestamp() -> None:
    events = [
        _event("model_loading_array", 0, 50),
        # warm-up run: a slow first MatMul that must not count
        _event("a", 110, 500, "MatMul"),
        _event("model_run", 100, 600),
        # two measured runs
        _event("a", 1010, 30, "MatMul"),
        _event("b", 1040, 10, "Relu"),
        _event("c", 1050, 20, "MatMul"),
        _event("model_run", 1000, 80),
        _event("a", 2010, 50, "MatMul"),
        _event("b", 2060, 10, "Relu"),
        _event("c", 2070, 20, "MatMul"),
        _event("model_run", 2000, 100),
    ]
    profile = summarize_ort_trace(events, skip_runs=1, top_n=10, batch_size=4)
    assert profile.runs == 2
    assert profile.batch_size == 4
    assert profile.run_mean_ms == pytest.approx(0.090)
    assert profile.kernel_mean_ms == pytest.approx(0.070)
    matmul, relu = profile.top_ops
    assert (matmul.name, matmul.calls) == ("MatMul", 4)
    assert matmul.total_ms == pytest.approx(0.120)  # the 0.5 ms warm-up MatMul left out
    assert matmul.ms_per_run == pytest.approx(0.060)
    assert matmul.share == pytest.approx(120 / 140)
    assert (relu.name, relu.calls) == ("Relu", 2)
    assert [(n.name, n.op_type) for n in profile.top_nodes] == [
        ("a", "MatMul"),
        ("c", "MatMul"),
        ("b", "Relu"),
    ]
    assert len(summarize_ort_trace(events, 1, top_n=1, batch_size=4).top_nodes) == 1


def test_json_csv_html_and_png_reports(mlp_result: ProfileResult, tmp_path: Path) -> None:
    write_json(mlp_result, tmp_path / "p.json")
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["best_batch_size"] == mlp_result.best_batch_size
    for key in ("peak_rss_mb", "model_size_mb", "load_rss_increase_mb", "threads"):
        assert isinstance(data[key], (int, float))
    assert [b["batch_size"] for b in data["batches"]] == [1, 4, 16]
    assert {"throughput_infer_per_s", "p50_ms", "p90_ms", "p99_ms"} <= set(data["batches"][0])
    assert "MatMul" in [op["name"] for op in data["op_profile"]["top_ops"]]

    write_csv(mlp_result, tmp_path / "p.csv")
    with (tmp_path / "p.csv").open(newline="") as rows:
        table = list(csv.DictReader(rows))
    assert [int(r["batch_size"]) for r in table] == [1, 4, 16]
    assert [r["batch_size"] for r in table if r["is_best"] == "True"] == [
        str(mlp_result.best_batch_size)
    ]
    assert float(table[0]["throughput_infer_per_s"]) > 0

    write_report(mlp_result, tmp_path / "p.html")
    page = (tmp_path / "p.html").read_text()
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(images) == 3  # throughput, latency, top ops
    assert all(base64.b64decode(image).startswith(b"\x89PNG") for image in images)
    assert "<tr class='best'><td>" + str(mlp_result.best_batch_size) in page

    write_report(mlp_result, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes().startswith(b"\x89PNG")
    with pytest.raises(ValueError, match=r"\.html or \.png"):
        write_report(mlp_result, tmp_path / "p.pdf")


def test_gpu_memory_and_utilization_beside_rss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where there is a GPU (a fake NVML here, tests/fake_nvml.py): its memory in the
    memory figures, its utilization per batch size, in every output."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # the fake GPU visible
    from rich.console import Console

    from slipstream.observability.gpu import Gpus
    from slipstream.profile.cli import print_result
    from tests.fake_nvml import FakeGpu, FakeNvml

    gpu = FakeGpu("GPU-aaaa", utilization_pct=40, memory_used=600 * 2**20)
    nvml = FakeNvml([gpu])
    path = build_mlp(tmp_path / "model.onnx")
    result = fast_profile(path, [1, 4], op_profile=False, open_gpus=lambda: Gpus.open(nvml))
    assert nvml.initialized == 0  # let go after the runs
    assert result.baseline_gpu_memory_mb == pytest.approx(600.0)
    assert result.load_gpu_memory_increase_mb == pytest.approx(0.0)
    assert result.peak_gpu_memory_mb == pytest.approx(600.0)
    assert [b.gpu_util_pct for b in result.batches] == [pytest.approx(40.0)] * 2

    out = io.StringIO()
    print_result(result, Console(file=out, width=250, force_terminal=False))
    assert "GPU%" in out.getvalue()
    assert "GPU memory in use (every process) 600 MB before loading" in out.getvalue()
    write_csv(result, tmp_path / "p.csv")
    with (tmp_path / "p.csv").open(newline="") as rows:
        assert [float(r["gpu_util_pct"]) for r in csv.DictReader(rows)] == [40.0, 40.0]
    write_json(result, tmp_path / "p.json")
    assert json.loads((tmp_path / "p.json").read_text())["peak_gpu_memory_mb"] == 600.0

    cpu_only = fast_profile(path, [1], op_profile=False, open_gpus=lambda: None)
    assert cpu_only.batches[0].gpu_util_pct is None and cpu_only.peak_gpu_memory_mb is None
    out = io.StringIO()
    print_result(cpu_only, Console(file=out, width=250, force_terminal=False))
    assert "GPU" not in out.getvalue()


def test_sklearn_models_run_through_their_backend(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    import joblib
    from sklearn.linear_model import LogisticRegression

    features = np.random.default_rng(0).standard_normal((40, 6))
    path = tmp_path / "model.joblib"
    joblib.dump(LogisticRegression().fit(features, features[:, 0] > 0), path)
    result = fast_profile(path, [1, 8])
    assert result.backend == "sklearn"
    assert [b.status for b in result.batches] == ["ok", "ok"]
    assert result.inputs[0].shape == (-1, 6)
    assert result.op_profile is None
    assert result.threads is None  # the sklearn backend has no thread setting
    assert any("threads not applied" in note for note in result.notes)


# torch 2.13 deprecates torch.jit in favour of torch.export; TorchScript files still load.
@pytest.mark.filterwarnings(r"ignore:`torch\.jit\.\w+` is deprecated:DeprecationWarning")
def test_a_torchscript_model_without_a_signature_takes_shape(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    path = tmp_path / "model.pt"
    torch.jit.script(torch.nn.Linear(6, 3)).save(str(path))
    with pytest.raises(ProfileError, match="--shape NAME:D1,D2"):
        fast_profile(path, [1])
    result = fast_profile(path, [1, 4], shapes={"input": [6]})
    assert result.backend == "torch"
    assert result.threads == 1
    assert [(b.batch_size, b.status) for b in result.batches] == [(1, "ok"), (4, "ok")]
