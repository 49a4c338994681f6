"""The datatype tables and BYTES codecs of Triton's ``triton_python_backend_utils``,
re-exported by :mod:`.python_utils` (models call them as ``pb_utils.<name>``).

Triton numbers its datatypes (``TRITONSERVER_DataType``: 1 BOOL ... 13 BYTES) and lays a
BYTES tensor out as each element's length (4 bytes, little-endian) then its bytes, in C
order; models that hand-decode a raw buffer or pick output dtypes use these.
"""

from __future__ import annotations

import struct
from typing import Any

import ml_dtypes
import numpy as np

# A config's TYPE_* name -> the numpy type a model builds its arrays with.
TRITON_STRING_TO_NUMPY: dict[str, Any] = {
    "TYPE_BOOL": bool,
    "TYPE_UINT8": np.uint8,
    "TYPE_UINT16": np.uint16,
    "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64,
    "TYPE_INT8": np.int8,
    "TYPE_INT16": np.int16,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32,
    "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
    # numpy has none: ml_dtypes' (Slipstream's BF16 arrays; Triton's own shim has no
    # numpy type for it, so a model reading BF16 there goes through DLPack).
    "TYPE_BF16": ml_dtypes.bfloat16,
}

# TRITONSERVER_DataType's numbers, in its order (0 is INVALID).
_BY_NUMBER: tuple[Any, ...] = (
    None,
    np.bool_,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.float16,
    np.float32,
    np.float64,
    np.object_,
    ml_dtypes.bfloat16,
)


def triton_to_numpy_type(data_type: int) -> Any:
    """TRITONSERVER_DataType's number -> numpy type (None where numpy has none)."""
    return _BY_NUMBER[data_type] if 0 < data_type < len(_BY_NUMBER) else None


def numpy_to_triton_type(data_type: Any) -> int | None:
    """numpy type -> TRITONSERVER_DataType's number (``np.bytes_`` is BYTES too)."""
    if data_type == np.bytes_:
        return 13
    for number, known in enumerate(_BY_NUMBER[1:], start=1):
        if data_type == known:
            return number
    return None


def serialize_byte_tensor(input_tensor: np.ndarray) -> Any:
    """A BYTES tensor (numpy object or ``np.bytes_``) as Triton's length-prefixed bytes;
    ``()`` for an empty one, None for an array of another dtype. ``str`` elements are
    UTF-8 encoded."""
    if input_tensor.size == 0:
        return ()
    if input_tensor.dtype != np.object_ and input_tensor.dtype.type != np.bytes_:
        return None
    parts: list[bytes] = []
    for item in input_tensor.reshape(-1, order="C"):
        data = item if isinstance(item, bytes) else str(item).encode("utf-8")
        parts.append(struct.pack("<I", len(data)))
        parts.append(data)
    return b"".join(parts)


def deserialize_bytes_tensor(encoded_tensor: bytes) -> np.ndarray:
    """Triton's length-prefixed bytes -> a flat numpy object array of ``bytes``."""
    items: list[bytes] = []
    buffer = memoryview(encoded_tensor)
    offset = 0
    while offset < len(buffer):
        (length,) = struct.unpack_from("<I", buffer, offset)
        offset += 4
        items.append(bytes(buffer[offset : offset + length]))
        offset += length
    array = np.empty(len(items), dtype=object)
    array[:] = items
    return array
