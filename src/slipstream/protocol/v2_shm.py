"""Triton's system shared-memory extension on the wire: pure codecs, no memory mapped here.

A client puts a tensor in a POSIX shared-memory object it created, registers a window of
that object under a region name, then names the region (and an offset and size in it) in
a tensor's parameters instead of sending the data::

    {"name": "INPUT0", "datatype": "FP32", "shape": [1, 16],
     "parameters": {"shared_memory_region": "input", "shared_memory_byte_size": 64}}

The same three parameters on a requested output ask for the output to be written into
the region; the response then lists the output's name, datatype and shape without data.
This module parses those parameters and the register / status requests of HTTP and
gRPC (the V2 and gRPC codecs call it); ``serving/shared_memory.py`` maps the regions,
checks every access against their bounds, and reads and writes the tensors.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from slipstream.datatypes import numpy_dtype
from slipstream.errors import InvalidRequest
from slipstream.protocol.proto import inference_pb2 as pb
from slipstream.types import (
    CudaRegionStatus,
    SharedMemoryInput,
    SharedMemoryRef,
    SharedMemoryRegionStatus,
)

REGION = "shared_memory_region"
OFFSET = "shared_memory_offset"
BYTE_SIZE = "shared_memory_byte_size"
PARAMETERS = (REGION, OFFSET, BYTE_SIZE)

# The extensions' names in the server metadata, as Triton lists them.
EXTENSION = "system_shared_memory"
CUDA_EXTENSION = "cuda_shared_memory"


@dataclass(frozen=True, slots=True)
class CudaRegisterRequest:
    """A request to open ``byte_size`` bytes of device memory a client exported."""

    # cudaIpcGetMemHandle's handle: 64 raw bytes (base64 in HTTP's JSON).
    raw_handle: bytes
    # The GPU the memory is on.
    device_id: int
    byte_size: int


@dataclass(frozen=True, slots=True)
class RegisterRequest:
    """A request to map ``byte_size`` bytes at ``offset`` of the object ``key``."""

    # POSIX shared-memory object name, as given to shm_open (e.g. "/input_simple").
    key: str
    offset: int
    byte_size: int


def region_ref(where: str, parameters: Mapping[str, Any]) -> SharedMemoryRef | None:
    """The region a tensor's parameters point at, or None when they name none.

    ``parameters`` are plain values (JSON, or gRPC InferParameters already unpacked).
    ``where`` names the tensor in errors, e.g. ``input 'INPUT0'``.
    """
    # Every tensor of every request passes here: most carry no parameters at all.
    if not parameters or (
        REGION not in parameters and OFFSET not in parameters and BYTE_SIZE not in parameters
    ):
        return None
    region = parameters.get(REGION)
    if not isinstance(region, str) or not region:
        raise InvalidRequest(
            f"{where}: parameters.{REGION}: expected the name of a registered region, "
            f"got {region!r}; send {REGION} with {BYTE_SIZE} (and optionally {OFFSET})"
        )
    if BYTE_SIZE not in parameters:
        raise InvalidRequest(
            f"{where}: parameters.{BYTE_SIZE} is required with {REGION}: the tensor's size "
            "in bytes in the region"
        )
    offset = _non_negative(where, OFFSET, parameters.get(OFFSET, 0))
    byte_size = _non_negative(where, BYTE_SIZE, parameters[BYTE_SIZE])
    return SharedMemoryRef(region, offset, byte_size)


def grpc_region(where: str, parameters: Mapping[str, pb.InferParameter]) -> SharedMemoryRef | None:
    """:func:`region_ref` of a gRPC tensor's InferParameter map."""
    if not parameters or not any(key in parameters for key in PARAMETERS):
        return None
    values = {
        key: getattr(parameters[key], parameters[key].WhichOneof("parameter_choice") or "", None)
        for key in PARAMETERS
        if key in parameters
    }
    return region_ref(where, values)


def shared_input(
    where: str, datatype: str, shape: list[int], ref: SharedMemoryRef
) -> SharedMemoryInput:
    """An input to read from a region; refuses a size that cannot hold its shape."""
    dtype = numpy_dtype(datatype, field=f"{where}: datatype")
    if datatype != "BYTES":
        expected = math.prod(shape) * dtype.itemsize
        if ref.byte_size != expected:
            raise InvalidRequest(
                f"{where}: parameters.{BYTE_SIZE} is {ref.byte_size} but shape {shape} of "
                f"{datatype} takes {expected} bytes"
            )
    return SharedMemoryInput(datatype, shape, ref)


# ---------------------------------------------------------------- HTTP


def decode_register_json(body: bytes) -> RegisterRequest:
    """The body of ``POST /v2/systemsharedmemory/region/<name>/register``."""
    doc = _json_object(body, "key and byte_size")
    key = doc.get("key")
    if not isinstance(key, str):
        raise InvalidRequest(
            f"key: expected the shared-memory object's name as a string, got {key!r}"
        )
    if "byte_size" not in doc:
        raise InvalidRequest("byte_size: required; the size of the region in bytes")
    offset = _non_negative("register request", "offset", doc.get("offset", 0))
    byte_size = _non_negative("register request", "byte_size", doc["byte_size"])
    return RegisterRequest(key, offset, byte_size)


def decode_cuda_register_json(body: bytes) -> CudaRegisterRequest:
    """The body of ``POST /v2/cudasharedmemory/region/<name>/register``:
    ``{"raw_handle": {"b64": "..."}, "device_id": 0, "byte_size": 64}``."""
    doc = _json_object(body, "raw_handle, device_id and byte_size")
    handle = doc.get("raw_handle")
    encoded = handle.get("b64") if isinstance(handle, dict) else None
    if not isinstance(encoded, str):
        raise InvalidRequest(
            f'raw_handle: expected {{"b64": <the CUDA IPC handle in base64>}}, got {handle!r}'
        )
    try:
        raw_handle = base64.b64decode(encoded, validate=True)
    except ValueError as exc:  # binascii.Error, or characters outside ASCII
        raise InvalidRequest(f"raw_handle.b64: not valid base64 ({exc})") from None
    for field in ("device_id", "byte_size"):
        if field not in doc:
            raise InvalidRequest(f"{field}: required")
    device_id = _non_negative("register request", "device_id", doc["device_id"])
    byte_size = _non_negative("register request", "byte_size", doc["byte_size"])
    return CudaRegisterRequest(raw_handle, device_id, byte_size)


def cuda_status_json(regions: list[CudaRegionStatus]) -> bytes:
    return orjson.dumps(
        [{"name": r.name, "device_id": r.device_id, "byte_size": r.byte_size} for r in regions]
    )


def status_json(regions: list[SharedMemoryRegionStatus]) -> bytes:
    return orjson.dumps(
        [
            {"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}
            for r in regions
        ]
    )


# ---------------------------------------------------------------- gRPC


def decode_register_grpc(message: pb.SystemSharedMemoryRegisterRequest) -> RegisterRequest:
    return RegisterRequest(message.key, message.offset, message.byte_size)


def decode_cuda_register_grpc(message: pb.CudaSharedMemoryRegisterRequest) -> CudaRegisterRequest:
    # device_id is an int64 on this message.
    device_id = _non_negative("register request", "device_id", message.device_id)
    return CudaRegisterRequest(message.raw_handle, device_id, message.byte_size)


def encode_cuda_status_grpc(regions: list[CudaRegionStatus]) -> pb.CudaSharedMemoryStatusResponse:
    response = pb.CudaSharedMemoryStatusResponse()
    for r in regions:
        status = response.regions[r.name]
        status.name, status.device_id, status.byte_size = r.name, r.device_id, r.byte_size
    return response


def encode_status_grpc(
    regions: list[SharedMemoryRegionStatus],
) -> pb.SystemSharedMemoryStatusResponse:
    response = pb.SystemSharedMemoryStatusResponse()
    for r in regions:
        status = response.regions[r.name]
        status.name, status.key = r.name, r.key
        status.offset, status.byte_size = r.offset, r.byte_size
    return response


def _json_object(body: bytes, fields: str) -> dict[str, Any]:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidRequest(f"request body: expected a JSON object with {fields}")
    return doc


def _non_negative(where: str, field: str, value: Any) -> int:
    # JSON has one number type: 64.0 is the integer 64 (JSON Schema agrees).
    if type(value) is float and value.is_integer():
        value = int(value)
    # bool is an int, but true is no size.
    if type(value) is not int or value < 0:
        raise InvalidRequest(f"{where}: {field}: expected a non-negative integer, got {value!r}")
    return value
