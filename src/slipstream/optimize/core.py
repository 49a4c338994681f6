"""``optimize_model``: transform a model, gate it on accuracy, write it as a new version.

Example::

    from slipstream.optimize import OptimizeRequest, optimize_model

    result = optimize_model(OptimizeRequest(
        model=Path("models/mlp/1/model.onnx"),
        repository=Path("models"),
        name="mlp",
        passes=["graph", "int8-dynamic"],
        validation=Path("digits_val.npz"),
    ))
    print(result.gate.summary, result.version_dir)

PyTorch models (a whole module saved with ``torch.save(module, "model.pt")``) take the
``prune`` or ``distill`` pass first; see ``optimize.torch_passes``::

    optimize_model(OptimizeRequest(
        model=Path("teacher.pt"), repository=Path("models"), name="digits",
        passes=["distill"], validation=Path("val.npz"), train=Path("train.npz"),
        settings=PassSettings(student="mlp-small", epochs=30),
    ))

Nothing is written unless the optimized model passes the gate; then
``REPO/NAME/<next>/model.onnx`` and ``optimization.json`` are written (and
``REPO/NAME/config.yaml`` when the model has none), the version directory appearing
whole or not at all.
"""

from __future__ import annotations

import json
import secrets
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slipstream.optimize.data import LABELS_NAME, Dataset, array_names, load_dataset
from slipstream.optimize.gate import (
    DEFAULT_MAX_DROP,
    CalibrationJudge,
    GateResult,
    MetricName,
    check_max_drop,
    choose_metric,
    compare_outputs,
    judge,
    run_model,
)
from slipstream.optimize.passes import (
    PRECISION_PASSES,
    PYTORCH_PASSES,
    PassContext,
    PassError,
    PassRecord,
    PassSettings,
    order_passes,
    run_pass,
)
from slipstream.repository.layout import read_model_directory

if TYPE_CHECKING:
    from slipstream.optimize.torch_passes import TorchPassOutput

__all__ = [
    "OptimizationResult",
    "OptimizeError",
    "OptimizeRequest",
    "SpeedResult",
    "optimize_model",
    "resolve_source",
]

ProgressCallback = Callable[[str, int, int], None]
# Calibration rows taken from the validation data when no --calibration is given;
# never more than half of it, so the gate still judges rows the quantizer did not see.
DEFAULT_CALIBRATION_ROWS = 128
RECORD_NAME = "optimization.json"
# Operators of a quantized ONNX model (besides QLinear*): what the int8 passes write.
_INT8_OPS = frozenset(
    {
        "DynamicQuantizeLinear",
        "QuantizeLinear",
        "DequantizeLinear",
        "MatMulInteger",
        "ConvInteger",
        "DynamicQuantizeMatMul",
        "MatMulIntegerToFloat",
        "QGemm",
        "QAttention",
    }
)


class OptimizeError(ValueError):
    """The optimization cannot run as asked; the message names the option that fixes it."""


@dataclass(frozen=True, slots=True)
class OptimizeRequest:
    """Everything ``optimize_model`` needs; the CLI options map one to one."""

    # An ONNX file, REPO/NAME (its newest version's model.onnx), or for prune / distill
    # a PyTorch whole module saved with torch.save(module, "model.pt").
    model: Path
    # The model repository the new version is written into.
    repository: Path
    # The model's directory name in the repository.
    name: str
    # Pass names, in any order (see optimize.passes.PASS_ORDER).
    passes: Sequence[str]
    # Rows the gate compares the two models on (.npz, .npy directory or V2 JSON).
    validation: Path
    # Rows for int8-static calibration; default: a split of the validation rows.
    calibration: Path | None = None
    # Labelled rows prune fine-tunes on and distill trains the student on.
    train: Path | None = None
    # Gate metric; default chosen from the data and the output (see optimize.gate).
    metric: MetricName | None = None
    # Largest accepted drop; default per metric (see optimize.gate.DEFAULT_MAX_DROP).
    max_drop: float | None = None
    # The model output the gate compares; default its first output.
    output_name: str | None = None
    settings: PassSettings = field(default_factory=PassSettings)
    # Batch sizes the speed profile measures, before and after.
    batch_sizes: Sequence[int] = (1, 8)
    # Dims after the batch dim for variable-dim inputs, as for ``slipstream profile``.
    shapes: Mapping[str, Sequence[int]] | None = None
    # Seconds of timed runs per batch size in the speed profile.
    profile_seconds: float = 0.3
    # Skip the speed profile (the tuner measures speed itself).
    measure_speed: bool = True


@dataclass(frozen=True, slots=True)
class SpeedResult:
    """One batch size's speed with one model file (one intra-op thread)."""

    batch_size: int
    p50_ms: float | None
    p99_ms: float | None
    throughput_infer_per_s: float | None


@dataclass(frozen=True, slots=True)
class OptimizationResult:
    """What ``optimize_model`` did; ``to_record()`` is the optimization.json content."""

    source_model: str
    passes: list[PassRecord]
    gate: GateResult
    size_bytes_before: int
    size_bytes_after: int
    # Empty when measure_speed was off or the gate failed.
    speed_before: list[SpeedResult]
    speed_after: list[SpeedResult]
    tool_versions: dict[str, str]
    # How the validation / calibration rows were chosen.
    data: dict[str, Any]
    notes: list[str]
    # The version written, or None when the gate failed and nothing was written.
    version: int | None = None
    version_dir: Path | None = None

    def to_record(self) -> dict[str, Any]:
        record = asdict(self)
        record["version_dir"] = None if self.version_dir is None else str(self.version_dir)
        return record


def resolve_source(model: Path) -> Path:
    """An ONNX file as given, or a model directory's newest version's model.onnx."""
    if model.is_file():
        return model
    if model.is_dir():
        versions = [
            v
            for v in read_model_directory(model).versions
            if (model / str(v) / "model.onnx").is_file()
        ]
        if versions:
            return model / str(versions[-1]) / "model.onnx"
        raise OptimizeError(f"--model: {model} has no version directory with a model.onnx")
    raise OptimizeError(f"--model: {model} does not exist")


def optimize_model(
    request: OptimizeRequest, on_progress: ProgressCallback | None = None
) -> OptimizationResult:
    """Run the passes, gate the result, and write it as a new version if it passes."""
    source = resolve_source(request.model)
    try:
        names = order_passes(list(request.passes))
    except ValueError as exc:
        raise OptimizeError(str(exc)) from None
    torch_pass = names[0] if names[0] in PYTORCH_PASSES else None
    _check_source(source, torch_pass)
    if torch_pass is None:
        _check_precision(source, names)
    if request.max_drop is not None:
        # Before any work; the metric's own range once the metric is known (_metric).
        _check_max_drop(request.metric, request.max_drop)
    with tempfile.TemporaryDirectory(prefix="slipstream-optimize-") as scratch:
        work = Path(scratch)
        reference, current, records, versions = source, source, [], _tool_versions()
        if torch_pass is not None:
            output = _run_torch_pass(request, torch_pass, source, work, on_progress)
            reference, current = output.reference, output.optimized
            records, names = [output.record], names[1:]
            versions.update(output.tool_versions)
        validation, calibration, data_record = _datasets(request, reference, names)
        judge = _calibration_judge(request, reference, validation, calibration, names)
        for index, name in enumerate(names):
            target = work / f"{index}-{name}.onnx"
            later = tuple(names[index + 1 :])
            context = PassContext(request.settings, calibration, on_progress, later, judge)
            try:
                records.append(run_pass(name, current, target, context))
            except PassError as exc:
                raise OptimizeError(str(exc)) from None
            current = target
        gate = _gate(request, reference, current, validation, on_progress)
        result = OptimizationResult(
            source_model=str(source),
            passes=records,
            gate=gate,
            size_bytes_before=reference.stat().st_size,
            size_bytes_after=current.stat().st_size,
            speed_before=[],
            speed_after=[],
            tool_versions=versions,
            data=data_record,
            notes=[],
        )
        if torch_pass is not None:
            result.notes.append(
                "sizes and speeds before are the original PyTorch model's, exported to ONNX"
            )
        if not gate.passed:
            return result
        if request.measure_speed:
            result = _with_speed(result, request, reference, current, names, validation)
        return _write_version(result, request, current)


def _check_source(source: Path, torch_pass: str | None) -> None:
    from slipstream.optimize.torch_passes import TORCH_SUFFIXES

    suffix = source.suffix.lower()
    if torch_pass is not None and suffix not in TORCH_SUFFIXES:
        raise OptimizeError(
            f"--model: {torch_pass} needs a PyTorch model (.pt saved with "
            f"torch.save(module, path)); {source} is not one"
        )
    if torch_pass is None and suffix in TORCH_SUFFIXES:
        raise OptimizeError(
            f"--model: {source} is a PyTorch model; the ONNX passes need an ONNX file "
            "(or add prune or distill to --passes, which export it)"
        )
    if torch_pass is None and suffix != ".onnx":
        raise OptimizeError(f"--model: {source} is not an ONNX file (.onnx)")


def _check_precision(source: Path, names: Sequence[str]) -> None:
    """A precision pass needs an FP32 model: converting an int8 one to fp16 (or quantizing
    an fp16 or int8 one) is not meaningful, and the converters fail on it with a trace."""
    wanted = [name for name in names if name in PRECISION_PASSES]
    reduced = _reduced_precision(source) if wanted else None
    if reduced is None:
        return
    original = _fp32_version(source)
    fix = (
        f"pass the FP32 model instead: --model {original}"
        if original is not None
        else "pass the FP32 model it was made from as --model"
    )
    raise OptimizeError(
        f"--passes {wanted[0]}: {source} is already {reduced}; precision passes start from "
        f"an FP32 model, so {fix}"
    )


def _reduced_precision(path: Path) -> str | None:
    """``int8`` or ``fp16`` where the ONNX model at ``path`` is already so, else None."""
    import onnx

    try:
        graph = onnx.load(str(path), load_external_data=False).graph
    except Exception:  # protobuf's DecodeError and kin: _datasets names the file
        return None
    if any(node.op_type in _INT8_OPS or node.op_type.startswith("QLinear") for node in graph.node):
        return "int8 (quantized)"
    if any(init.data_type == onnx.TensorProto.FLOAT16 for init in graph.initializer):
        return "fp16"
    return None


def _fp32_version(source: Path) -> Path | None:
    """The newest version beside ``source`` (REPO/NAME/<version>/model.onnx) whose
    model is FP32, if there is one."""
    model_dir = source.parent.parent
    try:
        versions = read_model_directory(model_dir).versions
    except (OSError, ValueError):
        return None
    for version in sorted(versions, reverse=True):
        candidate = model_dir / str(version) / "model.onnx"
        if candidate.is_file() and candidate != source and _reduced_precision(candidate) is None:
            return candidate
    return None


def _run_torch_pass(
    request: OptimizeRequest,
    name: str,
    source: Path,
    work: Path,
    on_progress: ProgressCallback | None,
) -> TorchPassOutput:
    from slipstream.optimize.torch_passes import run_torch_pass

    try:
        found = [n for n in array_names(request.validation) if n != LABELS_NAME]
        if len(found) != 1:
            raise OptimizeError(
                f"--validation: a PyTorch model takes one input; the data has arrays "
                f"{', '.join(found) or 'none'} besides labels, expected exactly one"
            )
        input_name = found[0]
        sample = load_dataset(request.validation, [input_name]).inputs[input_name][:2]
        train = None if request.train is None else load_dataset(request.train, [input_name])
        io_names = (input_name, request.output_name or "logits")
        return run_torch_pass(
            name, source, work, request.settings, io_names, sample, train, on_progress
        )
    except ValueError as exc:  # PassError, DataError
        raise OptimizeError(str(exc)) from None


def _wants_calibration(request: OptimizeRequest, names: Sequence[str]) -> bool:
    return "int8-static" in names or ("int8-dynamic" in names and request.settings.int8_search)


def _datasets(
    request: OptimizeRequest, source: Path, names: Sequence[str]
) -> tuple[Dataset, Dataset | None, dict[str, Any]]:
    import onnx

    try:
        graph = onnx.load(str(source), load_external_data=False).graph
    except Exception as exc:  # protobuf's DecodeError and kin: the file, not our fault
        raise OptimizeError(f"{source.name}: not a readable ONNX model ({exc})") from None
    initializers = {init.name for init in graph.initializer}
    input_names = [value.name for value in graph.input if value.name not in initializers]
    try:
        validation = load_dataset(request.validation, input_names)
        if request.calibration is not None:
            calibration: Dataset | None = load_dataset(request.calibration, input_names)
        elif _wants_calibration(request, names):
            rows = min(DEFAULT_CALIBRATION_ROWS, validation.num_rows // 2)
            if rows < 1 and "int8-static" in names:
                raise OptimizeError("--validation: too few rows to split off calibration rows")
            calibration = validation.rows(0, rows) if rows >= 1 else None
            validation = validation.rows(rows, validation.num_rows)
        else:
            calibration = None
    except ValueError as exc:
        raise OptimizeError(str(exc)) from None
    record = {
        "validation": validation.source,
        "validation_rows": validation.num_rows,
        "calibration": None if calibration is None else calibration.source,
        "calibration_rows": None if calibration is None else calibration.num_rows,
    }
    return validation, calibration, record


def _calibration_judge(
    request: OptimizeRequest,
    source: Path,
    validation: Dataset,
    calibration: Dataset | None,
    names: Sequence[str],
) -> CalibrationJudge | None:
    """The gate on the calibration rows, for the int8-dynamic search (None: no search)."""
    if calibration is None or "int8-dynamic" not in names or not request.settings.int8_search:
        return None
    try:
        name, before = run_model(source, calibration, request.output_name)
    except Exception as exc:  # ORT raises its own exception types for bad feeds
        # Without --calibration the rows are the first of --validation: name what was given.
        option = "--validation" if request.calibration is None else "--calibration"
        raise OptimizeError(f"{option}: the original model cannot run it: {exc}") from None
    metric, _, max_drop = _metric(request, validation.labels is not None, name, before)
    return CalibrationJudge(calibration, before, name, metric, max_drop)


def _metric(
    request: OptimizeRequest, has_labels: bool, output_name: str, output: Any
) -> tuple[MetricName, str, float]:
    """(metric, why it was chosen, largest accepted drop) for the gate."""
    try:
        metric, reason = choose_metric(request.metric, has_labels, output_name, output)
    except ValueError as exc:
        raise OptimizeError(str(exc)) from None
    if request.max_drop is None:
        return metric, reason, DEFAULT_MAX_DROP[metric]
    return metric, reason, _check_max_drop(metric, request.max_drop)


def _check_max_drop(metric: MetricName | None, max_drop: float) -> float:
    try:
        return check_max_drop(metric, max_drop)
    except ValueError as exc:
        raise OptimizeError(str(exc)) from None


def _gate(
    request: OptimizeRequest,
    source: Path,
    optimized: Path,
    data: Dataset,
    on_progress: ProgressCallback | None,
) -> GateResult:
    try:
        name, before = run_model(source, data, request.output_name, on_progress, "original")
    except Exception as exc:  # ORT raises its own exception types for bad feeds
        raise OptimizeError(f"--validation: the original model cannot run it: {exc}") from None
    metric, reason, max_drop = _metric(request, data.labels is not None, name, before)
    _, after = run_model(optimized, data, name, on_progress, "optimized")
    values = compare_outputs(metric, max_drop, before, after, data.labels)
    return judge(metric, reason, name, data.num_rows, max_drop, values)


def _with_speed(
    result: OptimizationResult,
    request: OptimizeRequest,
    source: Path,
    optimized: Path,
    names: list[str],
    validation: Dataset,
) -> OptimizationResult:
    from slipstream.profile import ProfileError

    notes = list(result.notes)
    try:
        before = _speed(source, request, validation)
        after = _speed(optimized, request, validation)
    except ProfileError as exc:
        # The gate passed: the version is written whatever the speed profile says.
        notes.append(f"speed not measured: {exc}")
        return _replace(result, notes=notes)
    ratios = [
        a.p50_ms / b.p50_ms
        for b, a in zip(before, after, strict=True)
        if a.p50_ms is not None and b.p50_ms
    ]
    if ratios:
        median = sorted(ratios)[len(ratios) // 2]
        faster = "faster" if median < 1 else "slower"
        notes.append(
            f"on this CPU with one thread the optimized model is {faster}: p50 latency "
            f"x{median:.2f} of the original's (median over batch sizes)"
        )
        if "fp16" in names and median >= 1:
            notes.append("fp16 is slower on this CPU; it pays off on GPUs with FP16 units")
    return _replace(result, speed_before=before, speed_after=after, notes=notes)


def _speed(path: Path, request: OptimizeRequest, validation: Dataset) -> list[SpeedResult]:
    """p50/p99 and throughput at each --batch-size: on random inputs of the --shape
    dims when given, else on the validation rows (taken or tiled to each batch size), so
    a model with variable dims needs no --shape."""
    from slipstream.profile import profile_model

    profile = profile_model(
        path,
        batch_sizes=list(request.batch_sizes),
        shapes=request.shapes,
        input_data=None if request.shapes else validation.inputs,
        threads=1,
        seconds=request.profile_seconds,
        op_profile=False,
    )
    return [
        SpeedResult(batch.batch_size, batch.p50_ms, batch.p99_ms, batch.throughput_infer_per_s)
        for batch in profile.batches
    ]


def _write_version(
    result: OptimizationResult, request: OptimizeRequest, optimized: Path
) -> OptimizationResult:
    model_dir = request.repository / request.name
    model_dir.mkdir(parents=True, exist_ok=True)
    version = max(read_model_directory(model_dir).versions, default=0) + 1
    final = model_dir / str(version)
    result = _replace(result, version=version, version_dir=final)
    # Build the version beside its final name, then rename: a polling server never sees
    # a version directory without its model file. mkdir, not tempfile.mkdtemp: the rename
    # keeps the mode, and mkdtemp's 0o700 would lock out a server running as another user.
    staging = model_dir / f".{version}-{secrets.token_hex(8)}"
    staging.mkdir()
    try:
        shutil.copyfile(optimized, staging / "model.onnx")
        (staging / RECORD_NAME).write_text(json.dumps(result.to_record(), indent=2) + "\n")
        staging.rename(final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if not any((model_dir / name).exists() for name in ("config.yaml", "config.yml")):
        (model_dir / "config.yaml").write_text(
            f"# Written by slipstream optimize; the rest is read from the model file.\n"
            f"name: {request.name}\nbackend: onnxruntime\n"
        )
    return result


def _replace(result: OptimizationResult, **changes: Any) -> OptimizationResult:
    from dataclasses import replace

    return replace(result, **changes)


def _tool_versions() -> dict[str, str]:
    import onnx
    import onnxruntime

    from slipstream import __version__

    return {
        "onnx": onnx.__version__,
        "onnxruntime": str(onnxruntime.__version__),
        "slipstream": __version__,
    }
