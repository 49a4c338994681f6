"""``optimize_model`` end to end in-process: data formats, the accuracy gate's verdicts,
and what is (and is not) written into the repository."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from sklearn.datasets import load_digits
from sklearn.neural_network import MLPClassifier

from slipstream.optimize import OptimizeError, OptimizeRequest, load_dataset, optimize_model
from slipstream.optimize import passes as passes_module
from slipstream.optimize.data import DataError
from slipstream.optimize.gate import choose_metric, compare_outputs, judge


def build_digits_mlp(path: Path) -> tuple[Path, np.ndarray, np.ndarray]:
    """An MLP trained on digits, as ONNX: ``pixels`` FP32 [batch, 64] -> ``logits`` [batch, 10].

    Returns the model path and held-out (pixels, labels).
    """
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    classifier = MLPClassifier(hidden_layer_sizes=(128,), max_iter=400, random_state=0)
    classifier.fit(x[:1200], y[:1200])
    nodes, initializers, current = [], [], "pixels"
    for i, (weight, bias) in enumerate(zip(classifier.coefs_, classifier.intercepts_, strict=True)):
        initializers += [
            numpy_helper.from_array(weight.astype(np.float32), f"W{i}"),
            numpy_helper.from_array(bias.astype(np.float32), f"b{i}"),
        ]
        nodes += [
            helper.make_node("MatMul", [current, f"W{i}"], [f"m{i}"]),
            helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"]),
        ]
        current = f"a{i}"
        if i < len(classifier.coefs_) - 1:
            nodes.append(helper.make_node("Relu", [current], [f"r{i}"]))
            current = f"r{i}"
    nodes.append(helper.make_node("Identity", [current], ["logits"]))
    graph = helper.make_graph(
        nodes,
        "digits",
        [helper.make_tensor_value_info("pixels", TensorProto.FLOAT, ["batch", 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path, x[1200:], y[1200:]


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(repository with digits/1/model.onnx, labelled .npz, unlabelled .npz)."""
    root = tmp_path_factory.mktemp("digits")
    _, x, y = build_digits_mlp(root / "repo" / "digits" / "1" / "model.onnx")
    np.savez(root / "val.npz", pixels=x, labels=y)
    np.savez(root / "unlabelled.npz", pixels=x)
    return root / "repo", root / "val.npz", root / "unlabelled.npz"


def _request(repo: Path, validation: Path, **changes: Any) -> OptimizeRequest:
    fields: dict[str, Any] = {
        "model": repo / "digits" / "1" / "model.onnx",
        "repository": repo,
        "name": "digits",
        "passes": ["int8-dynamic"],
        "validation": validation,
        "measure_speed": False,
    }
    return OptimizeRequest(**(fields | changes))


def test_int8_on_a_digits_classifier_passes_the_top1_gate_and_is_written(
    digits: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    source_repo, validation, _ = digits
    repo = tmp_path / "repo"
    result = optimize_model(
        _request(
            source_repo,
            validation,
            repository=repo,
            passes=["int8-static", "graph"],
            measure_speed=True,
            batch_sizes=(1, 4),
            profile_seconds=0.05,
        )
    )

    assert result.gate.passed and result.gate.metric == "top1"
    assert result.gate.before["top1_percent"] > 90
    assert [record.name for record in result.passes] == ["graph", "int8-static"]
    assert result.version == 1 and result.version_dir == repo / "digits" / "1"
    assert onnx.load(str(repo / "digits" / "1" / "model.onnx")).graph.node
    assert "backend: onnxruntime" in (repo / "digits" / "config.yaml").read_text()
    record = json.loads((repo / "digits" / "1" / "optimization.json").read_text())
    assert record["passes"][1]["settings"]["calibration_method"] == "minmax"
    assert record["size_bytes_after"] < record["size_bytes_before"]
    assert [speed["batch_size"] for speed in record["speed_before"]] == [1, 4]
    assert record["speed_after"][0]["p50_ms"] > 0
    assert record["gate"]["after"]["top1_percent"] >= record["gate"]["limits"]["top1_percent"]
    assert set(record["tool_versions"]) == {"onnx", "onnxruntime", "slipstream"}
    assert record["data"]["calibration_rows"] == 128  # split off the validation rows
    assert record["data"]["validation_rows"] == len(np.load(validation)["labels"]) - 128
    assert any("p50 latency" in note for note in record["notes"])


def test_new_version_goes_after_the_newest_and_keeps_the_config(
    digits: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    source_repo, validation, _ = digits
    repo = tmp_path / "repo"
    shutil.copytree(source_repo, repo)
    config = repo / "digits" / "config.yaml"
    config.write_text("max_batch_size: 16\n")
    result = optimize_model(_request(repo, validation, model=repo / "digits"))

    assert result.source_model == str(repo / "digits" / "1" / "model.onnx")
    assert result.version == 2
    assert (repo / "digits" / "2" / "model.onnx").is_file()
    assert config.read_text() == "max_batch_size: 16\n"
    assert sorted(p.name for p in (repo / "digits").iterdir()) == ["1", "2", "config.yaml"]


def test_a_broken_optimization_fails_the_gate_and_writes_nothing(
    digits: tuple[Path, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source_repo, validation, _ = digits

    def zero_weights(source: Path, target: Path, context: Any) -> tuple[dict[str, Any], list[str]]:
        model = onnx.load(str(source))
        for init in model.graph.initializer:
            init.CopyFrom(
                numpy_helper.from_array(np.zeros_like(numpy_helper.to_array(init)), init.name)
            )
        onnx.save(model, str(target))
        return {}, []

    monkeypatch.setitem(passes_module._PASSES, "int8-dynamic", zero_weights)
    repo = tmp_path / "repo"
    result = optimize_model(_request(source_repo, validation, repository=repo))

    assert not result.gate.passed and result.version is None
    assert result.gate.shortfall > 50  # from ~97 % to ~10 %: tens of points short
    assert f"missed by {result.gate.shortfall:.4f}" in result.gate.summary
    assert not repo.exists()


def test_without_labels_a_classifier_is_gated_on_agreement(
    digits: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    source_repo, _, unlabelled = digits
    result = optimize_model(_request(source_repo, unlabelled, repository=tmp_path))

    assert result.gate.metric == "agreement" and result.gate.passed
    assert result.gate.after["agreement_percent"] >= 99.0


def test_an_impossible_limit_fails_the_gate(
    digits: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    source_repo, validation, _ = digits
    result = optimize_model(
        _request(source_repo, validation, repository=tmp_path, metric="maxae", max_drop=0.0)
    )

    assert not result.gate.passed and result.gate.metric == "maxae"
    assert not (tmp_path / "digits").exists()


def test_refused_pass_and_top1_without_labels_name_the_fix(
    digits: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    source_repo, validation, unlabelled = digits
    with pytest.raises(OptimizeError, match="prune needs a PyTorch model"):
        optimize_model(_request(source_repo, validation, passes=["prune"]))
    with pytest.raises(OptimizeError, match="--metric top1 needs labels"):
        optimize_model(_request(source_repo, unlabelled, repository=tmp_path, metric="top1"))


def test_data_formats_npy_directory_and_v2_json(tmp_path: Path) -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    (tmp_path / "npy").mkdir()
    np.save(tmp_path / "npy" / "x.npy", x)
    np.save(tmp_path / "npy" / "labels.npy", np.array([0, 1, 2]))
    from_npy = load_dataset(tmp_path / "npy", ["x"])
    assert from_npy.num_rows == 3 and from_npy.labels is not None

    request = {
        "inputs": [{"name": "x", "shape": [3, 4], "datatype": "FP32", "data": x.ravel().tolist()}]
    }
    (tmp_path / "req.json").write_text(json.dumps([request, request]))
    from_json = load_dataset(tmp_path / "req.json", ["x"])
    assert from_json.num_rows == 6 and from_json.labels is None
    np.testing.assert_array_equal(from_json.inputs["x"][3:], x)

    with pytest.raises(DataError, match="no array for model input"):
        load_dataset(tmp_path / "npy", ["y"])


def test_cosine_gate_for_embeddings() -> None:
    before = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    metric, reason = choose_metric(None, False, "sentence_embedding", before)
    assert metric == "cosine" and "embedding" in reason

    close = judge(
        "cosine", reason, "e", 8, 0.01, compare_outputs("cosine", 0.01, before, before * 1.1, None)
    )
    assert close.passed and close.after["min_cosine"] == pytest.approx(1.0)

    flipped = before.copy()
    flipped[0] *= -1
    far = judge(
        "cosine", reason, "e", 8, 0.01, compare_outputs("cosine", 0.01, before, flipped, None)
    )
    assert not far.passed and far.after["min_cosine"] == pytest.approx(-1.0)
    assert far.shortfall == pytest.approx(0.98 + 1.0)


def _sequence_model(path: Path) -> Path:
    """``x`` FP32 [batch, tokens, 8] -> MatMul -> ``y`` [batch, tokens, 4]: a dim beyond
    the batch dim is variable, as a transformer's sequence length is."""
    weight = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "sequence",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "tokens", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "tokens", 4])],
        [numpy_helper.from_array(weight, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def _sequence_request(tmp_path: Path, **changes: Any) -> OptimizeRequest:
    """int8-dynamic of :func:`_sequence_model` with its speed profile, 24 rows of 5 tokens."""
    source = _sequence_model(tmp_path / "repo" / "seq" / "1" / "model.onnx")
    rows = np.random.default_rng(1).standard_normal((24, 5, 8)).astype(np.float32)
    np.savez(tmp_path / "val.npz", x=rows)
    fields: dict[str, Any] = {
        "model": source, "repository": tmp_path / "repo", "name": "seq",
        "passes": ["int8-dynamic"], "validation": tmp_path / "val.npz", "metric": "mae",
        "max_drop": 1.0, "profile_seconds": 0.02,
    }  # fmt: skip
    return OptimizeRequest(**(fields | changes))


def test_variable_dims_are_profiled_on_the_validation_rows(tmp_path: Path) -> None:
    # Without --shape the speed profile takes the validation rows' dims (it raised
    # ProfileError after the gate passed, and the version was never written).
    result = optimize_model(_sequence_request(tmp_path))
    assert result.version == 2
    assert [s.batch_size for s in result.speed_after] == [1, 8]
    assert all(s.p50_ms is not None and s.p50_ms > 0 for s in result.speed_before)


def test_a_speed_profile_that_cannot_run_leaves_a_note_and_the_version(tmp_path: Path) -> None:
    # The last dim is declared 8.
    result = optimize_model(_sequence_request(tmp_path, shapes={"x": [5, 9]}))
    assert result.version == 2 and (tmp_path / "repo" / "seq" / "2" / "model.onnx").is_file()
    assert result.speed_after == []
    assert any(note.startswith("speed not measured: input 'x'") for note in result.notes)
    record = json.loads((tmp_path / "repo" / "seq" / "2" / "optimization.json").read_text())
    assert any("speed not measured" in note for note in record["notes"])
