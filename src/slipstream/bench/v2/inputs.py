"""The tensors a benchmark sends: random data shaped by the model's metadata, or a file.

The metadata comes from the server (``GET /v2/models/{m}`` or the ModelMetadata RPC), so
any Open Inference Protocol server can be driven without knowing the model beforehand:

>>> signature = RemoteModel(
...     name="mlp", inputs=(RemoteTensor("input", "FP32", (-1, 256)),), batching=True)
>>> [request] = generate_requests(signature, batch_size=4, shapes={}, seed=0)
>>> request.tensors["input"].shape, request.batch_size
((4, 256), 4)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from slipstream.tensors import TensorFileError, random_tensor, read_tensor_file

# Integer inputs are drawn from [0, _INT_HIGH): inside any vocabulary or category count.
_INT_HIGH = 100


class InputError(ValueError):
    """The inputs cannot be built; the message names the input and the fix."""


@dataclass(frozen=True)
class RemoteTensor:
    """One tensor of a model as the server describes it."""

    name: str
    # V2 datatype name, e.g. "FP32".
    datatype: str
    # As the metadata reports it: the batch dim included for a batching model, -1 = variable.
    shape: tuple[int, ...]


@dataclass(frozen=True)
class RemoteModel:
    """What the server says a model takes and returns."""

    name: str
    inputs: tuple[RemoteTensor, ...]
    # True when the first dim of every input is the batch dim.
    batching: bool
    outputs: tuple[RemoteTensor, ...] = ()
    # The server's max_batch_size when it publishes a config (Triton's extension); None
    # when it does not.
    max_batch_size: int | None = None


@dataclass(frozen=True)
class RequestInputs:
    """The tensors of one request."""

    # Input name -> array, exactly the shape sent.
    tensors: dict[str, np.ndarray]
    # Inferences the request counts for: its batch dim for a batching model, else 1.
    batch_size: int


def signature_from_metadata(metadata: Mapping[str, Any], max_batch_size: int | None) -> RemoteModel:
    """A signature from V2 model metadata (JSON form) and, when known, max_batch_size.

    Without a config the first dim is taken as the batch dim when it is variable in
    every input: the convention of every V2 server for batching models.
    """
    inputs = tuple(_tensor_spec(t) for t in metadata.get("inputs", []))
    outputs = tuple(_tensor_spec(t) for t in metadata.get("outputs", []))
    if not inputs:
        raise InputError(f"model {metadata.get('name')!r}: the server's metadata lists no inputs")
    if max_batch_size is not None:
        batching = max_batch_size > 0
    else:
        batching = all(spec.shape[:1] == (-1,) for spec in inputs)
    return RemoteModel(
        name=str(metadata.get("name", "")),
        inputs=inputs,
        outputs=outputs,
        batching=batching,
        max_batch_size=max_batch_size,
    )


def _tensor_spec(raw: Mapping[str, Any]) -> RemoteTensor:
    return RemoteTensor(
        name=str(raw["name"]),
        datatype=str(raw["datatype"]),
        shape=tuple(int(d) for d in raw.get("shape", [])),
    )


# ------------------------------------------------------------------- generated inputs


def generate_requests(
    signature: RemoteModel,
    batch_size: int,
    shapes: Mapping[str, list[int]],
    seed: int,
) -> list[RequestInputs]:
    """One request of random data of each input's datatype and shape, as perf_analyzer
    sends by default (the same data every time)."""
    _check_batch_size(signature, batch_size)
    unknown = sorted(set(shapes) - {spec.name for spec in signature.inputs})
    if unknown:
        known = ", ".join(spec.name for spec in signature.inputs)
        raise InputError(f"--shape names unknown inputs {unknown}; the model's inputs: {known}")
    rng = np.random.default_rng(seed)
    tensors = {
        spec.name: _random(spec.datatype, _concrete_shape(spec, signature, batch_size, shapes), rng)
        for spec in signature.inputs
    }
    return [RequestInputs(tensors=tensors, batch_size=batch_size if signature.batching else 1)]


def _random(datatype: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    try:
        return random_tensor(datatype, shape, rng, high=_INT_HIGH)
    except ValueError as exc:
        raise InputError(str(exc)) from None


def _check_batch_size(signature: RemoteModel, batch_size: int) -> None:
    if not signature.batching and batch_size != 1:
        raise InputError(
            f"model {signature.name!r} does not batch (max_batch_size 0): "
            f"--batch-size must be 1, got {batch_size}"
        )
    limit = signature.max_batch_size
    if limit and batch_size > limit:
        raise InputError(
            f"--batch-size {batch_size} exceeds model {signature.name!r}'s max_batch_size "
            f"{limit}; use at most {limit}"
        )


def _concrete_shape(
    spec: RemoteTensor,
    signature: RemoteModel,
    batch_size: int,
    shapes: Mapping[str, list[int]],
) -> tuple[int, ...]:
    """The input's shape with the batch dim and every variable dim filled in."""
    dims = spec.shape[1:] if signature.batching else spec.shape
    override = shapes.get(spec.name)
    if override is not None:
        if len(override) != len(dims):
            which = "without the batch dim " if signature.batching else ""
            raise InputError(
                f"--shape {spec.name}: expected {len(dims)} dims {which}(the model's shape is "
                f"{list(spec.shape)}), got {override}"
            )
        for fixed, given in zip(dims, override, strict=True):
            if fixed != -1 and fixed != given:
                raise InputError(
                    f"--shape {spec.name}: dim {given} conflicts with the model's fixed dim "
                    f"{fixed} (shape {list(spec.shape)})"
                )
        dims = tuple(override)
    if any(d < 0 for d in dims):
        example = ",".join("8" if d < 0 else str(d) for d in dims)
        raise InputError(
            f"input {spec.name!r} has variable dims (shape {list(spec.shape)}): give them with "
            f"--shape {spec.name}:{example}"
        )
    return (batch_size, *dims) if signature.batching else tuple(dims)


# --------------------------------------------------------------------- inputs from a file


def read_input_data(path: Path, signature: RemoteModel, batch_size: int) -> list[RequestInputs]:
    """Requests from ``path`` (see :func:`slipstream.tensors.read_tensor_file`): ``.npz``
    or a directory of ``.npy`` files (one request, arrays named like the inputs; an array
    without the batch dim is repeated ``batch_size`` times) or ``.json`` (one V2
    inference request, or a list of them sent in turn)."""
    try:
        requests = read_tensor_file(path)
    except TensorFileError as exc:
        raise InputError(f"--input-data {exc}") from None
    single = len(requests) == 1 and path.suffix.lower() != ".json"
    inputs = []
    for index, arrays in enumerate(requests):
        where = f"--input-data {path}" if single else f"--input-data {path}: request {index}"
        _check_names(where, set(arrays), signature)
        tensors = {spec.name: arrays[spec.name] for spec in signature.inputs}
        if single and signature.batching:
            tensors = {
                spec.name: _with_batch(tensors[spec.name], spec, batch_size)
                for spec in signature.inputs
            }
        inputs.append(RequestInputs(tensors=tensors, batch_size=_batch_of(tensors, signature)))
    return inputs


def _with_batch(array: np.ndarray, spec: RemoteTensor, batch_size: int) -> np.ndarray:
    """An array given without the batch dim, repeated ``batch_size`` times."""
    if array.ndim == len(spec.shape) - 1:
        return np.repeat(array[np.newaxis], batch_size, axis=0)
    return array


def _check_names(where: str, names: set[str], signature: RemoteModel) -> None:
    expected = {spec.name for spec in signature.inputs}
    missing, unknown = sorted(expected - names), sorted(names - expected)
    if missing or unknown:
        raise InputError(
            f"{where}: inputs must be named like the model's {sorted(expected)}; "
            f"missing {missing}, unknown {unknown}"
        )


def _batch_of(tensors: Mapping[str, np.ndarray], signature: RemoteModel) -> int:
    if not signature.batching:
        return 1
    first = next(iter(tensors.values()))
    return int(first.shape[0]) if first.ndim else 1
