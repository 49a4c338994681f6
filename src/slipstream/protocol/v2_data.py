"""One V2 tensor's elements between the wire and numpy: JSON ``data`` lists and the
binary extension's raw bytes, both ways, each checked against the tensor's datatype and
shape (an :class:`InvalidRequest` naming the tensor otherwise).

:mod:`slipstream.protocol.v2` handles the envelope around them (the request and response
objects, parameters, which tensor's bytes lie where in the body) and calls these per
tensor:

>>> numeric_from_json("input 'x'", [[1, 2]], 2, [1, 2], "FP32", np.dtype(np.float32))
array([1., 2.], dtype=float32)
>>> binary_payload(np.array([b"hi"], dtype=object), "BYTES")
(b'\\x02\\x00\\x00\\x00hi', 6)
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import orjson

from slipstream.datatypes import BF16, V2_ITEM_SIZE
from slipstream.errors import InvalidRequest

__all__ = [
    "binary_payload",
    "bytes_from_binary",
    "bytes_from_json",
    "fixed_from_binary",
    "json_strings",
    "numeric_from_json",
    "show",
]

# Length prefix of one BYTES element in binary data.
_LENGTH_PREFIX = struct.Struct("<I")
# Target dtype kind -> kinds np.asarray may infer from JSON values and still be accepted:
# ints fit float tensors (JSON writes 1.0 as 1), but floats never truncate into ints and
# booleans only fill BOOL.
_ACCEPTED_KINDS = {"b": "b", "i": "iu", "u": "iu", "f": "iuf"}
_EXPECTED_VALUES = {"b": "true/false", "i": "integers", "u": "integers", "f": "numbers"}
_FOUND_VALUES = {
    "b": "booleans",
    "i": "integers",
    "u": "integers",
    "f": "non-integer numbers",
    "U": "strings",
    "O": "nulls, objects, mixed values or integers beyond 64 bits",
}


# ---------------------------------------------------------------------------- decoding


def _count_error(where: str, shape: list[int], count: int, got: int) -> InvalidRequest:
    return InvalidRequest(f"{where}: shape {shape} needs {count} elements, got {got}")


def numeric_from_json(
    where: str, data: list[Any], count: int, shape: list[int], datatype: str, dtype: np.dtype[Any]
) -> np.ndarray:
    """A flat array of `dtype` from JSON numbers, checked without a per-element loop."""
    # Let numpy infer the dtype first: asking for `dtype` directly would parse "1.5"
    # into 1.5 and truncate 1.5 into 1. The inferred kind tells what the JSON held.
    try:
        natural = np.asarray(data)
    except ValueError:
        raise InvalidRequest(
            f"{where}: data: expected a flat or evenly nested list of {datatype} values"
        ) from None
    if natural.size != count:
        raise _count_error(where, shape, count, natural.size)
    if count == 0:
        return np.empty(0, dtype)
    if dtype == BF16:
        # Checked as FP32 numbers (a bfloat16 keeps FP32's range), then rounded.
        wide = _checked_numbers(where, natural, data, datatype, np.dtype(np.float32))
        return wide.astype(dtype)
    return _checked_numbers(where, natural, data, datatype, dtype)


def _checked_numbers(
    where: str, natural: np.ndarray, data: list[Any], datatype: str, dtype: np.dtype[Any]
) -> np.ndarray:
    kind = dtype.kind
    if kind in "iu" and natural.dtype.kind in "fO":
        # numpy infers float64 (or object) when values span int64 and uint64 ranges, as
        # UINT64 data may; such data, and data that is simply wrong, takes the slow path.
        return _exact_integers(where, data, datatype, dtype)
    if natural.dtype.kind not in _ACCEPTED_KINDS[kind]:
        found = _FOUND_VALUES.get(natural.dtype.kind, str(natural.dtype))
        raise InvalidRequest(
            f"{where}: {datatype} data must be {_EXPECTED_VALUES[kind]}, got {found}"
        )
    if natural.dtype == dtype:
        return natural.ravel()
    if np.can_cast(natural.dtype, dtype):
        return natural.astype(dtype).ravel()
    if kind == "f":
        try:
            with np.errstate(over="raise"):
                return natural.astype(dtype).ravel()
        except FloatingPointError:
            raise InvalidRequest(f"{where}: a value is out of range for {datatype}") from None
    # Integers into a narrower integer type: check the range once instead of per element.
    info = np.iinfo(dtype)
    low, high = natural.min(), natural.max()
    if low < info.min or high > info.max:
        raise InvalidRequest(
            f"{where}: values from {low} to {high} do not fit {datatype} ({info.min} to {info.max})"
        )
    return natural.astype(dtype).ravel()


_NOTHING = object()


def _exact_integers(where: str, data: list[Any], datatype: str, dtype: np.dtype[Any]) -> np.ndarray:
    flat = np.array(data, dtype=object).ravel().tolist()
    # A sentinel, not None: a JSON null is itself a bad value.
    bad = next((value for value in flat if type(value) is not int), _NOTHING)
    if bad is not _NOTHING:
        raise InvalidRequest(f"{where}: {datatype} data must be integers, got {show(bad)}")
    try:
        return np.array(flat, dtype=dtype)
    except OverflowError:
        info = np.iinfo(dtype)
        raise InvalidRequest(
            f"{where}: a value does not fit {datatype} ({info.min} to {info.max})"
        ) from None


def bytes_from_json(where: str, data: list[Any], count: int, shape: list[int]) -> np.ndarray:
    if data and isinstance(data[0], list):
        # An object array flattens nested lists of strings in C; ragged nesting leaves
        # lists as elements, which the str check below rejects.
        try:
            data = np.array(data, dtype=object).ravel().tolist()
        except ValueError:
            raise InvalidRequest(f"{where}: data: expected an evenly nested list") from None
    if len(data) != count:
        raise _count_error(where, shape, count, len(data))
    try:
        items = [value.encode() for value in data]
    except (AttributeError, UnicodeEncodeError):
        bad = next((value for value in data if not isinstance(value, str)), None)
        raise InvalidRequest(
            f"{where}: BYTES data must be strings of valid Unicode, got {show(bad)}"
        ) from None
    array = np.empty(count, dtype=object)
    array[:] = items
    return array


def fixed_from_binary(
    where: str, chunk: memoryview, count: int, shape: list[int], datatype: str, dtype: np.dtype[Any]
) -> np.ndarray:
    expected = count * V2_ITEM_SIZE[datatype]
    if len(chunk) != expected:
        raise InvalidRequest(
            f"{where}: binary_data_size is {len(chunk)} but shape {shape} of {datatype} "
            f"needs {expected} bytes"
        )
    if count == 0:
        return np.empty(0, dtype)
    array = np.frombuffer(chunk, dtype=dtype)
    if not array.flags.aligned:
        # The JSON header has any length, so the data often starts at an odd address;
        # one copy here spares every backend from handling misaligned buffers.
        array = array.copy()
    if datatype == "BOOL" and array.view(np.uint8).max() > 1:
        raise InvalidRequest(f"{where}: BOOL binary data must hold bytes 0 or 1")
    return array


def bytes_from_binary(where: str, chunk: memoryview, count: int) -> np.ndarray:
    end = len(chunk)
    # Every element takes at least its 4-byte length, which bounds `count` before any
    # allocation sized by it.
    if count * _LENGTH_PREFIX.size > end:
        raise InvalidRequest(
            f"{where}: binary_data_size {end} is too small for {count} BYTES elements"
        )
    raw = chunk.tobytes()  # one copy, so that each element is a cheap bytes slice
    unpack = _LENGTH_PREFIX.unpack_from
    items: list[bytes] = []
    pos = 0
    while pos < end and len(items) < count:
        if pos + 4 > end:
            raise InvalidRequest(f"{where}: BYTES element {len(items)} has a truncated length")
        (length,) = unpack(raw, pos)
        pos += 4
        if pos + length > end:
            raise InvalidRequest(
                f"{where}: BYTES element {len(items)} of {length} bytes runs past the "
                f"binary_data_size of {end}"
            )
        items.append(raw[pos : pos + length])
        pos += length
    if len(items) != count or pos != end:
        raise InvalidRequest(
            f"{where}: binary data holds {len(items)} BYTES elements in {pos} of {end} "
            f"bytes; the shape needs {count} elements filling all {end} bytes"
        )
    array = np.empty(count, dtype=object)
    array[:] = items
    return array


# ---------------------------------------------------------------------------- encoding


def binary_payload(array: np.ndarray, datatype: str) -> tuple[Any, int]:
    """(bytes-like payload, its size) of one tensor in the binary extension."""
    if datatype != "BYTES":
        # bytes.join reads a C-contiguous array's buffer directly, saving a tobytes() copy.
        contiguous = np.ascontiguousarray(array)
        return contiguous, contiguous.nbytes
    pack = _LENGTH_PREFIX.pack
    parts: list[bytes] = []
    for item in _bytes_elements(array):
        parts.append(pack(len(item)))
        parts.append(item)
    payload = b"".join(parts)
    return payload, len(payload)


def _bytes_elements(array: np.ndarray) -> list[bytes]:
    items: list[bytes] = []
    for item in array.ravel().tolist():
        if isinstance(item, bytes):
            items.append(item)
        elif isinstance(item, str):
            items.append(item.encode())
        else:
            raise ValueError(
                f"BYTES output elements must be bytes or str, got {type(item).__name__}"
            )
    return items


def json_strings(name: str, array: np.ndarray) -> list[str]:
    items: list[Any] = array.ravel().tolist()
    try:
        return [item if isinstance(item, str) else item.decode() for item in items]
    except UnicodeDecodeError:
        raise InvalidRequest(
            f"output {name!r} holds bytes that are not valid UTF-8, which a JSON string "
            'cannot carry; request it with parameters {"binary_data": true}'
        ) from None
    except AttributeError:
        bad = next(item for item in items if not isinstance(item, (str, bytes)))
        raise ValueError(
            f"BYTES output elements must be bytes or str, got {type(bad).__name__}"
        ) from None


def show(value: Any) -> str:
    """A short description of a bad value for error messages."""
    try:
        text = orjson.dumps(value, default=repr).decode()
    except orjson.JSONEncodeError:  # nested deeper than orjson writes
        text = type(value).__name__
    return text if len(text) <= 80 else text[:77] + "..."
