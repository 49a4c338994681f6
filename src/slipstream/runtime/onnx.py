"""ONNX Runtime backend, the default for ``.onnx`` files and ONNX Runtime's own ``.ort`` format.

Thread defaults favour the batcher over ORT's own parallelism: the cores this process may
use are shared out among the model's instances, and ORT's spin-waiting is off, because a
spinning worker steals the core the event loop needs to accept the next requests.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from slipstream.errors import InvalidRequest
from slipstream.runtime import data_errors
from slipstream.runtime.base import Backend, ModelSignature, TensorSpec, usable_cpu_count

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


def session_options(parameters: dict[str, str], instance_count: int) -> ort.SessionOptions:
    """SessionOptions from config ``parameters`` (intra_op_thread_count, ...)."""
    options = ort.SessionOptions()
    default_threads = max(1, usable_cpu_count() // max(1, instance_count))
    options.intra_op_num_threads = int(parameters.get("intra_op_thread_count", default_threads))
    options.inter_op_num_threads = int(parameters.get("inter_op_thread_count", 1))
    spinning = parameters.get("allow_spinning", "0")
    if spinning not in ("0", "1"):  # ORT spins for "1" only: "yes" would silently mean no
        raise ValueError(f'parameters.allow_spinning: {spinning!r}; expected "0" or "1"')
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
    if parameters.get("denormal_as_zero", "1") not in ("0", "false"):
        options.add_session_config_entry("session.set_denormal_as_zero", "1")
    return options


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

    def __init__(self, session: ort.InferenceSession) -> None:
        self._session = session
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

    @classmethod
    def load(cls, path: Path, parameters: dict[str, str], instance_count: int) -> OnnxBackend:
        return cls(create_session(path, session_options(parameters, instance_count)))

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
            results = self._run(names, feed)
        except data_errors.ORT_ERRORS as exc:
            refused = data_errors.ort_data_error(exc)
            if refused is None:
                raise
            raise refused from exc
        return dict(zip(names, results, strict=True))

    def _run(self, names: list[str], feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        # The public InferenceSession.run re-checks input names and types on every call,
        # about 6 us of a 45 us batch-1 MLP run; the scheduler has already checked them
        # against the model's config, so the batch goes to the C++ session directly.
        if self._raw_session is None:  # pragma: no cover - an ORT without the attribute
            return list(self._session.run(names, feed))
        return list(self._raw_session.run(names, feed, self._run_options))

    def close(self) -> None:
        del self._session, self._raw_session


def _as_str(value: object) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)
