"""The Open Inference Protocol (V2) REST wire codec, with Triton's binary tensor extension.

Pure functions between HTTP bodies and :class:`~slipstream.types.InferRequest` /
:class:`~slipstream.types.InferResponse`; no I/O. The HTTP server calls:

>>> body = b'{"inputs":[{"name":"x","shape":[2],"datatype":"FP32","data":[1,2]}]}'
>>> request = decode_infer_request(body, None, "m", "1")
>>> request.inputs["x"]
array([1., 2.], dtype=float32)
>>> response = InferResponse("m", "1", {"y": request.inputs["x"] * 2})
>>> body, json_header_length = encode_infer_response(response, request)
>>> body[-60:], json_header_length
(b'"name":"y","datatype":"FP32","shape":[2],"data":[2.0,4.0]}]}', None)

Binary extension: with an ``Inference-Header-Content-Length: N`` header, the first N
bytes of the body are the JSON and the rest holds, back to back in input order, the raw
data of every input whose ``parameters`` carry ``binary_data_size``: little-endian,
row-major, no padding; a BOOL element is one byte; a BYTES element is a 4-byte
little-endian length followed by its bytes. Responses use the same layout.

Contracts and limitations worth knowing:

- Fixed-size inputs decoded from binary data are zero-copy views of ``body`` and so are
  read-only when ``body`` is ``bytes``; backends must not write into their inputs.
- JSON numbers are checked against the datatype without per-element Python work: a
  string, ``null`` or ``true`` in FP32 data, ``1.5`` in INT32 data, ``300`` in UINT8 data
  or ``1e39`` in FP32 data are rejected rather than coerced.
- NaN and infinity have no JSON spelling: JSON outputs write them as ``null``, which a
  JSON request cannot send back (use binary data for such tensors).
- A BYTES output whose elements are not valid UTF-8 cannot be written as a JSON string;
  asking for it as JSON is answered with :class:`InvalidRequest` telling the client to
  ask for ``"binary_data": true``.
- Every platform Slipstream runs on (x86-64, aarch64) is little-endian, so the wire
  byte order is the native one and fixed-size tensors are read and written as is.
"""

from __future__ import annotations

import math
from typing import Any, cast

import numpy as np
import orjson

from slipstream.datatypes import addressable, numpy_dtype, v2_datatype
from slipstream.errors import InvalidRequest
from slipstream.protocol import v2_shm
from slipstream.protocol.v2_data import (
    binary_payload,
    bytes_from_binary,
    bytes_from_json,
    fixed_from_binary,
    json_strings,
    numeric_from_json,
    show,
)
from slipstream.types import InferRequest, InferResponse, RequestedOutput, SharedMemoryInput

__all__ = [
    "binary_payload",
    "decode_infer_request",
    "decode_tensors",
    "encode_error",
    "encode_infer_response",
    "load_json_object",
]

_INT64_MAX = 2**63 - 1
# Request parameters that become InferRequest fields; the rest pass through.
_RESERVED_PARAMETERS = frozenset({"priority", "timeout", "binary_data_output"})
_DUMPS_OPTIONS = orjson.OPT_SERIALIZE_NUMPY


def decode_infer_request(
    body: bytes, header_length: int | None, model_name: str, model_version: str
) -> InferRequest:
    """Decode a V2 REST inference request body.

    ``header_length`` is the ``Inference-Header-Content-Length`` HTTP header (None when
    absent: the whole body is JSON). Raises :class:`InvalidRequest`, naming the field,
    for anything malformed.

    >>> req = decode_infer_request(
    ...     b'{"id":"7","inputs":[{"name":"t","shape":[1],"datatype":"BYTES","data":["hi"]}]}',
    ...     None, "m", "")
    >>> req.id, req.inputs["t"]
    ('7', array([b'hi'], dtype=object))
    """
    view = memoryview(body)
    if header_length is None:
        header, binary = view, None
    else:
        if type(header_length) is not int or not 0 <= header_length <= len(view):
            raise InvalidRequest(
                f"Inference-Header-Content-Length: {header_length!r} is not a length "
                f"within the {len(view)}-byte body"
            )
        header, binary = view[:header_length], view[header_length:]
    doc = load_json_object(header)
    # Some clients send "id": null for "no id"; treat it as absent.
    request_id = doc.get("id")
    if request_id is None:
        request_id = ""
    elif not isinstance(request_id, str):
        raise InvalidRequest(f"id: expected a string, got {show(request_id)}")
    priority, timeout_us, binary_data_output, parameters = _decode_parameters(doc.get("parameters"))
    inputs, shared_inputs = decode_tensors(doc.get("inputs"), binary)
    return InferRequest(
        model_name=model_name,
        model_version=model_version,
        inputs=inputs,
        shared_memory_inputs=shared_inputs,
        id=request_id,
        outputs=_decode_requested_outputs(doc.get("outputs")),
        priority=priority,
        timeout_us=timeout_us,
        binary_data_output=binary_data_output,
        parameters=parameters,
    )


def encode_infer_response(
    response: InferResponse, request: InferRequest
) -> tuple[bytes, int | None]:
    """Encode a V2 REST inference response; returns ``(body, json_header_length)``.

    ``json_header_length`` is None when every output is JSON (send the body as
    ``application/json``); otherwise send ``Inference-Header-Content-Length:
    <json_header_length>`` and ``application/octet-stream``. An output is binary when
    its requested output says ``binary_data: true``, or says nothing and the request set
    ``binary_data_output``.

    >>> req = InferRequest("m", "1", {}, binary_data_output=True)
    >>> out = InferResponse("m", "1", {"y": np.ones(2, np.uint8)})
    >>> body, json_header_length = encode_infer_response(out, req)
    >>> body[json_header_length - 38 :]
    b'"parameters":{"binary_data_size":2}}]}\\x01\\x01'
    """
    choices = None
    if request.outputs:
        choices = {out.name: out.binary_data for out in request.outputs}
    outputs: list[dict[str, Any]] = []
    payloads: list[Any] = []
    for name, array in response.outputs.items():
        if not array.dtype.isnative:
            array = array.astype(array.dtype.newbyteorder("="))
        datatype = v2_datatype(array.dtype)
        binary = None if choices is None else choices.get(name)
        if binary is None:
            binary = request.binary_data_output
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": array.shape}
        if name in response.in_shared_memory:
            pass  # written into the client's region: name, datatype and shape only
        elif binary:
            payload, size = binary_payload(array, datatype)
            entry["parameters"] = {"binary_data_size": size}
            payloads.append(payload)
        elif datatype == "BYTES":
            entry["data"] = json_strings(name, array)
        else:
            # ravel() is a view for C-contiguous arrays and a contiguous copy otherwise,
            # which is what orjson needs to write the array without a Python list.
            entry["data"] = array.ravel()
        outputs.append(entry)
    doc: dict[str, Any] = {
        "model_name": response.model_name,
        "model_version": response.model_version,
    }
    response_id = response.id or request.id
    if response_id:
        doc["id"] = response_id
    if response.parameters:
        doc["parameters"] = response.parameters
    doc["outputs"] = outputs
    header = orjson.dumps(doc, default=_json_default, option=_DUMPS_OPTIONS)
    if not payloads:
        return header, None
    return b"".join([header, *payloads]), len(header)


def encode_error(message: str) -> bytes:
    """The V2 error body.

    >>> encode_error('no model "m"')
    b'{"error":"no model \\\\"m\\\\""}'
    """
    return orjson.dumps({"error": message})


# ---------------------------------------------------------------------------- decoding


def load_json_object(header: memoryview | bytes) -> dict[str, Any]:
    """Parse a request body that must be a JSON object; InvalidRequest otherwise."""
    try:
        doc = orjson.loads(header)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidRequest(f"request body: expected a JSON object, got {show(doc)}")
    return doc


def _decode_parameters(raw: Any) -> tuple[int, int, bool, dict[str, Any]]:
    """Split request parameters into (priority, timeout_us, binary_data_output, rest)."""
    if raw is None:
        return 0, 0, False, {}
    if not isinstance(raw, dict):
        raise InvalidRequest(f"parameters: expected an object, got {show(raw)}")
    priority = raw.get("priority", 0)
    if type(priority) is not int or priority < 0:
        raise InvalidRequest(
            f"parameters.priority: expected a non-negative integer, got {show(priority)}"
        )
    # Triton's name and unit: "timeout" in microseconds.
    timeout_us = raw.get("timeout", 0)
    if type(timeout_us) is not int or timeout_us < 0:
        raise InvalidRequest(
            "parameters.timeout: expected a non-negative integer of microseconds, "
            f"got {show(timeout_us)}"
        )
    binary_data_output = raw.get("binary_data_output", False)
    if type(binary_data_output) is not bool:
        raise InvalidRequest(
            f"parameters.binary_data_output: expected true or false, got {show(binary_data_output)}"
        )
    rest = {key: value for key, value in raw.items() if key not in _RESERVED_PARAMETERS}
    return priority, timeout_us, binary_data_output, rest


def _decode_requested_outputs(raw: Any) -> list[RequestedOutput] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise InvalidRequest(f"outputs: expected a list, got {show(raw)}")
    requested: list[RequestedOutput] = []
    seen: set[str] = set()
    for index, item in enumerate(raw):
        if not isinstance(item, dict):
            raise InvalidRequest(f"outputs[{index}]: expected an object, got {show(item)}")
        name = item.get("name")
        if not isinstance(name, str):
            raise InvalidRequest(f"outputs[{index}].name: expected a string, got {show(name)}")
        if name in seen:
            raise InvalidRequest(f"outputs: output {name!r} is requested more than once")
        seen.add(name)
        params = _tensor_parameters(f"output {name!r}", item.get("parameters"))
        region = v2_shm.region_ref(f"output {name!r}", params)
        # tritonclient sends binary_data false beside a region; true contradicts it.
        if region is not None and params.get("binary_data") is True:
            raise InvalidRequest(
                f"output {name!r}: set either shared_memory_region or binary_data true, not both"
            )
        classes = params.get("classification", 0)
        if type(classes) is not int or classes < 0:
            raise InvalidRequest(
                f"output {name!r}: parameters.classification: expected a non-negative "
                f"integer (the number of classes), got {show(classes)}"
            )
        if classes and region is not None:
            raise InvalidRequest(
                f"output {name!r}: set either shared_memory_region or classification, not both"
            )
        binary_data = params.get("binary_data")
        if binary_data is not None and type(binary_data) is not bool:
            raise InvalidRequest(
                f"output {name!r}: parameters.binary_data: expected true or false, "
                f"got {show(binary_data)}"
            )
        requested.append(RequestedOutput(name, binary_data, region, classes))
    return requested or None


def _tensor_parameters(where: str, raw: Any) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{where}: parameters: expected an object, got {show(raw)}")
    return raw


def decode_tensors(
    raw: Any, binary: memoryview | None, field: str = "inputs"
) -> tuple[dict[str, np.ndarray], dict[str, SharedMemoryInput]]:
    """The tensors of a request's ``inputs`` (or a response's ``outputs``: ``field``)
    with their data, and those to read from shared memory."""
    if raw is None:
        raise InvalidRequest(f"{field}: required field is missing; expected a list of tensors")
    if not isinstance(raw, list):
        raise InvalidRequest(f"{field}: expected a list, got {show(raw)}")
    inputs: dict[str, np.ndarray] = {}
    shared: dict[str, SharedMemoryInput] = {}
    offset = 0  # into `binary`: inputs' binary data follow each other in input order
    for index, item in enumerate(raw):
        name, array, offset = _decode_input(index, item, binary, offset)
        if name in inputs or name in shared:
            raise InvalidRequest(f"{field}: {field[:-1]} {name!r} appears more than once")
        if isinstance(array, SharedMemoryInput):
            shared[name] = array
        else:
            inputs[name] = array
    if binary is not None and offset != len(binary):
        raise InvalidRequest(
            f"binary data: the body holds {len(binary)} bytes after the JSON header but "
            f"the {field}' binary_data_size add up to {offset}"
        )
    return inputs, shared


def _decode_input(
    index: int, raw: Any, binary: memoryview | None, offset: int
) -> tuple[str, np.ndarray | SharedMemoryInput, int]:
    """Decode one input; returns (name, array, offset past its binary data)."""
    if not isinstance(raw, dict):
        raise InvalidRequest(f"inputs[{index}]: expected an object, got {show(raw)}")
    name = raw.get("name")
    if not isinstance(name, str):
        raise InvalidRequest(f"inputs[{index}].name: expected a string, got {show(name)}")
    where = f"input {name!r}"
    shape = _decode_shape(where, raw.get("shape"))
    # numpy_dtype rejects anything but a known datatype name, so it is a str past here.
    datatype = cast(str, raw.get("datatype"))
    dtype = numpy_dtype(datatype, field=f"{where}: datatype")
    count = math.prod(shape)
    params = _tensor_parameters(where, raw.get("parameters"))
    size = params.get("binary_data_size")
    data = raw.get("data")
    region = v2_shm.region_ref(where, params)
    if region is not None:
        if data is not None or size is not None:
            raise InvalidRequest(
                f"{where}: set one of data, binary_data_size, shared_memory_region"
            )
        return name, v2_shm.shared_input(where, datatype, shape, region), offset
    if size is None:
        if data is None:
            raise InvalidRequest(f"{where}: needs either 'data' or parameters.binary_data_size")
        if not isinstance(data, list):
            raise InvalidRequest(f"{where}: data: expected a list, got {show(data)}")
        if datatype == "BYTES":
            flat = bytes_from_json(where, data, count, shape)
        else:
            flat = numeric_from_json(where, data, count, shape, datatype, dtype)
    else:
        if data is not None:
            raise InvalidRequest(f"{where}: has both 'data' and parameters.binary_data_size")
        _check_binary_size(where, size, binary, offset)
        assert binary is not None  # checked above; tells mypy
        chunk = binary[offset : offset + size]
        offset += size
        if datatype == "BYTES":
            flat = bytes_from_binary(where, chunk, count)
        else:
            flat = fixed_from_binary(where, chunk, count, shape, datatype, dtype)
    try:
        return name, flat.reshape(shape), offset
    except ValueError as exc:  # only zero-size shapes too big for numpy reach here
        raise InvalidRequest(f"{where}: shape {shape} is not supported: {exc}") from None


def _check_binary_size(where: str, size: Any, binary: memoryview | None, offset: int) -> None:
    if type(size) is not int or size < 0:
        raise InvalidRequest(
            f"{where}: parameters.binary_data_size: expected a non-negative integer, "
            f"got {show(size)}"
        )
    if binary is None:
        raise InvalidRequest(
            f"{where}: has binary_data_size but the request has no "
            "Inference-Header-Content-Length header to say where the JSON ends"
        )
    if size > len(binary) - offset:
        raise InvalidRequest(
            f"{where}: binary_data_size is {size} but only {len(binary) - offset} bytes "
            "of binary data are left in the body"
        )


def _decode_shape(where: str, raw: Any) -> list[int]:
    if not isinstance(raw, list) or not all(
        type(dim) is int and 0 <= dim <= _INT64_MAX for dim in raw
    ):
        raise InvalidRequest(
            f"{where}: shape: expected a list of non-negative integers, got {show(raw)}"
        )
    if not addressable(raw):
        raise InvalidRequest(f"{where}: shape: {raw} is too large for any tensor")
    return raw


# ---------------------------------------------------------------------------- encoding


def _json_default(value: Any) -> Any:
    # orjson hands over what it cannot write natively: arrays it cannot serialize in C
    # (unaligned ones) and numpy scalars in response parameters.
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    raise TypeError(f"cannot write {type(value).__name__} as JSON")
