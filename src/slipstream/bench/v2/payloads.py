"""Request bodies, encoded once before the load starts: the hot loop only sends bytes.

>>> from slipstream.bench.v2.inputs import RequestInputs
>>> request = RequestInputs({"x": np.array([[1.0, 2.0]], np.float32)}, batch_size=1)
>>> encode_request("http", "m", "", request).body
b'{"inputs":[{"name":"x","shape":[1,2],"datatype":"FP32","data":[1.0,2.0]}]}'
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson

from slipstream.bench.v2.inputs import InputError, RequestInputs
from slipstream.bench.v2.messages import EncodedRequest, Protocol
from slipstream.datatypes import v2_datatype
from slipstream.protocol.grpc_codec import encode_raw_tensor
from slipstream.protocol.proto import inference_pb2 as pb


def encode_request(
    protocol: Protocol, model: str, version: str, request: RequestInputs
) -> EncodedRequest:
    """The request in the protocol's wire form."""
    if protocol == "http":
        body, header_length = _json_body(request.tensors), None
    elif protocol == "http-binary":
        body, header_length = _binary_body(request.tensors)
    else:
        body, header_length = _grpc_body(model, version, request.tensors), None
    return EncodedRequest(body=body, header_length=header_length, batch_size=request.batch_size)


def _input(name: str, array: np.ndarray, datatype: str, **more: Any) -> dict[str, Any]:
    """An input of a V2 JSON body (or of a binary body's JSON header)."""
    return {"name": name, "shape": list(array.shape), "datatype": datatype, **more}


def _json_body(tensors: dict[str, np.ndarray]) -> bytes:
    inputs = []
    for name, array in tensors.items():
        datatype = v2_datatype(array.dtype)
        inputs.append(_input(name, array, datatype, data=_json_data(name, array, datatype)))
    return orjson.dumps({"inputs": inputs}, option=orjson.OPT_SERIALIZE_NUMPY)


def _json_data(name: str, array: np.ndarray, datatype: str) -> Any:
    if datatype == "BYTES":
        try:
            return [
                item.decode("utf-8") if isinstance(item, bytes) else str(item)
                for item in array.flat
            ]
        except UnicodeDecodeError:
            raise InputError(
                f"input {name!r}: BYTES elements that are not UTF-8 cannot be sent as JSON; "
                "use --protocol http-binary or grpc"
            ) from None
    if datatype in ("FP16", "BF16"):
        # orjson writes neither; the values are exact in float32.
        return np.ascontiguousarray(array, np.float32).ravel()
    return np.ascontiguousarray(array).ravel()


def _binary_body(tensors: dict[str, np.ndarray]) -> tuple[bytes, int]:
    inputs = []
    chunks = []
    for name, array in tensors.items():
        datatype, raw = encode_raw_tensor(array)
        inputs.append(_input(name, array, datatype, parameters={"binary_data_size": len(raw)}))
        chunks.append(raw)
    # Outputs come back binary too, as perf_analyzer asks for them.
    header = orjson.dumps({"inputs": inputs, "parameters": {"binary_data_output": True}})
    return b"".join([header, *chunks]), len(header)


def _grpc_body(model: str, version: str, tensors: dict[str, np.ndarray]) -> bytes:
    message = pb.ModelInferRequest(model_name=model, model_version=version)
    for name, array in tensors.items():
        datatype, raw = encode_raw_tensor(array)
        message.inputs.add(name=name, datatype=datatype, shape=array.shape)
        message.raw_input_contents.append(raw)
    return message.SerializeToString()
