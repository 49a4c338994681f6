"""A runtime error caused by the request's data is the client's 400, not a 500.

The model is a mean-of-embeddings ONNX graph (a Gather over a 10-row table): a token id
past the table passes every check the model's config allows (INT64, any length) and
only ONNX Runtime refuses it, when it runs. Triton answers that with the runtime's
message and a client error; so does Slipstream, over HTTP and gRPC, and a batch holding
one such request still answers the others.

A second model adds a table of position biases, as an encoder does: a sequence longer
than the table, and inputs whose lengths differ where the model names one dimension
for both, are the client's errors too (ONNX Runtime reports the first as a FAIL, the
status it also gives its own faults).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.models import build_mean_embedding, build_positions, mean_embedding, write_config
from tests.utils import RemoteServer

TABLE = np.arange(40, dtype=np.float32).reshape(10, 4)
# What ONNX Runtime says of a Gather index past a 10-row table.
ORT_MESSAGE = "indices element out of data bounds, idx=10"
# The position table's length: sequences of other lengths (but 1) are refused.
POSITIONS = 4
# Requests sent together into one batch: the queue holds them until BATCH of them wait.
BATCH = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    tmp = tmp_path_factory.mktemp("data_errors")
    repo = tmp / "models"
    build_mean_embedding(repo, "embed", TABLE)
    write_config(
        repo,
        "embed",
        {
            "max_batch_size": 8,
            "input": [
                {"name": "input_ids", "data_type": "TYPE_INT64", "dims": [3]},
                {"name": "attention_mask", "data_type": "TYPE_INT64", "dims": [3]},
            ],
            "output": [{"name": "embedding", "data_type": "TYPE_FP32", "dims": [4]}],
            # Held for up to 30 s until BATCH requests wait, so they share one batch.
            "dynamic_batching": {
                "preferred_batch_size": [BATCH],
                "max_queue_delay_microseconds": 30_000_000,
            },
        },
    )
    build_positions(repo, "positions", POSITIONS)
    write_config(repo, "positions", {"max_batch_size": 8})
    with RemoteServer(repo, log_dir=tmp) as remote:
        yield remote


def _body(ids: list[int]) -> dict[str, object]:
    return {
        "inputs": [
            {"name": "input_ids", "shape": [1, 3], "datatype": "INT64", "data": ids},
            {"name": "attention_mask", "shape": [1, 3], "datatype": "INT64", "data": [1, 1, 1]},
        ]
    }


def _post(server: RemoteServer, ids: list[int]) -> httpx.Response:
    return httpx.post(server.url("/v2/models/embed/infer"), json=_body(ids), timeout=60)


def _send_batch(server: RemoteServer, requests: list[list[int]]) -> list[httpx.Response]:
    assert len(requests) == BATCH
    with ThreadPoolExecutor(BATCH) as pool:
        return list(pool.map(lambda ids: _post(server, ids), requests))


def test_http_token_past_the_vocabulary_is_a_400_with_the_runtime_message(
    server: RemoteServer,
) -> None:
    responses = _send_batch(server, [[1, 2, 10]] * BATCH)
    for response in responses:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error.startswith("the model refused the request's data: ")
        assert ORT_MESSAGE in error
        assert "ONNXRuntimeError" not in error  # ORT's status prefix is not the message


def test_one_bad_request_does_not_fail_its_batch(server: RemoteServer) -> None:
    good = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    before = _batches(server)
    responses = _send_batch(server, [good[0], [0, 10, 0], good[1], good[2]])
    statuses = [r.status_code for r in responses]
    assert statuses == [200, 400, 200, 200], [r.text for r in responses]
    assert ORT_MESSAGE in responses[1].json()["error"]
    for ids, response in zip(good, [responses[0], responses[2], responses[3]], strict=True):
        output = response.json()["outputs"][0]
        np.testing.assert_allclose(output["data"], mean_embedding(TABLE, ids), rtol=1e-6)
    # The four went to the model as one batch, then were rerun one by one.
    assert _batches(server) == {**before, BATCH: before.get(BATCH, 0) + 1}


def test_grpc_token_past_the_vocabulary_is_invalid_argument(server: RemoteServer) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_address)
    inputs = []
    for name, values in (("input_ids", [[3, 10, 4]]), ("attention_mask", [[1, 1, 1]])):
        tensor = grpcclient.InferInput(name, [1, 3], "INT64")
        tensor.set_data_from_numpy(np.array(values, dtype=np.int64))
        inputs.append(tensor)
    # A lone request waits for a batch of BATCH: send BATCH of them on the stream.
    results: list[object] = []
    client.start_stream(callback=lambda result, error: results.append(error or result))
    try:
        for index in range(BATCH):
            client.async_stream_infer("embed", inputs, request_id=str(index))
    finally:
        client.stop_stream()  # waits for every answer
    assert len(results) == BATCH
    for error in results:
        assert isinstance(error, InferenceServerException)
        assert ORT_MESSAGE in str(error.message())
    with pytest.raises(InferenceServerException) as unary, ThreadPoolExecutor(BATCH) as pool:
        for done in [pool.submit(client.infer, "embed", inputs) for _ in range(BATCH)]:
            done.result()
    assert unary.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert ORT_MESSAGE in str(unary.value.message())
    client.close()


def _batches(server: RemoteServer) -> dict[int, int]:
    """Batch size -> how many batches of it the model ran."""
    stats = httpx.get(server.url("/v2/models/embed/stats"), timeout=30).json()
    return {
        batch["batch_size"]: batch["compute_infer"]["count"]
        for batch in stats["model_stats"][0]["batch_stats"]
    }


def _positions(server: RemoteServer, ids: list[int], mask: list[int]) -> httpx.Response:
    body = {
        "inputs": [
            {"name": "input_ids", "shape": [1, len(ids)], "datatype": "INT64", "data": ids},
            {"name": "attention_mask", "shape": [1, len(mask)], "datatype": "INT64", "data": mask},
        ]
    }
    return httpx.post(server.url("/v2/models/positions/infer"), json=body, timeout=60)


def test_a_sequence_past_the_position_table_is_a_400(server: RemoteServer) -> None:
    ok = _positions(server, [1, 2, 3, 4], [1, 1, 1, 0])
    assert ok.status_code == 200, ok.text
    np.testing.assert_allclose(ok.json()["outputs"][0]["data"], [1.0, 2.1, 3.2, 0.0], rtol=1e-6)
    for length in (POSITIONS + 2, 0):
        response = _positions(server, [1] * length, [1] * length)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error.startswith("the model refused the request's data: Add node"), error
        if length:
            broadcast = "Attempting to broadcast an axis by a dimension other than 1"
            assert f"{broadcast}. {POSITIONS} by {length}" in error
        # The kernel's words, without ORT's status, source file or C++ function.
        assert "ONNXRuntimeError" not in error and "onnxruntime::" not in error
        assert ".h:" not in error


def test_inputs_that_disagree_on_a_named_dimension_are_a_400(server: RemoteServer) -> None:
    response = _positions(server, [1, 2, 3, 4], [1, 1, 1])
    assert response.status_code == 400, response.text
    assert response.json()["error"] == (
        "input 'attention_mask': dimension 1 is 3, but the model names it 'tokens', which "
        "is 4 in input 'input_ids' (dimension 1)"
    )
    client = grpcclient.InferenceServerClient(server.grpc_address)
    inputs = []
    for name, values in (("input_ids", [[1, 2, 3, 4, 5, 6]]), ("attention_mask", [[1] * 6])):
        tensor = grpcclient.InferInput(name, [1, 6], "INT64")
        tensor.set_data_from_numpy(np.array(values, dtype=np.int64))
        inputs.append(tensor)
    with pytest.raises(InferenceServerException) as refused:
        client.infer("positions", inputs)
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "Attempting to broadcast" in str(refused.value.message())
    client.close()
