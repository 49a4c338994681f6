"""What slipstream bench sends: inputs generated from metadata or read from files, and
their wire encodings, checked by decoding them with the server's own codecs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import orjson
import pytest

from slipstream.bench.core.endpoint import parse_endpoint
from slipstream.bench.v2.clients import http_request_bytes, model_path
from slipstream.bench.v2.inputs import (
    InputError,
    RemoteModel,
    RemoteTensor,
    RequestInputs,
    generate_requests,
    read_input_data,
    signature_from_metadata,
)
from slipstream.bench.v2.payloads import encode_request
from slipstream.datatypes import V2_TO_NUMPY
from slipstream.protocol import grpc_codec, v2
from slipstream.protocol.proto import inference_pb2 as pb

MLP_METADATA = {
    "name": "mlp",
    "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 256]}],
    "outputs": [{"name": "output", "datatype": "FP32", "shape": [-1, 10]}],
}


def _signature(
    *specs: RemoteTensor, batching: bool = True, max_batch: int | None = None
) -> RemoteModel:
    return RemoteModel(name="m", inputs=specs, batching=batching, max_batch_size=max_batch)


# ------------------------------------------------------------------- metadata


def test_the_first_dim_is_the_batch_dim_when_the_config_says_the_model_batches() -> None:
    signature = signature_from_metadata(MLP_METADATA, max_batch_size=64)
    assert signature.batching
    assert signature.inputs == (RemoteTensor("input", "FP32", (-1, 256)),)
    assert signature_from_metadata(MLP_METADATA, max_batch_size=0).batching is False


def test_without_a_config_a_variable_first_dim_in_every_input_means_batching() -> None:
    assert signature_from_metadata(MLP_METADATA, max_batch_size=None).batching
    fixed = {"name": "f", "inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 4]}]}
    assert not signature_from_metadata(fixed, max_batch_size=None).batching


def test_metadata_without_inputs_is_refused() -> None:
    with pytest.raises(InputError, match="no inputs"):
        signature_from_metadata({"name": "m", "inputs": []}, None)


# ------------------------------------------------------------------- generated inputs


@pytest.mark.parametrize("datatype", sorted(V2_TO_NUMPY))
def test_generated_data_has_each_datatype_and_the_batch_size(datatype: str) -> None:
    signature = _signature(RemoteTensor("x", datatype, (-1, 3)))
    [request] = generate_requests(signature, batch_size=5, shapes={}, seed=0)
    array = request.tensors["x"]
    assert array.shape == (5, 3)
    assert array.dtype == V2_TO_NUMPY[datatype]
    assert request.batch_size == 5
    if datatype == "BYTES":
        assert all(isinstance(item, bytes) and len(item) == 8 for item in array.flat)


def test_generation_is_seeded() -> None:
    signature = _signature(RemoteTensor("x", "FP32", (-1, 8)))
    first = generate_requests(signature, 2, {}, seed=3)[0].tensors["x"]
    again = generate_requests(signature, 2, {}, seed=3)[0].tensors["x"]
    other = generate_requests(signature, 2, {}, seed=4)[0].tensors["x"]
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)


def test_shape_fills_variable_dims_after_the_batch_dim() -> None:
    signature = _signature(
        RemoteTensor("ids", "INT64", (-1, -1)), RemoteTensor("mask", "INT64", (-1, -1))
    )
    [request] = generate_requests(signature, 4, {"ids": [128], "mask": [128]}, seed=0)
    assert request.tensors["ids"].shape == (4, 128)
    assert request.tensors["mask"].shape == (4, 128)


def test_a_variable_dim_without_shape_names_the_option_to_give() -> None:
    signature = _signature(RemoteTensor("ids", "INT64", (-1, -1)))
    with pytest.raises(InputError, match=r"--shape ids:8"):
        generate_requests(signature, 1, {}, seed=0)


def test_shape_with_the_wrong_number_of_dims_or_a_conflicting_dim_is_refused() -> None:
    signature = _signature(RemoteTensor("x", "FP32", (-1, 256)))
    with pytest.raises(InputError, match="expected 1 dims without the batch dim"):
        generate_requests(signature, 1, {"x": [1, 256]}, seed=0)
    with pytest.raises(InputError, match="conflicts with the model's fixed dim 256"):
        generate_requests(signature, 1, {"x": [128]}, seed=0)
    with pytest.raises(InputError, match="unknown inputs"):
        generate_requests(signature, 1, {"y": [3]}, seed=0)


def test_a_model_that_does_not_batch_takes_its_shape_as_is() -> None:
    signature = _signature(RemoteTensor("x", "FP32", (2, 4)), batching=False)
    [request] = generate_requests(signature, 1, {}, seed=0)
    assert request.tensors["x"].shape == (2, 4)
    assert request.batch_size == 1
    with pytest.raises(InputError, match="does not batch"):
        generate_requests(signature, 2, {}, seed=0)


def test_a_batch_size_over_the_models_limit_is_refused() -> None:
    signature = _signature(RemoteTensor("x", "FP32", (-1, 4)), max_batch=8)
    with pytest.raises(InputError, match="max_batch_size 8"):
        generate_requests(signature, 9, {}, seed=0)


# ------------------------------------------------------------------- input files


def test_npz_arrays_are_taken_as_is_or_repeated_to_the_batch_size(tmp_path: Path) -> None:
    signature = _signature(RemoteTensor("a", "FP32", (-1, 3)), RemoteTensor("b", "INT32", (-1, 2)))
    path = tmp_path / "inputs.npz"
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([7, 8], dtype=np.int32)  # no batch dim
    np.savez(path, a=a, b=b)
    [request] = read_input_data(path, signature, batch_size=2)
    np.testing.assert_array_equal(request.tensors["a"], a)
    np.testing.assert_array_equal(request.tensors["b"], [[7, 8], [7, 8]])
    assert request.batch_size == 2


def test_npz_arrays_must_be_named_like_the_inputs(tmp_path: Path) -> None:
    path = tmp_path / "inputs.npz"
    np.savez(path, wrong=np.zeros((1, 3), np.float32))
    with pytest.raises(InputError, match=r"missing \['a'\], unknown \['wrong'\]"):
        read_input_data(path, _signature(RemoteTensor("a", "FP32", (-1, 3))), 1)


def test_a_json_list_of_v2_requests_is_sent_in_turn(tmp_path: Path) -> None:
    signature = _signature(RemoteTensor("x", "FP32", (-1, 2)))
    docs = [
        {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]},
        {"inputs": [{"name": "x", "shape": [3, 2], "datatype": "FP32", "data": [0] * 6}]},
    ]
    path = tmp_path / "requests.json"
    path.write_bytes(orjson.dumps(docs))
    requests = read_input_data(path, signature, batch_size=1)
    assert [r.batch_size for r in requests] == [1, 3]
    np.testing.assert_array_equal(requests[0].tensors["x"], [[1, 2]])


def test_one_json_request_is_accepted_and_a_bad_one_is_named(tmp_path: Path) -> None:
    signature = _signature(RemoteTensor("x", "FP32", (-1, 2)))
    path = tmp_path / "request.json"
    path.write_bytes(
        orjson.dumps(
            {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}
        )
    )
    assert len(read_input_data(path, signature, 1)) == 1
    path.write_bytes(
        orjson.dumps([{"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32"}]}])
    )
    with pytest.raises(InputError, match="request 0: input 'x': needs either 'data'"):
        read_input_data(path, signature, 1)


def test_other_files_are_refused(tmp_path: Path) -> None:
    signature = _signature(RemoteTensor("x", "FP32", (-1, 2)))
    with pytest.raises(InputError, match="no such file"):
        read_input_data(tmp_path / "missing.json", signature, 1)
    (tmp_path / "data.csv").write_text("1,2")
    with pytest.raises(InputError, match=r"expected a \.npz or \.json"):
        read_input_data(tmp_path / "data.csv", signature, 1)


# ------------------------------------------------------------------- encodings


def _mixed_request() -> RequestInputs:
    text = np.empty((2, 1), dtype=object)
    text[:, 0] = [b"hello", b"world"]
    return RequestInputs(
        tensors={
            "f": np.arange(6, dtype=np.float32).reshape(2, 3) / 4,
            "h": np.array([[0.5], [1.5]], dtype=np.float16),
            "i": np.array([[1, -2], [3, 4]], dtype=np.int64),
            "t": text,
        },
        batch_size=2,
    )


def _assert_same(decoded: dict[str, np.ndarray], request: RequestInputs) -> None:
    assert decoded.keys() == request.tensors.keys()
    for name, array in request.tensors.items():
        assert decoded[name].dtype == array.dtype, name
        np.testing.assert_array_equal(decoded[name], array)


def test_json_bodies_decode_to_the_same_tensors_on_the_server() -> None:
    request = _mixed_request()
    encoded = encode_request("http", "m", "", request)
    assert encoded.header_length is None and encoded.batch_size == 2
    _assert_same(v2.decode_infer_request(encoded.body, None, "m", "").inputs, request)


def test_binary_bodies_decode_to_the_same_tensors_and_ask_for_binary_outputs() -> None:
    request = _mixed_request()
    encoded = encode_request("http-binary", "m", "", request)
    assert encoded.header_length is not None
    decoded = v2.decode_infer_request(encoded.body, encoded.header_length, "m", "")
    _assert_same(decoded.inputs, request)
    assert decoded.binary_data_output


def test_grpc_bodies_decode_to_the_same_tensors() -> None:
    request = _mixed_request()
    encoded = encode_request("grpc", "m", "2", request)
    message = pb.ModelInferRequest.FromString(encoded.body)
    assert (message.model_name, message.model_version) == ("m", "2")
    _assert_same(grpc_codec.decode_infer_request(message).inputs, request)


def test_bytes_that_are_not_utf8_cannot_go_as_json() -> None:
    text = np.array([b"\xff\xfe"], dtype=object)
    with pytest.raises(InputError, match="use --protocol http-binary or grpc"):
        encode_request("http", "m", "", RequestInputs({"t": text}, batch_size=1))


# ------------------------------------------------------------------- endpoints


def test_endpoints_parse_with_or_without_a_scheme() -> None:
    http = parse_endpoint("http://10.0.0.1:8000/prefix/", "http")
    assert (http.host, http.port, http.tls, http.path_prefix) == (
        "10.0.0.1",
        8000,
        False,
        "/prefix",
    )
    assert model_path(http, "my model", "3") == "/prefix/v2/models/my%20model/versions/3"
    assert parse_endpoint("localhost:9000", "http-binary").origin == "http://localhost:9000"
    grpc = parse_endpoint("grpc://localhost", "grpc")
    assert (grpc.address, grpc.path_prefix) == ("localhost:8001", "")
    assert parse_endpoint("https://example.com", "http").port == 443
    with pytest.raises(ValueError, match="expected http://host:port"):
        parse_endpoint("ftp://example.com", "http")


def test_an_http_request_is_one_complete_message() -> None:
    endpoint = parse_endpoint("http://127.0.0.1:8000", "http-binary")
    encoded = encode_request("http-binary", "m", "", _mixed_request())
    raw = http_request_bytes(endpoint, "/v2/models/m/infer", encoded)
    head, body = raw.split(b"\r\n\r\n", 1)
    assert head.startswith(b"POST /v2/models/m/infer HTTP/1.1\r\n")
    assert f"Content-Length: {len(encoded.body)}".encode() in head
    assert f"Inference-Header-Content-Length: {encoded.header_length}".encode() in head
    assert body == encoded.body
