"""A gRPC request message that is not valid protobuf is the client's mistake: answered
INVALID_ARGUMENT naming the message expected, nothing logged as a server fault, and the
calls around it served. grpc itself answers UNKNOWN and logs a traceback at ERROR."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest

from slipstream.protocol.proto import inference_pb2 as pb
from slipstream.server.grpc_front_door import GrpcFrontDoor, MessageGuard
from tests.utils import RemoteServer

pytestmark = pytest.mark.timeout(30)

SERVICE = "inference.GRPCInferenceService"
GARBAGE = b"\xff\xff\xff\xff\x0f not protobuf"


async def live(request: pb.ServerLiveRequest, context: Any) -> pb.ServerLiveResponse:
    return pb.ServerLiveResponse(live=True)


async def echo_ids(requests: AsyncIterator[pb.ModelInferRequest], context: Any) -> Any:
    async for request in requests:
        yield pb.ModelInferResponse(id=request.id).SerializeToString()


def handlers() -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "ServerLive": grpc.unary_unary_rpc_method_handler(
                live,
                request_deserializer=pb.ServerLiveRequest.FromString,
                response_serializer=pb.ServerLiveResponse.SerializeToString,
            ),
            "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(
                echo_ids, request_deserializer=pb.ModelInferRequest.FromString
            ),
        },
    )


@pytest.fixture(params=["guard", "guard+front door"])
async def address(request: pytest.FixtureRequest) -> AsyncIterator[str]:
    interceptors: list[grpc.aio.ServerInterceptor] = [MessageGuard()]
    if request.param == "guard+front door":  # the front door makes a handler per call
        interceptors.append(GrpcFrontDoor(None, None, access_log=True))
    server = grpc.aio.server(interceptors=interceptors)
    server.add_generic_rpc_handlers((handlers(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(0)


async def test_a_malformed_unary_message_is_invalid_argument_and_the_next_call_served(
    address: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        raw = channel.unary_unary(f"/{SERVICE}/ServerLive")
        with caplog.at_level(logging.ERROR), pytest.raises(grpc.aio.AioRpcError) as refused:
            await raw(GARBAGE, timeout=5)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid protobuf ServerLiveRequest" in (refused.value.details() or "")
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        for _ in range(2):  # the handler, wrapped once, serves the calls after
            assert pb.ServerLiveResponse.FromString(await raw(b"", timeout=5)).live


async def test_a_malformed_message_mid_stream_ends_it_invalid_argument(address: str) -> None:
    good = [pb.ModelInferRequest(id=str(i)).SerializeToString() for i in range(2)]
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.stream_stream(f"/{SERVICE}/ModelStreamInfer")(iter([*good, GARBAGE]))
        answered = [pb.ModelInferResponse.FromString(a).id async for a in _until_error(call)]
        assert answered == ["0", "1"]
        assert await call.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid protobuf ModelInferRequest" in (await call.details() or "")


async def _until_error(call: Any) -> AsyncIterator[bytes]:
    try:
        async for answer in call:
            yield answer
    except grpc.aio.AioRpcError:
        return


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    root = tmp_path_factory.mktemp("grpc_malformed")
    (root / "repo").mkdir()
    with RemoteServer(root / "repo", log_dir=root, wait_for="live") as server:
        yield server


def test_slipstream_serve_refuses_a_malformed_model_infer_without_logging_a_fault(
    served: RemoteServer,
) -> None:
    with grpc.insecure_channel(served.grpc_address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            channel.unary_unary(f"/{SERVICE}/ModelInfer")(GARBAGE, timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        reply = channel.unary_unary(f"/{SERVICE}/ServerLive")(b"", timeout=10)
        assert pb.ServerLiveResponse.FromString(reply).live
    assert "Traceback" not in served.log_text(), served.log_tail()
