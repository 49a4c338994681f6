"""KServe's V1 inference protocol (TensorFlow Serving's REST ``predict`` API): JSON bodies
to :class:`~slipstream.types.InferRequest` and :class:`~slipstream.types.InferResponse`
back, with no I/O. The route is ``POST /v1/models/<model>[/versions/<v>]:predict``.

Two request formats, as TensorFlow Serving defines them:

- row (``{"instances": [...]}``): each instance is one row of the batch: a value of the
  single input's shape without its first (batch) dimension, or, for a model of several
  inputs, an object keyed by input name. Rows are stacked along a new first dimension.
  The answer is ``{"predictions": [...]}``, one entry per row: the single output's row,
  or an object keyed by output name.
- columnar (``{"inputs": ...}``): the single input's whole tensor, or an object of
  tensors keyed by input name. The answer is ``{"outputs": ...}``: the single output's
  tensor, or an object of tensors keyed by output name.

Other keys of the body (TensorFlow Serving's ``signature_name``) are ignored, as KServe's
servers ignore them. The datatypes come from the model's metadata, and the elements are
checked as the V2 JSON codec checks them (:mod:`.v2_data`): no string in FP32 data, no
1.5 in INT32 data. A BYTES element is a string (sent as its UTF-8 bytes) or
``{"b64": "<base64>"}``; a BYTES output is written as a string, or as ``{"b64": ...}``
where its bytes are not UTF-8 or its name ends in ``_bytes`` (TensorFlow Serving's rule).

>>> x = TensorMetadata("x", "FP32", [-1, 2])
>>> meta = ModelMetadata("m", ["1"], "onnx", [x], [TensorMetadata("y", "FP32", [-1, 2])])
>>> predict = decode_predict(b'{"instances": [[1, 2], [3, 4]]}', meta, "m", "")
>>> predict.request.inputs["x"].tolist(), predict.columnar
([[1.0, 2.0], [3.0, 4.0]], False)
>>> encode_predict(InferResponse("m", "1", {"y": predict.request.inputs["x"] * 2}), False)
b'{"predictions":[[2.0,4.0],[6.0,8.0]]}'
"""

from __future__ import annotations

import base64
import binascii
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from slipstream.datatypes import BF16, numpy_dtype
from slipstream.errors import InvalidRequest
from slipstream.protocol.v2 import load_json_object
from slipstream.protocol.v2_data import numeric_from_json, show
from slipstream.types import InferRequest, InferResponse, ModelMetadata, TensorMetadata

__all__ = ["V1Predict", "decode_predict", "encode_predict", "is_predict_path"]

_DUMPS_OPTIONS = orjson.OPT_SERIALIZE_NUMPY
_PREDICT = ":predict"
# How the answer of a row request that cannot be split into rows tells the fix.
_USE_COLUMNAR = 'send the request in the columnar format ({"inputs": ...}) instead'


@dataclass(slots=True)
class V1Predict:
    """A decoded ``:predict`` body."""

    # The inference to run, as a V2 request would run it.
    request: InferRequest
    # Whether the body was columnar ({"inputs": ...}): the answer is then {"outputs": ...}.
    columnar: bool


def is_predict_path(path: str) -> bool:
    """Whether ``path`` is a V1 ``:predict`` route (answered in KServe's error shape).

    >>> is_predict_path("/v1/models/mlp:predict"), is_predict_path("/v1/models/mlp")
    (True, False)
    """
    return path.startswith("/v1/models/") and path.rstrip("/").endswith(_PREDICT)


# ---------------------------------------------------------------------------- decoding


def decode_predict(
    body: bytes, metadata: ModelMetadata, model_name: str, model_version: str
) -> V1Predict:
    """Decode a ``:predict`` body against the model's ``metadata``; InvalidRequest (400)
    naming the field for anything the model cannot take."""
    doc = load_json_object(body)
    rows, columns = "instances" in doc, "inputs" in doc
    if rows == columns:
        raise InvalidRequest(
            'request body: expected exactly one of "instances" (row format: one entry per '
            'row) or "inputs" (columnar format: whole tensors), got '
            + ("both" if rows else f"neither (keys: {', '.join(doc) or 'none'})")
        )
    inputs = {tensor.name: tensor for tensor in metadata.inputs}
    if rows:
        arrays = _decode_rows(doc["instances"], inputs, model_name)
    else:
        arrays = _decode_columns(doc["inputs"], inputs, model_name)
    return V1Predict(InferRequest(model_name, model_version, arrays), columnar=columns)


def _decode_rows(
    instances: Any, inputs: dict[str, TensorMetadata], model: str
) -> dict[str, np.ndarray]:
    if not isinstance(instances, list) or not instances:
        raise InvalidRequest(
            f"instances: expected a non-empty list with one instance per row, got {show(instances)}"
        )
    if not _named(instances[0], inputs):
        only = _only_input(
            inputs, model, "instances", "each instance an object keyed by input name"
        )
        _check_rows(instances, "")
        return {only.name: _tensor("instances", instances, only)}
    first = instances[0]
    for name in first:
        if name not in inputs:
            raise InvalidRequest(f"instances[0]: {_not_an_input(name, inputs, model)}")
    columns: dict[str, list[Any]] = {name: [] for name in first}
    for index, instance in enumerate(instances):
        if not isinstance(instance, dict):
            raise InvalidRequest(
                f"instances[{index}]: expected an object keyed by input name as instances[0] "
                f"is, got {show(instance)}"
            )
        if instance.keys() != first.keys():
            raise InvalidRequest(f"instances[{index}]: {_key_difference(instance, first)}")
        for name, column in columns.items():
            column.append(instance[name])
    for name, column in columns.items():
        _check_rows(column, f".{name}")
    return {name: _tensor(f"instances: input {name!r}", columns[name], inputs[name])
            for name in columns}  # fmt: skip


def _decode_columns(
    value: Any, inputs: dict[str, TensorMetadata], model: str
) -> dict[str, np.ndarray]:
    if not _named(value, inputs):
        only = _only_input(inputs, model, "inputs", "an object of tensors keyed by input name")
        return {only.name: _tensor("inputs", value, only)}
    if not value:
        raise InvalidRequest(
            f"inputs: expected tensors keyed by input name ({', '.join(inputs)}), got {{}}"
        )
    arrays = {}
    for name, data in value.items():
        tensor = inputs.get(name)
        if tensor is None:
            raise InvalidRequest(f"inputs: {_not_an_input(name, inputs, model)}")
        arrays[name] = _tensor(f"inputs.{name}", data, tensor)
    return arrays


def _named(value: Any, inputs: dict[str, TensorMetadata]) -> bool:
    """Whether ``value`` holds inputs by name (not one value, such as {"b64": ...})."""
    return isinstance(value, dict) and not _is_b64(value, inputs)


def _is_b64(value: dict[str, Any], inputs: dict[str, TensorMetadata]) -> bool:
    return value.keys() == {"b64"} and "b64" not in inputs


def _only_input(
    inputs: dict[str, TensorMetadata], model: str, field: str, instead: str
) -> TensorMetadata:
    if len(inputs) == 1:
        return next(iter(inputs.values()))
    raise InvalidRequest(
        f"{field}: model {model!r} has {len(inputs)} inputs ({', '.join(inputs) or 'none'}); "
        f"send {instead}"
    )


def _not_an_input(name: str, inputs: dict[str, TensorMetadata], model: str) -> str:
    return f"{name!r} is not an input of model {model!r}; its inputs are {', '.join(inputs)}"


def _key_difference(instance: dict[str, Any], first: dict[str, Any]) -> str:
    missing = [name for name in first if name not in instance]
    if missing:
        return (
            f"input {missing[0]!r} is missing; every instance names the inputs instances[0] "
            f"names ({', '.join(first)})"
        )
    extra = next(name for name in instance if name not in first)
    return f"input {extra!r} is not in instances[0]; every instance names the same inputs"


def _check_rows(rows: list[Any], suffix: str) -> None:
    """Rows of one shape: a ragged row is named here (the V2 codec would only say the data
    is not evenly nested)."""
    width = _width(rows[0])
    for index, row in enumerate(rows):
        if _width(row) != width:
            raise InvalidRequest(
                f"instances[{index}]{suffix}: {_describe(_width(row))} where instances[0]"
                f"{suffix} has {_describe(width)}; every row must have the same shape"
            )


def _width(row: Any) -> int | None:
    return len(row) if isinstance(row, list) else None


def _describe(width: int | None) -> str:
    if width is None:
        return "one value"
    return f"a list of {width} value{'' if width == 1 else 's'}"


def _tensor(where: str, data: Any, tensor: TensorMetadata) -> np.ndarray:
    """The array of ``data`` (a JSON value, nested lists for dimensions) as ``tensor``'s
    datatype, checked by the V2 JSON codec's rules."""
    if tensor.datatype == "BYTES":
        return _bytes_tensor(where, data)
    shape = _nested_shape(data)
    dtype = numpy_dtype(tensor.datatype, field=f"{where}: datatype")
    flat = numeric_from_json(where, data, math.prod(shape), shape, tensor.datatype, dtype)
    return flat.reshape(shape)


def _nested_shape(data: Any) -> list[int]:
    """The shape nested lists spell, read along their first elements (numpy's parse then
    refuses any that are not even)."""
    shape = []
    while isinstance(data, list):
        shape.append(len(data))
        if not data:
            break
        data = data[0]
    return shape


def _bytes_tensor(where: str, data: Any) -> np.ndarray:
    # An object array spells the nesting out in C; ragged nesting leaves lists as its
    # elements, which _element refuses.
    nested = np.array(data, dtype=object)
    items = [_element(where, value) for value in nested.ravel().tolist()]
    array = np.empty(len(items), dtype=object)
    array[:] = items
    return array.reshape(nested.shape)


def _element(where: str, value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, dict) and value.keys() == {"b64"} and isinstance(value["b64"], str):
        try:
            return base64.b64decode(value["b64"], validate=True)
        except binascii.Error as exc:
            raise InvalidRequest(f"{where}: b64: not valid base64 ({exc})") from None
    raise InvalidRequest(
        f'{where}: BYTES data must be strings or {{"b64": "<base64>"}} objects, got {show(value)}'
    )


# ---------------------------------------------------------------------------- encoding


def encode_predict(response: InferResponse, columnar: bool) -> bytes:
    """The answer's body: ``{"outputs": ...}`` for a columnar request, else
    ``{"predictions": [...]}`` with one entry per row."""
    values = {name: _json_value(name, array) for name, array in response.outputs.items()}
    if columnar:
        whole = next(iter(values.values())) if len(values) == 1 else values
        return orjson.dumps({"outputs": whole}, option=_DUMPS_OPTIONS)
    if len(values) == 1:
        name, array = next(iter(response.outputs.items()))
        if array.ndim == 0:
            raise InvalidRequest(
                f"output {name!r} is a scalar, which has no rows to answer as predictions; "
                + _USE_COLUMNAR
            )
        return orjson.dumps({"predictions": values[name]}, option=_DUMPS_OPTIONS)
    return orjson.dumps({"predictions": _rows(response.outputs, values)}, option=_DUMPS_OPTIONS)


def _rows(outputs: dict[str, np.ndarray], values: dict[str, Any]) -> list[dict[str, Any]]:
    """One object per row, keyed by output name; every output must have the rows."""
    counts = {name: (array.shape[0] if array.ndim else None) for name, array in outputs.items()}
    if len(set(counts.values())) != 1 or None in counts.values():
        shown = ", ".join(f"{name!r}: {count}" for name, count in counts.items())
        raise InvalidRequest(
            f"the outputs' rows differ ({shown}), so they cannot be answered row by row; "
            + _USE_COLUMNAR
        )
    rows = next(iter(counts.values()))
    assert rows is not None  # checked above; tells mypy
    # A row of a 1-D output is a numpy scalar, which orjson refuses for some types (an
    # ONNX INT64 output's numpy.longlong): those rows are taken as Python numbers.
    values = {name: value.tolist() if isinstance(value, np.ndarray) and value.ndim == 1
              else value for name, value in values.items()}  # fmt: skip
    return [{name: value[index] for name, value in values.items()} for index in range(rows)]


def _json_value(name: str, array: np.ndarray) -> Any:
    """What orjson writes for one output: a C-contiguous numeric array (written in C,
    with no Python list), or nested lists for BYTES."""
    if array.dtype.kind in "OSU":
        return _bytes_value(name, array)
    if array.dtype == BF16:  # orjson knows no bfloat16; float32 holds every value of it
        return array.astype(np.float32)
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    return np.ascontiguousarray(array)


def _bytes_value(name: str, array: np.ndarray) -> Any:
    always_b64 = name.endswith("_bytes")
    items: list[Any] = []
    for item in array.ravel().tolist():
        if isinstance(item, str):
            item = item.encode()
        elif not isinstance(item, bytes):
            raise ValueError(f"BYTES output elements must be bytes or str, got {type(item)}")
        items.append(_string_or_b64(item, always_b64))
    nested = np.empty(len(items), dtype=object)
    nested[:] = items
    return nested.reshape(array.shape).tolist()


def _string_or_b64(item: bytes, always_b64: bool) -> Any:
    if not always_b64:
        try:
            return item.decode()
        except UnicodeDecodeError:
            pass
    return {"b64": base64.b64encode(item).decode("ascii")}
