"""The V2 tensor datatypes and their numpy and Triton-config spellings."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from slipstream.errors import InvalidRequest

# numpy has no bfloat16: ml_dtypes' is the one tritonclient (r26.06+), JAX and ONNX use,
# so a client's BF16 array and ours are the same type. Its dtype kind is "V" (void), not
# "f": test for floats with :func:`is_float`, never by kind alone.
BF16 = np.dtype(ml_dtypes.bfloat16)

# V2 datatype name -> numpy dtype. BYTES tensors are object arrays of bytes.
V2_TO_NUMPY: dict[str, np.dtype[np.generic]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "BF16": BF16,
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(np.object_),
}

NUMPY_TO_V2: dict[np.dtype[np.generic], str] = {dt: name for name, dt in V2_TO_NUMPY.items()}
# numpy unicode / bytes string arrays are served as BYTES too.
_STRING_KINDS = ("U", "S", "O")

# Byte size of one element, for fixed-size types (BYTES is variable).
V2_ITEM_SIZE: dict[str, int] = {
    name: dt.itemsize for name, dt in V2_TO_NUMPY.items() if name != "BYTES"
}


def is_float(dtype: np.dtype[Any]) -> bool:
    """Whether ``dtype`` holds floating-point numbers (bfloat16 among them).

    >>> is_float(np.dtype(np.float16)), is_float(BF16), is_float(np.dtype(np.int8))
    (True, True, False)
    """
    return dtype.kind == "f" or dtype == BF16


def numpy_dtype(datatype: str, *, field: str = "datatype") -> np.dtype[np.generic]:
    """numpy dtype of a V2 datatype; a clear InvalidRequest for an unknown name."""
    try:
        return V2_TO_NUMPY[datatype]
    except (KeyError, TypeError):
        expected = ", ".join(V2_TO_NUMPY)
        raise InvalidRequest(
            f"{field}: unsupported datatype {datatype!r}; expected one of {expected}"
        ) from None


def v2_datatype(dtype: np.dtype[np.generic]) -> str:
    """V2 datatype name of a numpy dtype (strings map to BYTES)."""
    name = NUMPY_TO_V2.get(dtype)
    if name is not None:
        return name
    if dtype.kind in _STRING_KINDS:
        return "BYTES"
    raise ValueError(f"numpy dtype {dtype} has no V2 datatype")


def from_config_datatype(value: str) -> str:
    """Normalise a config datatype ('TYPE_FP32', 'FP32', 'TYPE_STRING') to V2 ('FP32')."""
    name = value.upper()
    if name.startswith("TYPE_"):
        name = name[len("TYPE_") :]
    if name == "STRING":
        name = "BYTES"
    if name not in V2_TO_NUMPY:
        expected = ", ".join(f"TYPE_{n}" for n in V2_TO_NUMPY)
        raise ValueError(f"unsupported data_type {value!r}; expected one of {expected}")
    return name


def to_config_datatype(datatype: str) -> str:
    """Triton config spelling of a V2 datatype ('FP32' -> 'TYPE_FP32', BYTES -> TYPE_STRING)."""
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


# numpy refuses an array whose non-zero dims multiply (times the item size) past its
# index range, even when another dim is 0 and the array is empty.
_MAX_ADDRESSABLE_ELEMENTS = 2**58


def addressable(shape: list[int]) -> bool:
    """Whether numpy can hold an array of ``shape`` (non-negative dims), empty or not.

    >>> addressable([0, 2**31, 2**40]), addressable([0, 2**31]), addressable([3, 4])
    (False, True, True)
    """
    product = 1
    for dim in shape:
        if dim:
            product *= dim
            if product > _MAX_ADDRESSABLE_ELEMENTS:
                return False
    return True
