"""ModelStreamInfer as Triton answers it, on a real server in both layouts (one process,
and ``--frontends 1``: a front-end process before the engine): answers in request order
while the requests run concurrently, errors that name their request, and Triton's
``triton_final_response`` on every answer.

A request held at the gated backend's closed gate (``tests/gated.py``) stands in for a
slow model, so "the later requests finished first" is a state the test constructs.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from slipstream.protocol.proto import inference_pb2 as pb
from tests.gated import Gate, build_gated, gated_command, gated_input, wait_until
from tests.models import ADD_SUB_WIDTH, build_add_sub
from tests.utils import RemoteServer

SERVICE = "/inference.GRPCInferenceService/"
TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def gate(tmp_path_factory: pytest.TempPathFactory) -> Gate:
    return Gate(tmp_path_factory.mktemp("gate"))


@pytest.fixture(scope="module", params=[[], ["--frontends", "1"]], ids=["one", "split"])
def server(
    request: pytest.FixtureRequest, gate: Gate, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RemoteServer]:
    tmp = tmp_path_factory.mktemp("stream")
    repo = tmp / "models"
    build_add_sub(repo)
    build_gated(repo, "held", gate, {"max_batch_size": 1})
    with RemoteServer(repo, request.param, log_dir=tmp, command=gated_command()) as remote:
        yield remote


def add_sub_message(request_id: str, model: str = "add_sub", raw: bytes | None = None) -> Any:
    """A raw-stub request to add_sub ([1, ADD_SUB_WIDTH] FP32 ones); ``raw`` replaces
    INPUT1's bytes."""
    message = pb.ModelInferRequest(model_name=model, model_version="1", id=request_id)
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


def successes(server: RemoteServer, model: str) -> int:
    stats = server.http.get(f"/v2/models/{model}/stats").json()["model_stats"][0]
    return int(stats["inference_stats"]["success"]["count"])


def open_stream(server: RemoteServer, sent: queue.Queue[Any]) -> Any:
    """A raw ModelStreamInfer call sending what the test puts in ``sent`` (None ends it)."""
    channel = grpc.insecure_channel(server.grpc_address)
    stream = channel.stream_stream(
        SERVICE + "ModelStreamInfer",
        request_serializer=pb.ModelInferRequest.SerializeToString,
        response_deserializer=pb.ModelStreamInferResponse.FromString,
    )
    return channel, stream(iter(sent.get, None), timeout=TIMEOUT_S)


def test_answers_keep_request_order_behind_a_slow_request_and_errors_name_theirs(
    server: RemoteServer, gate: Gate
) -> None:
    sent: queue.Queue[Any] = queue.Queue()
    channel, call = open_stream(server, sent)
    before = successes(server, "add_sub")
    try:
        with gate.closed():
            runs = len(gate.runs())
            sent.put(held_message("r0", 7.0))
            gate.wait_runs(runs + 1)  # r0 is running, held at the gate
            sent.put(add_sub_message("r1"))
            sent.put(add_sub_message("r2", raw=b"\x00" * 3))  # 3 bytes where 64 are due
            sent.put(add_sub_message("r3", model="nosuch"))
            sent.put(add_sub_message("r4"))
            # r1 and r4 have run (r2 and r3 fail at once) while r0 is still held.
            wait_until(lambda: successes(server, "add_sub") >= before + 2, "r1 and r4 to run")
        sent.put(None)
        answers = list(call)
    finally:
        channel.close()
    responses = [answer.infer_response for answer in answers]
    assert [(r.id, r.model_name, r.model_version) for r in responses] == [
        ("r0", "held", "1"), ("r1", "add_sub", "1"), ("r2", "add_sub", "1"),
        ("r3", "nosuch", "1"), ("r4", "add_sub", "1"),
    ]  # fmt: skip
    assert [bool(answer.error_message) for answer in answers] == [False, False, True, True, False]
    assert "'INPUT1'" in answers[2].error_message
    assert "nosuch" in answers[3].error_message
    for response in responses:  # Triton's flag, on answers and errors alike
        assert response.parameters["triton_final_response"].bool_param


def test_failed_requests_are_answered_with_their_id_model_and_version(
    server: RemoteServer,
) -> None:
    sent: queue.Queue[Any] = queue.Queue()
    for message in (
        add_sub_message("bad-bytes", raw=b"\x00" * 3),
        add_sub_message("bad-model", model="nosuch"),
        held_message("bad-shape", 1.0),
    ):
        sent.put(message)
    sent.put(None)
    sent.queue[2].inputs[0].shape[:] = [2, 4]  # 16 bytes sent for a [2, 4] FP32 tensor
    channel, call = open_stream(server, sent)
    try:
        answers = list(call)
    finally:
        channel.close()
    assert all(answer.error_message for answer in answers)
    named = {(a.infer_response.id, a.infer_response.model_name) for a in answers}
    assert named == {("bad-bytes", "add_sub"), ("bad-model", "nosuch"), ("bad-shape", "held")}
    assert {a.infer_response.model_version for a in answers} == {"1"}


def test_many_requests_to_one_model_are_answered_in_order(server: RemoteServer) -> None:
    sent: queue.Queue[Any] = queue.Queue()
    for index in range(300):
        sent.put(add_sub_message(str(index)))
    sent.put(None)
    channel, call = open_stream(server, sent)
    try:
        answers = list(call)
    finally:
        channel.close()
    assert [a.error_message for a in answers] == [""] * 300
    assert [a.infer_response.id for a in answers] == [str(index) for index in range(300)]


def test_tritonclient_reading_until_the_final_response_gets_one_answer_per_request(
    server: RemoteServer,
) -> None:
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_address)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    a = np.arange(ADD_SUB_WIDTH, dtype=np.float32).reshape(1, -1)
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = grpcclient.InferInput(name, [1, ADD_SUB_WIDTH], "FP32")
        tensor.set_data_from_numpy(a)
        inputs.append(tensor)
    try:
        for request_id in ("a", "b"):
            client.async_stream_infer(
                "add_sub", inputs, request_id=request_id, enable_empty_final_response=True
            )
            # The loop a decoupled-aware client runs: read until the final answer.
            received = []
            while True:
                result, error = answers.get(timeout=TIMEOUT_S)
                assert error is None
                received.append(result)
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
            assert [r.get_response().id for r in received] == [request_id]
            np.testing.assert_array_equal(received[0].as_numpy("OUTPUT0"), a + a)
        # A non-decoupled model's one answer is its final one: no empty answer follows.
        with pytest.raises(queue.Empty):
            answers.get(timeout=0.3)
    finally:
        client.stop_stream()
        client.close()


def test_log_has_no_stream_errors(server: RemoteServer) -> None:
    """Failed requests are the clients' mistakes: none is logged as a server fault."""
    assert "ModelStreamInfer request failed" not in Path(server.log_path).read_text()
