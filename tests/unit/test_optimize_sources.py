"""What optimize and export do to and with the source model: an ONNX-ML model is refused
with a message, a read-only repository is only read, and the version (or bundle)
directories they write can be read by a server running as another user."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from slipstream.cli import main
from slipstream.edge.export import ExportRequest, ExportResult, export_bundle
from slipstream.edge.targets import ExportError, TargetOptions
from slipstream.optimize import OptimizeError, OptimizeRequest, PassSettings, optimize_model
from tests.models import build_tiny_encoder, tiny_encoder_rows

# skl2onnx's opset list when given target_opset={"": 17, "ai.onnx.ml": 3}: the standard
# set twice, which ONNX Runtime's quantizers refuse ("Failed to find proper ai.onnx domain").
_SKL2ONNX_OPSETS = [("ai.onnx.ml", 1), ("", 17), ("", 17)]


def _save(path: Path, graph: onnx.GraphProto, opsets: list[tuple[str, int]]) -> Path:
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid(domain, version) for domain, version in opsets]
    )
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def _onnx_ml_classifier(path: Path) -> Path:
    """A scikit-learn pipeline as skl2onnx writes it: Scaler -> LinearClassifier, every
    operator of ai.onnx.ml; ``input`` FP32 [N, 4] -> ``label`` INT64, ``probabilities``."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node(
            "Scaler", ["input"], ["scaled"], domain="ai.onnx.ml",
            offset=[0.5] * 4, scale=[2.0] * 4,
        ),
        helper.make_node(
            "LinearClassifier", ["scaled"], ["label", "probabilities"], domain="ai.onnx.ml",
            classlabels_ints=[0, 1, 2], coefficients=rng.standard_normal(12).tolist(),
            intercepts=[0.0, 0.1, -0.1], post_transform="SOFTMAX",
        ),
    ]  # fmt: skip
    graph = helper.make_graph(
        nodes,
        "pipeline",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 4])],
        [
            helper.make_tensor_value_info("label", TensorProto.INT64, ["N"]),
            helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["N", 3]),
        ],
    )
    return _save(path, graph, _SKL2ONNX_OPSETS)


def _matmul_model(path: Path, opsets: list[tuple[str, int]] | None = None) -> Path:
    """``x`` FP32 [N, 16] -> MatMul -> Relu -> MatMul -> ``y`` [N, 8]."""
    rng = np.random.default_rng(1)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W0"], ["h"], name="matmul0"),
            helper.make_node("Relu", ["h"], ["r"]),
            helper.make_node("MatMul", ["r", "W1"], ["y"], name="matmul1"),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])],
        [
            numpy_helper.from_array(rng.standard_normal((16, 32)).astype(np.float32), "W0"),
            numpy_helper.from_array(rng.standard_normal((32, 8)).astype(np.float32), "W1"),
        ],
    )
    return _save(path, graph, opsets or [("", 17)])


def _request(tmp_path: Path, model: Path, passes: list[str], **changes: Any) -> OptimizeRequest:
    fields: dict[str, Any] = {
        "model": model, "repository": tmp_path / "repo", "name": "m", "passes": passes,
        "validation": tmp_path / "val.npz", "metric": "mae", "max_drop": 1.0,
        "measure_speed": False,
    }  # fmt: skip
    return OptimizeRequest(**(fields | changes))


@pytest.fixture
def onnx_ml(tmp_path: Path) -> Path:
    """REPO/m/1/model.onnx in ai.onnx.ml operators only, and val.npz for it."""
    rows = np.random.default_rng(2).random((64, 4), dtype=np.float32)
    np.savez(tmp_path / "val.npz", input=rows)
    return _onnx_ml_classifier(tmp_path / "repo" / "m" / "1" / "model.onnx")


@pytest.mark.parametrize(
    ("passes", "search"),
    [
        (["graph", "int8-dynamic"], True),
        (["int8-dynamic"], True),
        (["int8-dynamic"], False),
        (["int8-static"], True),
    ],
)
def test_an_onnx_ml_model_is_refused_by_the_int8_passes_with_why(
    onnx_ml: Path, tmp_path: Path, passes: list[str], search: bool
) -> None:
    # ONNX Runtime's quantizer raised "Failed to find proper ai.onnx domain" from deep in
    # its own code, which the CLI printed as a traceback.
    settings = PassSettings(int8_search=search)
    with pytest.raises(OptimizeError) as refused:
        optimize_model(_request(tmp_path, onnx_ml, passes, settings=settings))
    message = str(refused.value)
    assert message.startswith(f"{passes[-1]}: the int8 passes quantize standard ONNX (ai.onnx)")
    assert "LinearClassifier, Scaler" in message and "ai.onnx.ml" in message
    assert not (tmp_path / "repo" / "m" / "2").exists()


def test_the_cli_refuses_an_onnx_ml_model_without_a_traceback(
    onnx_ml: Path, tmp_path: Path
) -> None:
    args = [
        "optimize", "--model", str(tmp_path / "repo" / "m"), "--repository",
        str(tmp_path / "repo"), "--name", "m", "--passes", "graph,int8-dynamic",
        "--validation", str(tmp_path / "val.npz"),
    ]  # fmt: skip
    outcome = CliRunner().invoke(main, args)
    assert outcome.exit_code == 2 and isinstance(outcome.exception, SystemExit)
    assert "Error: int8-dynamic: the int8 passes quantize standard ONNX" in outcome.output


def test_export_refuses_an_onnx_ml_model_without_a_traceback(onnx_ml: Path, tmp_path: Path) -> None:
    out = tmp_path / "bundles" / "m"
    with pytest.raises(ExportError, match=r"standard ONNX \(ai.onnx\) operators"):
        export_bundle(
            ExportRequest(
                model_dir=tmp_path / "repo" / "m", target="edge", out=out,
                options=TargetOptions(validation=tmp_path / "val.npz"),
            )
        )  # fmt: skip
    args = ["export", "--target", "mobile", str(tmp_path / "repo" / "m"), "-o", str(out)]
    outcome = CliRunner().invoke(main, [*args, "--validation", str(tmp_path / "val.npz")])
    assert outcome.exit_code == 1 and isinstance(outcome.exception, SystemExit)
    assert "the int8 passes quantize standard ONNX" in outcome.output
    assert not out.exists()


def test_a_standard_opset_imported_twice_is_quantized(tmp_path: Path) -> None:
    source = _matmul_model(tmp_path / "repo" / "m" / "1" / "model.onnx", _SKL2ONNX_OPSETS)
    np.savez(tmp_path / "val.npz", x=np.random.default_rng(3).random((32, 16), np.float32))
    result = optimize_model(_request(tmp_path, source, ["int8-dynamic"], max_drop=5.0))
    assert result.version == 2
    written = onnx.load(str(tmp_path / "repo" / "m" / "2" / "model.onnx"))
    assert "MatMulInteger" in {node.op_type for node in written.graph.node}


@pytest.fixture
def read_only_source(tmp_path: Path) -> Iterator[Path]:
    """REPO/m/1/ (a MatMul model) with mode 0o555, as a read-only mount shows it.

    Tests run as root here, whom the mode does not stop: the tests also check that the
    directory's listing and mtime (which a file made and deleted in it moves) stay as
    they were. As any other user the mode alone makes the old code fail."""
    version_dir = tmp_path / "repo" / "m" / "1"
    _matmul_model(version_dir / "model.onnx")
    np.savez(tmp_path / "val.npz", x=np.random.default_rng(4).random((64, 16), np.float32))
    version_dir.chmod(0o555)
    try:
        yield version_dir
    finally:
        version_dir.chmod(0o755)


def _untouched(version_dir: Path) -> tuple[list[str], int]:
    return sorted(os.listdir(version_dir)), version_dir.stat().st_mtime_ns


@pytest.mark.parametrize(
    ("passes", "search"),
    [(["int8-dynamic"], True), (["int8-dynamic"], False), (["int8-static"], True)],
)
def test_the_int8_passes_write_nothing_beside_a_read_only_source(
    read_only_source: Path, tmp_path: Path, passes: list[str], search: bool
) -> None:
    # ONNX Runtime's quantizers wrote model-inferred.onnx beside their input: 90 MB beside
    # MiniLM's repository file, a FileNotFoundError where the repository is read-only.
    before = _untouched(read_only_source)
    settings = PassSettings(int8_search=search)
    request = _request(
        tmp_path, read_only_source / "model.onnx", passes, settings=settings, max_drop=5.0
    )
    result = optimize_model(request)
    assert result.version == 2 and (tmp_path / "repo" / "m" / "2" / "model.onnx").is_file()
    assert _untouched(read_only_source) == before


def test_export_writes_nothing_beside_a_read_only_source(tmp_path: Path) -> None:
    build_tiny_encoder(tmp_path / "repo")
    np.savez(tmp_path / "val.npz", **tiny_encoder_rows(40))  # type: ignore[arg-type]
    version_dir = tmp_path / "repo" / "encoder" / "1"
    version_dir.chmod(0o555)
    try:
        before = _untouched(version_dir)
        result = _export_encoder(tmp_path)
        assert result.gate.passed
        assert _untouched(version_dir) == before
    finally:
        version_dir.chmod(0o755)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_version_directory_has_the_mode_mkdir_gives(tmp_path: Path, umask: int) -> None:
    # It was tempfile.mkdtemp's 0o700, renamed into place: a server running as another
    # user could not read the new version.
    source = _matmul_model(tmp_path / "repo" / "m" / "1" / "model.onnx")
    np.savez(tmp_path / "val.npz", x=np.random.default_rng(5).random((32, 16), np.float32))
    result = optimize_model(_request(tmp_path, source, ["graph"]))
    assert result.version_dir == tmp_path / "repo" / "m" / "2"
    assert _mode(result.version_dir) == 0o777 & ~umask


def test_a_bundle_directory_has_the_mode_mkdir_gives(tmp_path: Path, umask: int) -> None:
    build_tiny_encoder(tmp_path / "repo")
    np.savez(tmp_path / "val.npz", **tiny_encoder_rows(40))  # type: ignore[arg-type]
    result = _export_encoder(tmp_path)
    assert _mode(result.bundle) == 0o777 & ~umask
    assert _mode(result.bundle / "1") == 0o777 & ~umask


def _export_encoder(tmp_path: Path) -> ExportResult:
    """The edge bundle of tmp_path/repo/encoder, gated on tmp_path/val.npz."""
    return export_bundle(
        ExportRequest(
            model_dir=tmp_path / "repo" / "encoder", target="edge",
            out=tmp_path / "bundles" / "encoder",
            options=TargetOptions(validation=tmp_path / "val.npz"),
        )
    )  # fmt: skip
