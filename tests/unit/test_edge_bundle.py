"""Edge bundles: what `slipstream export` writes for each target, and how a bundle is checked."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from slipstream.cli import main
from slipstream.edge.export import ExportRequest, check_samples, export_bundle
from slipstream.edge.manifest import BundleError, read_manifest, sha256_of, verify_bundle
from slipstream.edge.targets import ExportError, TargetOptions
from tests.models import build_tiny_encoder, tiny_encoder_rows, write_config

pytest.importorskip("openvino")

TARGETS = ("edge", "mobile", "openvino")


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """REPO/encoder with a config, a tokenizer file beside it, and validation rows."""
    root = tmp_path_factory.mktemp("edge")
    build_tiny_encoder(root / "repo")
    write_config(
        root / "repo",
        "encoder",
        {
            "max_batch_size": 8,
            "tokenizer": "tokenizer/tokenizer.json",
            "version_policy": {"all": {}},
        },
    )
    (root / "repo" / "encoder" / "tokenizer").mkdir()
    (root / "repo" / "encoder" / "tokenizer" / "tokenizer.json").write_text("{}")
    np.savez(root / "val.npz", **tiny_encoder_rows(40))  # type: ignore[arg-type]
    return root


@pytest.fixture(scope="module")
def bundles(source: Path) -> dict[str, Path]:
    """One bundle per target, exported once for the module."""
    written = {}
    for target in TARGETS:
        result = export_bundle(
            ExportRequest(
                model_dir=source / "repo" / "encoder",
                target=target,  # type: ignore[arg-type]
                out=source / "bundles" / f"encoder_{target}",
                options=TargetOptions(validation=source / "val.npz"),
            )
        )
        assert result.gate.passed
        written[target] = result.bundle
    return written


@pytest.fixture
def copy_of(bundles: dict[str, Path], tmp_path: Path) -> Iterator[Path]:
    target = tmp_path / "encoder_mobile"
    shutil.copytree(bundles["mobile"], target)
    yield target


@pytest.mark.parametrize(
    ("target", "model_files", "backend"),
    [
        ("edge", ["1/model.onnx"], "onnxruntime"),
        ("mobile", ["1/model.ort", "required_operators_and_types.config"], "onnxruntime"),
        ("openvino", ["1/model.bin", "1/model.xml"], "openvino"),
    ],
)
def test_each_target_writes_a_repository_entry_with_its_manifest(
    bundles: dict[str, Path], target: str, model_files: list[str], backend: str
) -> None:
    bundle = bundles[target]
    manifest = read_manifest(bundle)
    listed = {entry.path: entry for entry in manifest.files}
    assert set(listed) == {
        *model_files,
        "config.yaml",
        "sample_inputs.npz",
        "sample_outputs.npz",
        "tokenizer/tokenizer.json",
    }
    for path, entry in listed.items():
        assert entry.size_bytes == (bundle / path).stat().st_size
        assert entry.sha256 == sha256_of(bundle / path)
    assert (manifest.name, manifest.version, manifest.target) == ("encoder", 1, target)
    assert manifest.backend == backend and backend in manifest.minimum_runtime_versions
    assert manifest.gate["passed"] and manifest.gate["metric"] == "cosine"
    assert manifest.gate["after"]["min_cosine"] >= 0.98
    model_bytes = sum(listed[p].size_bytes for p in model_files if p.startswith("1/"))
    assert manifest.size["model_bytes"] == model_bytes
    config = yaml.safe_load((bundle / "config.yaml").read_text())
    # The source's settings, its own backend, no version policy (one version is shipped).
    assert config == {
        "backend": backend,
        "max_batch_size": 8,
        "tokenizer": "tokenizer/tokenizer.json",
    }
    # The shipped outputs are what the bundle's model answers here for the samples.
    assert check_samples(bundle) == []
    assert verify_bundle(bundle).unlisted == []


def test_int8_bundles_are_quantized_and_the_mobile_one_lists_its_operators(
    bundles: dict[str, Path],
) -> None:
    edge = read_manifest(bundles["edge"])
    assert [p["name"] for p in edge.source["passes"]] == ["int8-dynamic"]
    assert edge.source["passes"][0]["settings"]["op_types"] == ["MatMul", "Gather"]
    mobile = read_manifest(bundles["mobile"])
    assert [p["name"] for p in mobile.source["passes"]] == ["int8-dynamic", "ort-format"]
    operators = (bundles["mobile"] / "required_operators_and_types.config").read_text()
    assert "DynamicQuantizeMatMul" in operators and "Gather" in operators
    # The ORT-format file starts with its FlatBuffers identifier, not ONNX's protobuf.
    assert (bundles["mobile"] / "1" / "model.ort").read_bytes()[4:8] == b"ORTM"


def test_verify_names_a_changed_a_truncated_and_a_missing_file(copy_of: Path) -> None:
    model = copy_of / "1" / "model.ort"
    data = bytearray(model.read_bytes())
    data[-1] ^= 0xFF
    model.write_bytes(bytes(data))
    (copy_of / "sample_inputs.npz").write_bytes(b"short")
    (copy_of / "sample_outputs.npz").unlink()
    (copy_of / "notes.txt").write_text("added after export")
    with pytest.raises(BundleError) as raised:
        verify_bundle(copy_of)
    message = str(raised.value)
    assert "1/model.ort: sha256 " in message and "(the file was changed)" in message
    assert "sample_inputs.npz: 5 bytes, the manifest says" in message
    assert "sample_outputs.npz: missing" in message
    assert "notes.txt" not in message


def test_an_extra_file_is_reported_and_a_bad_manifest_refused(copy_of: Path) -> None:
    (copy_of / "notes.txt").write_text("added after export")
    assert verify_bundle(copy_of).unlisted == ["notes.txt"]
    manifest = json.loads((copy_of / "manifest.json").read_text())
    manifest["files"][0]["path"] = "../../etc/passwd"
    (copy_of / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        BundleError, match=r"\.\./\.\./etc/passwd: the manifest names a file outside"
    ):
        verify_bundle(copy_of)
    (copy_of / "manifest.json").write_text("{not json")
    with pytest.raises(BundleError, match=r"manifest\.json: not a valid manifest"):
        verify_bundle(copy_of)
    (copy_of / "manifest.json").unlink()
    with pytest.raises(BundleError, match=r"manifest\.json: missing"):
        verify_bundle(copy_of)


def test_a_bundle_that_misses_the_gate_is_not_written(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "never"
    request = ExportRequest(
        model_dir=source / "repo" / "encoder",
        target="openvino",
        out=out,
        # FP16 weights move outputs by ~1e-4: more than an absolute error of 0 allows.
        options=TargetOptions(validation=source / "val.npz", metric="maxae", max_drop=0.0),
    )
    with pytest.raises(ExportError, match=r"missed the accuracy gate: accuracy gate \(maxae\)"):
        export_bundle(request)
    assert list(tmp_path.iterdir()) == []


def test_bad_requests_name_the_fix(
    source: Path, bundles: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = TargetOptions(validation=source / "val.npz")

    def export(model_dir: Path, out: Path, target: str = "edge") -> None:
        export_bundle(ExportRequest(model_dir, target, out, options))  # type: ignore[arg-type]

    with pytest.raises(ExportError, match=r"MODEL_DIR .*missing: not a directory"):
        export(tmp_path / "missing", tmp_path / "out")
    with pytest.raises(ExportError, match="already exists; remove it or pass --overwrite"):
        export(source / "repo" / "encoder", bundles["edge"])
    with pytest.raises(ExportError, match="export reads ONNX models"):
        export(bundles["openvino"], tmp_path / "out")
    monkeypatch.setitem(sys.modules, "openvino", None)
    with pytest.raises(ExportError, match=r"pip install 'slipstream\[openvino\]'"):
        export(source / "repo" / "encoder", tmp_path / "out", "openvino")


def test_the_cli_exports_and_verifies(
    source: Path, bundles: dict[str, Path], tmp_path: Path
) -> None:
    runner = CliRunner()
    out = tmp_path / "encoder"
    args = ["export", "--target", "edge", str(source / "repo" / "encoder"), "-o", str(out)]
    built = runner.invoke(main, [*args, "--validation", str(source / "val.npz")])
    assert built.exit_code == 0, built.output
    assert f"wrote {out}: edge bundle of encoder version 1 (backend onnxruntime)" in built.output
    assert "accuracy gate (cosine) passed" in built.output
    checked = runner.invoke(main, ["export", "verify", str(out), "--run"])
    assert checked.exit_code == 0, checked.output
    assert "the 4 sample rows give the shipped outputs" in checked.output
    (out / "config.yaml").write_text("backend: onnxruntime\n")
    broken = runner.invoke(main, ["export", "verify", str(out)])
    assert broken.exit_code == 1 and "config.yaml: " in broken.output
    unknown = runner.invoke(
        main, [*args, "--validation", str(source / "val.npz"), "--target", "tpu"]
    )
    assert unknown.exit_code == 2 and "'tpu' is not one of 'edge', 'mobile', 'openvino'" in (
        unknown.output
    )
