"""The model transformations of ``slipstream optimize``, one function per pass.

Each pass reads one ONNX file and writes another; it never touches the repository.
Passes run in a fixed order whatever order they are asked in: the PyTorch passes
``prune`` or ``distill`` first (see ``optimize.torch_passes``; they read a PyTorch model
and write ONNX), then ``graph`` (it
folds constants and removes nodes the quantizers would otherwise have to handle), then
one precision pass (``fp16``, ``int8-dynamic`` or ``int8-static``), as quantizing an
FP16 model or converting a quantized one to FP16 is not meaningful.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import onnx

from slipstream.optimize.data import Dataset
from slipstream.optimize.gate import CandidateScore
from slipstream.optimize.onnx_edit import sort_topologically, strip_value_info
from slipstream.optimize.row_scales import per_row_activation_scales

if TYPE_CHECKING:
    from slipstream.optimize.int8_search import Quantizer, SearchResult

logger = logging.getLogger(__name__)

__all__ = [
    "PASS_ORDER",
    "PRECISION_PASSES",
    "PYTORCH_PASSES",
    "PassContext",
    "PassError",
    "PassRecord",
    "PassSettings",
    "order_passes",
    "run_pass",
]

PASS_ORDER = ("prune", "distill", "graph", "fp16", "int8-dynamic", "int8-static")
PRECISION_PASSES = frozenset({"fp16", "int8-dynamic", "int8-static"})
# Passes that read a PyTorch model; at most one runs, first (see optimize.torch_passes).
PYTORCH_PASSES = frozenset({"prune", "distill"})
CalibrationMethodName = Literal["minmax", "entropy", "percentile"]
GraphLevel = Literal["basic", "extended"]
ActivationScales = Literal["row", "run"]
# The names of the standard ONNX operator domain, the one the int8 passes quantize.
_STANDARD_DOMAINS = frozenset({"", "ai.onnx"})
# Why the default graph level is "basic", kept in the record next to the setting.
_GRAPH_LEVEL_REASONS = {
    "basic": (
        "basic rewrites (constant folding, redundant node elimination, Conv/BN fusion) keep "
        "standard ONNX ops only, so the saved model loads in any ONNX runtime and the int8 "
        "quantizers still see plain MatMul/Conv nodes; the server applies the extended and "
        "layout fusions itself at load time, for the hardware it runs on"
    ),
    "extended": (
        "extended fusions write com.microsoft contrib ops (FusedMatMul, Gelu, "
        "LayerNormalization, Attention): the model then loads only in ONNX Runtime "
        "(CPU/CUDA), and later int8 passes no longer see the fused MatMuls"
    ),
}


class PassError(ValueError):
    """A pass cannot run as asked; the message names the option that fixes it."""


@dataclass(frozen=True, slots=True)
class PassSettings:
    """Options of the passes; each field is recorded with the pass that used it."""

    # graph: ONNX Runtime optimization level written into the saved model.
    graph_level: GraphLevel = "basic"
    # int8-*: ONNX op types to quantize; MatMul alone keeps accuracy on most models.
    int8_op_types: tuple[str, ...] = ("MatMul",)
    # int8-dynamic: one scale per output channel of each weight (static always is).
    # On all-MiniLM-L6-v2 one scale per tensor drops the mean cosine to ~0.96; per
    # channel keeps it at ~0.994 for a few KB of scales.
    per_channel: bool = True
    # int8-dynamic: activation scales computed per ``run`` (ONNX Runtime's
    # DynamicQuantizeLinear, fused into DynamicQuantizeMatMul: one scale for the whole
    # input, which in a server is a batch of requests, so a row's answer moves a little
    # with its batch mates) or per ``row`` (a row's answer is the one it gets alone, in
    # any batch; unfused, so slower: all-MiniLM-L6-v2 19.0 ms instead of 14.6 ms a
    # sequence, a 256-wide MLP 290 us instead of 164 us a batch of 64, on one core).
    # See optimize.row_scales.
    activation_scales: ActivationScales = "run"
    # int8-dynamic: when plain int8 misses the gate on the calibration rows, try
    # activation smoothing, then keep the most damaging nodes in FP32, and keep the
    # fastest candidate that passes (see optimize.int8_search). Plain int8 leaves
    # all-MiniLM-L6-v2 at a min cosine of ~0.966 over real sentences; smoothing lifts
    # it to ~0.988 with every MatMul still in int8.
    int8_search: bool = True
    # int8-dynamic search: smoothing strengths tried (0: none moved to the weights,
    # 1: all); the best depends on the model (MiniLM: 0.7).
    smoothing_alphas: tuple[float, ...] = (0.5, 0.6, 0.7, 0.8)
    # int8-static: how activation ranges are chosen from the calibration data.
    calibration_method: CalibrationMethodName = "minmax"
    # int8-static: rows per calibration batch.
    calibration_batch_size: int = 16
    # fp16: keep FP32 inputs and outputs so clients need not change what they send.
    fp16_keep_io_types: bool = True
    # prune: share of each layer's output channels / neurons removed (smallest L1 norm).
    prune_ratio: float = 0.5
    # distill: a preset (mlp-tiny, mlp-small, mlp-medium, cnn-small), a
    # package.module:factory called with (input_shape, num_classes), or a .pt module.
    student: str = "mlp-medium"
    # prune (with --train) / distill: passes over the training rows.
    epochs: int = 30
    # distill: softens teacher and student distributions; higher shares more of the
    # teacher's "dark knowledge" about similar classes.
    temperature: float = 4.0
    # distill: weight of the soft (teacher) loss; 1 - alpha goes to the label loss.
    alpha: float = 0.7
    # prune / distill: Adam learning rate and rows per step.
    learning_rate: float = 3e-3
    train_batch_size: int = 64
    # prune / distill: seed for initialization and row order, so runs repeat.
    seed: int = 0


@dataclass(frozen=True, slots=True)
class PassContext:
    """What a pass may need beyond its input file."""

    settings: PassSettings
    # Rows for int8-static calibration (None: that pass cannot run).
    calibration: Dataset | None = None
    # Called with (task, rows done, rows total) as calibration proceeds.
    on_progress: Callable[[str, int, int], None] | None = None
    # The passes that run after this one (the graph pass adapts to a later int8 pass).
    later_passes: tuple[str, ...] = ()
    # The accuracy gate on the calibration rows, for the int8-dynamic search (None: no
    # search, e.g. without calibration rows).
    judge: Callable[[Path], CandidateScore] | None = None


@dataclass(frozen=True, slots=True)
class PassRecord:
    """What one pass did, as written into optimization.json."""

    name: str
    # The settings this pass used (only the ones that apply to it).
    settings: dict[str, Any]
    # Wall time of the transformation itself.
    seconds: float
    # Human-readable remarks (why a level was chosen, rows calibrated, ...).
    notes: list[str] = field(default_factory=list)


def order_passes(names: list[str]) -> list[str]:
    """Validate pass names and put them in the order they run in (see module docstring)."""
    cleaned = [name.strip().lower() for name in names if name.strip()]
    unknown = sorted(set(cleaned) - set(PASS_ORDER))
    if unknown:
        raise PassError(
            f"--passes: unknown pass {', '.join(unknown)}; expected some of "
            + ", ".join(PASS_ORDER)
        )
    if not cleaned:
        raise PassError("--passes: name at least one pass, e.g. graph,int8-dynamic")
    precision = sorted(set(cleaned) & PRECISION_PASSES)
    if len(precision) > 1:
        raise PassError(
            f"--passes: {' and '.join(precision)} both set the precision; choose one of them"
        )
    if len(set(cleaned) & PYTORCH_PASSES) > 1:
        raise PassError(
            "--passes: prune and distill both start from the PyTorch model; choose one of them"
        )
    return [name for name in PASS_ORDER if name in cleaned]


def run_pass(name: str, source: Path, target: Path, context: PassContext) -> PassRecord:
    """Run pass ``name`` from ``source`` to ``target``; see :data:`PASS_ORDER`."""
    started = time.perf_counter()
    settings, notes = _PASSES[name](source, target, context)
    onnx.checker.check_model(str(target))
    return PassRecord(name, settings, time.perf_counter() - started, notes)


_PassResult = tuple[dict[str, Any], list[str]]


def _graph(source: Path, target: Path, context: PassContext) -> _PassResult:
    import onnxruntime as ort

    level = context.settings.graph_level
    options = ort.SessionOptions()
    options.graph_optimization_level = {
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    }[level]
    options.optimized_model_filepath = str(target)
    notes = [_GRAPH_LEVEL_REASONS[level]]
    disabled = []
    quantizing = any(name.startswith("int8") for name in context.later_passes)
    if quantizing and "Gemm" not in context.settings.int8_op_types:
        # MatMul + Add -> Gemm would hide 2-D MatMuls from a MatMul-only quantizer (and
        # int8-dynamic has no Gemm kernel at all), leaving the model in FP32.
        disabled.append("MatMulAddFusion")
        notes.append("MatMulAddFusion disabled so the int8 pass still sees the MatMuls")
    ort.InferenceSession(
        str(source), options, providers=["CPUExecutionProvider"], disabled_optimizers=disabled
    )
    return {"graph_level": level, "disabled_optimizers": disabled}, notes


def _int8_dynamic(source: Path, target: Path, context: PassContext) -> _PassResult:
    from slipstream.optimize.int8_search import search_int8_dynamic

    settings = context.settings
    quantize = _dynamic_quantizer(settings)
    recorded: dict[str, Any] = {
        "op_types": list(settings.int8_op_types),
        "per_channel": settings.per_channel,
        "weight_type": "int8",
        "activations": f"uint8, scale and zero point computed per {settings.activation_scales} "
        "at run time",
        "int8_search": settings.int8_search,
    }
    notes = []
    judge, rows = context.judge, context.calibration
    with _quantizer_input("int8-dynamic", source, target) as private_source:
        if settings.int8_search and judge is not None and rows is not None:
            result = search_int8_dynamic(
                private_source,
                target,
                quantize,
                judge,
                rows,
                settings.smoothing_alphas,
                settings.int8_op_types,
                context.on_progress,
            )
            recorded["smoothing_alpha"] = result.smoothing_alpha
            recorded["excluded_nodes"] = result.excluded_nodes
            recorded["search"] = result.to_record()
            notes.append(_search_note(result, rows.num_rows))
        else:
            quantize(private_source, target, (), None)
            if settings.int8_search:
                notes.append("int8 search skipped: no calibration rows to judge candidates on")
    # Written by the quantizer; see onnx_edit.strip_value_info for why they go.
    model = onnx.load(str(target))
    per_run = [n.name for n in model.graph.node if n.op_type == "DynamicQuantizeLinear"]
    if per_run:
        why = "as asked" if settings.activation_scales == "run" else "they feed other ops"
        notes.append(
            f"{len(per_run)} activations keep one int8 scale per run ({why}): a row's answer "
            "moves a little with its batch mates; where it must not, quantize with "
            "--activation-scales row or serve with parameters.activation_scales: row"
        )
    if strip_value_info(model):
        onnx.save(model, str(target))
    return recorded, notes


def _dynamic_quantizer(settings: PassSettings) -> Quantizer:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    def quantize(
        source: Path, target: Path, exclude: Sequence[str], only: Sequence[str] | None
    ) -> None:
        with _without_preprocessing_hint():
            quantize_dynamic(
                source,
                target,
                op_types_to_quantize=list(settings.int8_op_types),
                per_channel=settings.per_channel,
                # Signed weights, unsigned activations (U8S8): the pairing ORT's x86 int8
                # GEMMs run fastest, with VNNI at full 8-bit weight precision.
                weight_type=QuantType.QInt8,
                nodes_to_exclude=list(exclude),
                nodes_to_quantize=list(only or []),
                # Tensors after com.microsoft ops (graph level extended) get no inferred
                # type; they are FP32.
                extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
            )
        if settings.activation_scales == "row":
            # One activation scale per row instead of per run (per batch, in a server):
            # a row's answer no longer depends on its batch mates (optimize.row_scales).
            model = onnx.load(str(target))
            per_row_activation_scales(model)
            onnx.save(model, str(target))

    return quantize


@contextmanager
def _quantizer_input(name: str, source: Path, target: Path) -> Iterator[Path]:
    """``source`` copied into a directory of its own beside ``target``, for ORT's quantizers.

    They write a shape-inferred copy (``<input>-inferred.onnx``, as large as the model)
    beside the file they are given: beside the repository's model when a pass reads it
    first, where it fails if the repository is mounted read-only. The copy also keeps the
    standard operator set imported once (skl2onnx may import it twice), as they require.
    """
    model = onnx.load(str(source))
    _check_quantizable(name, model)
    with tempfile.TemporaryDirectory(prefix=f"{name}-input-", dir=target.parent) as scratch:
        copy = Path(scratch) / "model.onnx"
        if _drop_repeated_opsets(name, model):
            onnx.save(model, str(copy))
        else:
            shutil.copyfile(source, copy)
        yield copy


def _check_quantizable(name: str, model: onnx.ModelProto) -> None:
    """PassError unless ``model`` has a node in the standard ONNX domain to quantize."""
    nodes = model.graph.node
    if any(node.domain in _STANDARD_DOMAINS for node in nodes):
        return
    operators = ", ".join(sorted({node.op_type for node in nodes}))
    domains = ", ".join(sorted({node.domain for node in nodes}))
    found = (
        f"its operators ({operators}) are all {domains} ones, as in a scikit-learn pipeline "
        "converted to ONNX-ML"
        if nodes
        else "its graph has no nodes"
    )
    raise PassError(
        f"{name}: the int8 passes quantize standard ONNX (ai.onnx) operators, and this model "
        f"has none: {found}. It cannot be made INT8: serve it as it is, or convert it to "
        "standard ONNX operators first"
    )


def _drop_repeated_opsets(name: str, model: onnx.ModelProto) -> bool:
    """Remove repeated imports of one operator set version; whether any was removed."""
    seen: dict[str, int] = {}
    kept = []
    for opset in model.opset_import:
        domain = "" if opset.domain in _STANDARD_DOMAINS else opset.domain
        if seen.get(domain) == opset.version:
            continue
        if domain in seen:
            raise PassError(
                f"{name}: the model imports operator set {domain or 'ai.onnx'} twice, as "
                f"versions {seen[domain]} and {opset.version}; export it with one version"
            )
        seen[domain] = opset.version
        kept.append(onnx.helper.make_opsetid(opset.domain, opset.version))
    if len(kept) == len(model.opset_import):
        return False
    del model.opset_import[:]
    model.opset_import.extend(kept)
    return True


# ONNX Runtime's quantizers log "Please consider [to run] pre-processing before
# quantization ..." on the root logger for every model they quantize (an int8 search
# quantizes one per candidate). It is advice (shape inference and graph optimization
# first, which `--passes graph,int8-...` partly does), not a fault.
_PREPROCESSING_HINT = "pre-processing before quantization"


def _drop_preprocessing_hint(record: logging.LogRecord) -> bool:
    message = str(record.msg)
    return not (message.startswith("Please consider") and _PREPROCESSING_HINT in message)


@contextmanager
def _without_preprocessing_hint() -> Iterator[None]:
    root = logging.getLogger()
    root.addFilter(_drop_preprocessing_hint)
    try:
        yield
    finally:
        root.removeFilter(_drop_preprocessing_hint)


def _search_note(result: SearchResult, rows: int) -> str:
    parts = []
    if result.smoothing_alpha is not None:
        parts.append(f"smoothing alpha {result.smoothing_alpha:g}")
    if result.excluded_nodes:
        parts.append(f"{len(result.excluded_nodes)} nodes in FP32")
    kept = ", ".join(parts) or "plain int8"
    verdict = "passed" if result.passed else "missed (the closest was kept)"
    return (
        f"int8 search: {len(result.steps)} candidates judged on {rows} calibration rows in "
        f"{result.seconds:.0f} s; kept {kept}, which {verdict} the gate there"
    )


def _int8_static(source: Path, target: Path, context: PassContext) -> _PassResult:
    from onnxruntime.quantization import (
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    if context.calibration is None:
        raise PassError("int8-static needs calibration data: pass --calibration or --validation")
    settings = context.settings
    method = {
        "minmax": CalibrationMethod.MinMax,
        "entropy": CalibrationMethod.Entropy,
        "percentile": CalibrationMethod.Percentile,
    }[settings.calibration_method]
    reader = _CalibrationReader(
        context.calibration, settings.calibration_batch_size, context.on_progress
    )
    with (
        _quantizer_input("int8-static", source, target) as private_source,
        _without_preprocessing_hint(),
    ):
        quantize_static(
            private_source,
            target,
            calibration_data_reader=reader,
            quant_format=QuantFormat.QDQ,
            op_types_to_quantize=list(settings.int8_op_types),
            per_channel=True,
            activation_type=QuantType.QInt8,
            weight_type=QuantType.QInt8,
            calibrate_method=method,
            extra_options={"ActivationSymmetric": False, "WeightSymmetric": True},
        )
    recorded = {
        "format": "QDQ",
        "op_types": list(settings.int8_op_types),
        "per_channel": True,
        "calibration_method": settings.calibration_method,
        "calibration_rows": context.calibration.num_rows,
        "calibration_source": context.calibration.source,
    }
    notes = [f"calibrated on {context.calibration.num_rows} rows"]
    if settings.calibration_method == "entropy":
        # quantize_static passes no bin counts to its entropy calibrator, whose defaults
        # (128 histogram bins searched for a 128-level range) leave nothing to clip.
        notes.append(
            "ONNX Runtime's entropy calibration runs with 128 histogram bins for 128 "
            "levels, so it keeps the full range: expect the same scales as minmax"
        )
    return recorded, notes


def _fp16(source: Path, target: Path, context: PassContext) -> _PassResult:
    # onnxconverter-common is not a dependency; ORT ships the same converter.
    from onnxruntime.transformers.float16 import convert_float_to_float16

    keep_io = context.settings.fp16_keep_io_types
    model = onnx.load(str(source))
    converted = convert_float_to_float16(model, keep_io_types=keep_io)
    # The converter appends its input casts after the nodes that read them; ORT does not
    # mind, but the ONNX spec (and other runtimes) want topological order.
    sort_topologically(converted.graph)
    onnx.save(converted, str(target))
    notes = [
        "FP16 halves the weights' size; on CPU, ONNX Runtime runs most FP16 ops through "
        "casts or slower kernels, so compare the latencies below before serving it on CPU"
    ]
    return {"keep_io_types": keep_io}, notes


def even_batch_size(total: int, wanted: int) -> int:
    """The largest batch size <= ``wanted`` that divides ``total`` rows evenly.

    ONNX Runtime's histogram calibrators (entropy, percentile) stack every batch's
    activations into one array and fail on a shorter last batch, so all batches are
    made the same size rather than dropping rows.
    """
    for size in range(max(1, min(wanted, total)), 0, -1):
        if total % size == 0:
            return size
    return 1


class _CalibrationReader:
    """Feeds calibration rows to ``quantize_static`` in batches (a CalibrationDataReader)."""

    def __init__(
        self,
        data: Dataset,
        batch_size: int,
        on_progress: Callable[[str, int, int], None] | None,
    ) -> None:
        self._data = data
        self._batch_size = even_batch_size(data.num_rows, batch_size)
        self._on_progress = on_progress
        self._batches = self._iterate()

    def _iterate(self) -> Iterator[dict[str, np.ndarray]]:
        total = self._data.num_rows
        for start in range(0, total, self._batch_size):
            stop = min(start + self._batch_size, total)
            yield self._data.rows(start, stop).inputs
            if self._on_progress is not None:
                self._on_progress("calibrating", stop, total)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._batches, None)

    def rewind(self) -> None:
        self._batches = self._iterate()


_PASSES: dict[str, Callable[[Path, Path, PassContext], _PassResult]] = {
    "graph": _graph,
    "fp16": _fp16,
    "int8-dynamic": _int8_dynamic,
    "int8-static": _int8_static,
}
