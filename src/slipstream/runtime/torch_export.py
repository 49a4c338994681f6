"""torch.export programs (``.pt2``) for the torch backend: loading one, and what the
program itself declares about its tensors.

* **Names, datatypes, shapes**: input names are ``forward``'s parameter names; outputs
  are named after the returned structure (the keys of a dict, ``output`` for one
  tensor, ``output_0``, ``output_1``, ... for a tuple). Dims exported as dynamic
  (``torch.export.Dim``) are -1.
* **bfloat16**: numpy, and so the V2 protocol here, has no bfloat16. A bf16 program's
  bf16 inputs are declared FP32: clients send FP32, and the backend casts them to
  bfloat16 on the model's device before the program runs (the values are rounded to
  bf16's 8 bits of mantissa, as the program would round them itself). Its bf16 outputs
  are returned as FP32 (exact: every bf16 value is an FP32 value).
* **Batch bound**: a batch dim exported as ``Dim("batch", max=N)`` is the program's
  limit; :attr:`ModelSignature.max_batch_size` carries it, and the backend runs a larger
  batch (a config whose ``max_batch_size`` is above N) as several runs of at most N
  rows, instead of every such batch failing the program's guard.
"""

from __future__ import annotations

import threading
import warnings
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from slipstream.datatypes import v2_datatype
from slipstream.runtime.base import ModelSignature, TensorSpec

# A loaded ScriptModule or an exported program's module: called with positional tensors.
Model = Callable[..., Any]

# torch.export.load keeps the program being read in a module global (two loads at once
# fail one: "_CURRENT_DESERIALIZER is already set"), and warnings.catch_warnings swaps
# the process's warning filters: the model manager loads a repository's models side by
# side in threads, so one .pt2 is read at a time.
_EXPORT_LOAD_LOCK = threading.Lock()


class CastInputs:
    """An exported program's module whose floating-point inputs are cast to the dtypes
    the program was exported with (FP32 in, bfloat16 into the program)."""

    def __init__(self, module: Any, dtypes: Sequence[torch.dtype | None]) -> None:
        self._module = module
        # Per positional input: the dtype it is cast to; None leaves it as it comes.
        self._dtypes = tuple(dtypes)

    @property
    def module(self) -> Any:
        """The program's module (its weights)."""
        return self._module

    def __call__(self, *tensors: torch.Tensor) -> Any:
        cast = [
            t.to(dtype) if dtype is not None and t.is_floating_point() and t.dtype != dtype else t
            for t, dtype in zip(tensors, self._dtypes + (None,) * len(tensors), strict=False)
        ]
        return self._module(*cast)

    def to(self, dtype: torch.dtype) -> CastInputs:
        """The module's weights cast to ``dtype`` (``precision: fp16 | bf16``), and its
        floating-point inputs with them."""
        self._module = self._module.to(dtype)
        self._dtypes = tuple(None if d is None else dtype for d in self._dtypes)
        return self


def load_exported(path: Path, device: torch.device) -> tuple[Model, ModelSignature]:
    """The program's module (moved to ``device``) and its signature."""
    try:
        with _EXPORT_LOAD_LOCK, warnings.catch_warnings():
            # torch 2.11's loader wraps each weight's bytes read-only and says so once per
            # process; the tensors own those bytes, and nothing writes to them.
            warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
            program = torch.export.load(str(path))
    # torch.export.load falls back to the legacy zip format, whose errors are BadZipFile.
    except (RuntimeError, zipfile.BadZipFile) as exc:
        raise ValueError(
            f"{path.name}: not a torch.export program ({str(exc).splitlines()[0]}); save it "
            "with torch.export.save(torch.export.export(model, args), 'model.pt2')"
        ) from None
    signature = exported_signature(program)
    casts = _bf16_inputs(program)
    if device.type != "cpu":
        # module().to(device) would move the weights but not the devices burnt into the
        # graph (arange(device=cpu), ...): every request would fail on a device mismatch.
        from torch.export.passes import move_to_device_pass

        program = move_to_device_pass(program, device)
    module = program.module()
    if any(dtype is not None for dtype in casts):
        return CastInputs(module, casts), signature
    return module, signature


def exported_signature(program: Any) -> ModelSignature:
    """Names, dtypes and shapes of an ExportedProgram's user inputs and outputs, and the
    bound of its batch dim."""
    nodes = {node.name: node for node in program.graph.nodes}
    input_values = [nodes[name].meta.get("val") for name in program.graph_signature.user_inputs]
    input_specs = tuple(
        _fake_tensor_spec(name, value)
        for name, value in zip(program.graph_signature.user_inputs, input_values, strict=True)
    )
    output_node = next(node for node in program.graph.nodes if node.op == "output")
    user_output_count = len(program.graph_signature.user_outputs)
    # User outputs come last, after any buffer mutations the graph also returns.
    returned = list(output_node.args[0])[-user_output_count:] if user_output_count else []
    names = _output_names(program.call_spec.out_spec, len(returned))
    output_specs = tuple(
        _fake_tensor_spec(name, getattr(node, "meta", {}).get("val"))
        for name, node in zip(names, returned, strict=True)
    )
    return ModelSignature(
        inputs=tuple(s for s in input_specs if s is not None),
        outputs=tuple(s for s in output_specs if s is not None),
        max_batch_size=_batch_bound(program, input_values),
    )


def _bf16_inputs(program: Any) -> list[torch.dtype | None]:
    """Per user input: bfloat16 where the program takes it (cast from FP32), else None."""
    nodes = {node.name: node for node in program.graph.nodes}
    dtypes: list[torch.dtype | None] = []
    for name in program.graph_signature.user_inputs:
        value = nodes[name].meta.get("val")
        bf16 = isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16
        dtypes.append(torch.bfloat16 if bf16 else None)
    return dtypes


def _batch_bound(program: Any, input_values: list[Any]) -> int | None:
    """The smallest upper bound the program sets on its inputs' first (batch) dims;
    None where every such dim is unbounded (``Dim("batch")``) or fixed."""
    bounds: list[int] = []
    for value in input_values:
        if not isinstance(value, torch.Tensor) or not value.shape:
            continue
        dim = value.shape[0]
        if not isinstance(dim, torch.SymInt):
            return None  # a fixed first dim: no batch dim to bound
        ranges = program.range_constraints.get(dim.node.expr)
        # An unbounded dim's upper bound is torch's int_oo, which is no sympy Integer.
        if ranges is not None and getattr(ranges.upper, "is_Integer", False):
            bounds.append(int(ranges.upper))
    return min(bounds) if bounds else None


def _output_names(out_spec: Any, count: int) -> list[str]:
    """Output names from the pytree spec of what forward() returns."""
    if out_spec is not None and out_spec.type is dict and len(out_spec.context) == count:
        return [str(key) for key in out_spec.context]
    if count == 1 and out_spec is not None and out_spec.is_leaf():
        return ["output"]
    return [f"output_{i}" for i in range(count)]


def _fake_tensor_spec(name: str, value: Any) -> TensorSpec | None:
    """A TensorSpec from a node's fake tensor; symbolic dims become -1."""
    if not isinstance(value, torch.Tensor):
        return None  # a non-tensor input or output (int, None): not servable over V2
    # bfloat16 tensors are FP32 to clients unless the config declares them BF16: FP32
    # inputs are cast (CastInputs), outputs returned in the declared datatype.
    bf16 = value.dtype == torch.bfloat16
    dtype = torch.float32 if bf16 else value.dtype
    numpy_dtype = torch.empty((), dtype=dtype).numpy().dtype
    shape = tuple(dim if isinstance(dim, int) else -1 for dim in value.shape)
    also = ("BF16",) if bf16 else ()
    return TensorSpec(name=name, datatype=v2_datatype(numpy_dtype), shape=shape, also=also)
