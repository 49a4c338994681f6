"""V2 gRPC messages <-> Slipstream's plain data: pure functions, no I/O.

Requests arrive with tensor data either in ``raw_input_contents`` (one little-endian,
row-major bytes entry per input, which is what tritonclient sends) or in each input's
typed ``contents`` field. Responses always carry ``raw_output_contents``, as Triton's do:
one memcpy per output instead of a protobuf repeated field per element.

Every malformed request raises :class:`InvalidRequest` naming the input or parameter,
what was expected and what was received.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from slipstream.datatypes import V2_TO_NUMPY, addressable, v2_datatype
from slipstream.errors import InvalidRequest
from slipstream.observability.stats import ModelStats, StatDuration
from slipstream.protocol import v2_shm
from slipstream.protocol.proto import inference_pb2 as pb
from slipstream.types import (
    InferRequest,
    InferResponse,
    ModelMetadata,
    RepositoryEntry,
    RequestedOutput,
    ServerMetadata,
    SharedMemoryInput,
    TensorMetadata,
)

# Tags (field number << 3 | 2, length-delimited) of the fields serialised by hand.
_RAW_OUTPUT_TAG = b"\x32"  # ModelInferResponse.raw_output_contents = 6
_STREAM_INFER_RESPONSE_TAG = b"\x12"  # ModelStreamInferResponse.infer_response = 2

# Triton's parameter marking a stream's last answer to a request; serialised once.
FINAL_RESPONSE = "triton_final_response"
_FINAL_RESPONSE_ENTRY = pb.ModelInferResponse(
    parameters={FINAL_RESPONSE: pb.InferParameter(bool_param=True)}
).SerializeToString()

# The 4-byte little-endian length before each element of a raw BYTES tensor.
_BYTES_LENGTH = struct.Struct("<I")

# V2 datatype -> dtype of its raw bytes on the wire (little-endian). On little-endian
# hosts these equal the native dtypes, so np.frombuffer needs no byte swap.
_WIRE_DTYPES: dict[str, np.dtype[Any]] = {
    name: dt.newbyteorder("<") for name, dt in V2_TO_NUMPY.items() if name != "BYTES"
}

# V2 datatype -> the InferTensorContents field that carries it (FP16 has none: raw only).
_CONTENTS_FIELD: dict[str, str] = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}

# INT8/INT16/UINT8/UINT16 travel in 32-bit fields: read at that width, then range-checked.
_NARROW_INTS: dict[str, tuple[np.dtype[Any], int, int]] = {
    name: (np.dtype(wide), int(np.iinfo(narrow).min), int(np.iinfo(narrow).max))
    for name, wide, narrow in (
        ("INT8", np.int32, np.int8),
        ("INT16", np.int32, np.int16),
        ("UINT8", np.uint32, np.uint8),
        ("UINT16", np.uint32, np.uint16),
    )
}

# Request parameters Slipstream reads into InferRequest fields rather than passing on.
_PRIORITY = "priority"
_TIMEOUT = "timeout"

_INT64_MAX = 2**63 - 1

ParameterValue = bool | int | float | str


# ---------------------------------------------------------------- requests


def decode_infer_request(message: pb.ModelInferRequest) -> InferRequest:
    """A ModelInferRequest as an :class:`InferRequest` with numpy inputs.

    >>> req = pb.ModelInferRequest(model_name="m", raw_input_contents=[b"\\x01\\x00"])
    >>> _ = req.inputs.add(name="x", datatype="INT16", shape=[1])
    >>> decode_infer_request(req).inputs["x"].tolist()
    [1]
    """
    raw_contents = message.raw_input_contents
    # Inputs in shared memory have no raw_input_contents entry (tritonclient, Triton).
    shared = {
        t.name: ref
        for t in message.inputs
        if t.parameters and (ref := v2_shm.grpc_region(f"input '{t.name}'", t.parameters))
    }
    num_inputs = len(message.inputs) - len(shared)
    if raw_contents and len(raw_contents) != num_inputs:
        raise InvalidRequest(
            f"raw_input_contents has {len(raw_contents)} entries but the request has "
            f"{num_inputs} inputs outside shared memory; send raw data for every such "
            "input or for none"
        )
    inputs: dict[str, np.ndarray] = {}
    shared_inputs: dict[str, SharedMemoryInput] = {}
    index = 0
    for tensor in message.inputs:
        name = tensor.name
        if name in inputs or name in shared_inputs:
            raise InvalidRequest(f"input '{name}' appears more than once in the request")
        shape = _shape_of(name, tensor.shape)
        ref = shared.get(name)
        if ref is not None:
            if tensor.HasField("contents"):
                raise InvalidRequest(
                    f"input '{name}': data given in both contents and a shared-memory "
                    "region; send it in one of them"
                )
            where = f"input '{name}'"
            shared_inputs[name] = v2_shm.shared_input(where, tensor.datatype, shape, ref)
        elif raw_contents:
            if tensor.HasField("contents"):
                raise InvalidRequest(
                    f"input '{name}': data given in both contents and raw_input_contents; "
                    "send it in one of them"
                )
            inputs[name] = decode_raw_tensor(name, tensor.datatype, shape, raw_contents[index])
            index += 1
        else:
            inputs[name] = decode_typed_tensor(name, tensor.datatype, shape, tensor.contents)
    request = InferRequest(
        model_name=message.model_name,
        model_version=message.model_version,
        inputs=inputs,
        id=message.id,
        outputs=_requested_outputs(message.outputs) if message.outputs else None,
        shared_memory_inputs=shared_inputs,
    )
    _apply_parameters(request, message.parameters)
    return request


def decode_raw_tensor(name: str, datatype: str, shape: list[int], data: bytes) -> np.ndarray:
    """One input's raw_input_contents entry as an array (a zero-copy view when fixed-size)."""
    count = math.prod(shape)
    if datatype == "BYTES":
        return _decode_raw_bytes(name, shape, count, data).reshape(shape)
    wire_dtype = _WIRE_DTYPES.get(datatype)
    if wire_dtype is None:
        raise _unsupported_datatype(name, datatype)
    expected = count * wire_dtype.itemsize
    if len(data) != expected:
        raise InvalidRequest(
            f"input '{name}': expected {expected} bytes of raw_input_contents for shape "
            f"{shape} and datatype {datatype}, got {len(data)}"
        )
    # A read-only view over the message's bytes: no copy of the tensor data.
    return np.frombuffer(data, dtype=wire_dtype).reshape(shape)


def _decode_raw_bytes(name: str, shape: list[int], count: int, data: bytes) -> np.ndarray:
    size = len(data)
    # Each element takes at least its 4-byte length: refuse an impossible shape before
    # allocating an array for it.
    if count * _BYTES_LENGTH.size > size:
        raise InvalidRequest(
            f"input '{name}': raw_input_contents has {size} bytes, too few for the {count} "
            f"BYTES elements of shape {shape} (each needs a 4-byte length)"
        )
    elements = np.empty(count, dtype=object)
    offset = 0
    for index in range(count):
        if offset + _BYTES_LENGTH.size > size:
            raise InvalidRequest(
                f"input '{name}': raw_input_contents holds {index} BYTES elements, "
                f"expected {count} for shape {shape}"
            )
        (length,) = _BYTES_LENGTH.unpack_from(data, offset)
        offset += _BYTES_LENGTH.size
        end = offset + length
        if end > size:
            raise InvalidRequest(
                f"input '{name}': BYTES element {index} declares {length} bytes but only "
                f"{size - offset} remain in raw_input_contents"
            )
        elements[index] = data[offset:end]
        offset = end
    if offset != size:
        raise InvalidRequest(
            f"input '{name}': raw_input_contents has {size - offset} bytes left after the "
            f"{count} BYTES elements expected for shape {shape}"
        )
    return elements


def decode_typed_tensor(
    name: str, datatype: str, shape: list[int], contents: pb.InferTensorContents
) -> np.ndarray:
    """One input's typed ``contents`` as an array of its V2 datatype."""
    dtype = V2_TO_NUMPY.get(datatype)
    if dtype is None:
        raise _unsupported_datatype(name, datatype)
    field = _CONTENTS_FIELD.get(datatype)
    if field is None:
        raise InvalidRequest(
            f"input '{name}': {datatype} has no typed contents field; send it in raw_input_contents"
        )
    values: Sequence[Any] = getattr(contents, field)
    count = math.prod(shape)
    if len(values) != count:
        raise InvalidRequest(
            f"input '{name}': expected {count} values in contents.{field} for shape "
            f"{shape} and datatype {datatype}, got {len(values)}"
        )
    if datatype == "BYTES":
        array = np.empty(count, dtype=object)
        array[:] = list(values)
        return array.reshape(shape)
    narrow = _NARROW_INTS.get(datatype)
    if narrow is None:
        return np.array(values, dtype=dtype).reshape(shape)
    wide, low, high = narrow
    array = np.array(values, dtype=wide)
    if count and (array.min() < low or array.max() > high):
        raise InvalidRequest(
            f"input '{name}': contents.{field} holds values outside the {datatype} range "
            f"{low}..{high}"
        )
    return array.astype(dtype).reshape(shape)


def _unsupported_datatype(name: str, datatype: str) -> InvalidRequest:
    expected = ", ".join(V2_TO_NUMPY)
    return InvalidRequest(
        f"input '{name}': unsupported datatype {datatype!r}; expected one of {expected}"
    )


def _shape_of(name: str, dims: Sequence[int]) -> list[int]:
    shape = list(dims)
    for dim in shape:
        if dim < 0:
            raise InvalidRequest(
                f"input '{name}': shape {shape} has a negative dim; send the actual shape"
            )
    if not addressable(shape):
        raise InvalidRequest(f"input '{name}': shape {shape} is too large for any tensor")
    return shape


def _requested_outputs(
    outputs: Sequence[pb.ModelInferRequest.InferRequestedOutputTensor],
) -> list[RequestedOutput]:
    requested = []
    for output in outputs:
        region = v2_shm.grpc_region(f"output '{output.name}'", output.parameters)
        classes = 0
        if "classification" in output.parameters:
            classes = _classification(output.name, output.parameters["classification"])
            if classes and region is not None:
                raise InvalidRequest(
                    f"output '{output.name}': set either shared_memory_region or "
                    "classification, not both"
                )
        requested.append(
            RequestedOutput(name=output.name, shared_memory=region, classification=classes)
        )
    return requested


def _classification(name: str, parameter: pb.InferParameter) -> int:
    # tritonclient sends int64_param; Triton refuses any other kind.
    if parameter.WhichOneof("parameter_choice") != "int64_param" or parameter.int64_param < 0:
        raise InvalidRequest(
            f"output '{name}': parameter 'classification': expected a non-negative "
            "int64_param (the number of classes)"
        )
    return parameter.int64_param


def _apply_parameters(request: InferRequest, parameters: Mapping[str, pb.InferParameter]) -> None:
    """Read priority and timeout into the request; keep every other parameter as is."""
    for key, parameter in parameters.items():
        value = parameter_value(parameter)
        if key == _PRIORITY:
            request.priority = _non_negative_int(key, value)
        elif key == _TIMEOUT:
            request.timeout_us = _non_negative_int(key, value)
        elif value is not None:
            request.parameters[key] = value


def _non_negative_int(key: str, value: ParameterValue | None) -> int:
    # bool is an int subclass, but a bool priority is a client bug, not priority 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidRequest(
            f"parameter '{key}': expected a non-negative integer in int64_param or "
            f"uint64_param, got {value!r}"
        )
    return value


def parameter_value(parameter: pb.InferParameter) -> ParameterValue | None:
    """The Python value of an InferParameter (None when no member of the oneof is set)."""
    choice = parameter.WhichOneof("parameter_choice")
    if choice is None:
        return None
    value: ParameterValue = getattr(parameter, choice)
    return value


def set_parameter(parameter: pb.InferParameter, value: Any) -> None:
    """Store a Python value in an InferParameter, choosing the oneof member by type."""
    if isinstance(value, bool):
        parameter.bool_param = value
    elif isinstance(value, int):
        if value > _INT64_MAX:
            parameter.uint64_param = value
        else:
            parameter.int64_param = value
    elif isinstance(value, float):
        parameter.double_param = value
    else:
        parameter.string_param = value if isinstance(value, str) else str(value)


# ---------------------------------------------------------------- responses


def encode_infer_response(response: InferResponse) -> pb.ModelInferResponse:
    """An :class:`InferResponse` as a ModelInferResponse with raw_output_contents."""
    message, raw_contents = _response_header(response)
    message.raw_output_contents.extend(bytes(data) for data in raw_contents)
    return message


def serialize_infer_response(response: InferResponse) -> bytes:
    """The wire bytes of ``encode_infer_response(response)``, copying tensor data once.

    upb serialises large bytes fields through growing arena buffers: two 600 KB outputs
    took 4.5 ms that way against 0.26 ms here. So the message is serialised without
    its raw contents and the raw_output_contents fields are appended by hand; a
    protobuf parser reads fields in any order, repeated fields by concatenation.
    """
    return b"".join(_infer_response_parts(response))


def serialize_stream_infer_response(response: InferResponse, final: bool = False) -> bytes:
    """The wire bytes of ``ModelStreamInferResponse(infer_response=...)``, one copy;
    ``final`` adds Triton's parameter ``triton_final_response``, true."""
    parts = _infer_response_parts(response)
    if final:
        parts.append(_FINAL_RESPONSE_ENTRY)  # a parser merges map entries in any order
    size = sum(len(part) for part in parts)
    return b"".join([_STREAM_INFER_RESPONSE_TAG, varint(size), *parts])


def _infer_response_parts(response: InferResponse) -> list[bytes | memoryview]:
    header, raw_contents = _response_header(response)
    parts: list[bytes | memoryview] = [header.SerializeToString()]
    for data in raw_contents:
        parts.append(_RAW_OUTPUT_TAG + varint(len(data)))
        parts.append(data)
    return parts


def _response_header(
    response: InferResponse,
) -> tuple[pb.ModelInferResponse, list[bytes | memoryview]]:
    """The response without raw_output_contents, and each output's raw contents."""
    message = pb.ModelInferResponse(
        model_name=response.model_name,
        model_version=response.model_version,
        id=response.id,
    )
    outputs = message.outputs
    raw_contents: list[bytes | memoryview] = []
    in_shared_memory = response.in_shared_memory
    for name, array in response.outputs.items():
        datatype, data = raw_buffer(array)
        outputs.add(name=name, datatype=datatype, shape=array.shape)
        # Triton keeps one raw_output_contents entry per output, empty for those it wrote
        # into a region: tritonclient finds an output's data by its index.
        raw_contents.append(b"" if name in in_shared_memory else data)
    for key, value in response.parameters.items():
        set_parameter(message.parameters[key], value)
    return message, raw_contents


def varint(value: int) -> bytes:
    """Protobuf's base-128 varint of a non-negative int (a length or a tag)."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_raw_tensor(array: np.ndarray) -> tuple[str, bytes]:
    """The V2 datatype of an array and its raw contents (row-major, little-endian)."""
    datatype, data = raw_buffer(array)
    return datatype, bytes(data)


def raw_buffer(array: np.ndarray) -> tuple[str, bytes | memoryview]:
    """The V2 datatype of an array and a view (or, for BYTES, a copy) of its raw contents."""
    dtype = array.dtype
    # A byte-swapped array (say, read from a big-endian file) is still its datatype.
    datatype = v2_datatype(dtype if dtype.isnative else dtype.newbyteorder("="))
    if datatype == "BYTES":
        return datatype, _encode_raw_bytes(array)
    # No copy for C-contiguous native little-endian arrays: a byte view of the array.
    wire = np.ascontiguousarray(array, dtype=_WIRE_DTYPES[datatype])
    # Flat uint8 so that len() of the view is its size in bytes.
    return datatype, wire.reshape(-1).view(np.uint8).data


def _encode_raw_bytes(array: np.ndarray) -> bytes:
    pack = _BYTES_LENGTH.pack
    parts: list[bytes] = []
    for item in array.flat:
        if isinstance(item, bytes):
            data = item
        elif isinstance(item, str):
            data = item.encode("utf-8")
        else:
            # tritonclient turns non-string objects into their str() the same way.
            data = str(item).encode("utf-8")
        parts.append(pack(len(data)))
        parts.append(data)
    return b"".join(parts)


def encode_server_metadata(metadata: ServerMetadata) -> pb.ServerMetadataResponse:
    return pb.ServerMetadataResponse(
        name=metadata.name, version=metadata.version, extensions=metadata.extensions
    )


def encode_model_metadata(metadata: ModelMetadata) -> pb.ModelMetadataResponse:
    return pb.ModelMetadataResponse(
        name=metadata.name,
        versions=metadata.versions,
        platform=metadata.platform,
        inputs=[_tensor_metadata(t) for t in metadata.inputs],
        outputs=[_tensor_metadata(t) for t in metadata.outputs],
    )


def _tensor_metadata(tensor: TensorMetadata) -> pb.ModelMetadataResponse.TensorMetadata:
    return pb.ModelMetadataResponse.TensorMetadata(
        name=tensor.name, datatype=tensor.datatype, shape=tensor.shape
    )


def encode_repository_index(entries: list[RepositoryEntry]) -> pb.RepositoryIndexResponse:
    return pb.RepositoryIndexResponse(
        models=[
            pb.RepositoryIndexResponse.ModelIndex(
                name=e.name, version=e.version, state=e.state, reason=e.reason
            )
            for e in entries
        ]
    )


# ---------------------------------------------------------------- statistics


def encode_model_statistics(stats: list[ModelStats]) -> pb.ModelStatisticsResponse:
    """Statistics snapshots in Triton's ModelStatisticsResponse."""
    return pb.ModelStatisticsResponse(model_stats=[_model_statistics(s) for s in stats])


def _model_statistics(stats: ModelStats) -> pb.ModelStatistics:
    infer = stats.inference_stats
    return pb.ModelStatistics(
        name=stats.name,
        version=stats.version,
        last_inference=stats.last_inference_ms,
        inference_count=stats.inference_count,
        execution_count=stats.execution_count,
        inference_stats=pb.InferStatistics(
            success=_duration(infer.success),
            fail=_duration(infer.fail),
            queue=_duration(infer.queue),
            compute_input=_duration(infer.compute_input),
            compute_infer=_duration(infer.compute_infer),
            compute_output=_duration(infer.compute_output),
            cache_hit=_duration(infer.cache_hit),
            cache_miss=_duration(infer.cache_miss),
        ),
        batch_stats=[
            pb.InferBatchStatistics(
                batch_size=b.batch_size,
                compute_input=_duration(b.compute_input),
                compute_infer=_duration(b.compute_infer),
                compute_output=_duration(b.compute_output),
            )
            for b in stats.batch_stats
        ],
        memory_usage=[
            pb.MemoryUsage(type=m.type, id=m.id, byte_size=m.byte_size) for m in stats.memory_usage
        ],
        response_stats={
            index: pb.InferResponseStatistics(
                compute_infer=_duration(entry.compute_infer),
                compute_output=_duration(entry.compute_output),
                success=_duration(entry.success),
                fail=_duration(entry.fail),
                empty_response=_duration(entry.empty_response),
                cancel=_duration(entry.cancel),
            )
            for index, entry in stats.response_stats.items()
        },
    )


def _duration(duration: StatDuration) -> pb.StatisticDuration:
    return pb.StatisticDuration(count=duration.count, ns=duration.ns)
