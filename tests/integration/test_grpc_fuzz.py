"""Property-based requests to a live server's gRPC endpoint, every RPC of the V2 service:
whatever a client sends (names that walk out of the repository, versions that are not
numbers, parameters of every kind under known and unknown keys, tensors whose datatype,
shape and contents disagree, shared-memory regions with bad keys, offsets and sizes, CUDA
handles of random bytes, model loads with random overrides), the answer is OK or a
status naming the client's mistake (INVALID_ARGUMENT, NOT_FOUND, UNAVAILABLE, ...), never
INTERNAL or UNKNOWN, and the server keeps serving. The REST twin of this test is the
OpenAPI conformance search (``test_openapi_conformance.py``). Deeper:
``SLIPSTREAM_GRPC_FUZZ_EXAMPLES=500`` cases per RPC (40 by default).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from slipstream.protocol.proto import inference_pb2 as pb
from tests.models import ADD_SUB_WIDTH, build_add_sub
from tests.utils import RemoteServer

pytestmark = pytest.mark.slow

FUZZ = settings(
    max_examples=int(os.environ.get("SLIPSTREAM_GRPC_FUZZ_EXAMPLES", "40")),
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
SERVICE = "/inference.GRPCInferenceService/"
# What a client's mistake may be answered with; INTERNAL and UNKNOWN are the server's.
CLIENT_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.DEADLINE_EXCEEDED,
}  # fmt: skip

TEXT = st.text(max_size=12)
NAMES = st.sampled_from(["add_sub", "", "nope", "../add_sub", "add_sub/1", "a" * 300]) | TEXT
VERSIONS = st.sampled_from(["", "1", "2", "0", "-1", "01", "9" * 30, "x"]) | TEXT
INT64 = st.sampled_from([0, 1, -1, 2**31, 2**63 - 1, -(2**63)]) | st.integers(-(2**63), 2**63 - 1)
UINT64 = st.sampled_from([0, 1, 2**32, 2**64 - 1]) | st.integers(0, 2**64 - 1)
PARAMETER_KEYS = st.sampled_from([
    "priority", "timeout", "binary_data_output", "binary_data", "binary_data_size",
    "shared_memory_region", "shared_memory_offset", "shared_memory_byte_size",
    "sequence_id", "sequence_start", "sequence_end", "classification", "max_tokens",
    "headers", "triton_enable_empty_final_response", "",
]) | TEXT  # fmt: skip


@st.composite
def infer_parameters(draw: Any) -> dict[str, pb.InferParameter]:
    parameters = {}
    for key in draw(st.lists(PARAMETER_KEYS, max_size=4)):
        kind = draw(st.sampled_from(["bool", "int64", "string", "double", "uint64"]))
        value = {
            "bool": st.booleans(), "int64": INT64,
            "string": st.sampled_from(["", "region", "add_sub"]) | TEXT,
            "double": st.floats(allow_nan=True, allow_infinity=True), "uint64": UINT64,
        }[kind]  # fmt: skip
        parameters[key] = pb.InferParameter(**{f"{kind}_param": draw(value)})
    return parameters


DATATYPES = st.sampled_from(["FP32", "FP32", "FP32", "FP16", "INT64", "BYTES", "BOOL", "", "X"])
SHAPES = st.lists(st.sampled_from([1, 2, ADD_SUB_WIDTH, 0, -1, 2**40]), max_size=3) | st.just(
    [1, ADD_SUB_WIDTH]
)


@st.composite
def infer_requests(draw: Any) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(
        model_name=draw(st.sampled_from(["add_sub"]) | NAMES),
        model_version=draw(st.sampled_from([""]) | VERSIONS),
        id=draw(TEXT),
    )
    for key, value in draw(infer_parameters()).items():
        request.parameters[key].CopyFrom(value)
    raw = draw(st.booleans())
    for name in draw(st.lists(st.sampled_from(["INPUT0", "INPUT1", "X", ""]), max_size=3)):
        shape = draw(SHAPES)
        tensor = request.inputs.add(name=name, datatype=draw(DATATYPES), shape=shape)
        for key, value in draw(infer_parameters()).items():
            tensor.parameters[key].CopyFrom(value)
        count = int(np.prod([max(d, 0) for d in shape])) if all(d < 2**20 for d in shape) else 0
        if raw:
            size = draw(st.sampled_from([4 * count, 0, 3, 4 * count + 4]))
            request.raw_input_contents.append(bytes(size))
        elif draw(st.booleans()):
            tensor.contents.fp32_contents.extend([1.0] * draw(st.sampled_from([count, 1, 0])))
    for name in draw(st.lists(st.sampled_from(["OUTPUT0", "OUTPUT1", "Y"]), max_size=2)):
        output = request.outputs.add(name=name)
        for key, value in draw(infer_parameters()).items():
            output.parameters[key].CopyFrom(value)
    return request


@st.composite
def parameterised_infer_requests(draw: Any) -> pb.ModelInferRequest:
    """A valid request for ``add_sub`` but for its parameters (request, inputs' and
    outputs'), which take anything."""
    rows = draw(st.integers(1, 4))
    request = pb.ModelInferRequest(model_name="add_sub", id=draw(TEXT))
    for key, value in draw(infer_parameters()).items():
        request.parameters[key].CopyFrom(value)
    for name in ("INPUT0", "INPUT1"):
        tensor = request.inputs.add(name=name, datatype="FP32", shape=[rows, ADD_SUB_WIDTH])
        for key, value in draw(infer_parameters()).items():
            tensor.parameters[key].CopyFrom(value)
        request.raw_input_contents.append(bytes(4 * rows * ADD_SUB_WIDTH))
    for name in draw(st.lists(st.sampled_from(["OUTPUT0", "OUTPUT1"]), max_size=2)):
        output = request.outputs.add(name=name)
        for key, value in draw(infer_parameters()).items():
            output.parameters[key].CopyFrom(value)
    return request


@st.composite
def repository_parameters(draw: Any) -> dict[str, pb.ModelRepositoryParameter]:
    parameters = {}
    keys = st.sampled_from(["config", "file:1/model.onnx", "file:config.yaml", "x"]) | TEXT
    for key in draw(st.lists(keys, max_size=3)):
        kind = draw(st.sampled_from(["bool", "int64", "string", "bytes"]))
        value = {
            "bool": st.booleans(), "int64": INT64,
            "string": st.sampled_from(["{}", '{"max_batch_size": -1}', "not json", ""]) | TEXT,
            "bytes": st.binary(max_size=64),
        }[kind]  # fmt: skip
        parameters[key] = pb.ModelRepositoryParameter(**{f"{kind}_param": draw(value)})
    return parameters


METHODS = [
    "ModelInfer", "ModelMetadata", "ModelConfig", "ModelReady", "ModelStatistics",
    "RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload",
    "SystemSharedMemoryRegister", "SystemSharedMemoryStatus", "SystemSharedMemoryUnregister",
    "CudaSharedMemoryRegister", "CudaSharedMemoryStatus", "CudaSharedMemoryUnregister",
]  # fmt: skip


@st.composite
def calls(draw: Any, method: str) -> tuple[str, Any, Any]:
    """One call of ``method``: the method, its request and its response class."""
    name, version = draw(NAMES), draw(VERSIONS)
    if method == "ModelInfer":
        request = draw(infer_requests() | parameterised_infer_requests())
        return method, request, pb.ModelInferResponse
    if method in ("ModelMetadata", "ModelConfig", "ModelReady", "ModelStatistics"):
        request = getattr(pb, f"{method}Request")(name=name, version=version)
        return method, request, getattr(pb, f"{method}Response")
    if method == "RepositoryIndex":
        name = draw(st.just("") | TEXT)  # the one repository: "" (or its name)
        request = pb.RepositoryIndexRequest(repository_name=name, ready=draw(st.booleans()))
        return method, request, pb.RepositoryIndexResponse
    if method in ("RepositoryModelLoad", "RepositoryModelUnload"):
        # The served model stays: a load or unload of it would only turn later cases
        # into 404s. Other names, and a scratch one, take anything.
        target = draw(st.sampled_from(["scratch"]) | NAMES.filter(lambda n: n != "add_sub"))
        request = getattr(pb, f"{method}Request")(model_name=target)
        for key, value in draw(repository_parameters()).items():
            request.parameters[key].CopyFrom(value)
        return method, request, getattr(pb, f"{method}Response")
    region = draw(st.sampled_from(["region", ""]) | TEXT)
    if method == "SystemSharedMemoryRegister":
        request = pb.SystemSharedMemoryRegisterRequest(
            name=region, key=draw(st.sampled_from(["/nope", "", "/../etc/passwd"]) | TEXT),
            offset=draw(UINT64), byte_size=draw(UINT64),
        )  # fmt: skip
        return method, request, pb.SystemSharedMemoryRegisterResponse
    if method == "CudaSharedMemoryRegister":
        request = pb.CudaSharedMemoryRegisterRequest(
            name=region, raw_handle=draw(st.binary(max_size=80)), device_id=draw(INT64),
            byte_size=draw(UINT64),
        )  # fmt: skip
        return method, request, pb.CudaSharedMemoryRegisterResponse
    request = getattr(pb, f"{method}Request")(name=region)
    return method, request, getattr(pb, f"{method}Response")


@pytest.fixture(scope="module")
def channel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[grpc.Channel]:
    tmp = tmp_path_factory.mktemp("grpc_fuzz")
    build_add_sub(tmp / "repo")
    build_add_sub(tmp / "repo", "scratch")
    args = ["--model-control-mode", "explicit", "--load-model", "add_sub", "--allow-client-shm",
            "--frontends", os.environ.get("SLIPSTREAM_GRPC_FUZZ_FRONTENDS", "0")]  # fmt: skip
    with (
        RemoteServer(Path(tmp / "repo"), args, log_dir=tmp) as server,
        grpc.insecure_channel(server.grpc_address) as opened,
    ):
        yield opened
        assert "Traceback" not in server.log_text(), server.log_text()[-3000:]


@pytest.mark.parametrize("method", METHODS)
@FUZZ
@given(data=st.data())
def test_every_rpc_answers_a_clients_mistake_with_a_client_error(
    channel: grpc.Channel, method: str, data: st.DataObject
) -> None:
    _, request, response_class = data.draw(calls(method))
    rpc = channel.unary_unary(
        SERVICE + method,
        request_serializer=type(request).SerializeToString,
        response_deserializer=response_class.FromString,
    )
    try:
        rpc(request, timeout=30)
        event(f"{method}: OK")
    except grpc.RpcError as error:
        code = error.code()  # type: ignore[attr-defined]
        details = error.details()  # type: ignore[attr-defined]
        event(f"{method}: {code.name}")
        assert code in CLIENT_ERRORS, f"{method}: {code} {details!r} for {request}"
        assert details, f"{method}: {code} without a message"
    live = channel.unary_unary(
        SERVICE + "ServerLive",
        request_serializer=pb.ServerLiveRequest.SerializeToString,
        response_deserializer=pb.ServerLiveResponse.FromString,
    )
    assert live(pb.ServerLiveRequest(), timeout=30).live
