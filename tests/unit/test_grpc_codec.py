"""The V2 gRPC codec: protobuf messages <-> InferRequest / InferResponse, no sockets."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import pytest
from google.protobuf.descriptor import Descriptor, EnumDescriptor
from tritonclient.grpc import InferResult, model_config_pb2, service_pb2

from slipstream.config import parse_model_config
from slipstream.errors import InvalidRequest
from slipstream.observability.stats import (
    BatchStats,
    InferStats,
    MemoryUsage,
    ModelStats,
    StatDuration,
    add_response,
)
from slipstream.protocol import grpc_codec, grpc_config
from slipstream.protocol.proto import inference_pb2 as pb
from slipstream.types import (
    InferResponse,
    ModelMetadata,
    RepositoryEntry,
    RequestedOutput,
    SharedMemoryInput,
    SharedMemoryRef,
    TensorMetadata,
)

FIXED_DATATYPES = [
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
]
NUMPY_OF = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
}
TYPED_FIELD = {
    "BOOL": "bool_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}


def sample(datatype: str) -> np.ndarray:
    """A [2, 3] array of the datatype, with values that survive every conversion."""
    values = np.array([[0, 1, 2], [3, 4, 5]])
    if datatype == "BOOL":
        return values % 2 == 1
    if datatype.startswith("INT"):
        values = values - 2
    return values.astype(NUMPY_OF[datatype])


def raw_bytes(elements: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


def request_with(
    name: str, datatype: str, shape: list[int], raw: bytes | None = None, **contents: Any
) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name="m", model_version="2", id="req-1")
    tensor = message.inputs.add(name=name, datatype=datatype, shape=shape)
    if raw is not None:
        message.raw_input_contents.append(raw)
    if contents:
        tensor.contents.CopyFrom(pb.InferTensorContents(**contents))
    return message


def decode_error(message: pb.ModelInferRequest) -> str:
    with pytest.raises(InvalidRequest) as info:
        grpc_codec.decode_infer_request(message)
    return info.value.message


# ---------------------------------------------------------------- request tensors


@pytest.mark.parametrize("datatype", FIXED_DATATYPES)
def test_raw_input_of_every_fixed_datatype_decodes_to_its_array(datatype: str) -> None:
    array = sample(datatype)
    request = grpc_codec.decode_infer_request(
        request_with("x", datatype, [2, 3], raw=array.tobytes())
    )
    decoded = request.inputs["x"]
    assert decoded.dtype == array.dtype
    assert decoded.shape == (2, 3)
    np.testing.assert_array_equal(decoded, array)
    assert (request.model_name, request.model_version, request.id) == ("m", "2", "req-1")


def test_raw_bytes_input_reads_length_prefixed_elements() -> None:
    elements = [b"a", b"", b"hello\x00world", "ü".encode(), b"x" * 300]
    request = grpc_codec.decode_infer_request(
        request_with("text", "BYTES", [1, 5], raw=raw_bytes(elements))
    )
    decoded = request.inputs["text"]
    assert decoded.dtype == object
    assert decoded.shape == (1, 5)
    assert decoded.ravel().tolist() == elements


def test_raw_input_of_empty_tensor_decodes() -> None:
    request = grpc_codec.decode_infer_request(request_with("x", "FP32", [0, 4], raw=b""))
    assert request.inputs["x"].shape == (0, 4)


@pytest.mark.parametrize("datatype", sorted(TYPED_FIELD))
def test_typed_contents_of_every_datatype_decode_to_its_array(datatype: str) -> None:
    array = sample(datatype)
    field = TYPED_FIELD[datatype]
    request = grpc_codec.decode_infer_request(
        request_with("x", datatype, [2, 3], **{field: array.ravel().tolist()})
    )
    decoded = request.inputs["x"]
    assert decoded.dtype == array.dtype
    np.testing.assert_array_equal(decoded, array)


def test_typed_bytes_contents_decode_to_object_array() -> None:
    elements = [b"a", b"", b"\xff\x00"]
    request = grpc_codec.decode_infer_request(
        request_with("s", "BYTES", [3, 1], bytes_contents=elements)
    )
    decoded = request.inputs["s"]
    assert decoded.dtype == object
    assert decoded.shape == (3, 1)
    assert decoded.ravel().tolist() == elements


def test_fp16_in_typed_contents_is_refused_naming_raw_contents() -> None:
    message = decode_error(request_with("half", "FP16", [1], fp32_contents=[1.0]))
    assert "'half'" in message
    assert "raw_input_contents" in message


def test_raw_size_mismatch_names_input_expected_and_received_bytes() -> None:
    message = decode_error(request_with("INPUT0", "FP32", [2, 3], raw=b"\x00" * 20))
    assert "'INPUT0'" in message
    assert "expected 24 bytes" in message
    assert "got 20" in message


def test_typed_count_mismatch_names_input_and_contents_field() -> None:
    message = decode_error(request_with("INPUT1", "FP32", [2, 2], fp32_contents=[1.0, 2.0]))
    assert "'INPUT1'" in message
    assert "contents.fp32_contents" in message
    assert "expected 4 values" in message
    assert "got 2" in message


def test_typed_contents_in_wrong_field_are_missing_values() -> None:
    message = decode_error(request_with("x", "INT64", [2], int_contents=[1, 2]))
    assert "contents.int64_contents" in message


def test_narrow_int_out_of_range_is_refused() -> None:
    message = decode_error(request_with("small", "INT8", [2], int_contents=[1, 300]))
    assert "'small'" in message
    assert "INT8 range -128..127" in message


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (raw_bytes([b"abcdefgh"])[:-1], "element 0 declares 8 bytes but only 7 remain"),
        (raw_bytes([b"ab"]), "too few for the 2 BYTES elements"),
        (raw_bytes([b"abcd"]), "holds 1 BYTES elements, expected 2"),
        (raw_bytes([b"ab", b"c"]) + b"zz", "2 bytes left after the 2 BYTES elements"),
    ],
    ids=["truncated-element", "too-short", "too-few-elements", "trailing-bytes"],
)
def test_malformed_raw_bytes_input_is_refused(raw: bytes, expected: str) -> None:
    message = decode_error(request_with("words", "BYTES", [2], raw=raw))
    assert "'words'" in message
    assert expected in message


def test_huge_bytes_shape_is_refused_before_allocating() -> None:
    message = decode_error(request_with("words", "BYTES", [10**12], raw=raw_bytes([b"a"])))
    assert "too few for the 1000000000000 BYTES elements" in message


def test_raw_contents_must_cover_every_input() -> None:
    message = request_with("a", "FP32", [1], raw=b"\x00" * 4)
    message.inputs.add(name="b", datatype="FP32", shape=[1])
    assert "1 entries but the request has 2 inputs" in decode_error(message)


def test_data_in_both_raw_and_typed_contents_is_refused() -> None:
    message = request_with("a", "FP32", [1], raw=b"\x00" * 4, fp32_contents=[1.0])
    assert "'a'" in decode_error(message)


def test_unknown_datatype_is_refused_listing_the_choices() -> None:
    message = decode_error(request_with("a", "FLOAT", [1], raw=b"\x00" * 4))
    assert "'a'" in message
    assert "'FLOAT'" in message
    assert "FP32" in message


def test_negative_dim_is_refused() -> None:
    message = decode_error(request_with("a", "FP32", [-1, 2], raw=b""))
    assert "'a'" in message
    assert "[-1, 2]" in message


def test_duplicate_input_is_refused() -> None:
    message = request_with("a", "FP32", [1], fp32_contents=[1.0])
    message.inputs.add(name="a", datatype="FP32", shape=[1]).contents.fp32_contents.append(2.0)
    assert "'a' appears more than once" in decode_error(message)


def test_missing_data_is_refused() -> None:
    message = decode_error(request_with("a", "FP32", [3]))
    assert "contents.fp32_contents" in message


def test_shared_memory_input_is_read_from_its_region_later() -> None:
    # Inputs in a region have no raw_input_contents entry: "b" holds the only one.
    message = request_with("a", "FP32", [2, 2])
    message.inputs[0].parameters["shared_memory_region"].string_param = "region0"
    message.inputs[0].parameters["shared_memory_offset"].uint64_param = 32
    message.inputs[0].parameters["shared_memory_byte_size"].int64_param = 16
    message.inputs.add(name="b", datatype="INT8", shape=[1])
    message.raw_input_contents.append(b"\x07")
    message.outputs.add(name="y").parameters["shared_memory_region"].string_param = "out"
    message.outputs[0].parameters["shared_memory_byte_size"].int64_param = 64
    request = grpc_codec.decode_infer_request(message)
    assert list(request.inputs) == ["b"]
    assert request.shared_memory_inputs == {
        "a": SharedMemoryInput("FP32", [2, 2], SharedMemoryRef("region0", 32, 16))
    }
    assert request.outputs is not None
    assert request.outputs[0].shared_memory == SharedMemoryRef("out", 0, 64)


def test_shared_memory_input_of_the_wrong_size_is_refused() -> None:
    message = request_with("a", "FP32", [1])
    message.inputs[0].parameters["shared_memory_region"].string_param = "region0"
    assert "shared_memory_byte_size is required" in decode_error(message)
    message.inputs[0].parameters["shared_memory_byte_size"].int64_param = 8
    assert "is 8 but shape [1] of FP32 takes 4 bytes" in decode_error(message)
    message.inputs[0].parameters["shared_memory_byte_size"].int64_param = 4
    message.inputs[0].contents.fp32_contents.append(1.0)
    assert "both contents and a shared-memory region" in decode_error(message)


# ---------------------------------------------------------------- request parameters


def test_priority_timeout_and_other_parameters_are_read() -> None:
    message = request_with("a", "FP32", [1], raw=b"\x00" * 4)
    message.parameters["priority"].uint64_param = 2
    message.parameters["timeout"].int64_param = 1500
    message.parameters["sequence_start"].bool_param = True
    message.parameters["tag"].string_param = "blue"
    message.parameters["scale"].double_param = 0.5
    request = grpc_codec.decode_infer_request(message)
    assert request.priority == 2
    assert request.timeout_us == 1500
    assert request.parameters == {"sequence_start": True, "tag": "blue", "scale": 0.5}


@pytest.mark.parametrize("name", ["priority", "timeout"])
def test_non_integer_priority_or_timeout_is_refused(name: str) -> None:
    message = request_with("a", "FP32", [1], raw=b"\x00" * 4)
    message.parameters[name].string_param = "high"
    error = decode_error(message)
    assert f"'{name}'" in error
    assert "'high'" in error


def test_requested_outputs_are_listed_and_none_means_all() -> None:
    message = request_with("a", "FP32", [1], raw=b"\x00" * 4)
    assert grpc_codec.decode_infer_request(message).outputs is None
    message.outputs.add(name="OUTPUT1")
    outputs = grpc_codec.decode_infer_request(message).outputs
    assert outputs == [RequestedOutput(name="OUTPUT1")]


def test_a_classification_that_is_not_a_count_is_refused_naming_the_output() -> None:
    message = request_with("a", "FP32", [1], raw=b"\x00" * 4)
    message.outputs.add(name="probs").parameters["classification"].string_param = "3"
    error = decode_error(message)
    assert "'probs'" in error
    assert "'classification'" in error


# ---------------------------------------------------------------- responses


@pytest.mark.parametrize("datatype", FIXED_DATATYPES)
def test_response_outputs_are_raw_and_decode_in_tritonclient(datatype: str) -> None:
    array = sample(datatype)
    response = InferResponse(model_name="m", model_version="1", outputs={"y": array}, id="r7")
    encoded = grpc_codec.encode_infer_response(response)
    assert not encoded.outputs[0].HasField("contents")
    # The stock client decodes the hot path's bytes with its own message classes.
    wire = grpc_codec.serialize_infer_response(response)
    triton = service_pb2.ModelInferResponse.FromString(wire)
    result = InferResult(triton)
    decoded = result.as_numpy("y")
    assert decoded.dtype == array.dtype
    np.testing.assert_array_equal(decoded, array)
    assert triton.outputs[0].datatype == datatype
    assert list(triton.outputs[0].shape) == [2, 3]
    assert (triton.model_name, triton.model_version, triton.id) == ("m", "1", "r7")


def test_bytes_outputs_from_bytes_str_and_unicode_arrays_decode_in_tritonclient() -> None:
    objects = np.array([b"a", "ü", b""], dtype=object)
    unicode = np.array([["x", "yz"]])
    encoded = grpc_codec.encode_infer_response(
        InferResponse(model_name="m", model_version="1", outputs={"o": objects, "u": unicode})
    )
    result = InferResult(service_pb2.ModelInferResponse.FromString(encoded.SerializeToString()))
    assert result.as_numpy("o").tolist() == [b"a", "ü".encode(), b""]
    assert result.as_numpy("u").tolist() == [[b"x", b"yz"]]
    assert [o.datatype for o in encoded.outputs] == ["BYTES", "BYTES"]


@pytest.mark.parametrize(
    "outputs",
    [
        {"a": np.arange(300_000, dtype=np.float32).reshape(3, -1), "b": np.zeros((0, 4))},
        {"t": np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2]},
        {"s": np.array([b"x", "yz"], dtype=object), "z": np.float16(2.5) * np.ones(())},
        {},
    ],
    ids=["large-and-empty", "strided", "bytes-and-scalar", "no-outputs"],
)
def test_hand_serialised_response_equals_protobuf_serialisation(
    outputs: dict[str, np.ndarray],
) -> None:
    response = InferResponse(
        model_name="m", model_version="3", outputs=outputs, id="r", parameters={"k": 1}
    )
    expected = grpc_codec.encode_infer_response(response)
    assert grpc_codec.serialize_infer_response(response) == expected.SerializeToString()
    stream = grpc_codec.serialize_stream_infer_response(response)
    expected_stream = pb.ModelStreamInferResponse(infer_response=expected)
    assert stream == expected_stream.SerializeToString()


def test_response_parameters_keep_their_type() -> None:
    encoded = grpc_codec.encode_infer_response(
        InferResponse(
            model_name="m",
            model_version="1",
            outputs={},
            parameters={"flag": True, "n": 3, "big": 2**64 - 1, "x": 0.25, "s": "v"},
        )
    )
    values = {k: grpc_codec.parameter_value(v) for k, v in encoded.parameters.items()}
    assert values == {"flag": True, "n": 3, "big": 2**64 - 1, "x": 0.25, "s": "v"}
    assert encoded.parameters["flag"].WhichOneof("parameter_choice") == "bool_param"


def test_raw_roundtrip_of_every_datatype_through_decode() -> None:
    for datatype in FIXED_DATATYPES:
        array = sample(datatype)
        wire_type, data = grpc_codec.encode_raw_tensor(array)
        assert wire_type == datatype
        decoded = grpc_codec.decode_raw_tensor("x", datatype, [2, 3], data)
        np.testing.assert_array_equal(decoded, array)


# ---------------------------------------------------------------- metadata, config, stats


def test_model_metadata_encodes_tensors() -> None:
    encoded = grpc_codec.encode_model_metadata(
        ModelMetadata(
            name="m",
            versions=["1", "2"],
            platform="onnxruntime_onnx",
            inputs=[TensorMetadata("x", "FP32", [-1, 4])],
            outputs=[TensorMetadata("y", "INT64", [-1])],
        )
    )
    triton = service_pb2.ModelMetadataResponse.FromString(encoded.SerializeToString())
    assert list(triton.versions) == ["1", "2"]
    assert (triton.inputs[0].name, triton.inputs[0].datatype) == ("x", "FP32")
    assert list(triton.inputs[0].shape) == [-1, 4]
    assert list(triton.outputs[0].shape) == [-1]


def test_model_config_decodes_in_tritonclient_with_triton_enums() -> None:
    config = parse_model_config(
        {
            "name": "m",
            "backend": "onnxruntime",
            "max_batch_size": 8,
            "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [4], "optional": True}],
            "output": [{"name": "y", "data_type": "BYTES", "dims": [-1]}],
            "dynamic_batching": {
                "preferred_batch_size": [4, 8],
                "max_queue_delay_microseconds": 100,
                "max_queue_size": 64,
                "default_timeout_microseconds": 5000,
                "priority_levels": 3,
            },
            "instance_group": {"count": 2, "kind": "KIND_CPU"},
            "version_policy": {"specific": {"versions": [1, 3]}},
            "parameters": {"intra_op_thread_count": {"string_value": "2"}},
            "model_warmup": [
                {"name": "w", "batch_size": 2, "inputs": {"x": {"data_type": "FP32", "dims": [4]}}}
            ],
        },
        "test",
    )
    encoded = grpc_config.encode_model_config(config)
    triton = service_pb2.ModelConfigResponse.FromString(encoded.SerializeToString()).config
    assert triton.max_batch_size == 8
    assert triton.backend == "onnxruntime"
    assert triton.input[0].data_type == model_config_pb2.TYPE_FP32
    assert list(triton.input[0].dims) == [4]
    assert triton.input[0].optional
    assert triton.output[0].data_type == model_config_pb2.TYPE_STRING
    batching = triton.dynamic_batching
    assert list(batching.preferred_batch_size) == [4, 8]
    assert batching.max_queue_delay_microseconds == 100
    assert (batching.priority_levels, batching.default_priority_level) == (3, 2)
    assert batching.default_queue_policy.max_queue_size == 64
    assert batching.default_queue_policy.default_timeout_microseconds == 5000
    assert triton.instance_group[0].count == 2
    assert triton.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_CPU
    assert list(triton.version_policy.specific.versions) == [1, 3]
    assert triton.parameters["intra_op_thread_count"].string_value == "2"
    warmup = triton.model_warmup[0]
    assert (warmup.name, warmup.batch_size, warmup.count) == ("w", 2, 1)
    assert warmup.inputs["x"].zero_data
    assert warmup.inputs["x"].data_type == model_config_pb2.TYPE_FP32


def test_model_config_default_version_policy_is_latest_one() -> None:
    encoded = grpc_config.encode_model_config(parse_model_config({"name": "m"}, "test"))
    assert encoded.config.version_policy.latest.num_versions == 1
    assert encoded.config.max_batch_size == 0


def test_statistics_decode_in_tritonclient() -> None:
    snapshot = ModelStats(
        name="m",
        version="1",
        last_inference_ms=1234,
        inference_count=4,
        execution_count=1,
        inference_stats=InferStats(
            success=StatDuration(1, 500),
            fail=StatDuration(1, 70),
            queue=StatDuration(1, 50),
            compute_infer=StatDuration(2, 200),
        ),
        batch_stats=[BatchStats(batch_size=4, compute_infer=StatDuration(1, 100))],
    )
    encoded = grpc_codec.encode_model_statistics([snapshot])
    triton = service_pb2.ModelStatisticsResponse.FromString(encoded.SerializeToString())
    stats = triton.model_stats[0]
    assert (stats.name, stats.version, stats.last_inference) == ("m", "1", 1234)
    assert (stats.inference_count, stats.execution_count) == (4, 1)
    assert (stats.inference_stats.success.count, stats.inference_stats.success.ns) == (1, 500)
    assert stats.inference_stats.fail.ns == 70
    assert stats.inference_stats.queue.ns == 50
    assert stats.inference_stats.compute_infer.ns == 200
    assert stats.batch_stats[0].batch_size == 4
    assert stats.batch_stats[0].compute_infer.ns == 100


def test_response_stats_and_memory_usage_decode_in_tritonclient() -> None:
    snapshot = ModelStats(name="m", version="1")
    add_response(snapshot.response_stats, 0, outcome="success", start_ns=10,
                 output_start_ns=40, end_ns=50)  # fmt: skip
    add_response(snapshot.response_stats, 1, outcome="cancel", start_ns=60, end_ns=65)
    snapshot.memory_usage = [MemoryUsage("CPU", 0, 4096), MemoryUsage("GPU", 1, 1 << 33)]
    encoded = grpc_codec.encode_model_statistics([snapshot])
    triton = service_pb2.ModelStatisticsResponse.FromString(encoded.SerializeToString())
    stats = triton.model_stats[0]
    first = stats.response_stats["0"]
    assert (first.compute_infer.count, first.compute_infer.ns) == (1, 30)
    assert (first.compute_output.count, first.compute_output.ns) == (1, 10)
    assert (first.success.count, first.success.ns) == (1, 40)
    assert stats.response_stats["1"].cancel.ns == 5
    assert stats.response_stats["1"].success.count == 0
    assert [(m.type, m.id, m.byte_size) for m in stats.memory_usage] == [
        ("CPU", 0, 4096), ("GPU", 1, 1 << 33)
    ]  # fmt: skip


def test_repository_index_encodes_entries() -> None:
    encoded = grpc_codec.encode_repository_index(
        [RepositoryEntry("a", "1", "READY", ""), RepositoryEntry("b", "", "UNAVAILABLE", "bad")]
    )
    assert [(m.name, m.version, m.state, m.reason) for m in encoded.models] == [
        ("a", "1", "READY", ""),
        ("b", "", "UNAVAILABLE", "bad"),
    ]


# ---------------------------------------------------------------- wire compatibility


def _our_messages() -> list[Descriptor]:
    found: list[Descriptor] = []

    def walk(descriptor: Descriptor) -> None:
        if descriptor.GetOptions().map_entry:
            return
        found.append(descriptor)
        for nested in descriptor.nested_types:
            walk(nested)

    for descriptor in pb.DESCRIPTOR.message_types_by_name.values():
        walk(descriptor)
    return found


def _triton_name(full_name: str) -> str:
    return full_name.replace("slipstream.inference.", "inference.", 1)


@pytest.mark.parametrize("ours", _our_messages(), ids=lambda d: d.name)
def test_every_field_matches_tritons_number_and_type(ours: Descriptor) -> None:
    pool = service_pb2.DESCRIPTOR.pool
    theirs = pool.FindMessageTypeByName(_triton_name(ours.full_name))
    for field in ours.fields:
        triton_field = theirs.fields_by_name[field.name]
        assert field.number == triton_field.number, field.full_name
        assert field.type == triton_field.type, field.full_name
        assert field.is_repeated == triton_field.is_repeated, field.full_name


def test_every_enum_matches_tritons_values() -> None:
    pool = service_pb2.DESCRIPTOR.pool
    enums: list[EnumDescriptor] = list(pb.DESCRIPTOR.enum_types_by_name.values())
    for message in _our_messages():
        enums.extend(message.enum_types)
    for ours in enums:
        theirs = pool.FindEnumTypeByName(_triton_name(ours.full_name))
        for value in ours.values:
            assert theirs.values_by_name[value.name].number == value.number, value.name
