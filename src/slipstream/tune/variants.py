"""The model variants a tune searches over: every version of the model directory.

A version written by ``slipstream optimize`` carries ``optimization.json``: its passes
and the accuracy gate's figures. Its accuracy drop is read from there, in the gate
metric's unit (top1 / agreement: percentage points; cosine: 1 - mean cosine; mae /
maxae: the error), or measured on ``--validation`` rows against the original (the
newest version without that file, i.e. not made by optimize). A variant whose drop is
over ``--max-accuracy-drop`` is kept in the report with the reason and not searched.

optimize starts from the newest version, so a second run makes v3 from v2 and v3's
record gives its drop against v2, not the original. Such a drop is reported "vs v2".
Drops against successive versions do not add up to the drop against the original (an
agreement or a cosine is not additive), so against ``--max-accuracy-drop`` it counts as
unknown: excluded, with the fix (``--validation`` measures it against the original).

Each variant is served by a backend: the model's own (``backend:`` in its config.yaml,
else by file type), and, with ``--backends``, every other installed backend that reads
the file: an ONNX version becomes a second variant on OpenVINO ("v1 original on
openvino") when the ``openvino`` extra is installed, with the same accuracy drop (both
run the same graph in FP32; OpenVINO's precision is pinned to f32 by default).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from slipstream.config import ModelConfig
from slipstream.repository.layout import model_file, read_config, read_model_directory
from slipstream.runtime import BACKEND_NAMES, backend_for_file
from slipstream.tune.settings import TuneInputError

# optimize's record in a version directory (slipstream.optimize.core.RECORD_NAME).
RECORD_NAME = "optimization.json"
# Backends that read each model file type, beside the file type's default backend, and
# the module each needs installed.
_ALSO_READ_BY = {".onnx": ("onnxruntime", "openvino")}
_BACKEND_MODULES = {"onnxruntime": "onnxruntime", "openvino": "openvino"}
# --backends: every installed backend that reads the variant's file.
AUTO_BACKENDS = "auto"


@dataclass
class Variant:
    """One version of the model, as a point of the search's variant dimension."""

    # "v2 int8-dynamic", "v1 original": what the leaderboard shows.
    name: str
    version: int
    model_file: Path
    # Passes that made it (empty for an original).
    passes: list[str]
    # Accuracy drop in the metric's unit (0 for the original); None: unknown.
    accuracy_drop: float | None
    # top1, agreement, cosine, mae, maxae; "" when not known.
    accuracy_metric: str
    # Where the drop comes from: "optimization.json", "--validation", "original".
    accuracy_source: str
    # Why the variant is not searched (over the accuracy budget, unreadable); "" if it is.
    excluded: str = ""
    # The backend that serves it (config.yaml's backend:); "" for the model's own.
    backend: str = ""
    # The version the drop is measured against when that is itself an optimized version
    # (optimize run on v2 records v3's drop against v2); None: against the original.
    accuracy_baseline: int | None = None


def find_variants(model_dir: Path) -> tuple[ModelConfig, list[Variant]]:
    """The model's config and its versions, oldest first; TuneInputError if it has none."""
    if not model_dir.is_dir():
        raise TuneInputError(f"MODEL_DIR {model_dir}: not a directory (expected REPO/NAME)")
    directory = read_model_directory(model_dir)
    if not directory.versions:
        raise TuneInputError(f"MODEL_DIR {model_dir}: no version directory (1/, 2/, ...)")
    config = read_config(directory)
    if config.generative:
        raise TuneInputError(
            f"MODEL_DIR {model_dir}: backend {config.backend} is a generative model; "
            "tune measures V2 tensor models"
        )
    made_of = "a cascade" if config.cascade else "an ensemble" if config.ensemble else ""
    if made_of or config.sequence_batching is not None:
        raise TuneInputError(
            f"MODEL_DIR {model_dir}: {made_of or 'a stateful model'} is not tuned as a whole; "
            + ("tune the models its steps run" if made_of else "its requests come in sequences")
        )
    variants = []
    for version in directory.versions:
        version_dir = model_dir / str(version)
        path = model_file(version_dir, config)
        record = _record(version_dir)
        if record is None:
            variants.append(Variant(f"v{version} original", version, path, [], 0.0, "", "original"))
            continue
        passes = [str(p.get("name", "?")) for p in record.get("passes", [])]
        metric, drop = gate_drop(record.get("gate", {}))
        variants.append(
            Variant(
                name=f"v{version} {'+'.join(passes) or 'optimized'}",
                version=version,
                model_file=path,
                passes=passes,
                accuracy_drop=drop,
                accuracy_metric=metric,
                accuracy_source=RECORD_NAME,
                accuracy_baseline=_optimized_source(record, model_dir),
            )
        )
    return config, variants


def _optimized_source(record: dict[str, Any], model_dir: Path) -> int | None:
    """The version of ``model_dir`` the record's gate compared with, when optimize made it."""
    source = Path(str(record.get("source_model", "")))
    version_dir = source.parent
    if not version_dir.name.isdigit() or version_dir.parent.name != model_dir.name:
        return None  # a file outside the model directory (a .pt, an ONNX file elsewhere)
    version = int(version_dir.name)
    return version if _record(model_dir / str(version)) is not None else None


def _record(version_dir: Path) -> dict[str, Any] | None:
    path = version_dir / RECORD_NAME
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise TuneInputError(f"{path}: cannot be read ({exc}); fix or remove it") from None
    return data if isinstance(data, dict) else {}


def gate_drop(gate: dict[str, Any]) -> tuple[str, float | None]:
    """(metric, drop) from an optimization.json gate; drop None when the figures are absent.

    >>> gate_drop({"metric": "top1", "before": {"top1_percent": 97.0},
    ...            "after": {"top1_percent": 96.5}})
    ('top1', 0.5)
    """
    metric = str(gate.get("metric", ""))
    before, after = gate.get("before") or {}, gate.get("after") or {}
    return metric, drop_from_values(metric, before, after)


def drop_from_values(
    metric: str, before: dict[str, float], after: dict[str, float]
) -> float | None:
    """The drop a gate's ``before``/``after`` values mean, in the metric's unit."""
    try:
        if metric == "top1":
            return round(float(before["top1_percent"]) - float(after["top1_percent"]), 6)
        if metric == "agreement":
            return round(100.0 - float(after["agreement_percent"]), 6)
        if metric == "cosine":
            return round(1.0 - float(after["mean_cosine"]), 6)
        if metric in ("mae", "maxae"):
            return float(after[metric])
    except (KeyError, TypeError, ValueError):
        return None
    return None


def measure_drops(variants: list[Variant], validation: Path) -> None:
    """Measure each variant's drop on ``validation`` against the original (in place)."""
    from slipstream.optimize.data import DataError, load_dataset
    from slipstream.optimize.gate import choose_metric, compare_outputs, run_model

    originals = [v for v in variants if not v.passes]
    reference = originals[-1] if originals else variants[0]
    try:
        import onnxruntime as ort

        session = ort.InferenceSession(
            str(reference.model_file), providers=["CPUExecutionProvider"]
        )
        data = load_dataset(validation, [i.name for i in session.get_inputs()])
        output_name, before = run_model(reference.model_file, data)
    except (DataError, OSError, ValueError) as exc:
        raise TuneInputError(f"--validation {validation}: {exc}") from None
    metric, _ = choose_metric(None, data.labels is not None, output_name, before)
    for variant in variants:
        _, after = run_model(variant.model_file, data, output_name)
        values = compare_outputs(metric, 0.0, before, after, data.labels)
        variant.accuracy_metric = metric
        variant.accuracy_drop = (
            0.0 if variant is reference else drop_from_values(metric, *values[:2])
        )
        variant.accuracy_source = "--validation"
        variant.accuracy_baseline = None


def apply_budget(variants: list[Variant], max_drop: float | None) -> None:
    """Mark the variants over ``max_drop`` (or of unknown drop) as excluded, with why."""
    if max_drop is None:
        return
    for variant in variants:
        if variant.accuracy_drop is None:
            variant.excluded = (
                f"accuracy drop unknown ({variant.accuracy_source} has no gate figures); "
                "give --validation to measure it"
            )
        elif variant.accuracy_baseline is not None:
            variant.excluded = (
                f"accuracy drop against the original unknown ({variant.accuracy_source} gives "
                f"{drop_text(variant)}, and v{variant.accuracy_baseline} was optimized "
                "itself); give --validation to measure it"
            )
        elif variant.accuracy_drop > max_drop:
            variant.excluded = (
                f"accuracy drop {drop_text(variant)} is over --max-accuracy-drop {max_drop:g}"
            )


def drop_text(variant: Variant) -> str:
    """The drop with its metric and, when not the original, what it is measured against.

    >>> drop_text(Variant("v3 graph", 3, Path("3/model.onnx"), ["graph"], 0.002, "cosine",
    ...                   RECORD_NAME, accuracy_baseline=2))
    '0.002 (cosine) vs v2'
    """
    text = "unknown" if variant.accuracy_drop is None else f"{variant.accuracy_drop:g}"
    if variant.accuracy_metric:
        text += f" ({variant.accuracy_metric})"
    if variant.accuracy_baseline is not None:
        text += f" vs v{variant.accuracy_baseline}"
    return text


def backend_variants(
    variants: list[Variant], config: ModelConfig, backends: Sequence[str]
) -> list[Variant]:
    """``variants`` on the model's own backend, each followed by its twins on the other
    ``backends`` that read its file (``("auto",)``: every installed one; ``()``: none).

    >>> from slipstream.config import ModelConfig
    >>> original = Variant("v1 original", 1, Path("1/model.onnx"), [], 0.0, "", "original")
    >>> [v.name for v in backend_variants([original], ModelConfig(), ["openvino"])]
    ['v1 original', 'v1 original on openvino']
    """
    unknown = [b for b in backends if b != AUTO_BACKENDS and b not in BACKEND_NAMES]
    if unknown:
        raise TuneInputError(
            f"--backends: unknown backend {unknown[0]!r}; expected {AUTO_BACKENDS} or some of "
            + ", ".join(BACKEND_NAMES)
        )
    found = []
    for variant in variants:
        found.append(variant)
        own = config.backend or backend_for_file(variant.model_file)
        readers = _ALSO_READ_BY.get(variant.model_file.suffix.lower(), ())
        if AUTO_BACKENDS in backends:
            wanted = [b for b in readers if _installed(b)]
        else:
            wanted = [b for b in backends if b in readers]
        for backend in wanted:
            if backend != own:
                found.append(replace(variant, name=f"{variant.name} on {backend}", backend=backend))
    return found


def _installed(backend: str) -> bool:
    return importlib.util.find_spec(_BACKEND_MODULES[backend]) is not None
