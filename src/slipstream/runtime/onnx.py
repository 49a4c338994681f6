"""ONNX Runtime backend, the default for ``.onnx`` files and ONNX Runtime's own ``.ort`` format.

Thread defaults favour the batcher over ORT's own parallelism: the cores this process may
use are shared out among the model's instances, and ORT's spin-waiting is off, because a
spinning worker steals the core the event loop needs to accept the next requests.

Parameters (config.yaml ``parameters``; a key not listed here fails the load, naming it
and the known ones):

* ``intra_op_thread_count``, ``inter_op_thread_count``: whole numbers of threads (0:
  ONNX Runtime's own default). Default: the usable cores shared out among the
  instances, and 1.
* ``allow_spinning``: ``"0"`` (default) or ``"1"``.
* ``graph_optimization_level``: ``disable``, ``basic``, ``extended`` or ``all`` (default).
* ``denormal_as_zero``: ``"1"`` / ``true`` (default: denormal floats flushed to zero) or
  ``"0"`` / ``false``.
* ``device``: ``cpu`` only (ONNX Runtime runs on the CPU here).
* ``activation_scales``: ``run`` (default) or ``row``. A model quantized with one int8
  activation scale per run (``DynamicQuantizeLinear``, ONNX Runtime's
  ``quantize_dynamic``, ``slipstream optimize``'s default) scales a whole batch of
  requests together, so a row's answer moves a little with its batch mates, as it does
  in Triton. ``row`` runs such a model's batches one row at a time: answers are then
  independent of batching (on all-MiniLM-L6-v2 at no cost, since its batches are no
  faster than its rows on a CPU; an MLP's batch of 64 took 8x as long). Models without
  such operators batch as usual either way; ``slipstream optimize --activation-scales
  row`` writes per-row scales, which batch.

Triton's onnxruntime backend keys, so a Triton repository loads as it is:
``execution_mode`` (``0`` sequential, ``1`` parallel), ``enable_mem_arena`` and
``enable_mem_pattern`` (``0``/``1``) are applied; a ``session.*`` or ``memory.*`` key is
passed to ONNX Runtime as a session config entry; the CUDA/TensorRT provider's keys
(``gpu_mem_limit``, ``cudnn_conv_algo_search``, ...) and ``share_session_between_instances``
are accepted and ignored with a warning, as ONNX Runtime runs on the CPU here.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import re
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from slipstream.datatypes import BF16
from slipstream.errors import InvalidRequest
from slipstream.runtime import data_errors
from slipstream.runtime.base import (
    Backend,
    ModelSignature,
    TensorSpec,
    check_cpu_device,
    usable_cpu_count,
)
from slipstream.runtime.onnx_weights import initializer_bytes
from slipstream.types import MemoryUsage

logger = logging.getLogger(__name__)

# ONNX Runtime type strings -> V2 datatypes.
_ORT_TO_V2 = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(bfloat16)": "BF16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
}

_GRAPH_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


def _spec(arg: ort.NodeArg) -> TensorSpec:
    datatype = _ORT_TO_V2.get(arg.type)
    if datatype is None:
        raise ValueError(f"tensor {arg.name!r} has unsupported type {arg.type}")
    # Symbolic dims ("batch", "seq") and unknown dims are variable.
    shape = tuple(d if isinstance(d, int) and d > 0 else -1 for d in (arg.shape or []))
    return TensorSpec(name=arg.name, datatype=datatype, shape=shape)


def _shared_dims(args: Sequence[ort.NodeArg]) -> list[tuple[str, list[tuple[str, int]]]]:
    """The model's named dimensions that more than one input has: (name, [(input,
    axis)...]). A name stands for one size in a run: two inputs of ``[batch, tokens]``
    must come with as many tokens each."""
    where: dict[str, list[tuple[str, int]]] = {}
    for arg in args:
        for axis, dim in enumerate(arg.shape or ()):
            if isinstance(dim, str) and dim:
                where.setdefault(dim, []).append((arg.name, axis))
    return [(dim, places) for dim, places in where.items() if len({name for name, _ in places}) > 1]


def _check_shared_dim(
    dim: str, places: list[tuple[str, int]], inputs: dict[str, np.ndarray]
) -> None:
    seen: tuple[str, int, int] | None = None  # (input, axis, size) of the first one sent
    for name, axis in places:
        array = inputs.get(name)
        if array is None or array.ndim <= axis:  # not sent (optional), or ORT's to refuse
            continue
        if seen is None:
            seen = (name, axis, array.shape[axis])
        elif array.shape[axis] != seen[2]:
            raise InvalidRequest(
                f"input {name!r}: dimension {axis} is {array.shape[axis]}, but the model "
                f"names it {dim!r}, which is {seen[2]} in input {seen[0]!r} (dimension "
                f"{seen[1]})"
            )


# The config ``parameters`` this backend reads; any other key is refused, naming it.
KNOWN_PARAMETERS = (
    "intra_op_thread_count",
    "inter_op_thread_count",
    "allow_spinning",
    "graph_optimization_level",
    "denormal_as_zero",
    "activation_scales",
    "device",
)
# Triton's onnxruntime backend keys that configure what this CPU build does not have (the
# CUDA and TensorRT providers, one session shared by instances): accepted, said ignored.
IGNORED_TRITON_PARAMETERS = (
    "arena_extend_strategy",
    "cudnn_conv_algo_search",
    "cudnn_conv_use_max_workspace",
    "do_copy_in_default_stream",
    "enable_cuda_graph",
    "gpu_mem_limit",
    "share_session_between_instances",
    "trt_engine_cache_enable",
    "trt_engine_cache_path",
    "trt_fp16_enable",
    "trt_int8_enable",
    "trt_max_workspace_size",
)
# Triton's onnxruntime backend keys applied to the session here.
_TRITON_SWITCHES = ("enable_mem_arena", "enable_mem_pattern")
# Prefixes of ONNX Runtime's session config entries (session.intra_op.allow_spinning,
# memory.enable_memory_arena_shrinkage): passed through as Triton passes them.
_ENTRY_PREFIXES = ("session.", "memory.")
# denormal_as_zero's spellings: Triton's "1"/"0" and YAML's true/false (read as strings).
_SWITCHES = {"1": True, "true": True, "0": False, "false": False}
# More threads than this is a typo, not a machine (ORT's setter takes a C int).
_MOST_THREADS = 4096


def session_options(parameters: dict[str, str], instance_count: int) -> ort.SessionOptions:
    """SessionOptions from config ``parameters`` (intra_op_thread_count, ...); ValueError
    names the parameter and the values it takes."""
    _check_keys(parameters)
    check_cpu_device("onnxruntime", parameters)
    options = ort.SessionOptions()
    _apply_triton_keys(options, parameters)
    default_threads = max(1, usable_cpu_count() // max(1, instance_count))
    options.intra_op_num_threads = _thread_count(
        parameters, "intra_op_thread_count", default_threads
    )
    options.inter_op_num_threads = _thread_count(parameters, "inter_op_thread_count", 1)
    spinning = parameters.get("allow_spinning", "0")
    if spinning not in ("0", "1"):  # ORT spins for "1" only: "yes" would silently mean no
        raise ValueError(f'parameters.allow_spinning: {spinning!r}; expected "0" or "1"')
    if "session.intra_op.allow_spinning" not in parameters:  # given by name: set below
        options.add_session_config_entry("session.intra_op.allow_spinning", spinning)
    level = parameters.get("graph_optimization_level", "all")
    if level not in _GRAPH_LEVELS:
        raise ValueError(
            f"parameters.graph_optimization_level: {level!r}; expected one of "
            + ", ".join(_GRAPH_LEVELS)
        )
    options.graph_optimization_level = _GRAPH_LEVELS[level]
    # Flush denormal floats to zero: masked softmax inputs (attention over padding) turn
    # into denormals, which the CPU handles about 10x slower; minilm's softmax measured
    # 8 ms instead of 0.8 ms per run. Outputs change below 1e-38 only; "0" turns it off.
    denormal = parameters.get("denormal_as_zero", "1")
    if denormal.strip().lower() not in _SWITCHES:
        raise ValueError(
            f'parameters.denormal_as_zero: {denormal!r}; expected "1" or "true" (the default: '
            'denormal floats flushed to zero) or "0" or "false"'
        )
    if _SWITCHES[denormal.strip().lower()] and "session.set_denormal_as_zero" not in parameters:
        options.add_session_config_entry("session.set_denormal_as_zero", "1")
    for key, value in parameters.items():  # last: an entry given by name wins
        if key.startswith(_ENTRY_PREFIXES):
            options.add_session_config_entry(key, value)
    return options


def _check_keys(parameters: dict[str, str]) -> None:
    """Refuse a key this backend does not know (a typo would otherwise change nothing
    without a word); say which of Triton's keys are ignored."""
    known = (*KNOWN_PARAMETERS, *_TRITON_SWITCHES, "execution_mode")
    unknown = sorted(
        key
        for key in parameters
        if key not in known
        and key not in IGNORED_TRITON_PARAMETERS
        and not key.startswith(_ENTRY_PREFIXES)
    )
    if unknown:
        raise ValueError(
            f"parameters: unknown onnxruntime backend parameter(s) {', '.join(unknown)}; "
            f"expected {', '.join(known)}, a session.* or memory.* session config entry, "
            f"or one of Triton's GPU keys ({', '.join(IGNORED_TRITON_PARAMETERS)})"
        )
    ignored = sorted(set(parameters) & set(IGNORED_TRITON_PARAMETERS))
    if ignored:
        logger.warning(
            "parameters %s ignored: they configure ONNX Runtime's GPU providers or shared "
            "sessions, and ONNX Runtime runs on the CPU here",
            ", ".join(ignored),
        )


def _apply_triton_keys(options: ort.SessionOptions, parameters: dict[str, str]) -> None:
    """Triton's execution_mode, enable_mem_arena and enable_mem_pattern, applied as
    Triton's onnxruntime backend applies them."""
    for key in _TRITON_SWITCHES:
        raw = parameters.get(key)
        if raw is None:
            continue
        if raw.strip().lower() not in _SWITCHES:
            raise ValueError(f'parameters.{key}: {raw!r}; expected "0" or "1"')
        on = _SWITCHES[raw.strip().lower()]
        if key == "enable_mem_arena":
            options.enable_cpu_mem_arena = on
        else:
            options.enable_mem_pattern = on
    mode = parameters.get("execution_mode")
    if mode is not None:
        if mode.strip() not in ("0", "1"):
            raise ValueError(
                f'parameters.execution_mode: {mode!r}; expected "0" (sequential) or "1" (parallel)'
            )
        options.execution_mode = (
            ort.ExecutionMode.ORT_PARALLEL
            if mode.strip() == "1"
            else ort.ExecutionMode.ORT_SEQUENTIAL
        )


def _thread_count(parameters: dict[str, str], key: str, default: int) -> int:
    """A thread count parameter: a whole number, 0 leaving ONNX Runtime its own default
    (one thread per physical core), as Triton's onnxruntime backend takes it."""
    raw = parameters.get(key)
    if raw is None:
        return default
    try:
        count = int(raw)
    except ValueError:
        count = -1
    if not 0 <= count <= _MOST_THREADS:
        raise ValueError(
            f"parameters.{key}: {raw!r}; expected a whole number of threads from 0 (ONNX "
            f"Runtime's own default) to {_MOST_THREADS}"
        )
    return count


# Operators that compute an int8 activation scale from the whole of a run's input: in a
# server, from a batch of requests.
_PER_RUN_SCALES = frozenset(
    {"DynamicQuantizeLinear", "DynamicQuantizeMatMul", "DynamicQuantizeLSTM"}
)
_PER_RUN_NAMES = re.compile(rb"DynamicQuantize(?:Linear|MatMul|LSTM)")


def scales_per_run(path: Path) -> bool:
    """Whether the model quantizes activations with one scale per run
    (``DynamicQuantizeLinear``: ONNX Runtime's ``quantize_dynamic``).

    Such a scale is taken over the whole batch in a server, so one request's values
    change how every other request in its batch is quantized (and answered). The file's
    bytes are searched for the operators' names first (a few ms for 100 MB); an ONNX
    file that names one is read to be sure. ``slipstream optimize`` writes per-row scales
    (:mod:`slipstream.optimize.row_scales`), which need none of this.
    """
    if not path.is_file() or path.stat().st_size == 0:
        return False
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if _PER_RUN_NAMES.search(data) is None:
            return False
    try:  # not a dependency of the server: without it, the names are all there is
        import onnx
    except ImportError:  # pragma: no cover
        return True
    if path.suffix.lower() != ".onnx":
        return True  # ONNX Runtime's own format, which onnx cannot read
    model = onnx.load(str(path), load_external_data=False)
    return any(node.op_type in _PER_RUN_SCALES for node in _nodes(model.graph))


def _nodes(graph: Any) -> Iterator[Any]:
    """``graph``'s nodes and those of its subgraphs (If, Loop, Scan bodies)."""
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            if attribute.HasField("g"):
                yield from _nodes(attribute.g)
            for subgraph in attribute.graphs:
                yield from _nodes(subgraph)


def create_session(path: Path, options: ort.SessionOptions) -> ort.InferenceSession:
    """A CPU InferenceSession, created on a thread of its own that then exits.

    With ``session.set_denormal_as_zero``, ONNX Runtime switches flush-to-zero and
    denormals-are-zero on for the thread that creates the session (besides its own pool
    threads), and that CPU state stays. On a thread of ours it would silently zero tiny
    floats in unrelated numpy work afterwards (request decoding, warm-up data, a caller's
    own code); a throwaway thread takes it away with it.
    """
    created: list[ort.InferenceSession] = []
    failed: list[BaseException] = []

    def create() -> None:
        try:
            created.append(
                ort.InferenceSession(
                    str(path), sess_options=options, providers=["CPUExecutionProvider"]
                )
            )
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=create, name="slipstream-ort-session")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return created[0]


class OnnxBackend(Backend):
    """One ONNX Runtime InferenceSession on the CPU execution provider."""

    name = "onnxruntime"
    file_extensions = (".onnx", ".ort")
    releases_gil = True

    def __init__(
        self,
        session: ort.InferenceSession,
        rows_alone: bool = False,
        weight_bytes: int | None = None,
    ) -> None:
        self._session = session
        # The model's initializers' bytes (onnx_weights); None: unknown.
        self._weight_bytes = weight_bytes
        # The model scales its int8 activations per run: a batch runs one row at a time
        # (see scales_per_run), where the model batches.
        self._rows_alone = rows_alone
        self._signature = ModelSignature(
            inputs=tuple(_spec(a) for a in session.get_inputs()),
            outputs=tuple(_spec(a) for a in session.get_outputs()),
        )
        self._string_inputs = {s.name for s in self._signature.inputs if s.datatype == "BYTES"}
        self._shared_dims = _shared_dims(session.get_inputs())
        self._run_options = ort.RunOptions()
        # A run refused for its data is answered 400 with ORT's message; ORT would also
        # log it at ERROR level, once per bad request. Real faults are logged by the
        # batcher, once, so the per-run log stays at FATAL.
        self._run_options.log_severity_level = 4
        self._raw_session = getattr(session, "_sess", None)
        # ORT's Python API takes and returns no numpy bfloat16: such a model's tensors
        # cross as OrtValues (see _run_bf16), the others as plain arrays.
        self._bf16 = any(
            spec.datatype == "BF16" for spec in (*self._signature.inputs, *self._signature.outputs)
        )
        # Whether the first dim is the batch: the config says so (configure), else the file.
        self._batching = self._signature.batch_dim_is_dynamic

    @classmethod
    def load(cls, path: Path, parameters: dict[str, str], instance_count: int) -> OnnxBackend:
        options = session_options(parameters, instance_count)
        scales = parameters.get("activation_scales", "run")
        if scales not in ("row", "run"):
            raise ValueError(
                f'parameters.activation_scales: {scales!r}; expected "run" (the default: one '
                'run per batch) or "row" (a batch runs one row at a time where the model '
                "scales int8 activations per run, so a row's answer does not depend on its "
                "batch mates)"
            )
        rows_alone = scales == "row" and scales_per_run(path)
        if rows_alone:
            logger.info(
                "%s scales its int8 activations per run (DynamicQuantizeLinear): its batches "
                "run one row at a time, so that a row's answer does not depend on its batch "
                "mates (activation_scales: row); slipstream optimize --passes int8-dynamic "
                "--activation-scales row writes per-row scales, which batch",
                path,
            )
        session = create_session(path, options)
        return cls(session, rows_alone=rows_alone, weight_bytes=initializer_bytes(path))

    def configure(self, config: dict[str, Any]) -> None:
        self._batching = bool(config.get("max_batch_size"))

    def signature(self) -> ModelSignature:
        return self._signature

    def run(
        self, inputs: dict[str, np.ndarray], output_names: Sequence[str]
    ) -> dict[str, np.ndarray]:
        feed = inputs
        if self._string_inputs:
            # ORT string tensors take str objects; V2 BYTES arrive as bytes.
            feed = dict(inputs)
            for name in self._string_inputs:
                try:
                    feed[name] = np.vectorize(_as_str, otypes=[object])(inputs[name])
                except UnicodeDecodeError:
                    raise InvalidRequest(
                        f"input {name!r}: BYTES elements must be valid UTF-8 for this model's "
                        "string input"
                    ) from None
        for dim, places in self._shared_dims:
            _check_shared_dim(dim, places, inputs)
        names = list(output_names)
        try:
            results = self._run_rows(names, feed)
        except data_errors.ORT_ERRORS as exc:
            refused = data_errors.ort_data_error(exc)
            if refused is None:
                raise
            raise refused from exc
        return dict(zip(names, results, strict=True))

    def _run_rows(self, names: list[str], feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        if not (self._rows_alone and self._batching):  # the common case, checked first
            return self._run(names, feed)
        rows = min((array.shape[0] for array in feed.values() if array.ndim), default=1)
        if rows <= 1:
            return self._run(names, feed)
        # One run per row: each row's activation scale is its own, as when it runs alone.
        parts = [
            self._run(names, {key: array[row : row + 1] for key, array in feed.items()})
            for row in range(rows)
        ]
        return [np.concatenate([part[index] for part in parts]) for index in range(len(names))]

    def _run(self, names: list[str], feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        # The public InferenceSession.run re-checks input names and types on every call,
        # about 6 us of a 45 us batch-1 MLP run; the scheduler has already checked them
        # against the model's config, so the batch goes to the C++ session directly.
        if self._bf16:
            return _run_bf16(self._session, names, feed, self._run_options)
        if self._raw_session is None:  # pragma: no cover - an ORT without the attribute
            return list(self._session.run(names, feed))
        return list(self._raw_session.run(names, feed, self._run_options))

    def memory_usage(self) -> list[MemoryUsage]:
        """The model's initializers, which the session holds on the CPU (see
        :mod:`.onnx_weights`: a floor, the session's arena not counted)."""
        if self._weight_bytes is None:
            return []
        return [MemoryUsage("CPU", 0, self._weight_bytes)]

    def close(self) -> None:
        del self._session, self._raw_session


def _run_bf16(
    session: ort.InferenceSession,
    names: list[str],
    feed: dict[str, np.ndarray],
    options: ort.RunOptions,
) -> list[np.ndarray]:
    """One run of a model with bfloat16 inputs or outputs: every tensor as an OrtValue
    (a bfloat16 array handed over as its 16-bit patterns, typed BFLOAT16), each
    bfloat16 output copied out of ORT's memory (OrtValue.numpy() refuses the type)."""
    values = {
        name: (
            ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                np.ascontiguousarray(array).view(np.uint16), _ONNX_BFLOAT16
            )
            if array.dtype == BF16
            else ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array))
        )
        for name, array in feed.items()
    }
    results = session.run_with_ort_values(names, values, options)
    return [_bf16_array(value) if value.data_type() == "tensor(bfloat16)" else value.numpy()
            for value in results]  # fmt: skip


# onnx.TensorProto.BFLOAT16, without importing onnx on the serving path.
_ONNX_BFLOAT16 = 16


def _bf16_array(value: ort.OrtValue) -> np.ndarray:
    shape = tuple(value.shape())
    count = math.prod(shape)
    if not count:
        return np.empty(shape, BF16)
    words = (ctypes.c_uint16 * count).from_address(value.data_ptr())
    copied: np.ndarray = np.frombuffer(words, np.uint16).copy()
    bf16: np.ndarray = copied.view(BF16)
    return bf16.reshape(shape)


def _as_str(value: object) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)
