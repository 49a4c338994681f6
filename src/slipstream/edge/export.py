"""``export_bundle``: a model directory as a self-contained bundle for one target.

A bundle is a model repository entry as it is (``slipstream serve --model-repository``
on its parent directory serves it, under the bundle directory's name)::

    OUT/config.yaml                           the source's settings, backend: set
    OUT/<version>/model.onnx | model.ort | model.xml + model.bin
    OUT/required_operators_and_types.config   mobile: the minimal build's operator list
    OUT/sample_inputs.npz, sample_outputs.npz rows and what the bundle's model answers
    OUT/tokenizer/...                         the model directory's other files
    OUT/manifest.json                         every file's size and SHA-256, the gate

Example::

    result = export_bundle(ExportRequest(
        model_dir=Path("models/minilm"), target="mobile", out=Path("bundles/minilm"),
        options=TargetOptions(validation=Path("val.npz"), calibration=Path("cal.npz")),
    ))
    print(result.gate.summary, result.manifest.size["ratio"])

The bundle's model is judged by the accuracy gate against the original on the
validation rows (those the int8 search did not see), running both in Slipstream's own
backends as a server would; nothing is written unless it passes. The bundle appears
whole or not at all (built beside OUT, then renamed).
"""

from __future__ import annotations

import logging
import secrets
import shutil
import tempfile
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import yaml

from slipstream import __version__
from slipstream.config import ConfigError
from slipstream.datatypes import numpy_dtype
from slipstream.edge.manifest import (
    MANIFEST_NAME,
    Manifest,
    SampleFiles,
    file_entries,
    sha256_of,
)

# check_samples lives in samples.py (the device imports it without optimize's passes).
from slipstream.edge.samples import check_samples as check_samples
from slipstream.edge.targets import (
    ExportError,
    Target,
    TargetModel,
    TargetOptions,
    build_target,
    size_bytes,
)
from slipstream.optimize.data import DataError, Dataset, load_dataset
from slipstream.optimize.gate import (
    DEFAULT_MAX_DROP,
    GateResult,
    check_max_drop,
    choose_metric,
    compare_outputs,
    judge,
)
from slipstream.repository.layout import (
    CONFIG_FILES,
    model_file,
    raw_config,
    read_config,
    read_model_directory,
)
from slipstream.runtime import get_backend
from slipstream.runtime.base import Backend

logger = logging.getLogger(__name__)

SAMPLE_INPUTS = "sample_inputs.npz"
SAMPLE_OUTPUTS = "sample_outputs.npz"
# Keys of the source's config.yaml a bundle does not carry: the bundle names its own
# backend and file, serves one version, and is renamed freely.
_DROPPED_KEYS = ("name", "backend", "platform", "default_model_filename", "version_policy")
# Rows per run when the model takes a variable batch (the batcher's default maximum).
_RUN_ROWS = 64


@dataclass(frozen=True, slots=True)
class ExportRequest:
    """Everything ``export_bundle`` needs; the CLI's options map onto it."""

    # REPO/NAME: a model directory of a repository.
    model_dir: Path
    target: Target
    # The bundle directory to write (must not exist unless `overwrite`).
    out: Path
    options: TargetOptions
    # The version exported; None: the newest.
    version: int | None = None
    # Rows of the validation data shipped as samples, with the outputs they give.
    sample_rows: int = 4
    overwrite: bool = False


@dataclass(frozen=True, slots=True)
class ExportResult:
    """What ``export_bundle`` wrote."""

    bundle: Path
    manifest: Manifest
    gate: GateResult


@dataclass(frozen=True, slots=True)
class _Source:
    name: str
    version: int
    path: Path
    config: dict[str, object]


def export_bundle(request: ExportRequest) -> ExportResult:
    """Build the bundle (see the module docstring); ExportError names what to fix."""
    source = _read_source(request)
    out = request.out
    if out.exists() and not request.overwrite:
        raise ExportError(f"-o {out}: already exists; remove it or pass --overwrite")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="slipstream-export-") as scratch:
        built = build_target(request.target, source.path, Path(scratch), request.options)
        # mkdir, not tempfile.mkdtemp: the rename keeps the mode, and mkdtemp's 0o700
        # would lock out a server running as another user.
        staging = out.parent / f".{out.name}-{secrets.token_hex(8)}"
        staging.mkdir()
        try:
            manifest, gate = _write_bundle(request, source, built, staging)
            if out.exists():
                shutil.rmtree(out)
            staging.rename(out)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    logger.info("wrote %s (%s bundle of %s v%d)", out, request.target, source.name, source.version)
    return ExportResult(out, manifest, gate)


def _read_source(request: ExportRequest) -> _Source:
    model_dir = request.model_dir
    if not model_dir.is_dir():
        raise ExportError(f"MODEL_DIR {model_dir}: not a directory (expected REPO/NAME)")
    directory = read_model_directory(model_dir)
    if not directory.versions:
        raise ExportError(f"MODEL_DIR {model_dir}: no version directory (1/, 2/, ...)")
    version = directory.versions[-1] if request.version is None else request.version
    if version not in directory.versions:
        found = ", ".join(map(str, directory.versions))
        raise ExportError(f"--version {version}: {model_dir} has versions {found}")
    try:
        config = read_config(directory)
        path = model_file(model_dir / str(version), config)
    except ConfigError as exc:
        raise ExportError(str(exc)) from None
    if config.generative:
        raise ExportError(f"MODEL_DIR {model_dir}: {config.backend} models are not exported")
    if path.suffix.lower() != ".onnx":
        raise ExportError(
            f"{path}: export reads ONNX models (model.onnx); export the model to ONNX first"
        )
    return _Source(directory.name, version, path, _raw_config(model_dir))


def _raw_config(model_dir: Path) -> dict[str, object]:
    """The model's config keys (a Triton config.pbtxt translated), written to the bundle
    as its config.yaml."""
    data = raw_config(model_dir)
    return dict(data) if isinstance(data, dict) else {}


def _write_bundle(
    request: ExportRequest, source: _Source, built: TargetModel, bundle: Path
) -> tuple[Manifest, GateResult]:
    version_dir = bundle / str(source.version)
    version_dir.mkdir()
    for path in built.model_files:
        shutil.copyfile(path, version_dir / path.name)
    for path in built.extra_files:
        shutil.copyfile(path, bundle / path.name)
    _copy_model_directory_files(request.model_dir, bundle)
    original = get_backend("onnxruntime").load(source.path, {}, 1)
    model = get_backend(built.backend).load(version_dir / built.model_files[0].name, {}, 1)
    try:
        rows = _gate_rows(request, original, built)
        gate = _gate(request.options, original, model, rows)
        if not gate.passed:
            raise ExportError(
                f"the {request.target} model missed the accuracy gate: {gate.summary}"
            )
        samples = _write_samples(bundle, model, rows, request.sample_rows)
    finally:
        original.close()
        model.close()
    _write_config(bundle, request.target, source, built.backend)
    sizes = {
        "source_model_bytes": source.path.stat().st_size,
        "model_bytes": size_bytes(built.model_files),
    }
    manifest = Manifest(
        name=source.name,
        version=source.version,
        target=request.target,
        backend=built.backend,
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        files=file_entries(bundle),
        samples=samples,
        gate=asdict(gate),
        minimum_runtime_versions={**built.writers, "slipstream": __version__},
        size={**sizes, "ratio": round(sizes["model_bytes"] / sizes["source_model_bytes"], 4)},
        source={
            "model": str(source.path),
            "sha256": sha256_of(source.path),
            "passes": built.passes,
        },
    )
    (bundle / MANIFEST_NAME).write_text(manifest.to_json())
    return manifest, gate


def _copy_model_directory_files(model_dir: Path, bundle: Path) -> None:
    """The model directory's other files (a tokenizer, a drift reference), as they are."""
    for entry in model_dir.iterdir():
        if entry.name.isdigit() or entry.name.startswith(".") or entry.name in CONFIG_FILES:
            continue
        if entry.is_dir():
            shutil.copytree(entry, bundle / entry.name)
        elif entry.is_file() and not entry.name.startswith("config.y"):
            shutil.copy2(entry, bundle / entry.name)


def _write_config(bundle: Path, target: Target, source: _Source, backend: str) -> None:
    config = {k: v for k, v in source.config.items() if k not in _DROPPED_KEYS}
    config = {"backend": backend, **config}
    header = (
        f"# Written by slipstream export --target {target} from {source.name} version "
        f"{source.version}; manifest.json lists every file of the bundle.\n"
    )
    (bundle / "config.yaml").write_text(header + yaml.safe_dump(config, sort_keys=False))


def _gate_rows(request: ExportRequest, original: Backend, built: TargetModel) -> Dataset:
    names = [spec.name for spec in original.signature().inputs]
    try:
        data = load_dataset(request.options.validation, names)
    except DataError as exc:
        raise ExportError(f"--validation: {exc}") from None
    start = built.calibration_rows
    return data.rows(start, data.num_rows) if 0 < start < data.num_rows else data


def _gate(options: TargetOptions, original: Backend, model: Backend, rows: Dataset) -> GateResult:
    """The bundle's model against the original on ``rows``, as optimize's gate judges."""
    outputs = [spec.name for spec in original.signature().outputs]
    name = options.output_name or outputs[0]
    if name not in outputs:
        raise ExportError(f"--output {name!r}: the model's outputs are {', '.join(outputs)}")
    before = run_rows(original, rows, [name])[name]
    after = run_rows(model, rows, [name])[name]
    try:
        metric, reason = choose_metric(options.metric, rows.labels is not None, name, before)
        max_drop = (
            DEFAULT_MAX_DROP[metric]
            if options.max_drop is None
            else check_max_drop(metric, options.max_drop)
        )
    except ValueError as exc:
        raise ExportError(str(exc)) from None
    values = compare_outputs(metric, max_drop, before, after, rows.labels)
    return judge(metric, reason, name, rows.num_rows, max_drop, values)


def run_rows(model: Backend, rows: Dataset, output_names: list[str]) -> dict[str, np.ndarray]:
    """Every row through ``model`` in batches; each output [N, ...]."""
    specs = {spec.name: spec for spec in model.signature().inputs}
    first = next(iter(specs.values())).shape[:1] if specs else ()
    step = first[0] if first and first[0] > 0 else _RUN_ROWS
    parts: dict[str, list[np.ndarray]] = {name: [] for name in output_names}
    for start in range(0, rows.num_rows, step):
        batch = rows.rows(start, min(start + step, rows.num_rows))
        feed = {
            name: np.ascontiguousarray(array, dtype=numpy_dtype(specs[name].datatype))
            for name, array in batch.inputs.items()
        }
        for name, value in model.run(feed, output_names).items():
            parts[name].append(value)
    return {name: np.concatenate(values) for name, values in parts.items()}


def _write_samples(bundle: Path, model: Backend, rows: Dataset, count: int) -> SampleFiles:
    specs = model.signature()
    first = specs.inputs[0].shape[:1] if specs.inputs else ()
    count = first[0] if first and first[0] > 0 else min(count, rows.num_rows)
    samples = rows.rows(0, count)
    names = [spec.name for spec in specs.outputs]
    outputs = run_rows(model, samples, names)
    inputs = {
        spec.name: np.ascontiguousarray(samples.inputs[spec.name], dtype=numpy_dtype(spec.datatype))
        for spec in specs.inputs
    }
    np.savez(bundle / SAMPLE_INPUTS, **inputs)  # type: ignore[arg-type]
    np.savez(bundle / SAMPLE_OUTPUTS, **outputs)  # type: ignore[arg-type]
    return SampleFiles(SAMPLE_INPUTS, SAMPLE_OUTPUTS, count)
