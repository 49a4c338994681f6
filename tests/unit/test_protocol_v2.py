"""The V2 REST codec: JSON and binary round trips, errors that name the field, fuzzing.

Responses are parsed here independently of the codec (``_parse_response``) so that an
encoder bug cannot hide behind a matching decoder bug.
"""

from __future__ import annotations

import contextlib
import struct
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from slipstream.datatypes import BF16, V2_TO_NUMPY
from slipstream.errors import InvalidRequest
from slipstream.protocol.v2 import decode_infer_request, encode_error, encode_infer_response
from slipstream.types import InferRequest, InferResponse, RequestedOutput

# No example database: the test tree stays free of generated files.
FUZZ = settings(
    max_examples=100,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# Per datatype, six values covering the type's extremes, as JSON sends them.
SAMPLES: dict[str, list[Any]] = {
    "BOOL": [True, False, True, True, False, False],
    "UINT8": [0, 1, 2, 127, 128, 255],
    "UINT16": [0, 1, 2, 300, 40000, 65535],
    "UINT32": [0, 1, 2, 70000, 2**31, 2**32 - 1],
    "UINT64": [0, 1, 2, 2**32, 2**63, 2**64 - 1],
    "INT8": [-128, -1, 0, 1, 2, 127],
    "INT16": [-32768, -1, 0, 1, 300, 32767],
    "INT32": [-(2**31), -1, 0, 1, 70000, 2**31 - 1],
    "INT64": [-(2**63), -1, 0, 1, 2**40, 2**63 - 1],
    "FP16": [0.0, -2.5, 0.0999755859375, 1024.0, -65504.0, 6.103515625e-05],
    "FP32": [0.0, -1.5, 0.1, 3.4028234663852886e38, -1e-30, 7],
    "FP64": [0.0, -1.5, 0.1, 1.7976931348623157e308, -5e-324, 7],
    "BYTES": ["", "a", "héllo", "日本語", 'with "quotes" and \\', "\x00nul"],
}


def _json_body(inputs: list[dict[str, Any]], **fields: Any) -> bytes:
    return orjson.dumps({"inputs": inputs, **fields})


def _input(data: Any, shape: Any = (2, 3), datatype: Any = "FP32", **fields: Any) -> dict[str, Any]:
    return {"name": "x", "shape": list(shape), "datatype": datatype, "data": data, **fields}


def _wire_bytes(array: np.ndarray, datatype: str) -> bytes:
    """The binary extension's layout of a tensor, written independently of the codec."""
    if datatype != "BYTES":
        return np.ascontiguousarray(array).astype(V2_TO_NUMPY[datatype].newbyteorder("<")).tobytes()
    items = [x.encode() if isinstance(x, str) else bytes(x) for x in array.ravel().tolist()]
    return b"".join(struct.pack("<I", len(x)) + x for x in items)


def _binary_request(tensors: dict[str, tuple[np.ndarray, str]], **fields: Any) -> tuple[bytes, int]:
    """A body whose inputs all travel as binary data, and its JSON header length."""
    inputs, payloads = [], []
    for name, (array, datatype) in tensors.items():
        payload = _wire_bytes(array, datatype)
        payloads.append(payload)
        inputs.append(
            {
                "name": name,
                "shape": list(array.shape),
                "datatype": datatype,
                "parameters": {"binary_data_size": len(payload)},
            }
        )
    header = _json_body(inputs, **fields)
    return header + b"".join(payloads), len(header)


def _parse_response(
    body: bytes, header_length: int | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(JSON header, output name -> array) of an encoded response."""
    header = orjson.loads(body if header_length is None else body[:header_length])
    offset = 0 if header_length is None else header_length
    arrays: dict[str, Any] = {}
    for out in header["outputs"]:
        dtype = V2_TO_NUMPY[out["datatype"]]
        size = out.get("parameters", {}).get("binary_data_size")
        if size is None:
            data = out["data"]
            if out["datatype"] == "BYTES":
                data = [s.encode() for s in data]
            arrays[out["name"]] = np.array(data, dtype=dtype).reshape(out["shape"])
            continue
        chunk = body[offset : offset + size]
        offset += size
        if out["datatype"] == "BYTES":
            items, pos = [], 0
            while pos < len(chunk):
                (n,) = struct.unpack_from("<I", chunk, pos)
                items.append(chunk[pos + 4 : pos + 4 + n])
                pos += 4 + n
            flat = np.empty(len(items), dtype=object)
            flat[:] = items
        else:
            flat = np.frombuffer(chunk, dtype=dtype.newbyteorder("<"))
        arrays[out["name"]] = flat.reshape(out["shape"])
    assert offset == len(body) or header_length is None
    return header, arrays


def _assert_same(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    if expected.dtype == object:
        assert actual.tolist() == expected.tolist()
    elif expected.dtype == BF16:  # bit for bit: numpy's comparison sees no NaN in it
        np.testing.assert_array_equal(actual.view(np.uint16), expected.view(np.uint16))
    else:
        np.testing.assert_array_equal(actual, expected)


def _expected(datatype: str, values: list[Any], shape: tuple[int, ...]) -> np.ndarray:
    if datatype == "BYTES":
        flat = np.empty(len(values), dtype=object)
        flat[:] = [v.encode() for v in values]
        return flat.reshape(shape)
    return np.array(values, dtype=V2_TO_NUMPY[datatype]).reshape(shape)


# ------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("datatype", list(SAMPLES))
def test_json_round_trip_every_datatype(datatype: str) -> None:
    expected = _expected(datatype, SAMPLES[datatype], (2, 3))
    body = _json_body([_input(SAMPLES[datatype], datatype=datatype)])
    request = decode_infer_request(body, None, "m", "1")
    _assert_same(request.inputs["x"], expected)

    response = InferResponse("m", "1", {"y": request.inputs["x"]})
    out_body, header_length = encode_infer_response(response, request)
    assert header_length is None
    header, arrays = _parse_response(out_body, None)
    assert header["outputs"][0]["datatype"] == datatype
    assert header["outputs"][0]["shape"] == [2, 3]
    _assert_same(arrays["y"], expected)


@pytest.mark.parametrize("datatype", list(SAMPLES))
def test_binary_round_trip_every_datatype(datatype: str) -> None:
    expected = _expected(datatype, SAMPLES[datatype], (3, 2))
    body, header_length = _binary_request(
        {"x": (expected, datatype)}, parameters={"binary_data_output": True}
    )
    request = decode_infer_request(body, header_length, "m", "1")
    _assert_same(request.inputs["x"], expected)

    out_body, out_header_length = encode_infer_response(
        InferResponse("m", "1", {"y": request.inputs["x"]}), request
    )
    assert out_header_length is not None
    header, arrays = _parse_response(out_body, out_header_length)
    assert "data" not in header["outputs"][0]
    assert out_body[out_header_length:] == _wire_bytes(expected, datatype)
    _assert_same(arrays["y"], expected)


def test_known_binary_layout_is_little_endian_with_uint32_length_prefixes() -> None:
    header = _json_body(
        [
            {"name": "f", "shape": [2], "datatype": "FP32", "parameters": {"binary_data_size": 8}},
            {
                "name": "t",
                "shape": [2],
                "datatype": "BYTES",
                "parameters": {"binary_data_size": 11},
            },
        ]
    )
    body = header + b"\x00\x00\x80\x3f\x00\x00\x00\xc0" + b"\x03\x00\x00\x00abc\x00\x00\x00\x00"
    request = decode_infer_request(body, len(header), "m", "1")
    assert request.inputs["f"].tolist() == [1.0, -2.0]
    assert request.inputs["t"].tolist() == [b"abc", b""]


def test_nested_data_is_row_major() -> None:
    body = _json_body(
        [
            _input([[1, 2, 3], [4, 5, 6]], datatype="INT32"),
            {"name": "t", "shape": [2, 2], "datatype": "BYTES", "data": [["a", "b"], ["c", "é"]]},
        ]
    )
    request = decode_infer_request(body, None, "m", "")
    assert request.inputs["x"].tolist() == [[1, 2, 3], [4, 5, 6]]
    assert request.inputs["t"].tolist() == [[b"a", b"b"], [b"c", "é".encode()]]


def test_flat_data_is_reshaped_and_nesting_need_not_match_shape() -> None:
    flat = decode_infer_request(_json_body([_input([1, 2, 3, 4, 5, 6])]), None, "m", "")
    nested = decode_infer_request(_json_body([_input([[1, 2], [3, 4], [5, 6]])]), None, "m", "")
    assert flat.inputs["x"].tolist() == [[1, 2, 3], [4, 5, 6]]
    assert nested.inputs["x"].tolist() == [[1, 2, 3], [4, 5, 6]]


def test_scalar_and_empty_tensors() -> None:
    body = _json_body(
        [
            {"name": "s", "shape": [], "datatype": "INT64", "data": [7]},
            {"name": "e", "shape": [0, 4], "datatype": "FP16", "data": []},
            {"name": "b", "shape": [0], "datatype": "BYTES", "data": []},
        ]
    )
    request = decode_infer_request(body, None, "m", "")
    assert request.inputs["s"].shape == () and request.inputs["s"] == 7
    assert request.inputs["e"].shape == (0, 4) and request.inputs["e"].dtype == np.float16
    assert request.inputs["b"].shape == (0,)
    out, _ = encode_infer_response(InferResponse("m", "", dict(request.inputs)), request)
    _, arrays = _parse_response(out, None)
    assert arrays["s"].shape == () and arrays["e"].shape == (0, 4)


def test_bytes_outputs_accept_str_and_numpy_string_arrays() -> None:
    objects = np.array(["é", b"raw", ""], dtype=object)
    unicode = np.array(["ab", "日本"])
    request = InferRequest("m", "", {}, outputs=[RequestedOutput("u", binary_data=True)])
    body, header_length = encode_infer_response(
        InferResponse("m", "", {"o": objects, "u": unicode}), request
    )
    header, arrays = _parse_response(body, header_length)
    assert header["outputs"][0]["data"] == ["é", "raw", ""]
    assert arrays["u"].tolist() == [b"ab", "日本".encode()]


def test_non_utf8_bytes_output_needs_binary_data() -> None:
    response = InferResponse("m", "", {"t": np.array([b"\xff\xfe"], dtype=object)})
    with pytest.raises(InvalidRequest, match=r"output 't'.*binary_data"):
        encode_infer_response(response, InferRequest("m", "", {}))
    request = InferRequest("m", "", {}, binary_data_output=True)
    body, header_length = encode_infer_response(response, request)
    assert _parse_response(body, header_length)[1]["t"].tolist() == [b"\xff\xfe"]


def test_non_contiguous_and_byte_swapped_outputs_are_written_row_major() -> None:
    base = np.arange(6, dtype=np.float32).reshape(2, 3)
    outputs = {"t": base.T, "s": base[:, ::2], "be": base.astype(">i4")}
    for binary in (False, True):
        request = InferRequest("m", "", {}, binary_data_output=binary)
        body, header_length = encode_infer_response(InferResponse("m", "", outputs), request)
        _, arrays = _parse_response(body, header_length)
        np.testing.assert_array_equal(arrays["t"], base.T)
        np.testing.assert_array_equal(arrays["s"], base[:, ::2])
        assert arrays["be"].dtype == np.int32
        np.testing.assert_array_equal(arrays["be"], base.astype(np.int32))


def test_requested_outputs_mix_binary_and_json() -> None:
    body = _json_body(
        [_input([1, 2, 3, 4, 5, 6])],
        outputs=[
            {"name": "a", "parameters": {"binary_data": True}},
            {"name": "b", "parameters": {"binary_data": False}},
            {"name": "c"},
        ],
    )
    request = decode_infer_request(body, None, "m", "")
    assert request.outputs == [
        RequestedOutput("a", True),
        RequestedOutput("b", False),
        RequestedOutput("c", None),
    ]
    outputs = {name: np.full(2, i, np.int16) for i, name in enumerate("abcd")}
    for default, binary_names in ((False, {"a"}), (True, {"a", "c", "d"})):
        request.binary_data_output = default
        out, header_length = encode_infer_response(InferResponse("m", "", outputs), request)
        header, arrays = _parse_response(out, header_length)
        assert header_length == len(orjson.dumps(header))
        for entry in header["outputs"]:
            assert ("data" not in entry) == (entry["name"] in binary_names)
        assert [arrays[name].tolist() for name in "abcd"] == [[i, i] for i in range(4)]
        # Binary payloads follow the JSON in output order.
        assert out[header_length:] == b"".join(
            outputs[name].tobytes() for name in "abcd" if name in binary_names
        )


def test_request_fields_and_parameters() -> None:
    body = _json_body(
        [_input([1, 2, 3, 4, 5, 6])],
        id="req-1",
        parameters={"priority": 2, "timeout": 1500, "binary_data_output": True, "custom": [1]},
        outputs=[],
    )
    request = decode_infer_request(body, None, "model", "3")
    assert (request.model_name, request.model_version, request.id) == ("model", "3", "req-1")
    assert (request.priority, request.timeout_us, request.binary_data_output) == (2, 1500, True)
    assert request.parameters == {"custom": [1]}
    assert request.outputs is None

    bare = decode_infer_request(
        _json_body([_input([1, 2, 3, 4, 5, 6])], id=None, parameters=None, outputs=None),
        None,
        "m",
        "",
    )
    assert (bare.id, bare.priority, bare.timeout_us, bare.binary_data_output) == ("", 0, 0, False)
    assert bare.parameters == {} and bare.outputs is None


def test_response_id_and_parameters_only_when_set() -> None:
    outputs = {"y": np.zeros(1, np.float32)}
    plain, _ = encode_infer_response(InferResponse("m", "2", outputs), InferRequest("m", "", {}))
    assert orjson.loads(plain).keys() == {"model_name", "model_version", "outputs"}
    assert orjson.loads(plain)["model_version"] == "2"
    request = InferRequest("m", "", {}, id="abc")
    full, _ = encode_infer_response(
        InferResponse("m", "2", outputs, parameters={"n": np.int64(3)}), request
    )
    assert orjson.loads(full)["id"] == "abc"
    assert orjson.loads(full)["parameters"] == {"n": 3}


def test_binary_inputs_are_aligned_and_zero_copy_when_the_header_allows() -> None:
    array = np.arange(4, dtype=np.float64)
    views = 0
    for padding in range(8):
        body, header_length = _binary_request({"x": (array, "FP64")}, pad="." * padding)
        decoded = decode_infer_request(body, header_length, "m", "").inputs["x"]
        np.testing.assert_array_equal(decoded, array)
        assert decoded.flags.aligned
        views += np.shares_memory(decoded, np.frombuffer(body, np.uint8))
    # Whatever the header length, some offsets are aligned and those are not copied.
    assert views >= 1


def test_encode_error() -> None:
    assert orjson.loads(encode_error('model "m" is not ready')) == {
        "error": 'model "m" is not ready'
    }


# ------------------------------------------------------------------------------ errors

SIX = [1, 2, 3, 4, 5, 6]

# (request document, substring the error message must contain: it names the field)
# Shared-memory parameters of a [2, 3] FP32 tensor (24 bytes).
_SHM24 = {"shared_memory_region": "r", "shared_memory_byte_size": 24}

JSON_ERRORS: list[tuple[Any, str]] = [
    ([1, 2], "request body: expected a JSON object"),
    ({}, "inputs: required field is missing"),
    ({"inputs": {"x": 1}}, "inputs: expected a list"),
    ({"inputs": [5]}, "inputs[0]: expected an object"),
    ({"inputs": [{"shape": [1], "datatype": "FP32", "data": [1]}]}, "inputs[0].name"),
    ({"inputs": [_input(SIX, shape=[2, 3], name=7)]}, "inputs[0].name"),
    ({"inputs": [_input(SIX, shape=[2, -3])]}, "input 'x': shape"),
    ({"inputs": [{**_input(SIX), "shape": "2,3"}]}, "input 'x': shape"),
    ({"inputs": [_input(SIX, shape=[2.0, 3])]}, "input 'x': shape"),
    ({"inputs": [_input(SIX, shape=[True, 6])]}, "input 'x': shape"),
    ({"inputs": [{"name": "x", "datatype": "FP32", "data": SIX}]}, "input 'x': shape"),
    ({"inputs": [_input(SIX, datatype="FLOAT")]}, "input 'x': datatype"),
    ({"inputs": [_input(SIX, datatype=None)]}, "input 'x': datatype"),
    ({"inputs": [_input(None)]}, "input 'x': needs either 'data' or parameters.binary_data_size"),
    ({"inputs": [_input({"a": 1})]}, "input 'x': data: expected a list"),
    ({"inputs": [_input([1, 2, 3, 4, 5])]}, "input 'x': shape [2, 3] needs 6 elements, got 5"),
    ({"inputs": [_input([[1, 2, 3], [4, 5]])]}, "input 'x': data"),
    ({"inputs": [_input([1, 2, 3, 4, 5, "6"])]}, "input 'x': FP32 data must be numbers"),
    ({"inputs": [_input([1, 2, 3, 4, 5, None])]}, "input 'x': FP32 data must be numbers"),
    ({"inputs": [_input([1, 2, 3, 4, 5, {}])]}, "input 'x': FP32 data must be numbers"),
    ({"inputs": [_input([1, 2, 3, 4, 5, 1e39])]}, "input 'x': a value is out of range for FP32"),
    ({"inputs": [_input([1, 2, 3, 4, 5, 7e4], datatype="FP16")]}, "out of range for FP16"),
    ({"inputs": [_input([1, 2, 3, 4, 5, 300], datatype="UINT8")]}, "input 'x': values from"),
    ({"inputs": [_input([-1, 2, 3, 4, 5, 6], datatype="UINT32")]}, "do not fit UINT32"),
    ({"inputs": [_input([1, 2, 3, 4, 5, 1.5], datatype="INT32")]}, "INT32 data must be integers"),
    (
        b'{"inputs":[{"name":"x","shape":[1],"datatype":"UINT64","data":[18446744073709551616]}]}',
        "input 'x': UINT64 data must be integers",
    ),
    ({"inputs": [_input([-1, 2, 3, 4, 5, 2**63], datatype="INT64")]}, "does not fit INT64"),
    ({"inputs": [_input([True] * 6, datatype="INT8")]}, "INT8 data must be integers"),
    (
        {"inputs": [_input([1, 2, 3, 4, 5, None], datatype="UINT8")]},
        "UINT8 data must be integers, got null",
    ),
    ({"inputs": [_input([True] * 6)]}, "FP32 data must be numbers, got booleans"),
    ({"inputs": [_input([1, 0, 1, 0, 1, 0], datatype="BOOL")]}, "BOOL data must be true/false"),
    ({"inputs": [_input(["a", "b", "c", "d", "e", 6], datatype="BYTES")]}, "must be strings"),
    ({"inputs": [_input([["a", "b", "c"], ["d", "e"]], datatype="BYTES")]}, "input 'x'"),
    ({"inputs": [_input(SIX), _input(SIX)]}, "input 'x' appears more than once"),
    ({"inputs": [_input(SIX, parameters=[1])]}, "input 'x': parameters: expected an object"),
    (
        {"inputs": [_input(SIX, parameters={"shared_memory_region": "r"})]},
        "input 'x': parameters.shared_memory_byte_size is required",
    ),
    (
        {"inputs": [_input(None, parameters={"shared_memory_byte_size": 24})]},
        "input 'x': parameters.shared_memory_region: expected the name of a registered region",
    ),
    (
        {"inputs": [_input(SIX, parameters=_SHM24)]},
        "input 'x': set one of data, binary_data_size, shared_memory_region",
    ),
    (
        {"inputs": [_input(None, parameters={**_SHM24, "shared_memory_byte_size": 20})]},
        "input 'x': parameters.shared_memory_byte_size is 20 but shape [2, 3] of FP32 takes 24",
    ),
    (
        {"inputs": [_input(None, parameters={**_SHM24, "shared_memory_offset": -8})]},
        "input 'x': shared_memory_offset: expected a non-negative integer, got -8",
    ),
    ({"inputs": [_input(SIX, parameters={"binary_data_size": 24})]}, "input 'x': has both"),
    (
        {"inputs": [_input(None, parameters={"binary_data_size": 24})]},
        "input 'x': has binary_data_size but the request has no Inference-Header-Content-Length",
    ),
    ({"inputs": [], "id": 5}, "id: expected a string"),
    ({"inputs": [], "parameters": [1]}, "parameters: expected an object"),
    ({"inputs": [], "parameters": {"priority": -1}}, "parameters.priority"),
    ({"inputs": [], "parameters": {"priority": "high"}}, "parameters.priority"),
    ({"inputs": [], "parameters": {"priority": True}}, "parameters.priority"),
    ({"inputs": [], "parameters": {"timeout": 1.5}}, "parameters.timeout"),
    ({"inputs": [], "parameters": {"timeout": -5}}, "parameters.timeout"),
    ({"inputs": [], "parameters": {"binary_data_output": 1}}, "parameters.binary_data_output"),
    ({"inputs": [], "outputs": {"y": {}}}, "outputs: expected a list"),
    ({"inputs": [], "outputs": ["y"]}, "outputs[0]: expected an object"),
    ({"inputs": [], "outputs": [{"parameters": {}}]}, "outputs[0].name"),
    ({"inputs": [], "outputs": [{"name": "y"}, {"name": "y"}]}, "output 'y' is requested more"),
    (
        {"inputs": [], "outputs": [{"name": "y", "parameters": {"binary_data": "yes"}}]},
        "output 'y': parameters.binary_data",
    ),
    (
        {"inputs": [], "outputs": [{"name": "y", "parameters": {"classification": -3}}]},
        "output 'y': parameters.classification: expected a non-negative integer",
    ),
    (
        {"inputs": [], "outputs": [{"name": "y", "parameters": {"shared_memory_region": "r"}}]},
        "output 'y': parameters.shared_memory_byte_size is required",
    ),
    (
        {"inputs": [], "outputs": [{"name": "y", "parameters": {**_SHM24, "binary_data": True}}]},
        "output 'y': set either shared_memory_region or binary_data true, not both",
    ),
]


@pytest.mark.parametrize(("doc", "message"), JSON_ERRORS)
def test_json_errors_name_the_field(doc: Any, message: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        decode_infer_request(doc if isinstance(doc, bytes) else orjson.dumps(doc), None, "m", "")
    assert message in info.value.message
    assert info.value.http_status == 400


@pytest.mark.parametrize("body", [b"", b"{", b'{"inputs": [}', b"\xff\xfe", b"NaN"])
def test_invalid_json(body: bytes) -> None:
    with pytest.raises(InvalidRequest, match=r"^request body is not valid JSON: "):
        decode_infer_request(body, None, "m", "")


def _binary_input(datatype: str, shape: list[int], size: Any) -> dict[str, Any]:
    return {
        "name": "x",
        "shape": shape,
        "datatype": datatype,
        "parameters": {"binary_data_size": size},
    }


# (JSON inputs, bytes after the header, substring of the error)
BINARY_ERRORS: list[tuple[list[dict[str, Any]], bytes, str]] = [
    ([_binary_input("FP32", [4], 12)], bytes(12), "input 'x': binary_data_size is 12 but shape"),
    ([_binary_input("FP32", [4], 16)], bytes(12), "input 'x': binary_data_size is 16 but only 12"),
    ([_binary_input("FP32", [3], 12)], bytes(13), "holds 13 bytes after the JSON header"),
    ([_input(SIX)], b"\x00", "holds 1 bytes after the JSON header"),
    ([_binary_input("FP32", [3], "12")], bytes(12), "input 'x': parameters.binary_data_size"),
    ([_binary_input("FP32", [3], -12)], bytes(12), "input 'x': parameters.binary_data_size"),
    ([_binary_input("BOOL", [2], 2)], b"\x01\x02", "input 'x': BOOL binary data"),
    ([_binary_input("BYTES", [2], 6)], b"\x00\x00\x00\x00\x00\x00", "too small for 2 BYTES"),
    ([_binary_input("BYTES", [1], 6)], b"\x09\x00\x00\x00ab", "runs past the binary_data_size"),
    ([_binary_input("BYTES", [1], 6)], b"\x01\x00\x00\x00a\x00", "input 'x': binary data holds"),
    (
        [_binary_input("BYTES", [2], 9)],
        b"\x01\x00\x00\x00a\x00\x00\x00\x00",  # 2 elements end at 9: fine, control case
        "",
    ),
    ([_binary_input("BYTES", [2], 10)], b"\x01\x00\x00\x00a\x00\x00\x00\x00\x00", "holds 2"),
    ([_binary_input("BYTES", [2], 8)], b"\x01\x00\x00\x00a\x00\x00\x00", "truncated length"),
]


@pytest.mark.parametrize(("inputs", "tail", "message"), BINARY_ERRORS)
def test_binary_errors_name_the_input(
    inputs: list[dict[str, Any]], tail: bytes, message: str
) -> None:
    header = _json_body(inputs)
    if not message:
        assert decode_infer_request(header + tail, len(header), "m", "").inputs["x"].size == 2
        return
    with pytest.raises(InvalidRequest) as info:
        decode_infer_request(header + tail, len(header), "m", "")
    assert message in info.value.message


@pytest.mark.parametrize("header_length", [-1, 10_000, 2.5])
def test_header_length_outside_the_body(header_length: Any) -> None:
    with pytest.raises(InvalidRequest, match="Inference-Header-Content-Length"):
        decode_infer_request(_json_body([_input(SIX)]), header_length, "m", "")


def test_header_length_equal_to_body_means_no_binary_data() -> None:
    body = _json_body([_input(SIX)])
    assert decode_infer_request(body, len(body), "m", "").inputs["x"].shape == (2, 3)


# ---------------------------------------------------------------------------- property

FIXED_DATATYPES = [name for name in V2_TO_NUMPY if name != "BYTES"]
SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)


@st.composite
def tensors(draw: st.DrawFn, finite: bool = False) -> tuple[np.ndarray, str]:
    datatype = draw(st.sampled_from([*FIXED_DATATYPES, "BYTES"]))
    shape = draw(SHAPES)
    if datatype == "BYTES":
        size = int(np.prod(shape))
        items = draw(st.lists(st.binary(max_size=6), min_size=size, max_size=size))
        flat = np.empty(size, dtype=object)
        flat[:] = items
        return flat.reshape(shape), datatype
    if datatype == "BF16":  # hypothesis makes no bfloat16: any 16 bits are one
        array = draw(hnp.arrays(np.uint16, shape)).view(BF16)
        if finite:
            array[~np.isfinite(array.astype(np.float32))] = 0
        return array, datatype
    elements = None
    if finite and datatype.startswith("FP"):
        elements = {"allow_nan": False, "allow_infinity": False}
    return draw(hnp.arrays(V2_TO_NUMPY[datatype], shape, elements=elements)), datatype


@FUZZ
@given(st.dictionaries(st.text(max_size=8), tensors(), max_size=3))
def test_random_tensors_round_trip_through_binary(named: dict[str, tuple[np.ndarray, str]]) -> None:
    body, header_length = _binary_request(named, parameters={"binary_data_output": True})
    request = decode_infer_request(body, header_length, "m", "")
    assert list(request.inputs) == list(named)
    for name, (array, _) in named.items():
        _assert_same(request.inputs[name], array)

    out, out_header_length = encode_infer_response(
        InferResponse("m", "", dict(request.inputs)), request
    )
    _, arrays = _parse_response(out, out_header_length)
    for name, (array, _) in named.items():
        _assert_same(arrays[name], array)


@FUZZ
@given(tensors(finite=True))
def test_random_tensors_round_trip_through_json(tensor: tuple[np.ndarray, str]) -> None:
    array, datatype = tensor
    data = array.ravel().tolist()
    if datatype == "BYTES":
        # JSON carries text: keep to bytes that are valid UTF-8.
        data = [item.decode("utf-8", "replace") for item in data]
        array = _expected("BYTES", data, array.shape)
    body = _json_body(
        [{"name": "x", "shape": list(array.shape), "datatype": datatype, "data": data}]
    )
    request = decode_infer_request(body, None, "m", "")
    _assert_same(request.inputs["x"], array)
    out, header_length = encode_infer_response(
        InferResponse("m", "", {"x": request.inputs["x"]}), request
    )
    _assert_same(_parse_response(out, header_length)[1]["x"], array)


@FUZZ
@given(st.binary(max_size=200), st.one_of(st.none(), st.integers(-2, 210)))
def test_garbage_bodies_only_raise_invalid_request(body: bytes, header_length: int | None) -> None:
    with contextlib.suppress(InvalidRequest):
        decode_infer_request(body, header_length, "m", "")


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=4),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=12,
)


def _maybe(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(valid, JSON_VALUES)


# Requests that are nearly valid, so the fuzzer reaches the checks deep inside an input.
FUZZ_INPUTS = st.fixed_dictionaries(
    {
        "name": _maybe(st.sampled_from(["x", "y"])),
        "shape": _maybe(st.lists(st.integers(0, 3), max_size=3)),
        "datatype": _maybe(st.sampled_from(list(V2_TO_NUMPY))),
    },
    optional={
        "data": _maybe(st.lists(_maybe(st.integers(-300, 300)), max_size=9)),
        "parameters": _maybe(
            st.fixed_dictionaries({"binary_data_size": _maybe(st.integers(0, 40))})
        ),
    },
)
FUZZ_REQUESTS = st.fixed_dictionaries(
    {"inputs": _maybe(st.lists(FUZZ_INPUTS, max_size=3))},
    optional={
        "id": JSON_VALUES,
        "outputs": _maybe(
            st.lists(st.fixed_dictionaries({"name": JSON_VALUES, "parameters": JSON_VALUES}))
        ),
        "parameters": _maybe(
            st.fixed_dictionaries(
                {},
                optional={
                    "priority": JSON_VALUES,
                    "timeout": JSON_VALUES,
                    "binary_data_output": JSON_VALUES,
                },
            )
        ),
    },
)


@FUZZ
@given(FUZZ_REQUESTS, st.none() | st.binary(max_size=40))
def test_fuzzed_requests_decode_or_raise_invalid_request(doc: Any, tail: bytes | None) -> None:
    header = orjson.dumps(doc)
    body, header_length = (header, None) if tail is None else (header + tail, len(header))
    try:
        request = decode_infer_request(body, header_length, "m", "")
    except InvalidRequest:
        return
    for name, array in request.inputs.items():
        assert isinstance(name, str) and isinstance(array, np.ndarray)


def test_an_empty_tensor_with_an_unaddressable_shape_is_refused_naming_the_shape() -> None:
    # numpy cannot even make it empty: [0, 2**31, 2**40] overflows its index range.
    body = _json_body([{"name": "x", "shape": [0, 2**31, 2**40], "datatype": "FP32", "data": []}])
    with pytest.raises(InvalidRequest, match=r"input 'x': shape: .* is too large"):
        decode_infer_request(body, None, "m", "")
