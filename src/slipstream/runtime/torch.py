"""The torch backend: TorchScript archives (``.pt``) and torch.export programs (``.pt2``).

Where the signature comes from:

* ``.pt2`` (``torch.export.save``): from the exported program itself. Input names are
  the ``forward`` parameter names; outputs are named after the returned structure: the
  keys of a returned dict, ``output`` for a single tensor, ``output_0``, ``output_1``, ...
  for a tuple. Dims exported as dynamic (``torch.export.Dim``) are -1; export the batch
  dim as dynamic or the model is served without batching; a bound on it
  (``Dim("batch", max=N)``) is kept, and larger batches run in parts of N rows. A
  bfloat16 program takes FP32 and returns FP32 (numpy has no bfloat16); its inputs are
  cast to bfloat16 before it runs (:mod:`slipstream.runtime.torch_export`).
  ``torch.export.load`` unpickles the weights, so a ``.pt2`` loads only with
  ``trust_pickle: true`` in the model's config.yaml (or ``slipstream serve
  --trust-pickle``).
* ``.pt`` (TorchScript) carries no reliable tensor signature. A model may declare one
  by embedding ``slipstream_signature.json`` in the archive (see
  :func:`signature_to_json`)::

      torch.jit.save(scripted, "model.pt", _extra_files={
          SIGNATURE_FILE: signature_to_json(ModelSignature(
              inputs=(TensorSpec("input", "FP32", (-1, 256)),),
              outputs=(TensorSpec("output", "FP32", (-1, 10)),),
          ))
      })

  Without it, ``signature()`` returns no inputs and no outputs, and the repository
  requires ``input`` and ``output`` in ``config.yaml``. ``run()`` then passes the inputs
  to ``forward`` positionally in the order of the ``inputs`` dict (config order), and
  maps a returned tuple positionally onto ``output_names``, which must then list every
  output in the order ``forward`` returns them. A returned dict is matched by key.

Outputs are answered in the datatypes and dims the completed config declares
(:mod:`slipstream.runtime.declared`): a ``float64`` output of a model declared FP32 is
cast to FP32; one of other dims, or an integer where a float is declared, fails the run
naming the output, and so the model's load, at its warm-up.

Parameters (config.yaml ``parameters``):

* ``intra_op_thread_count``: torch's intra-op threads on the CPU. Given, it is kept. Not
  given, it starts at the usable cores divided by the instance count and follows the
  host's load: while the kernel's CPU pressure says the cores are crowded (another
  process, the server's own front ends, a load generator), an instance gives up a
  thread, and tries one more once they are calm (:mod:`slipstream.runtime.cpu_share`).
  torch's OpenMP threads wait for each other after every op, so a thread that loses its
  core stalls the others: beside one busy process an MLP ran 2.6x slower on 2 threads
  than on 1 here (``benchmarks/torch_threads.py``).
* ``device``: ``cpu`` (default) or ``cuda`` / ``cuda:N``. A ``.pt2`` exported on another
  device (the CPU, usually) is moved with its burnt-in device arguments, so it serves.
  On CUDA each instance has its own stream and pinned staging buffers
  (:mod:`slipstream.runtime.torch_cuda`); give the model ``instance_count: 2`` or more
  so one batch's copies overlap the next one's compute.
* ``precision``: ``fp32`` (default; the model's own dtypes), ``fp16`` or ``bf16``.
  Floating-point inputs are cast on the device and outputs are returned in the
  datatypes the model declares, so clients see no difference beyond rounding.
* ``precision_mode``: ``cast`` (default: the weights are cast once, as ``model.half()``
  does) or ``autocast`` (weights stay FP32, ``torch.autocast`` picks per op: for models
  whose graph hard-codes FP32 somewhere a cast breaks).
* ``cuda_graph_batch_sizes``: CUDA only; comma-separated batch sizes (``1,2,4,8,16``)
  to capture CUDA graphs for. A batch is padded up to the next listed size and replayed
  as one graph, captured the first time that size and those per-row shapes are seen;
  larger batches run eagerly. Worth it where launch overhead dominates: small batches,
  and an event loop sharing the GIL.

Example config.yaml for a TorchScript model without an embedded signature::

    backend: torch
    max_batch_size: 32
    input: [{name: input, data_type: TYPE_FP32, dims: [256]}]
    output: [{name: output, data_type: TYPE_FP32, dims: [10]}]
    parameters: {intra_op_thread_count: "4"}
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from slipstream.datatypes import BF16, V2_TO_NUMPY, from_config_datatype, numpy_dtype
from slipstream.errors import InvalidRequest
from slipstream.runtime.base import Backend, ModelSignature, TensorSpec, usable_cpu_count
from slipstream.runtime.cpu_share import (
    AppliedThreads,
    GovernedThreads,
    ThreadGovernor,
    pressure_source,
)
from slipstream.runtime.data_errors import torch_data_error
from slipstream.runtime.declared import DeclaredOutputs
from slipstream.runtime.torch_arrays import as_array, as_tensor
from slipstream.runtime.torch_cuda import (
    CudaRunner,
    Precision,
    is_out_of_memory,
    out_of_memory_line,
    torch_dtype,
)
from slipstream.runtime.torch_export import CastInputs, Model, load_exported
from slipstream.types import MemoryUsage, total_memory

logger = logging.getLogger(__name__)

# Name of the signature file a TorchScript archive may embed (torch.jit.save _extra_files).
SIGNATURE_FILE = "slipstream_signature.json"

_KNOWN_PARAMETERS = (
    "intra_op_thread_count",
    "device",
    "precision",
    "precision_mode",
    "cuda_graph_batch_sizes",
)
_PRECISIONS = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class TorchParameters:
    """The backend options read from config.yaml ``parameters``."""

    # Threads torch uses inside one op (the most, where governed).
    intra_op_thread_count: int
    # Where the model's weights live and its batches run.
    device: torch.device
    # The compute dtype for fp16/bf16; None runs the model in its own dtypes.
    dtype: torch.dtype | None = None
    # Under fp16/bf16: torch.autocast per op instead of casting the weights.
    autocast: bool = False
    # CUDA graph batch sizes, ascending; empty = no graphs.
    graph_batch_sizes: tuple[int, ...] = ()
    # intra_op_thread_count was given: keep it whatever the host's load.
    fixed_threads: bool = True

    @classmethod
    def parse(cls, parameters: Mapping[str, str], instance_count: int) -> TorchParameters:
        """Validate ``parameters``; ValueError names the offending key and value."""
        unknown = sorted(set(parameters) - set(_KNOWN_PARAMETERS))
        if unknown:
            raise ValueError(
                f"parameters: unknown torch backend parameter(s) {', '.join(unknown)}; "
                f"expected {', '.join(_KNOWN_PARAMETERS)}"
            )
        default_threads = max(1, usable_cpu_count() // max(1, instance_count))
        raw_threads = parameters.get("intra_op_thread_count", str(default_threads))
        try:
            threads = int(raw_threads)
        except ValueError:
            threads = 0
        if threads < 1:
            raise ValueError(
                f"parameters.intra_op_thread_count: expected a positive integer, "
                f"got {raw_threads!r}"
            )
        raw_device = parameters.get("device", "cpu")
        try:
            device = torch.device(raw_device)
        except RuntimeError:
            device = torch.device("meta")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"parameters.device: expected cpu, cuda or cuda:N, got {raw_device!r}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"parameters.device: {raw_device!r} requested but this torch build sees "
                "no CUDA device; set device: cpu or install a CUDA build of torch"
            )
        precision = parameters.get("precision", "fp32")
        if precision not in _PRECISIONS:
            raise ValueError(
                f"parameters.precision: expected fp32, fp16 or bf16, got {precision!r}"
            )
        mode = parameters.get("precision_mode", "cast")
        if mode not in ("cast", "autocast"):
            raise ValueError(f"parameters.precision_mode: expected cast or autocast, got {mode!r}")
        sizes = _parse_graph_sizes(parameters.get("cuda_graph_batch_sizes", ""))
        if sizes and device.type != "cuda":
            raise ValueError(
                "parameters.cuda_graph_batch_sizes: CUDA graphs need device: cuda; "
                f"this model runs on {raw_device!r}"
            )
        return cls(
            intra_op_thread_count=threads,
            device=device,
            dtype=_PRECISIONS[precision],
            autocast=mode == "autocast",
            graph_batch_sizes=sizes,
            fixed_threads="intra_op_thread_count" in parameters,
        )


def _thread_count(parameters: TorchParameters) -> AppliedThreads:
    """The intra-op threads of an instance's runs: governed on the CPU where no count was
    given and the kernel keeps CPU pressure (PSI), else fixed."""
    most = parameters.intra_op_thread_count
    if not parameters.fixed_threads and most > 1 and parameters.device.type == "cpu":
        stalled_us = pressure_source()
        if stalled_us is not None:
            return GovernedThreads(ThreadGovernor(most, stalled_us), torch.set_num_threads)
        logger.debug("no CPU pressure information (PSI) here: %d torch threads throughout", most)
    return AppliedThreads(most, torch.set_num_threads)


def _parse_graph_sizes(raw: str) -> tuple[int, ...]:
    if not raw.strip():
        return ()
    try:
        sizes = {int(part) for part in raw.split(",") if part.strip()}
    except ValueError:
        sizes = {0}
    if not sizes or min(sizes) < 1:
        raise ValueError(
            "parameters.cuda_graph_batch_sizes: expected positive batch sizes separated by "
            f"commas (e.g. '1,2,4,8'), got {raw!r}"
        )
    return tuple(sorted(sizes))


class TorchBackend(Backend):
    """One loaded TorchScript module or exported program; see the module docstring."""

    name: ClassVar[str] = "torch"
    file_extensions: ClassVar[tuple[str, ...]] = (".pt", ".pt2")
    # TorchScript drops the GIL for the whole forward; exported programs drop it per op.
    releases_gil: ClassVar[bool] = True
    pickle_free_format: ClassVar[str] = (
        "save it as TorchScript (torch.jit.script(model).save('model.pt')) or export it "
        "to ONNX (torch.onnx.export)"
    )

    def __init__(
        self,
        model: Model,
        signature: ModelSignature,
        parameters: TorchParameters,
    ) -> None:
        self._model: Model | None = model
        self._signature = signature
        self._device = parameters.device
        self._input_names = tuple(spec.name for spec in signature.inputs)
        self._output_names = tuple(spec.name for spec in signature.outputs)
        self._precision = Precision(
            dtype=parameters.dtype,
            autocast=parameters.autocast,
            output_dtypes={
                spec.name: torch_dtype(numpy_dtype(spec.datatype))
                for spec in signature.outputs
                if spec.datatype in V2_TO_NUMPY and spec.datatype != "BYTES"
            },
        )
        self._cuda: CudaRunner | None = None
        self._threads = _thread_count(parameters)
        # The config's outputs (configure() sets them); until then nothing is checked
        # and the signature says whether the first dim is the batch.
        self._declared = DeclaredOutputs({}, batching=signature.batch_dim_is_dynamic)
        if self._device.type == "cuda":
            if (
                parameters.graph_batch_sizes
                and signature.inputs
                and not all(spec.shape and spec.shape[0] == -1 for spec in signature.inputs)
            ):
                raise ValueError(
                    "parameters.cuda_graph_batch_sizes: the model's inputs have no variable "
                    "batch dim, so its batches cannot be padded to a graph's size"
                )
            self._cuda = CudaRunner(
                model,
                self._device,
                precision=self._precision,
                graph_batch_sizes=parameters.graph_batch_sizes,
                name_outputs=self._name_outputs,
            )

    @classmethod
    def load(cls, path: Path, parameters: dict[str, str], instance_count: int) -> TorchBackend:
        options = TorchParameters.parse(parameters, instance_count)
        try:
            if path.suffix.lower() == ".pt2":
                model, signature = load_exported(path, options.device)
            else:
                model, signature = _load_torchscript(path, options.device)
            if options.dtype is not None and not options.autocast:
                model = model.to(options.dtype)  # type: ignore[attr-defined]
        except RuntimeError as exc:
            if not is_out_of_memory(exc):
                raise
            raise ValueError(
                f"{path.name}: out of GPU memory loading onto {options.device} "
                f"({out_of_memory_line(exc)})"
            ) from None
        return cls(model, signature, options)

    @classmethod
    def loads_pickle(cls, path: Path) -> bool:
        # torch.export.load unpickles a .pt2's weights and constants (weights_only=False).
        # TorchScript archives are read by TorchScript's own restricted unpickler.
        return path.suffix.lower() == ".pt2"

    def signature(self) -> ModelSignature:
        return self._signature

    @property
    def cpu_threads(self) -> int | None:
        return None if self._cuda is not None else self._threads.threads

    def configure(self, config: dict[str, Any]) -> None:
        self._declared = DeclaredOutputs.from_config(config)
        configured = int(config.get("max_batch_size") or 0)
        bound = self._signature.max_batch_size
        if bound is not None and configured > bound:
            logger.info(
                "%s: max_batch_size %d is above the %d rows the program's batch dim takes "
                "(its torch.export Dim max); larger batches run in parts of %d rows",
                config.get("name", "model"), configured, bound, bound,
            )  # fmt: skip

    def run(
        self, inputs: dict[str, np.ndarray], output_names: Sequence[str]
    ) -> dict[str, np.ndarray]:
        model = self._model
        if model is None:
            raise RuntimeError("torch backend: run() called after close()")
        names = self._input_names or tuple(inputs)
        arrays = [self._array(name, inputs) for name in names]
        bound = self._signature.max_batch_size
        rows = arrays[0].shape[0] if arrays and arrays[0].ndim else 0
        if bound is not None and self._declared.batching and rows > bound:
            # The program's guard refuses more rows than its Dim's max: run it in parts.
            parts = [
                self._run_once(
                    model, names, [array[start : start + bound] for array in arrays], output_names
                )
                for start in range(0, rows, bound)
            ]
            results = {
                name: np.concatenate([part[name] for part in parts]) for name in output_names
            }
        else:
            results = self._run_once(model, names, arrays, output_names)
        return {name: self._conform(name, array) for name, array in results.items()}

    def _conform(self, name: str, array: np.ndarray) -> np.ndarray:
        """The output in its declared datatype; bfloat16 that no config declares, as the
        FP32 a signature advertises for it (clients without bfloat16 arrays)."""
        if name not in self._declared.outputs and array.dtype == BF16:
            return array.astype(np.float32)
        return self._declared.conform(name, array)

    def _run_once(
        self,
        model: Model,
        names: Sequence[str],
        arrays: list[np.ndarray],
        output_names: Sequence[str],
    ) -> dict[str, np.ndarray]:
        with torch.inference_mode():
            try:
                if self._cuda is not None:
                    return self._cuda.run(names, arrays, output_names)
                tensors = [as_tensor(_writable(array)) for array in arrays]
                self._threads.before()
                try:
                    named = self._precision.forward(
                        model, tensors, output_names, self._name_outputs
                    )
                finally:
                    self._threads.after()
            except (IndexError, RuntimeError) as exc:
                refused = torch_data_error(exc)
                if refused is None:
                    raise
                raise refused from exc
            return {name: _to_numpy(named, name) for name in output_names}

    def memory_usage(self) -> list[MemoryUsage]:
        """The module's parameters and buffers, each storage once, per device (what its
        weights hold; activations and CUDA graphs' pools are not counted)."""
        model = self._model.module if isinstance(self._model, CastInputs) else self._model
        if not isinstance(model, torch.nn.Module):
            return []
        storages: dict[tuple[str, int, int], int] = {}
        for tensor in (*model.parameters(), *model.buffers()):
            device = tensor.device
            if device.type == "cpu":
                kind, index = "CPU", 0
            elif device.type == "cuda":
                kind = "GPU"
                index = device.index if device.index is not None else torch.cuda.current_device()
            else:  # meta tensors hold nothing; other devices have no Triton name
                continue
            storage = tensor.untyped_storage()
            storages[kind, index, storage.data_ptr()] = storage.nbytes()
        return total_memory(
            MemoryUsage(kind, index, size) for (kind, index, _), size in storages.items()
        )

    def close(self) -> None:
        self._model = None
        self._cuda = None

    def _array(self, name: str, inputs: dict[str, np.ndarray]) -> np.ndarray:
        try:
            array = inputs[name]
        except KeyError:
            raise InvalidRequest(f"inputs: missing input {name!r}") from None
        if array.dtype.kind in ("O", "U", "S"):
            raise InvalidRequest(f"inputs.{name}: the torch backend takes no BYTES tensors")
        return array

    def _name_outputs(self, result: Any, output_names: Sequence[str]) -> dict[str, Any]:
        if isinstance(result, Mapping):
            return {str(key): value for key, value in result.items()}
        values: list[Any] = list(result) if isinstance(result, (tuple, list)) else [result]
        names = self._output_names or tuple(output_names)
        if len(values) != len(names):
            source = "the model's signature" if self._output_names else "output_names"
            raise RuntimeError(
                f"torch backend: the model returned {len(values)} output(s) but "
                f"{source} lists {len(names)} ({', '.join(names)}); list every output in "
                "config.yaml `output` in the order forward() returns them"
            )
        return dict(zip(names, values, strict=True))


def _writable(array: np.ndarray) -> np.ndarray:
    """``array``, copied if torch cannot wrap it as it is.

    Wire decoders hand out read-only views of the request body, which torch cannot wrap
    without a warning (and a model may write to its inputs in place). Batches of several
    requests are fresh arrays already, so only single-request batches pay for this copy.
    """
    if array.flags.writeable and array.flags.c_contiguous:
        return array
    return np.array(array, order="C")


def _to_numpy(named: dict[str, Any], name: str) -> np.ndarray:
    try:
        value = named[name]
    except KeyError:
        raise RuntimeError(
            f"torch backend: the model returned no output {name!r}; "
            f"it returned {', '.join(named) or 'nothing'}"
        ) from None
    if not isinstance(value, torch.Tensor):
        raise RuntimeError(
            f"torch backend: output {name!r} is a {type(value).__name__}, not a tensor"
        )
    return as_array(value.detach().cpu())


def _load_torchscript(path: Path, device: torch.device) -> tuple[Model, ModelSignature]:
    extra_files: dict[str, Any] = {SIGNATURE_FILE: ""}
    try:
        module = torch.jit.load(  # type: ignore[no-untyped-call]
            str(path), map_location=device, _extra_files=extra_files
        )
    except RuntimeError as exc:
        if is_out_of_memory(exc):
            raise
        raise ValueError(
            f"{path.name}: not a TorchScript archive ({str(exc).splitlines()[0]}); save the "
            "model with torch.jit.script(model).save(path), or export it with "
            "torch.export.save(torch.export.export(model, args), 'model.pt2')"
        ) from None
    module.eval()
    declared = extra_files[SIGNATURE_FILE]
    if not declared:
        return module, ModelSignature(inputs=(), outputs=())
    text = declared.decode() if isinstance(declared, bytes) else str(declared)
    return module, signature_from_json(text, source=f"{path.name}:{SIGNATURE_FILE}")


def signature_to_json(signature: ModelSignature) -> str:
    """The ``slipstream_signature.json`` text that declares a TorchScript model's signature.

    Example::

        sig = ModelSignature(
            inputs=(TensorSpec("input", "FP32", (-1, 4)),),
            outputs=(TensorSpec("output", "FP32", (-1, 3)),),
        )
        torch.jit.save(scripted, "model.pt", _extra_files={SIGNATURE_FILE: signature_to_json(sig)})
    """

    def specs(items: tuple[TensorSpec, ...]) -> list[dict[str, Any]]:
        return [{"name": s.name, "datatype": s.datatype, "shape": list(s.shape)} for s in items]

    return json.dumps({"inputs": specs(signature.inputs), "outputs": specs(signature.outputs)})


def signature_from_json(text: str, source: str = SIGNATURE_FILE) -> ModelSignature:
    """Parse :func:`signature_to_json` output; ValueError names the bad entry."""
    try:
        data = json.loads(text)
        return ModelSignature(
            inputs=tuple(_spec_from_json(item) for item in data["inputs"]),
            outputs=tuple(_spec_from_json(item) for item in data["outputs"]),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{source}: invalid signature ({exc}); expected "
            '{"inputs": [{"name": ..., "datatype": "FP32", "shape": [-1, 4]}], "outputs": [...]}'
        ) from None


def _spec_from_json(item: dict[str, Any]) -> TensorSpec:
    shape = tuple(int(dim) for dim in item["shape"])
    if any(dim < -1 or dim == 0 for dim in shape):
        raise ValueError(f"{item['name']}: each dim must be -1 or > 0, got {list(shape)}")
    return TensorSpec(
        name=str(item["name"]),
        datatype=from_config_datatype(str(item["datatype"])),
        shape=shape,
    )
