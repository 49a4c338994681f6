"""The model file of each bundle target, made from the source ONNX model.

- ``edge``: INT8 ONNX, through ``slipstream optimize``'s ``int8-dynamic`` pass and its
  accuracy gate (nothing is written when the gate fails);
- ``mobile``: the same INT8 model in ONNX Runtime's own format (``.ort``, read without
  protobuf parsing, the format ONNX Runtime Mobile loads), made by
  ``onnxruntime.tools.convert_onnx_models_to_ort``, with the reduced operator config (the
  operators and types the model uses) that a minimal ONNX Runtime build takes
  (``build.sh --minimal_build --include_ops_by_config``);
- ``openvino``: OpenVINO IR (``model.xml`` + ``model.bin``) converted from the FP32 ONNX
  model, weights stored as FP16 by default (OpenVINO computes in FP32 on CPUs).
"""

from __future__ import annotations

import contextlib
import io
import logging
import shutil
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from slipstream.optimize import OptimizeError, OptimizeRequest, PassSettings, optimize_model
from slipstream.optimize.gate import MetricName

logger = logging.getLogger(__name__)

Target = Literal["edge", "mobile", "openvino"]
TARGETS: tuple[Target, ...] = ("edge", "mobile", "openvino")
# The operator config of a mobile bundle, at the bundle's top level.
OPERATOR_CONFIG_NAME = "required_operators_and_types.config"
# Ops the int8 pass quantizes for edge and mobile bundles: the embedding tables (Gather)
# too, which hold half of a small transformer's weights (MiniLM: 47 of 90 MB).
EDGE_INT8_OP_TYPES = ("MatMul", "Gather")


class ExportError(ValueError):
    """The export cannot run as asked; the message names the option or file to fix."""


@dataclass(frozen=True, slots=True)
class TargetOptions:
    """How the target's model is made (the CLI's options)."""

    # Rows the gate judges (and, without `calibration`, the int8 search's rows).
    validation: Path
    calibration: Path | None = None
    metric: MetricName | None = None
    max_drop: float | None = None
    # The output the gate compares; default the first.
    output_name: str | None = None
    # Activation scales per run: a device answers one request at a time, and ONNX
    # Runtime fuses them into DynamicQuantizeMatMul (a server batching the bundle runs
    # its rows alone; see runtime.onnx).
    settings: PassSettings = field(
        default_factory=lambda: PassSettings(
            int8_op_types=EDGE_INT8_OP_TYPES, activation_scales="run"
        )
    )
    # mobile: the platform ONNX Runtime's converter optimizes for (arm: no x86-only
    # layouts, so the file runs on phones and on x86 alike).
    mobile_platform: Literal["arm", "amd64"] = "arm"
    # openvino: store the IR's weights as FP16 (half the size; computed in FP32).
    ir_fp16_weights: bool = True


@dataclass(frozen=True, slots=True)
class TargetModel:
    """The model a target made, in a scratch directory."""

    # The backend that serves it (config.yaml's backend:).
    backend: str
    # Files that go into the bundle's version directory (model.onnx, model.ort, or
    # model.xml and model.bin).
    model_files: list[Path]
    # Files that go to the bundle's top level (the mobile operator config).
    extra_files: list[Path]
    # optimize's pass records (empty for openvino).
    passes: list[dict[str, Any]]
    # Rows at the start of the validation data the int8 search judged candidates on;
    # the bundle's gate judges the rows after them.
    calibration_rows: int
    # Runtime name -> release that wrote the file.
    writers: dict[str, str]


def build_target(target: Target, source: Path, work: Path, options: TargetOptions) -> TargetModel:
    """Make ``target``'s model from the ONNX file ``source`` inside ``work``."""
    if target == "openvino":
        return _openvino_ir(source, work, options)
    int8 = _int8_onnx(source, work, options)
    if target == "edge":
        return int8
    return _ort_format(int8, work, options)


def _int8_onnx(source: Path, work: Path, options: TargetOptions) -> TargetModel:
    import onnxruntime

    request = OptimizeRequest(
        model=source,
        repository=work / "optimized",
        name="model",
        passes=["int8-dynamic"],
        validation=options.validation,
        calibration=options.calibration,
        metric=options.metric,
        max_drop=options.max_drop,
        output_name=options.output_name,
        settings=options.settings,
        measure_speed=False,
    )
    try:
        result = optimize_model(request)
    except OptimizeError as exc:
        raise ExportError(str(exc)) from None
    if not result.gate.passed or result.version_dir is None:
        raise ExportError(
            f"the INT8 model missed the accuracy gate, nothing was written: {result.gate.summary}"
            " (give more representative --calibration rows, or a larger --max-drop)"
        )
    calibration_rows = result.data.get("calibration_rows") or 0
    return TargetModel(
        backend="onnxruntime",
        model_files=[result.version_dir / "model.onnx"],
        extra_files=[],
        passes=[dict(record) for record in result.to_record()["passes"]],
        calibration_rows=0 if options.calibration is not None else int(calibration_rows),
        writers={"onnxruntime": str(onnxruntime.__version__)},
    )


def _ort_format(int8: TargetModel, work: Path, options: TargetOptions) -> TargetModel:
    from onnxruntime.tools.convert_onnx_models_to_ort import (
        OptimizationStyle,
        convert_onnx_models_to_ort,
    )

    # Its helpers log each file written at INFO on a logger of their own.
    logging.getLogger("ort_format_model.utils").setLevel(logging.WARNING)
    out = work / "ort"
    printed = io.StringIO()
    # The converter reports with print(); library code keeps stdout for its caller. Its
    # operator scan leaves the .ort file it read open for the collector (ResourceWarning).
    with contextlib.redirect_stdout(printed), warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        convert_onnx_models_to_ort(
            int8.model_files[0],
            output_dir=out,
            optimization_styles=[OptimizationStyle.Fixed],
            target_platform=options.mobile_platform,
            enable_type_reduction=True,
        )
    logger.debug("convert_onnx_models_to_ort: %s", printed.getvalue())
    model, config = out / "model.ort", out / f"model.{OPERATOR_CONFIG_NAME}"
    if not model.is_file() or not config.is_file():
        raise ExportError(f"ONNX Runtime's converter wrote no {model.name}: {printed.getvalue()}")
    renamed = config.with_name(OPERATOR_CONFIG_NAME)
    shutil.move(config, renamed)
    return TargetModel(
        backend="onnxruntime",
        model_files=[model],
        extra_files=[renamed],
        passes=[
            *int8.passes,
            {
                "name": "ort-format",
                "settings": {
                    "optimization_style": "Fixed",
                    "target_platform": options.mobile_platform,
                    "type_reduction": True,
                },
                "notes": [
                    f"{OPERATOR_CONFIG_NAME}: build a minimal ONNX Runtime with "
                    f"--minimal_build --include_ops_by_config {OPERATOR_CONFIG_NAME} "
                    "--enable_reduced_operator_type_support"
                ],
            },
        ],
        calibration_rows=int8.calibration_rows,
        writers=int8.writers,
    )


def _openvino_ir(source: Path, work: Path, options: TargetOptions) -> TargetModel:
    try:
        import openvino as ov
    except ImportError:
        raise ExportError(
            "--target openvino needs OpenVINO: pip install 'slipstream[openvino]'"
        ) from None
    xml = work / "ir" / "model.xml"
    xml.parent.mkdir(parents=True)
    try:
        model = ov.convert_model(str(source))
    except Exception as exc:  # OpenVINO's frontends raise their own exception types
        raise ExportError(f"{source}: OpenVINO cannot convert it: {exc}") from None
    ov.save_model(model, str(xml), compress_to_fp16=options.ir_fp16_weights)
    weights = "FP16" if options.ir_fp16_weights else "FP32"
    return TargetModel(
        backend="openvino",
        model_files=[xml, xml.with_suffix(".bin")],
        extra_files=[],
        passes=[
            {
                "name": "openvino-ir",
                "settings": {"compress_to_fp16": options.ir_fp16_weights},
                "notes": [f"weights stored as {weights}; OpenVINO's CPU plugin computes in FP32"],
            }
        ],
        calibration_rows=0,
        writers={"openvino": str(ov.get_version()).split("-")[0]},
    )


def size_bytes(paths: Sequence[Path]) -> int:
    return sum(path.stat().st_size for path in paths)
