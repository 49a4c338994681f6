"""optimize's options checked before the work and errors that name the option given:
``--max-drop`` out of its metric's range, rows the model cannot run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from slipstream.cli import main
from slipstream.edge.export import ExportRequest, export_bundle
from slipstream.edge.targets import ExportError, Target, TargetOptions
from slipstream.optimize import OptimizeError, OptimizeRequest, optimize_model
from tests.models import write_graph


def _embedder(repo: Path) -> Path:
    """REPO/m/1/model.onnx: ``x`` FP32 [N, 16] -> MatMul -> ``embedding`` [N, 8] (its gate
    metric is cosine)."""
    weight = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["embedding"], name="matmul")],
        "embedder",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["N", 8])],
        [numpy_helper.from_array(weight, "W")],
    )
    return write_graph(graph, repo, "m")


@pytest.fixture
def source(tmp_path: Path) -> Path:
    rng = np.random.default_rng(1)
    np.savez(tmp_path / "val.npz", x=rng.random((64, 16), np.float32))
    np.savez(tmp_path / "narrow.npz", x=rng.random((64, 10), np.float32))
    return _embedder(tmp_path / "repo")


def _request(tmp_path: Path, **changes: Any) -> OptimizeRequest:
    fields: dict[str, Any] = {
        "model": tmp_path / "repo" / "m", "repository": tmp_path / "repo", "name": "m",
        "passes": ["int8-dynamic"], "validation": tmp_path / "val.npz", "measure_speed": False,
    }  # fmt: skip
    return OptimizeRequest(**(fields | changes))


@pytest.mark.parametrize(
    ("metric", "max_drop", "message"),
    [
        (None, -1.0, "--max-drop -1: expected a number >= 0"),
        ("mae", float("nan"), "--max-drop nan: expected a number >= 0"),
        ("cosine", 1.5, r"--max-drop 1.5: the cosine gate takes 0 to 1 \(1 - cosine"),
        (None, 2.0, "--max-drop 2: the cosine gate takes 0 to 1"),  # cosine, chosen
        ("agreement", 101.0, "--max-drop 101: the agreement gate takes 0 to 100"),
    ],
)
def test_a_max_drop_out_of_range_is_refused_naming_the_option(
    source: Path, tmp_path: Path, metric: str | None, max_drop: float, message: str
) -> None:
    # --max-drop -1 was accepted and the gate printed "mean_cosine 0.9999 (>= 2.0000
    # required)".
    with pytest.raises(OptimizeError, match=message):
        optimize_model(_request(tmp_path, metric=metric, max_drop=max_drop))
    assert not (tmp_path / "repo" / "m" / "2").exists()


def test_a_max_drop_in_range_is_taken(source: Path, tmp_path: Path) -> None:
    from slipstream.optimize.gate import check_max_drop

    assert check_max_drop("mae", 1e6) == 1e6 and check_max_drop("top1", 100.0) == 100.0
    result = optimize_model(_request(tmp_path, max_drop=1.0))  # cosine's largest
    assert result.gate.metric == "cosine" and result.gate.limits["mean_cosine"] == 0.0


def test_the_cli_refuses_a_negative_max_drop_before_any_work(source: Path, tmp_path: Path) -> None:
    args = [
        "optimize", "--model", str(tmp_path / "repo" / "m"), "--repository",
        str(tmp_path / "repo"), "--name", "m", "--passes", "int8-dynamic",
        "--validation", str(tmp_path / "val.npz"), "--max-drop", "-1",
    ]  # fmt: skip
    outcome = CliRunner().invoke(main, args)
    assert outcome.exit_code == 2, outcome.output
    assert "Error: --max-drop -1: expected a number >= 0" in outcome.output
    assert "required)" not in outcome.output


@pytest.mark.parametrize("target", ["edge", "openvino"])
def test_export_refuses_a_max_drop_out_of_range(
    source: Path, tmp_path: Path, target: Target
) -> None:
    if target == "openvino":
        pytest.importorskip("openvino")
    with pytest.raises(ExportError, match=r"--max-drop -0.5: expected a number >= 0"):
        export_bundle(
            ExportRequest(
                model_dir=tmp_path / "repo" / "m", target=target, out=tmp_path / "bundle",
                options=TargetOptions(validation=tmp_path / "val.npz", max_drop=-0.5),
            )
        )  # fmt: skip
    assert not (tmp_path / "bundle").exists()


def test_rows_the_model_cannot_run_name_the_option_they_came_from(
    source: Path, tmp_path: Path
) -> None:
    # Without --calibration the int8 search's rows are split off --validation; the error
    # named --calibration, an option the user had not given.
    narrow = tmp_path / "narrow.npz"
    with pytest.raises(OptimizeError, match=r"^--validation: the original model cannot run it"):
        optimize_model(_request(tmp_path, validation=narrow))
    with pytest.raises(OptimizeError, match=r"^--calibration: the original model cannot run it"):
        optimize_model(_request(tmp_path, calibration=narrow))
