"""Outputs held to the datatypes and dims the model's config declares.

A backend whose file carries no reliable signature (a TorchScript ``.pt``: the config
is the only declaration) can return tensors that disagree with it: ``float64`` where
the config says FP32, a ``[B, 5]`` where it says ``dims: [4]``. The response encoder
writes an array's own datatype, so such an answer would carry bytes other than the
ones the model's metadata promises, and clients decode garbage. What is done instead:

* **A floating-point output of another width** (FP64, FP16 or BF16 for a declared FP32, ...)
  is cast to the declared datatype, as a model returning the declared type would have
  rounded it: the client sees exactly the declared type.
* **An integer output of another width** is cast where every value fits the declared
  type; a value that does not fit fails the run, naming the output and its range.
* **Any other disagreement** (an integer for a float, a boolean, other dims after the
  batch dim) fails the run with an error naming the output, what the model returned and
  what the config declares. The load's default warm-up runs the model once, so such a
  model fails its load with that message instead of answering every request 500.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from slipstream.datatypes import V2_TO_NUMPY, from_config_datatype, is_float


@dataclass(frozen=True, slots=True)
class DeclaredOutput:
    """One output as the model's config declares it."""

    # V2 datatype name (FP32, INT64, ...).
    datatype: str
    # Its numpy dtype.
    dtype: np.dtype[Any]
    # The model's own shape of it, batch dim excluded when batching: the config's
    # ``reshape`` where it has one, else its ``dims``; -1 is any size.
    dims: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class DeclaredOutputs:
    """The config's outputs, checked against what a run returns."""

    # Output name -> its declaration; outputs not listed (a stateful model's states)
    # pass unchecked.
    outputs: Mapping[str, DeclaredOutput]
    # The config's max_batch_size > 0: every output's first dim is the batch.
    batching: bool

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> DeclaredOutputs:
        """From a completed config in Triton's JSON form (``Backend.configure``'s)."""
        outputs: dict[str, DeclaredOutput] = {}
        for tensor in config.get("output") or ():
            datatype = from_config_datatype(str(tensor.get("data_type", "")))
            if datatype not in V2_TO_NUMPY or datatype == "BYTES":
                continue
            reshape = (tensor.get("reshape") or {}).get("shape")
            dims = reshape if reshape is not None else tensor.get("dims") or []
            outputs[str(tensor["name"])] = DeclaredOutput(
                datatype, V2_TO_NUMPY[datatype], tuple(int(d) for d in dims)
            )
        return cls(outputs, bool(config.get("max_batch_size")))

    def conform(self, name: str, array: np.ndarray) -> np.ndarray:
        """``array`` in the declared datatype; RuntimeError names what disagrees."""
        declared = self.outputs.get(name)
        if declared is None:
            return array
        self._check_dims(name, array, declared)
        if array.dtype == declared.dtype:
            return array
        got, wanted = array.dtype, declared.dtype
        if is_float(got) and is_float(wanted):
            return array.astype(wanted)
        if got.kind in "iu" and wanted.kind in "iu":
            return _cast_integers(name, array, declared)
        raise RuntimeError(
            f"output {name!r}: the model returned {got} but the config declares "
            f"{declared.datatype}; declare data_type TYPE_{_v2_name(got)} for it, or return "
            f"{wanted} from the model"
        )

    def _check_dims(self, name: str, array: np.ndarray, declared: DeclaredOutput) -> None:
        shape = array.shape[1:] if self.batching else array.shape
        dims = declared.dims
        if len(shape) == len(dims) and all(d in (-1, s) for s, d in zip(shape, dims, strict=True)):
            return
        after = " after the batch dim" if self.batching else ""
        raise RuntimeError(
            f"output {name!r}: the model returned shape {list(array.shape)} but the config "
            f"declares dims {list(dims)}{after}; set the output's dims to what the model "
            "returns (-1 for a dim that varies)"
        )


def _cast_integers(name: str, array: np.ndarray, declared: DeclaredOutput) -> np.ndarray:
    wanted = declared.dtype
    if array.size and not np.can_cast(array.dtype, wanted):
        info = np.iinfo(wanted)
        low, high = int(array.min()), int(array.max())
        if low < info.min or high > info.max:
            raise RuntimeError(
                f"output {name!r}: the model returned {array.dtype} values from {low} to "
                f"{high}, outside the config's {declared.datatype}; declare a wider "
                f"data_type (TYPE_{_v2_name(array.dtype)})"
            )
    return array.astype(wanted)


def _v2_name(dtype: np.dtype[Any]) -> str:
    for name, known in V2_TO_NUMPY.items():
        if known == dtype:
            return name
    return str(dtype).upper()
