"""The gRPC front door on ModelStreamInfer and its access log, on a real server: a key's
concurrency limit holds over a stream's messages until each is answered, and each message
is logged when answered, with its own status, latency and bytes.

A message held at the gated backend's closed gate (``tests/gated.py``) stands in for a
slow model, so "one message is still running" is a state the test constructs.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import orjson
import pytest

from slipstream.protocol.proto import inference_pb2 as pb
from slipstream.security.keys import KeyLimits, KeyRing
from tests.gated import Gate, build_gated, gated_command, gated_input, wait_until
from tests.models import ADD_SUB_WIDTH, build_add_sub
from tests.utils import RemoteServer

SERVICE = "/inference.GRPCInferenceService/"
TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def gate(tmp_path_factory: pytest.TempPathFactory) -> Gate:
    return Gate(tmp_path_factory.mktemp("gate"))


@pytest.fixture(scope="module")
def secrets_(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("stream_keys")
    ring = KeyRing.load(root / "keys.json", missing_ok=True)
    made = {
        "admin": ring.create("ops", "admin")[0],
        "single": ring.create("single", "infer", limits=KeyLimits(max_concurrent=1))[0],
    }
    ring.save()
    made["file"] = str(root / "keys.json")
    return made


@pytest.fixture(scope="module")
def server(
    gate: Gate, secrets_: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RemoteServer]:
    tmp = tmp_path_factory.mktemp("stream_door")
    repo = tmp / "models"
    build_add_sub(repo)
    build_gated(repo, "held", gate, {"max_batch_size": 1})
    args = ["--auth-file", secrets_["file"], "--access-log"]
    with RemoteServer(repo, args, log_dir=tmp, command=gated_command()) as remote:
        yield remote


def add_sub_message(request_id: str, raw: bytes | None = None) -> Any:
    message = pb.ModelInferRequest(model_name="add_sub", model_version="1", id=request_id)
    ones = np.ones((1, ADD_SUB_WIDTH), np.float32).tobytes()
    for name in ("INPUT0", "INPUT1"):
        message.inputs.add(name=name, datatype="FP32", shape=[1, ADD_SUB_WIDTH])
        message.raw_input_contents.append(ones)
    if raw is not None:
        message.raw_input_contents[1] = raw
    return message


def held_message(request_id: str, tag: float) -> Any:
    message = pb.ModelInferRequest(model_name="held", model_version="1", id=request_id)
    message.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4])
    message.raw_input_contents.append(gated_input(tag).tobytes())
    return message


def open_stream(
    server: RemoteServer, sent: queue.Queue[Any], metadata: list[Any], timeout_s: float = TIMEOUT_S
) -> Any:
    channel = grpc.insecure_channel(server.grpc_address)
    stream = channel.stream_stream(
        SERVICE + "ModelStreamInfer",
        request_serializer=pb.ModelInferRequest.SerializeToString,
        response_deserializer=pb.ModelStreamInferResponse.FromString,
    )
    return channel, stream(iter(sent.get, None), metadata=metadata, timeout=timeout_s)


def unary_ok(server: RemoteServer, secret: str) -> bool:
    with grpc.insecure_channel(server.grpc_address) as channel:
        try:
            channel.unary_unary(SERVICE + "ModelInfer")(
                add_sub_message("u").SerializeToString(),
                metadata=[("authorization", f"Bearer {secret}")], timeout=TIMEOUT_S,
            )  # fmt: skip
        except grpc.RpcError:
            return False
    return True


def access_lines(server: RemoteServer, rid: str, count: int) -> list[dict[str, Any]]:
    def found() -> list[dict[str, Any]]:
        return [orjson.loads(line) for line in server.log_text().splitlines()
                if line.startswith('{"time"') and f'"request_id":"{rid}"' in line]  # fmt: skip

    wait_until(lambda: len(found()) >= count, f"{count} access-log lines of {rid}")
    return found()


def test_a_stream_message_holds_its_concurrency_slot_until_it_is_answered(
    server: RemoteServer, gate: Gate, secrets_: dict[str, str]
) -> None:
    """Audit defect 3: each message gave its slot back once admitted, so a key limited
    to one request in flight ran any number at once over one stream."""
    metadata = [("authorization", f"Bearer {secrets_['single']}")]
    # One at a time (the next sent once the last is answered) is within the limit.
    sent: queue.Queue[Any] = queue.Queue()
    channel, call = open_stream(server, sent, metadata)
    try:
        for index in range(5):
            sent.put(add_sub_message(f"s{index}"))
            answer = next(call)
            assert not answer.error_message and answer.infer_response.id == f"s{index}"
        sent.put(None)
        assert list(call) == []
    finally:
        channel.close()
    # A second message while the first runs is one too many.
    sent = queue.Queue()
    # Refused at once; a server that let h1 through would keep the stream open, held
    # behind h0, until this deadline.
    channel, call = open_stream(server, sent, metadata, timeout_s=5.0)
    try:
        with gate.closed():
            runs = len(gate.runs())
            sent.put(held_message("h0", 3.0))
            gate.wait_runs(runs + 1)  # h0 is running, held at the gate
            sent.put(add_sub_message("h1"))
            with pytest.raises(grpc.RpcError) as refused:
                list(call)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "concurrency" in str(refused.value.trailing_metadata())
            assert not unary_ok(server, secrets_["single"])  # h0 still holds the slot
    finally:
        sent.put(None)
        channel.close()
    # The gate open, h0 ends and its slot is given back.
    wait_until(lambda: unary_ok(server, secrets_["single"]), "the slot of h0 given back")


def test_stream_messages_are_logged_when_answered_with_their_status_and_bytes(
    server: RemoteServer, gate: Gate, secrets_: dict[str, str]
) -> None:
    """Audit defect 7: a stream's messages were logged at admission (status OK, the
    admission's latency, whatever the answer) and every gRPC line had bytes_out 0."""
    metadata = [("authorization", f"Bearer {secrets_['admin']}"), ("x-request-id", "logged")]
    sent: queue.Queue[Any] = queue.Queue()
    channel, call = open_stream(server, sent, metadata)
    try:
        with gate.closed():
            runs = len(gate.runs())
            sent.put(held_message("slow", 5.0))
            gate.wait_runs(runs + 1)
            time.sleep(0.3)  # what its latency must include
        sent.put(add_sub_message("bad", raw=b"\x00" * 3))  # 3 bytes where 64 are due
        sent.put(add_sub_message("good"))
        sent.put(None)
        answers = list(call)
    finally:
        channel.close()
    assert [bool(answer.error_message) for answer in answers] == [False, True, False]
    lines = access_lines(server, "logged", 3)
    assert [line["model"] for line in lines] == ["held", "add_sub", "add_sub"]
    assert [line["status"] for line in lines] == ["OK", "INVALID_ARGUMENT", "OK"]
    assert lines[0]["latency_ms"] >= 300
    for line, answer in zip(lines, answers, strict=True):
        assert line["bytes_out"] == answer.ByteSize() > 0, line
    # A unary call's line counts its reply too.
    with grpc.insecure_channel(server.grpc_address) as unary_channel:
        reply = unary_channel.unary_unary(SERVICE + "ModelMetadata")(
            pb.ModelMetadataRequest(name="add_sub").SerializeToString(),
            metadata=[("authorization", secrets_["admin"]), ("x-request-id", "unary-bytes")],
        )
    (line,) = access_lines(server, "unary-bytes", 1)
    assert line["bytes_out"] == len(reply) > 0
