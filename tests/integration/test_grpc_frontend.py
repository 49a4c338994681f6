"""The gRPC front end on a loopback port, driven by the stock tritonclient.grpc client."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from slipstream.config import ModelConfig, parse_model_config
from slipstream.errors import InvalidRequest, ModelNotFound
from slipstream.observability.stats import ModelStats
from slipstream.protocol.proto import inference_pb2 as pb
from slipstream.server.v2_grpc import SERVICE_NAME, build_grpc_server
from slipstream.serving.service import InferenceService
from slipstream.types import (
    CudaRegionStatus,
    InferRequest,
    InferResponse,
    ModelMetadata,
    RepositoryEntry,
    ServerMetadata,
    SharedMemoryRegionStatus,
    TensorMetadata,
)
from tests.models import build_add_sub
from tests.utils import RemoteServer

MAX_MESSAGE_BYTES = 4 * 1024 * 1024

# Model name -> V2 datatype of its add_sub inputs and outputs.
ADD_SUB_MODELS = {"add_sub": "FP32", "add_sub_int64": "INT64", "add_sub_fp16": "FP16"}


@dataclass
class FakeModel:
    config: ModelConfig
    loaded: bool = True
    stats: ModelStats = field(default_factory=lambda: ModelStats(name="", version="1"))


def _add_sub_config(name: str, datatype: str) -> ModelConfig:
    tensor = {"data_type": datatype, "dims": [4]}
    return parse_model_config(
        {
            "name": name,
            "backend": "fake",
            "max_batch_size": 8,
            "input": [{"name": "INPUT0", **tensor}, {"name": "INPUT1", **tensor}],
            "output": [{"name": "OUTPUT0", **tensor}, {"name": "OUTPUT1", **tensor}],
        },
        name,
    )


def _identity_config(name: str) -> ModelConfig:
    tensor = {"data_type": "TYPE_STRING", "dims": [-1]}
    return parse_model_config(
        {
            "name": name,
            "max_batch_size": 0,
            "input": [{"name": "INPUT0", **tensor}],
            "output": [{"name": "OUTPUT0", **tensor}],
        },
        name,
    )


class FakeService(InferenceService):
    """add_sub models in three dtypes, a BYTES identity, and models that crash or wait."""

    def __init__(self) -> None:
        self.models = {
            name: FakeModel(_add_sub_config(name, dt)) for name, dt in ADD_SUB_MODELS.items()
        }
        self.models["identity_bytes"] = FakeModel(_identity_config("identity_bytes"))
        self.models["broken"] = FakeModel(_add_sub_config("broken", "FP32"))
        self.models["loadable"] = FakeModel(_add_sub_config("loadable", "FP32"), loaded=False)
        self.models["gated"] = FakeModel(_add_sub_config("gated", "FP32"))
        for name, model in self.models.items():
            model.stats.name = name
        self.last_request: InferRequest | None = None
        # "gated" requests wait until an add_sub request with id "open" arrives.
        self._gate: asyncio.Event | None = None

    def _model(self, name: str, *, loaded: bool = True) -> FakeModel:
        model = self.models.get(name)
        if model is None or (loaded and not model.loaded):
            raise ModelNotFound(f"unknown model '{name}'; see the repository index")
        return model

    def is_live(self) -> bool:
        return True

    async def is_ready(self) -> bool:
        return True

    async def server_metadata(self) -> ServerMetadata:
        return ServerMetadata(name="slipstream", version="0.1.0", extensions=["statistics"])

    async def model_ready(self, name: str, version: str = "") -> bool:
        model = self.models.get(name)
        return model is not None and model.loaded

    async def model_metadata(self, name: str, version: str = "") -> ModelMetadata:
        config = self._model(name).config
        batch = [-1] if config.max_batch_size else []

        def tensors(specs: list[Any]) -> list[TensorMetadata]:
            return [TensorMetadata(t.name, t.data_type, batch + t.dims) for t in specs]

        return ModelMetadata(
            name=name,
            versions=["1"],
            platform="fake",
            inputs=tensors(config.input),
            outputs=tensors(config.output),
        )

    async def model_config(self, name: str, version: str = "") -> ModelConfig:
        return self._model(name).config

    async def infer(self, request: InferRequest) -> InferResponse:
        self.last_request = request
        model = self._model(request.model_name)
        if request.model_name == "broken":
            raise RuntimeError("secret internal detail")
        if self._gate is None:
            self._gate = asyncio.Event()  # created here: it belongs to the server's loop
        if request.model_name == "gated":
            await asyncio.wait_for(self._gate.wait(), timeout=5)
        elif request.id == "open":
            self._gate.set()
        if request.model_name == "identity_bytes":
            outputs = {"OUTPUT0": request.inputs["INPUT0"]}
        else:
            try:
                a, b = request.inputs["INPUT0"], request.inputs["INPUT1"]
            except KeyError as exc:
                raise InvalidRequest(
                    f"input {exc} is missing; add_sub needs INPUT0 and INPUT1"
                ) from None
            outputs = {"OUTPUT0": a + b, "OUTPUT1": a - b}
        if request.outputs is not None:
            outputs = {o.name: outputs[o.name] for o in request.outputs}
        await asyncio.sleep(0)  # a real service yields while the batch runs
        model.stats.inference_count += next(iter(request.inputs.values())).shape[0]
        model.stats.execution_count += 1
        return InferResponse(
            model_name=request.model_name, model_version="1", outputs=outputs, id=request.id
        )

    async def model_statistics(self, name: str = "", version: str = "") -> list[ModelStats]:
        if name:
            return [self._model(name).stats]
        return [m.stats for m in self.models.values() if m.loaded]

    async def repository_index(self, ready_only: bool = False) -> list[RepositoryEntry]:
        return [
            RepositoryEntry(name, "1" if m.loaded else "", "READY" if m.loaded else "", "")
            for name, m in self.models.items()
            if m.loaded or not ready_only
        ]

    async def load_model(self, name: str, config: str | None = None) -> None:
        self._model(name, loaded=False).loaded = True

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        self._model(name, loaded=False).loaded = False

    async def region_status(
        self, name: str = "", owner: str = ""
    ) -> list[SharedMemoryRegionStatus]:
        return []

    async def register_region(
        self, name: str, key: str, offset: int, byte_size: int, owner: str = ""
    ) -> None:
        raise InvalidRequest("no shared memory here")

    async def unregister_region(self, name: str = "", owner: str = "") -> None:
        return None

    async def cuda_region_status(self, name: str = "", owner: str = "") -> list[CudaRegionStatus]:
        return []

    async def register_cuda_region(
        self, name: str, raw_handle: bytes, device_id: int, byte_size: int, owner: str = ""
    ) -> None:
        raise InvalidRequest("no shared memory here")

    async def unregister_cuda_region(self, name: str = "", owner: str = "") -> None:
        return None


@dataclass
class Server:
    service: FakeService
    url: str


@contextlib.contextmanager
def serving(service: FakeService, **options: Any) -> Iterator[Server]:
    """``build_grpc_server(service, ..., **options)`` on a loop of its own thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="grpc-test-loop", daemon=True)
    thread.start()

    async def start() -> tuple[Any, int]:
        # grpc.aio binds a server to the loop it is created on: build it there.
        grpc_server, port = build_grpc_server(service, "127.0.0.1", 0, MAX_MESSAGE_BYTES, **options)
        await grpc_server.start()
        return grpc_server, port

    grpc_server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=10)
    try:
        yield Server(service, f"127.0.0.1:{port}")
    finally:
        asyncio.run_coroutine_threadsafe(grpc_server.stop(None), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with serving(FakeService()) as running:
        yield running


@pytest.fixture
def client(server: Server) -> Iterator[grpcclient.InferenceServerClient]:
    triton = grpcclient.InferenceServerClient(url=server.url)
    try:
        yield triton
    finally:
        triton.close()


def add_sub_inputs(a: np.ndarray, b: np.ndarray) -> list[grpcclient.InferInput]:
    datatype = {np.float32: "FP32", np.int64: "INT64", np.float16: "FP16"}[a.dtype.type]
    inputs = []
    for name, array in (("INPUT0", a), ("INPUT1", b)):
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


# ---------------------------------------------------------------- health and metadata


def test_server_live_and_ready(client: grpcclient.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()


def test_model_ready_for_known_and_unknown_models(client: grpcclient.InferenceServerClient) -> None:
    assert client.is_model_ready("add_sub")
    assert not client.is_model_ready("no_such_model")


def test_server_metadata(client: grpcclient.InferenceServerClient) -> None:
    metadata = client.get_server_metadata(as_json=True)
    assert metadata["name"] == "slipstream"
    assert metadata["extensions"] == ["statistics"]


def test_model_metadata(client: grpcclient.InferenceServerClient) -> None:
    metadata = client.get_model_metadata("add_sub")
    assert metadata.name == "add_sub"
    assert list(metadata.versions) == ["1"]
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == [
        ("INPUT0", "FP32", [-1, 4]),
        ("INPUT1", "FP32", [-1, 4]),
    ]


def test_model_config_decodes_in_tritonclient(client: grpcclient.InferenceServerClient) -> None:
    config = client.get_model_config("add_sub").config
    assert config.max_batch_size == 8
    assert [(t.name, t.data_type, list(t.dims)) for t in config.input] == [
        ("INPUT0", grpcclient.model_config_pb2.TYPE_FP32, [4]),
        ("INPUT1", grpcclient.model_config_pb2.TYPE_FP32, [4]),
    ]
    as_json = client.get_model_config("identity_bytes", as_json=True)["config"]
    assert as_json["input"][0]["data_type"] == "TYPE_STRING"
    assert as_json["input"][0]["dims"] == ["-1"]


# ---------------------------------------------------------------- inference


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.float16])
def test_infer_add_sub(client: grpcclient.InferenceServerClient, dtype: type) -> None:
    model = {np.float32: "add_sub", np.int64: "add_sub_int64", np.float16: "add_sub_fp16"}[dtype]
    a = np.arange(8).reshape(2, 4).astype(dtype)
    b = np.full((2, 4), 3).astype(dtype)
    result = client.infer(model, add_sub_inputs(a, b), request_id="req-1")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    assert result.as_numpy("OUTPUT0").dtype == dtype
    response = result.get_response()
    assert (response.model_name, response.id) == (model, "req-1")


def test_infer_bytes_identity(client: grpcclient.InferenceServerClient) -> None:
    words = np.array([b"hello", b"", "wörld".encode(), b"\x00bin"], dtype=object)
    tensor = grpcclient.InferInput("INPUT0", [4], "BYTES")
    tensor.set_data_from_numpy(words)
    result = client.infer("identity_bytes", [tensor])
    assert result.as_numpy("OUTPUT0").tolist() == words.tolist()


def test_infer_requested_output_priority_and_timeout(
    server: Server, client: grpcclient.InferenceServerClient
) -> None:
    a = np.ones((1, 4), np.float32)
    result = client.infer(
        "add_sub",
        add_sub_inputs(a, a),
        outputs=[grpcclient.InferRequestedOutput("OUTPUT1")],
        priority=2,
        timeout=2500,
    )
    assert result.as_numpy("OUTPUT0") is None
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), np.zeros((1, 4), np.float32))
    request = server.service.last_request
    assert request is not None
    assert (request.priority, request.timeout_us) == (2, 2500)


def test_stream_infer_answers_every_request_and_errors_in_band(
    client: grpcclient.InferenceServerClient,
) -> None:
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for i in range(5):
            a = np.full((1, 4), i, np.float32)
            client.async_stream_infer("add_sub", add_sub_inputs(a, a), request_id=str(i))
        a = np.ones((1, 4), np.float32)
        client.async_stream_infer("no_such_model", add_sub_inputs(a, a), request_id="bad")
        received = [answers.get(timeout=5) for _ in range(6)]
    finally:
        client.stop_stream()
    errors = [error for result, error in received if error is not None]
    assert len(errors) == 1
    assert "unknown model 'no_such_model'" in errors[0].message()
    sums = {r.get_response().id: r.as_numpy("OUTPUT0") for r, e in received if e is None}
    assert sorted(sums) == ["0", "1", "2", "3", "4"]
    for request_id, total in sums.items():
        np.testing.assert_array_equal(total, np.full((1, 4), 2 * int(request_id), np.float32))


def test_stream_requests_run_concurrently_and_are_answered_in_order(
    client: grpcclient.InferenceServerClient,
) -> None:
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        a = np.ones((1, 4), np.float32)
        # "gated" finishes only once the later "open" request has run: a stream that
        # served requests one by one would never answer either. "open" finishes first,
        # yet is answered second, as Triton answers a non-decoupled model's stream.
        client.async_stream_infer("gated", add_sub_inputs(a, a), request_id="waits")
        client.async_stream_infer("add_sub", add_sub_inputs(a, a), request_id="open")
        received = [answers.get(timeout=5) for _ in range(2)]
    finally:
        client.stop_stream()
    assert [error for _, error in received] == [None, None]
    assert [result.get_response().id for result, _ in received] == ["waits", "open"]


# ---------------------------------------------------------------- statistics and repository


def test_inference_statistics(client: grpcclient.InferenceServerClient) -> None:
    a = np.ones((3, 4), np.float32)
    before = client.get_inference_statistics("add_sub").model_stats[0].inference_count
    client.infer("add_sub", add_sub_inputs(a, a))
    stats = client.get_inference_statistics("add_sub", as_json=True)["model_stats"][0]
    assert stats["name"] == "add_sub"
    assert int(stats["inference_count"]) == before + 3


def test_repository_index_load_and_unload(client: grpcclient.InferenceServerClient) -> None:
    index = {m.name: m for m in client.get_model_repository_index().models}
    assert index["add_sub"].state == "READY"
    assert index["loadable"].state == ""
    client.load_model("loadable")
    assert client.is_model_ready("loadable")
    client.unload_model("loadable")
    assert not client.is_model_ready("loadable")


# ---------------------------------------------------------------- errors


def test_unknown_model_is_not_found_with_message(client: grpcclient.InferenceServerClient) -> None:
    a = np.ones((1, 4), np.float32)
    with pytest.raises(InferenceServerException) as info:
        client.infer("no_such_model", add_sub_inputs(a, a))
    assert info.value.status() == "StatusCode.NOT_FOUND"
    assert "unknown model 'no_such_model'" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("no_such_model")
    assert info.value.status() == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException) as info:
        client.load_model("no_such_model")
    assert info.value.status() == "StatusCode.NOT_FOUND"


def test_wrong_size_is_invalid_argument_naming_the_input(
    client: grpcclient.InferenceServerClient,
) -> None:
    a = np.ones((1, 4), np.float32)
    inputs = add_sub_inputs(a, a)
    inputs[1].set_shape([1, 5])  # the client sends 16 bytes for a shape that needs 20
    with pytest.raises(InferenceServerException) as info:
        client.infer("add_sub", inputs)
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "'INPUT1'" in info.value.message()
    assert "expected 20 bytes" in info.value.message()


def test_request_over_the_size_limit_is_resource_exhausted(
    client: grpcclient.InferenceServerClient,
) -> None:
    a = np.ones((MAX_MESSAGE_BYTES // 16, 4), np.float32)  # two inputs: 2x the limit
    with pytest.raises(InferenceServerException) as info:
        client.infer("add_sub", add_sub_inputs(a, a))
    assert info.value.status() == "StatusCode.RESOURCE_EXHAUSTED"


def test_rpcs_past_the_per_connection_stream_limit_wait_for_one_to_end() -> None:
    path = f"/{SERVICE_NAME}/"
    release = threading.Event()

    def held_open() -> Iterator[pb.ModelInferRequest]:
        release.wait(10)  # a stream that sends nothing until released
        yield from ()

    with (
        serving(FakeService(), max_concurrent_streams=2) as running,
        grpc.insecure_channel(running.url) as channel,
    ):
        live = channel.unary_unary(
            path + "ServerLive",
            request_serializer=pb.ServerLiveRequest.SerializeToString,
            response_deserializer=pb.ServerLiveResponse.FromString,
        )
        stream = channel.stream_stream(
            path + "ModelStreamInfer",
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelStreamInferResponse.FromString,
        )
        assert live(pb.ServerLiveRequest(), timeout=10).live  # the connection is up
        streams = [stream(held_open()) for _ in range(2)]
        # Both streams hold the connection's two slots: a third RPC waits its turn.
        with pytest.raises(grpc.RpcError) as waited:
            live(pb.ServerLiveRequest(), timeout=1.0)
        assert waited.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        release.set()
        for call in streams:
            assert list(call) == []
        assert live(pb.ServerLiveRequest(), timeout=10).live


def test_port_in_use_is_an_os_error(server: Server) -> None:
    port = int(server.url.rsplit(":", 1)[1])

    async def bind_again() -> None:
        build_grpc_server(FakeService(), "127.0.0.1", port, MAX_MESSAGE_BYTES)

    with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
        asyncio.run(bind_again())


def test_internal_error_is_logged_and_answered_without_details(
    client: grpcclient.InferenceServerClient, caplog: pytest.LogCaptureFixture
) -> None:
    a = np.ones((1, 4), np.float32)
    with (
        caplog.at_level(logging.ERROR, logger="slipstream.server.v2_grpc"),
        pytest.raises(InferenceServerException) as info,
    ):
        client.infer("broken", add_sub_inputs(a, a))
    assert info.value.status() == "StatusCode.INTERNAL"
    assert "secret" not in info.value.message()
    assert any("secret internal detail" in r.exc_text for r in caplog.records if r.exc_text)
    # The server goes on serving after an internal fault.
    served = client.infer("add_sub", add_sub_inputs(a, a)).as_numpy("OUTPUT0")
    np.testing.assert_array_equal(served, a + a)


def test_serve_flags_set_the_grpc_message_limit(tmp_path: Path) -> None:
    """--grpc-max-message-bytes (below --max-request-bytes here) bounds gRPC messages."""
    repo = tmp_path / "repo"
    build_add_sub(repo)
    args = ["--grpc-max-message-bytes", "65536", "--grpc-max-concurrent-streams", "8"]
    with RemoteServer(repo, args, log_dir=tmp_path) as server:
        client = grpcclient.InferenceServerClient(server.grpc_address)
        small = np.ones((1, 16), np.float32)
        assert client.infer("add_sub", add_sub_inputs(small, small)).as_numpy("OUTPUT0")[0, 0] == 2
        big = np.ones((1024, 16), np.float32)  # 2 x 64 KiB of inputs
        with pytest.raises(InferenceServerException) as info:
            client.infer("add_sub", add_sub_inputs(big, big))
        assert info.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        client.close()
