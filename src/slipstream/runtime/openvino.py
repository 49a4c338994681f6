"""OpenVINO backend (``backend: openvino``): OpenVINO IR or ONNX files on OpenVINO's CPU plugin.

A model directory holds either ``model.xml`` (OpenVINO IR; its weights, ``model.bin``,
beside it, as ``openvino.save_model`` writes them) or ``model.onnx`` with
``backend: openvino`` in its config.yaml (OpenVINO reads ONNX itself). Needs the
``openvino`` extra: ``pip install 'slipstream[openvino]'``.

Parameters (config.yaml ``parameters``):

* ``intra_op_thread_count``: threads of one inference (OpenVINO's
  ``INFERENCE_NUM_THREADS``); default: the usable cores divided by the instance count,
  as the ONNX Runtime backend shares them, so ``slipstream tune``'s threads dimension
  means the same for both backends.
* ``inference_precision``: ``f32`` (default), ``bf16`` or ``f16``. On CPUs with
  AVX512-BF16 or AMX, OpenVINO's own default is bf16, which moves outputs by about 1e-3;
  f32 keeps them equal to ONNX Runtime's to ~1e-6. ``bf16`` is the faster choice where
  the model tolerates it (the accuracy gate of ``slipstream optimize`` measures that).
* ``performance_hint``: ``LATENCY`` (default: one stream per instance; the batcher
  makes the batches and ``instance_group.count`` the parallelism) or ``THROUGHPUT``.

``device`` may only be ``cpu``. Another key (ONNX Runtime's ``denormal_as_zero``, a
typo) fails the model's load naming it and the keys above, as the other backends refuse
theirs.

Each instance is one compiled model and one infer request; ``run`` is called by one
thread at a time per instance and releases the GIL while OpenVINO computes.

Unlike ONNX Runtime, OpenVINO does not check a request's values against the graph: a
token id past the end of an embedding table reads a row of zeros instead of being
refused with a 400. Files OpenVINO cannot read (ONNX-ML operators such as
scikit-learn's LinearClassifier) fail the model's load with its list of operators.

Example config.yaml::

    backend: openvino
    max_batch_size: 32
    instance_group: [{count: 2}]
    parameters: {intra_op_thread_count: "1"}
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov

from slipstream.datatypes import BF16
from slipstream.runtime.base import (
    Backend,
    ModelSignature,
    TensorSpec,
    check_cpu_device,
    usable_cpu_count,
)

logger = logging.getLogger(__name__)

# OpenVINO element type names -> V2 datatypes.
_OV_TO_V2 = {
    "boolean": "BOOL",
    "u8": "UINT8",
    "u16": "UINT16",
    "u32": "UINT32",
    "u64": "UINT64",
    "i8": "INT8",
    "i16": "INT16",
    "i32": "INT32",
    "i64": "INT64",
    "f16": "FP16",
    "f32": "FP32",
    "f64": "FP64",
    "bf16": "BF16",
}
# The config ``parameters`` this backend reads; any other key is refused, naming it.
KNOWN_PARAMETERS = ("intra_op_thread_count", "inference_precision", "performance_hint", "device")
_PRECISIONS = ("f32", "bf16", "f16")
_HINTS = ("LATENCY", "THROUGHPUT")
# More threads than this is a typo, not a machine.
_MOST_THREADS = 4096
# File types OpenVINO reads here: its IR and ONNX.
_SUFFIXES = (".xml", ".onnx")

_core: ov.Core | None = None
# Models load on worker threads, several at once at start-up.
_core_lock = threading.Lock()


def core() -> ov.Core:
    """The process's one OpenVINO Core (it holds the plugins; creating one costs ~50 ms)."""
    global _core
    with _core_lock:
        if _core is None:
            _core = ov.Core()
        return _core


def compile_properties(parameters: dict[str, str], instance_count: int) -> dict[str, Any]:
    """The CPU plugin's properties from config ``parameters``; ValueError names the key
    and the values it takes, or the unknown key and the known ones."""
    unknown = sorted(set(parameters) - set(KNOWN_PARAMETERS))
    if unknown:
        raise ValueError(
            f"parameters: unknown openvino backend parameter(s) {', '.join(unknown)}; "
            f"expected {', '.join(KNOWN_PARAMETERS)}"
        )
    check_cpu_device("openvino", parameters)
    default_threads = max(1, usable_cpu_count() // max(1, instance_count))
    threads = parameters.get("intra_op_thread_count", str(default_threads))
    if not (threads.isascii() and threads.isdigit()) or not 1 <= int(threads) <= _MOST_THREADS:
        raise ValueError(
            f"parameters.intra_op_thread_count: {threads!r}; expected a whole number of "
            f"threads from 1 to {_MOST_THREADS}"
        )
    raw_precision = parameters.get("inference_precision", "f32")
    precision = raw_precision.lower()
    if precision not in _PRECISIONS:
        raise ValueError(
            f"parameters.inference_precision: {raw_precision!r}; expected one of "
            + ", ".join(_PRECISIONS)
        )
    raw_hint = parameters.get("performance_hint", "LATENCY")
    hint = raw_hint.upper()
    if hint not in _HINTS:
        raise ValueError(
            f"parameters.performance_hint: {raw_hint!r}; expected one of {', '.join(_HINTS)}"
        )
    return {
        "INFERENCE_NUM_THREADS": int(threads),
        "INFERENCE_PRECISION_HINT": precision,
        "PERFORMANCE_HINT": hint,
        # Several instances of a model (and the event loop) share the cores: threads
        # pinned to cores would pile every instance onto the same ones.
        "ENABLE_CPU_PINNING": False,
    }


def _spec(port: Any) -> TensorSpec:
    name = port.get_any_name()
    type_name = port.get_element_type().get_type_name()
    datatype = _OV_TO_V2.get(type_name)
    if datatype is None:
        raise ValueError(f"tensor {name!r} has unsupported type {type_name}")
    shape = port.get_partial_shape()
    if shape.rank.is_dynamic:
        raise ValueError(f"tensor {name!r} has no fixed rank; OpenVINO models need one here")
    dims = tuple(-1 if d.is_dynamic else int(d.get_length()) for d in shape)
    return TensorSpec(name=name, datatype=datatype, shape=dims)


def _summary(exc: RuntimeError) -> str:
    """OpenVINO's message without the C++ source locations it starts with."""
    text = str(exc)
    if "Summary:" in text:
        text = text.split("Summary:", 1)[1]
    lines = [line.strip(" -") for line in text.splitlines() if line.strip()]
    kept = [line for line in lines if not line.startswith(("Exception from", "Check "))]
    return "; ".join(kept or lines)


def _indexes(ports: Any) -> dict[str, int]:
    found: dict[str, int] = {}
    for index, port in enumerate(ports):
        for name in port.get_names():
            found.setdefault(name, index)
    return found


class OpenVinoBackend(Backend):
    """One compiled OpenVINO model and its infer request, on the CPU plugin."""

    name = "openvino"
    file_extensions = (".xml",)
    releases_gil = True

    def __init__(self, model: Any, compiled: Any) -> None:
        self._signature = ModelSignature(
            inputs=tuple(_spec(p) for p in model.inputs),
            outputs=tuple(_spec(p) for p in model.outputs),
        )
        self._compiled = compiled
        self._request = compiled.create_infer_request()
        # Name -> index: requests name tensors, the infer request numbers them.
        self._input_index = _indexes(model.inputs)
        self._output_index = _indexes(model.outputs)

    @classmethod
    def load(cls, path: Path, parameters: dict[str, str], instance_count: int) -> OpenVinoBackend:
        if path.suffix.lower() not in _SUFFIXES:
            raise ValueError(
                f"{path.name}: the openvino backend reads OpenVINO IR (model.xml with its "
                "model.bin) or ONNX (model.onnx)"
            )
        if path.suffix.lower() == ".xml" and not path.with_suffix(".bin").is_file():
            raise FileNotFoundError(
                f"{path.with_suffix('.bin')}: the IR's weights are missing; keep "
                f"{path.with_suffix('.bin').name} beside {path.name}"
            )
        properties = compile_properties(parameters, instance_count)
        try:
            model = core().read_model(str(path))
        except RuntimeError as exc:
            raise ValueError(
                f"{path.name}: OpenVINO cannot read it: {_summary(exc)} (serve it with "
                "backend: onnxruntime, or export it with operators OpenVINO supports)"
            ) from None
        compiled = core().compile_model(model, "CPU", properties)
        logger.debug("compiled %s for the CPU with %s", path, properties)
        return cls(model, compiled)

    def signature(self) -> ModelSignature:
        return self._signature

    def run(
        self, inputs: dict[str, np.ndarray], output_names: Sequence[str]
    ) -> dict[str, np.ndarray]:
        # Tensors set by index over the arrays' own memory, then a bare infer(): about
        # 8 us a call less than infer(dict), which wraps every output (a 64-feature
        # classifier: 25 instead of 32 us a run). The outputs are the request's own
        # buffers, which the next run overwrites: the requested ones are copied out.
        # OpenVINO shares only writeable memory: an array over a request's read-only
        # bytes (a gRPC raw content) is copied, any other is used in place.
        request = self._request
        for name, array in inputs.items():
            if array.dtype == BF16:
                tensor = _bf16_tensor(array)
            else:
                tensor = ov.Tensor(np.require(array, requirements=("C", "W")), shared_memory=True)
            request.set_input_tensor(self._input_index[name], tensor)
        request.infer()
        return {
            name: _array(request.get_output_tensor(self._output_index[name]))
            for name in output_names
        }

    def close(self) -> None:
        del self._request, self._compiled


# OpenVINO's Python API knows no ml_dtypes bfloat16, and shows a bf16 tensor's data as
# float16 (other numbers from the same bits): bfloat16 crosses as its 16-bit patterns.


def _bf16_tensor(array: np.ndarray) -> ov.Tensor:
    tensor = ov.Tensor(ov.Type.bf16, ov.Shape(list(array.shape)))
    tensor.data.view(np.uint16)[...] = array.view(np.uint16)
    return tensor


def _array(tensor: ov.Tensor) -> np.ndarray:
    """A copy of an output tensor's data (the request's buffer is reused)."""
    data: np.ndarray = tensor.data
    if tensor.element_type == ov.Type.bf16:
        return data.view(np.uint16).copy().view(BF16)
    copied: np.ndarray = data.copy()
    return copied
