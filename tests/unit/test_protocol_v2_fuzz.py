"""Property-based fuzzing of the V2 REST decoder with Triton's binary tensor extension.

Whatever a client sends (an ``Inference-Header-Content-Length`` that lies, JSON headers
with lying ``binary_data_size`` values, shapes whose element counts overflow, BYTES
elements whose 4-byte length prefixes lie, truncated or surplus binary data, plain noise),
:func:`decode_infer_request` either yields arrays of exactly the declared shapes and
datatypes, filled from the declared bytes, or raises :class:`InvalidRequest` naming the
input, the header or the binary data: never another exception (which the front end would
answer 500), and never an allocation sized by a lie rather than by the bytes received.
"""

from __future__ import annotations

import json
import math
import struct
import tracemalloc
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from slipstream.datatypes import V2_ITEM_SIZE
from slipstream.errors import InvalidRequest
from slipstream.protocol.v2 import decode_infer_request

FUZZ = settings(
    max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
DATATYPES = [*sorted(V2_ITEM_SIZE), "BYTES", "BF16", "fp32", ""]
DIMS = st.one_of(st.integers(0, 5), st.sampled_from([-1, 2**31, 2**40, 2**62, 2**63 - 1, 2**64]))
# What a refusal must name: an input, or the part of the body that is wrong.
NAMED = ("input '", "inputs", "binary data", "Inference-Header-Content-Length", "request body")
# Bytes a decode may allocate beyond the body's own size: numpy's and Python's per-object
# overhead for a handful of small tensors. A lie sized allocation (a shape of 2**40
# elements, a 4 GB BYTES length) would be gigabytes.
SLACK_BYTES = 256 * 1024


@st.composite
def payload(draw: st.DrawFn, datatype: str, shape: list[int]) -> bytes:
    """Binary data near what the shape needs (exact, short, long), or noise."""
    count = math.prod(shape) if all(d >= 0 for d in shape) else 0
    if datatype == "BYTES" and count <= 16:
        parts = []
        for _ in range(draw(st.integers(0, count + 2))):
            data = draw(st.binary(max_size=6))
            declared = draw(st.one_of(st.just(len(data)), st.integers(0, 2**32 - 1)))
            parts.append(struct.pack("<I", declared) + data)
        return b"".join(parts) + draw(st.binary(max_size=3))
    size = V2_ITEM_SIZE.get(datatype, 4) * count if count <= 64 else 0
    return draw(
        st.one_of(
            st.binary(min_size=size, max_size=size),
            st.binary(max_size=max(size - 1, 0)),
            st.binary(min_size=size + 1, max_size=size + 8),
        )
    )


def lie(draw: st.DrawFn) -> bool:
    """True one time in four: most of a request is honest, so decoding gets past the
    first check often and each lie is met deep in the decoder as well as at its door."""
    return draw(st.integers(0, 3)) == 3  # 0, what hypothesis favours and shrinks to: honest


@st.composite
def binary_request(draw: st.DrawFn) -> tuple[bytes, int | None]:
    """A body of a JSON header and binary data, with its header length (true or lying)."""
    inputs: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for index in range(draw(st.integers(0, 3))):
        # BYTES is the decoder with the most paths (length prefixes): drawn half the time.
        datatype = draw(st.one_of(st.just("BYTES"), st.sampled_from(DATATYPES)))
        shape = draw(st.lists(DIMS if lie(draw) else st.integers(0, 5), max_size=3))
        data = draw(payload(datatype, shape))
        entry: dict[str, Any] = {"name": f"in{index}", "datatype": datatype, "shape": shape}
        if not lie(draw):
            entry["parameters"] = {"binary_data_size": len(data)}
        elif draw(st.booleans()):
            values = st.one_of(st.integers(0, 2**64), st.sampled_from([-1, "8", 1.5, None]))
            entry["parameters"] = {"binary_data_size": draw(values)}
        else:
            entry["data"] = draw(st.lists(st.integers(0, 3), max_size=4))
        inputs.append(entry)
        chunks.append(data)
    # json, not orjson: it writes integers past 64 bits, as a hostile client may.
    header = json.dumps({"inputs": inputs, "outputs": [{"name": "out"}]}).encode()
    body = header + b"".join(chunks)
    length: int | None = len(header)
    if lie(draw):
        length = draw(st.one_of(st.integers(0, len(body) + 4), st.sampled_from([None, -1, 2**63])))
    return body, length


def _decode(body: bytes, header_length: int | None) -> Any:
    """Decode under tracemalloc; returns the request, or the InvalidRequest raised."""
    tracemalloc.start()
    try:
        return decode_infer_request(body, header_length, "m", "")
    except InvalidRequest as exc:
        return exc
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak <= 2 * len(body) + SLACK_BYTES, f"{peak} bytes for a {len(body)}-byte body"


def _check(result: Any, body: bytes, header_length: int | None) -> None:
    if isinstance(result, InvalidRequest):
        assert any(name in result.message for name in NAMED), result.message
        return
    if header_length is None:  # no binary data: the whole body was the JSON
        header_length = len(body)
    doc = json.loads(body[:header_length])
    offset = header_length
    for entry in doc["inputs"]:
        array = result.inputs[entry["name"]]
        assert list(array.shape) == entry["shape"]
        size = (entry.get("parameters") or {}).get("binary_data_size")
        if size is None:
            continue
        sent, offset = body[offset : offset + size], offset + size
        if entry["datatype"] == "BYTES":
            items = array.ravel().tolist()
            assert b"".join(struct.pack("<I", len(i)) + i for i in items) == sent
        else:
            assert array.dtype.itemsize == V2_ITEM_SIZE[entry["datatype"]]
            assert array.tobytes() == sent
            if entry["datatype"] == "BOOL":
                assert set(array.view(np.uint8).ravel().tolist()) <= {0, 1}
    assert offset == len(body)


@settings(FUZZ, max_examples=1000)
@given(binary_request())
def test_binary_requests_decode_exactly_or_are_refused_by_name(
    request: tuple[bytes, int | None],
) -> None:
    body, header_length = request
    _check(_decode(body, header_length), body, header_length)


@FUZZ
@given(st.binary(max_size=256), st.one_of(st.none(), st.integers(-2, 300)))
def test_noise_is_refused_by_name(body: bytes, header_length: int | None) -> None:
    result = _decode(body, header_length)
    assume(isinstance(result, InvalidRequest))  # noise that happens to be a request is fine
    assert any(name in result.message for name in NAMED), result.message


@pytest.mark.parametrize(
    ("datatype", "shape", "data", "message"),
    [
        # 2**40 BYTES elements declared, 8 bytes sent: refused before any per-element list.
        ("BYTES", [2**40], b"\x00" * 8, "too small for 1099511627776 BYTES elements"),
        # A 4-byte length prefix claiming 4 GiB: refused, nothing of that size allocated.
        ("BYTES", [1], struct.pack("<I", 2**32 - 1) + b"ab", "runs past the binary_data_size"),
        # An element count past what numpy can index: refused by shape.
        ("FP32", [2**40, 2**40], b"", "is too large for any tensor"),
        # The right count of elements of the wrong width.
        ("FP64", [2], b"\x00" * 8, "needs 16 bytes"),
        ("BOOL", [2], b"\x00\x02", "BOOL binary data must hold bytes 0 or 1"),
    ],
)
def test_lying_sizes_are_refused_without_allocating_what_they_claim(
    datatype: str, shape: list[int], data: bytes, message: str
) -> None:
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": datatype,
                    "shape": shape,
                    "parameters": {"binary_data_size": len(data)},
                }
            ]
        }
    )
    result = _decode(header + data, len(header))
    assert isinstance(result, InvalidRequest)
    assert message in result.message
    assert "input 'x'" in result.message


def test_a_header_length_beyond_the_body_is_refused_naming_the_header() -> None:
    body = b'{"inputs": []}'
    for length in (len(body) + 1, -1, 2**63):
        result = _decode(body, length)
        assert isinstance(result, InvalidRequest)
        assert result.message.startswith("Inference-Header-Content-Length: ")


def test_decoded_binary_tensors_are_the_bytes_sent() -> None:
    values = np.arange(6, dtype=np.int16).reshape(2, 3)
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "INT16",
                    "shape": [2, 3],
                    "parameters": {"binary_data_size": values.nbytes},
                }
            ]
        }
    )
    request = _decode(header + values.tobytes(), len(header))
    np.testing.assert_array_equal(request.inputs["x"], values)
