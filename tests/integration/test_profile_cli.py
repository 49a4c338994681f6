"""``slipstream profile`` from the command line, on small ONNX models built here."""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from slipstream.profile.cli import profile
from tests.utils import slipstream_command


def build_mlp(path: Path) -> Path:
    """A repository entry ``REPO/mlp/1/model.onnx``: x FP32 [batch, 32] -> MatMul -> Relu."""
    weights = np.random.default_rng(0).standard_normal((32, 16)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["h"], name="fc"),
            helper.make_node("Relu", ["h"], ["y"], name="relu"),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])],
        [numpy_helper.from_array(weights, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True)
    onnx.save(model, str(path))
    return path


def build_sequence(path: Path) -> Path:
    """tokens INT64 [batch, seq] -> Cast -> y FP32 [batch, seq]: needs --shape."""
    graph = helper.make_graph(
        [helper.make_node("Cast", ["tokens"], ["y"], to=TensorProto.FLOAT)],
        "sequence",
        [helper.make_tensor_value_info("tokens", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def mlp_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_mlp(tmp_path_factory.mktemp("repo") / "mlp" / "1" / "model.onnx")


def test_profile_writes_the_table_and_every_report(mlp_path: Path, tmp_path: Path) -> None:
    outputs = {
        "json": tmp_path / "p.json",
        "csv": tmp_path / "p.csv",
        "report": tmp_path / "p.html",
    }
    args = [str(mlp_path), "--seconds", "0.2", "--batch-sizes", "1,4", "--top-ops", "3"]
    for option, path in outputs.items():
        args += [f"--{option}", str(path)]
    result = CliRunner().invoke(profile, args)
    assert result.exit_code == 0, result.output
    assert "1 intra-op thread: figures are per core" in result.stdout
    assert "<- best" in result.stdout
    assert "MatMul" in result.stdout  # the top-operators table
    assert "peak RSS" in result.stdout
    data = json.loads(outputs["json"].read_text())
    assert data["best_batch_size"] in (1, 4)
    assert data["threads"] == 1
    with outputs["csv"].open(newline="") as rows:
        assert [row["batch_size"] for row in csv.DictReader(rows)] == ["1", "4"]
    assert outputs["report"].read_text().count("data:image/png;base64,") == 3


def test_a_repository_model_directory_profiles_its_newest_version(mlp_path: Path) -> None:
    model_dir = mlp_path.parent.parent
    result = CliRunner().invoke(
        profile, [str(model_dir), "--seconds", "0.05", "--batch-sizes", "2", "--no-op-profile"]
    )
    assert result.exit_code == 0, result.output
    assert "mlp/1/model.onnx" in result.stdout
    assert "Top operators" not in result.stdout


def test_shape_option_and_its_absence(tmp_path: Path) -> None:
    path = build_sequence(tmp_path / "seq.onnx")
    common = [str(path), "--seconds", "0.05", "--batch-sizes", "1,2", "--no-op-profile"]
    missing = CliRunner().invoke(profile, common)
    assert missing.exit_code == 1
    assert "--shape tokens:128" in missing.output
    result = CliRunner().invoke(profile, [*common, "--shape", "tokens:64"])
    assert result.exit_code == 0, result.output
    assert "tokens INT64 [-1, 64]: random integers in [0, 1000)" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--batch-sizes", "0,2"], "expected positive integers"),
        (["--shape", "x"], "expected NAME:D1,D2"),
        (["--report", "out.pdf"], "expected a .html or .png"),
    ],
)
def test_bad_options_are_refused_before_profiling(
    mlp_path: Path, args: list[str], message: str
) -> None:
    result = CliRunner().invoke(profile, [str(mlp_path), *args])
    assert result.exit_code == 2
    assert message in result.output


def test_the_slipstream_command_runs_profile(mlp_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    options = ["--seconds", "0.1", "--batch-sizes", "1,8", "--json", str(out)]
    completed = subprocess.run(
        [*slipstream_command(), "profile", str(mlp_path), *options],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert "wrote" in completed.stderr
    assert json.loads(out.read_text())["op_profile"]["top_ops"]
