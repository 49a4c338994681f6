"""The client side of the V2 REST codec: requests out, responses and metadata in.

What a server calling another V2 server needs (a cascade's remote stage): the request
with every tensor as Triton's binary extension (no per-element JSON either way), the
response decoded with the same checks the server applies to requests. Pure functions,
no I/O.

>>> body, json_length = encode_request({"x": np.ones((1, 2), np.float32)}, ["y"])
>>> body[:json_length]
b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1,2],"parameters":{"binary_data_size":8}}],"outputs":[{"name":"y","parameters":{"binary_data":true}}]}'
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson

from slipstream.datatypes import v2_datatype
from slipstream.errors import InvalidRequest
from slipstream.protocol import v2
from slipstream.types import TensorMetadata

__all__ = ["decode_metadata_tensors", "decode_response", "encode_request"]


def encode_request(
    inputs: dict[str, np.ndarray], outputs: list[str], parameters: dict[str, Any] | None = None
) -> tuple[bytes, int]:
    """A V2 inference request body asking for ``outputs`` in binary; returns ``(body,
    json_length)``: send ``Inference-Header-Content-Length: json_length``."""
    entries: list[dict[str, Any]] = []
    payloads: list[Any] = []
    for name, array in inputs.items():
        datatype = v2_datatype(array.dtype)
        payload, size = v2.binary_payload(array, datatype)
        entries.append({"name": name, "datatype": datatype, "shape": array.shape,
                        "parameters": {"binary_data_size": size}})  # fmt: skip
        payloads.append(payload)
    doc: dict[str, Any] = {"inputs": entries}
    if parameters:
        doc["parameters"] = parameters
    doc["outputs"] = [{"name": name, "parameters": {"binary_data": True}} for name in outputs]
    header = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    return b"".join([header, *payloads]), len(header)


def decode_response(body: bytes, header_length: int | None) -> dict[str, np.ndarray]:
    """The outputs of a V2 inference response body (``header_length``: its
    ``Inference-Header-Content-Length``, None for all-JSON). InvalidRequest names what
    is malformed.

    >>> decode_response(b'{"outputs":[{"name":"y","datatype":"INT64","shape":[2],'
    ...                 b'"data":[3,4]}]}', None)
    {'y': array([3, 4])}
    """
    view = memoryview(body)
    binary = None
    if header_length is not None:
        if not 0 <= header_length <= len(view):
            raise InvalidRequest(
                f"Inference-Header-Content-Length: {header_length} is not within the "
                f"{len(view)}-byte body"
            )
        view, binary = view[:header_length], view[header_length:]
    doc = v2.load_json_object(view)
    outputs, in_shared_memory = v2.decode_tensors(doc.get("outputs"), binary, "outputs")
    if in_shared_memory:
        raise InvalidRequest(f"outputs {sorted(in_shared_memory)} came back in shared memory")
    return outputs


def decode_metadata_tensors(body: bytes, kind: str) -> list[TensorMetadata]:
    """The ``inputs`` or ``outputs`` (``kind``) of a V2 model metadata body.

    >>> decode_metadata_tensors(b'{"inputs":[{"name":"x","datatype":"FP32","shape":[-1,4]}]}',
    ...                         "inputs")
    [TensorMetadata(name='x', datatype='FP32', shape=[-1, 4])]
    """
    doc = v2.load_json_object(body)
    raw = doc.get(kind)
    if not isinstance(raw, list):
        raise InvalidRequest(f"model metadata: {kind}: expected a list of tensors")
    tensors = []
    for item in raw:
        if not isinstance(item, dict):
            raise InvalidRequest(f"model metadata: {kind}: expected objects, got {item!r}")
        name, datatype, shape = item.get("name"), item.get("datatype"), item.get("shape")
        if not (isinstance(name, str) and isinstance(datatype, str) and isinstance(shape, list)):
            raise InvalidRequest(f"model metadata: {kind}: {item!r} lacks name, datatype or shape")
        tensors.append(TensorMetadata(name, datatype, [int(d) for d in shape]))
    return tensors
