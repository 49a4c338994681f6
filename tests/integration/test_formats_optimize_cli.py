"""``slipstream optimize`` asked for a precision pass on a model that already has one (its
newest version int8): a usage error that names the FP32 version to start from, not a
traceback from the converter."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from click.testing import CliRunner
from onnxruntime.quantization import QuantType, quantize_dynamic

from slipstream.cli import main
from tests.integration.test_optimize_cli import build_digits_linear


def test_formats_fp16_of_an_int8_newest_version_is_a_usage_error_naming_the_fp32_one(
    tmp_path: Path,
) -> None:
    repo = tmp_path / "models"
    x, y = build_digits_linear(repo)
    np.savez(tmp_path / "val.npz", pixels=x, labels=y)
    fp32 = repo / "digits" / "1" / "model.onnx"
    (repo / "digits" / "2").mkdir()
    int8 = repo / "digits" / "2" / "model.onnx"
    quantize_dynamic(fp32, int8, op_types_to_quantize=["MatMul"], weight_type=QuantType.QInt8)

    args = [
        "optimize", "--model", str(repo / "digits"), "--repository", str(repo),
        "--name", "digits", "--passes", "fp16", "--validation", str(tmp_path / "val.npz"),
    ]  # fmt: skip
    outcome = CliRunner().invoke(main, args)

    assert outcome.exit_code == 2, outcome.output  # click's usage error, no traceback
    assert isinstance(outcome.exception, SystemExit)
    assert f"--passes fp16: {int8} is already int8" in " ".join(outcome.output.split())
    assert f"--model {fp32}" in " ".join(outcome.output.split())
    assert sorted(p.name for p in (repo / "digits").iterdir()) == ["1", "2"]
