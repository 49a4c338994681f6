"""Running one torch model instance's batches on a CUDA device.

What :class:`CudaRunner` adds to a plain ``model(*tensors)`` call, each for a measured
reason (docs/gpu.md has the figures):

* **Its own CUDA stream per instance.** The batcher runs each instance in its own thread;
  with a stream each, one instance's copies overlap another's compute (Triton's
  ``instance_group: [{kind: KIND_GPU, count: N}]``).
* **Pinned host buffers, asynchronous copies.** Inputs are written into page-locked
  staging buffers (grown as needed, reused batch after batch) and copied to the device
  with ``non_blocking=True``; outputs come back the same way, with one stream
  synchronisation per batch. Pageable copies are synchronous and slower.
* **Precision.** ``fp16`` / ``bf16`` cast the weights (``cast``) or run under
  ``torch.autocast`` (``autocast``); floating-point inputs are cast on the device and
  outputs are returned in the datatype the FP32 model declares.
* **CUDA graphs** for listed batch sizes: a batch is padded up to the next listed size
  (rows are independent in any batching model) and replayed from a graph captured the
  first time that size and those per-row shapes are seen. One replay is one call, so the
  forward no longer needs the GIL for every kernel launch (DESIGN.md, GPU section). A
  model that cannot be captured runs eagerly, with one warning.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from slipstream.errors import Unavailable
from slipstream.runtime.torch_arrays import as_array, as_tensor

logger = logging.getLogger(__name__)

# At most this many graphs per instance (one per batch size and per-row shape): a model
# with variable per-row dims would otherwise capture one per sequence length it meets.
MAX_GRAPHS = 64

# (padded batch size, ((per-row shape, dtype) for each input))
_GraphKey = tuple[int, tuple[tuple[tuple[int, ...], str], ...]]
# Names a model's raw result: (result, requested output names) -> {name: tensor}.
Namer = Callable[[Any, Sequence[str]], dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Precision:
    """How a model runs in fp16/bf16: inputs cast in, outputs cast back to FP32's dtypes."""

    # The compute dtype; None runs the model in its own dtypes (and changes nothing).
    dtype: torch.dtype | None
    # torch.autocast per op instead of weights cast once at load.
    autocast: bool
    # Each output's dtype as the FP32 model declares it (missing: FP32 for half types).
    output_dtypes: dict[str, torch.dtype]

    def forward(
        self,
        model: Callable[..., Any],
        tensors: list[torch.Tensor],
        output_names: Sequence[str],
        name_outputs: Namer,
    ) -> dict[str, Any]:
        """``model(*tensors)`` in this precision, outputs named and cast back."""
        if self.dtype is None:
            return name_outputs(model(*tensors), output_names)
        if self.autocast:
            # No weight-cast cache: it would outlive a graph capture (eager runs recast anyway).
            with torch.autocast(tensors[0].device.type, dtype=self.dtype, cache_enabled=False):
                result = model(*tensors)
        else:
            dtype = self.dtype
            result = model(*(t.to(dtype) if t.is_floating_point() else t for t in tensors))
        named = name_outputs(result, output_names)
        return {name: self._cast_output(name, named.get(name)) for name in output_names}

    def _cast_output(self, name: str, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value  # the caller names what is wrong
        wanted = self.output_dtypes.get(name)
        if wanted is None and value.dtype in (torch.float16, torch.bfloat16):
            wanted = torch.float32
        return value if wanted is None or value.dtype == wanted else value.to(wanted)


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]
    outputs: dict[str, torch.Tensor]


class CudaRunner:
    """Runs batches of one model instance on one CUDA device; see the module docstring."""

    def __init__(
        self,
        model: Callable[..., Any],
        device: torch.device,
        *,
        precision: Precision,
        graph_batch_sizes: tuple[int, ...],
        name_outputs: Namer,
    ) -> None:
        self._model = model
        self._device = device
        self._precision = precision
        self._graph_sizes = tuple(sorted(graph_batch_sizes))
        self._name_outputs = name_outputs
        self._stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self._staging: dict[str, torch.Tensor] = {}
        self._graphs: dict[_GraphKey, _Graph] = {}
        self._pool: Any = None
        self._graphs_failed = False

    @property
    def graph_count(self) -> int:
        """Graphs captured so far."""
        return len(self._graphs)

    def run(
        self, names: Sequence[str], arrays: Sequence[np.ndarray], output_names: Sequence[str]
    ) -> dict[str, np.ndarray]:
        """One batch: upload, forward (eager or a graph replay), download, synchronise."""
        rows = arrays[0].shape[0] if arrays and arrays[0].ndim else 0
        try:
            with torch.cuda.stream(self._stream):
                host = [self._stage(name, array) for name, array in zip(names, arrays, strict=True)]
                graph = self._graph_for(host, rows, output_names)
                if graph is not None:
                    for static, staged in zip(graph.inputs, host, strict=True):
                        static[:rows].copy_(staged, non_blocking=True)
                    graph.graph.replay()
                    named = {name: graph.outputs[name][:rows] for name in output_names}
                else:
                    tensors = [t.to(self._device, non_blocking=True) for t in host]
                    named = self._forward(tensors, output_names)
                downloads = {name: self._download(name, named, rows) for name in output_names}
            self._stream.synchronize()
        except RuntimeError as exc:
            # TorchScript re-raises the allocator's OutOfMemoryError as a RuntimeError.
            if not is_out_of_memory(exc):
                raise
            torch.cuda.empty_cache()
            raise Unavailable(
                f"the GPU ran out of memory running a batch of {rows} rows "
                f"({out_of_memory_line(exc)}); retry with a smaller batch, lower "
                "max_batch_size or instance count, or free GPU memory",
                retry_after_s=1,
            ) from None
        # The staging buffers are reused by the next batch: hand out copies.
        return {name: np.array(view.numpy()) for name, view in downloads.items()}

    # -- eager -----------------------------------------------------------------------

    def _forward(self, tensors: list[torch.Tensor], output_names: Sequence[str]) -> dict[str, Any]:
        return self._precision.forward(self._model, tensors, output_names, self._name_outputs)

    # -- host staging --------------------------------------------------------------------

    def _stage(self, name: str, array: np.ndarray) -> torch.Tensor:
        """``array`` copied into this input's pinned buffer, as a tensor of its shape."""
        view = self._pinned(f"in:{name}", array.nbytes, torch_dtype(array.dtype), array.shape)
        np.copyto(as_array(view), array, casting="no")
        return view

    def _download(self, name: str, named: dict[str, Any], rows: int) -> torch.Tensor:
        value = named.get(name)
        if not isinstance(value, torch.Tensor):
            what = "nothing" if value is None else f"a {type(value).__name__}"
            raise RuntimeError(f"torch backend: output {name!r} is {what}, not a tensor")
        if value.dtype == torch.bfloat16:  # numpy has no bfloat16
            value = value.float()
        nbytes = value.numel() * value.element_size()
        view = self._pinned(f"out:{name}", nbytes, value.dtype, tuple(value.shape))
        view.copy_(value, non_blocking=True)
        return view

    def _pinned(
        self, key: str, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor:
        buffer = self._staging.get(key)
        if buffer is None or buffer.numel() < nbytes:
            capacity = max(4096, 1 << max(0, nbytes - 1).bit_length())
            buffer = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
            self._staging[key] = buffer
        return buffer[:nbytes].view(dtype).view(shape)

    # -- CUDA graphs ---------------------------------------------------------------------

    def _graph_for(
        self, host: list[torch.Tensor], rows: int, output_names: Sequence[str]
    ) -> _Graph | None:
        if self._graphs_failed or not self._graph_sizes or not host or rows < 1:
            return None
        size = next((s for s in self._graph_sizes if s >= rows), None)
        if size is None:
            return None  # larger than every captured size: eager
        key: _GraphKey = (size, tuple((tuple(t.shape[1:]), str(t.dtype)) for t in host))
        graph = self._graphs.get(key)
        if graph is not None and all(name in graph.outputs for name in output_names):
            return graph
        if len(self._graphs) >= MAX_GRAPHS:
            return None
        graph = self._capture(host, rows, size, output_names)
        if graph is not None:
            self._graphs[key] = graph
        return graph

    def _capture(
        self, host: list[torch.Tensor], rows: int, size: int, output_names: Sequence[str]
    ) -> _Graph | None:
        # Padding rows repeat this batch's rows, so they hold data the model accepts.
        index = torch.arange(size) % rows
        static = [t.index_select(0, index).to(self._device) for t in host]
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        try:
            for _ in range(2):  # warm-up on this stream: lazy inits, library handles
                self._forward(static, output_names)
            self._stream.synchronize()
            # thread_local: other instances' threads keep launching work meanwhile.
            with torch.cuda.graph(
                graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"
            ):
                outputs = self._forward(static, output_names)
        except Exception as exc:  # not capturable (host syncs, CPU ops, dynamic shapes)
            if isinstance(exc, RuntimeError) and is_out_of_memory(exc):
                raise
            self._graphs_failed = True
            logger.warning(
                "torch backend: CUDA graph capture failed (%s); this instance runs eagerly",
                str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
            )
            return None
        if not all(isinstance(outputs.get(name), torch.Tensor) for name in output_names):
            self._graphs_failed = True
            return None
        logger.info("torch backend: captured a CUDA graph for batch size %d", size)
        return _Graph(graph, static, outputs)


def is_out_of_memory(exc: RuntimeError) -> bool:
    """Whether ``exc`` is CUDA's allocator running out, however it was re-raised."""
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "CUDA out of memory" in str(exc)


def out_of_memory_line(exc: RuntimeError) -> str:
    """The allocator's own sentence (TorchScript puts its traceback in front of it)."""
    lines = str(exc).splitlines() or [type(exc).__name__]
    found = next((line for line in lines if "out of memory" in line), lines[0])
    return found.strip().removeprefix("RuntimeError: ").split(" GPU ")[0]


@functools.cache
def torch_dtype(dtype: np.dtype[Any]) -> torch.dtype:
    """The torch dtype of a numpy one (looked up once: staging asks for each input of
    every batch)."""
    return as_tensor(np.empty(0, dtype=dtype)).dtype
