"""A decoupled Python model (Triton's ``model_transaction_policy { decoupled: true }``)
answers each request any number of times through its response sender, from a thread of
its own; tritonclient's gRPC stream reads the answers as they come, in one process and
with a front end before the engine. One-answer routes refuse such a model, naming the
stream."""

from __future__ import annotations

import json
import queue
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.models import build_repeat
from tests.utils import RemoteServer


def build_repository(root: Path) -> Path:
    repo = root / "repo"
    build_repeat(repo)
    return repo


@pytest.fixture(scope="module", params=["one", "split"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RemoteServer]:
    root = tmp_path_factory.mktemp("decoupled")
    # Split: a front end before the engine, and the gRPC front door (its access log),
    # which keeps a message's slot until its last answer.
    split = ["--frontends", "1", "--access-log"] if request.param == "split" else []
    args = ["--trust-pickle", *split]
    with RemoteServer(build_repository(root), args, log_dir=root) as running:
        yield running


def _stream(server: RemoteServer, counts: dict[str, int]) -> dict[str, list[Any]]:
    """Each request id's answers, in the order they came: I values, "final", or errors."""
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_address)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for request_id, count in counts.items():
            tensor = grpcclient.InferInput("N", [1], "INT32")
            tensor.set_data_from_numpy(np.array([count], dtype=np.int32))
            client.async_stream_infer(
                "repeat", [tensor], request_id=request_id, enable_empty_final_response=True
            )
        seen: dict[str, list[Any]] = {request_id: [] for request_id in counts}
        finals = 0
        while finals < len(counts):
            result, error = answers.get(timeout=30)
            if error is not None:
                # tritonclient gives an error answer no response: the only error here
                # is request "bad"'s, its final answer.
                seen["bad"].append(f"error: {error.message()}")
                finals += 1
                continue
            response = result.get_response()
            final = response.parameters["triton_final_response"].bool_param
            if response.outputs:
                seen[response.id].append(int(result.as_numpy("I")[0]))
            if final:
                seen[response.id].append("final")
                finals += 1
        return seen
    finally:
        client.stop_stream()
        client.close()


def test_a_decoupled_model_streams_each_requests_answers(server: RemoteServer) -> None:
    seen = _stream(server, {"a": 3, "b": 2, "none": 0})
    assert seen == {"a": [0, 1, 2, "final"], "b": [0, 1, "final"], "none": ["final"]}


def test_an_error_answer_reaches_its_request_only(server: RemoteServer) -> None:
    seen = _stream(server, {"bad": -1, "good": 1})
    assert seen["good"] == [0, "final"]
    assert len(seen["bad"]) == 1 and "N must be >= 0" in seen["bad"][0]


def test_one_answer_routes_refuse_a_decoupled_model_naming_the_stream(
    server: RemoteServer,
) -> None:
    body = {"inputs": [{"name": "N", "datatype": "INT32", "shape": [1], "data": [2]}]}
    answer = server.http.post("/v2/models/repeat/infer", json=body)
    assert answer.status_code == 400
    assert "decoupled" in answer.json()["error"] and "ModelStreamInfer" in answer.json()["error"]
    client = grpcclient.InferenceServerClient(server.grpc_address)
    try:
        tensor = grpcclient.InferInput("N", [1], "INT32")
        tensor.set_data_from_numpy(np.array([2], dtype=np.int32))
        with pytest.raises(InferenceServerException, match="ModelStreamInfer"):
            client.infer("repeat", [tensor])
        config = client.get_model_config("repeat", as_json=True)["config"]
        assert config["model_transaction_policy"] == {"decoupled": True}
    finally:
        client.close()


def test_generate_and_generate_stream_take_triton_s_flat_json(server: RemoteServer) -> None:
    # Every answer of a decoupled model, as server-sent events.
    with server.http.stream(
        "POST", "/v2/models/repeat/generate_stream", json={"N": 3, "id": "g"}
    ) as events:
        assert events.status_code == 200
        assert events.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in events.iter_lines() if line.startswith("data: ")]
    answers = [json.loads(line[len("data: ") :]) for line in lines]
    assert [a["I"] for a in answers] == [0, 1, 2]
    assert all(a["id"] == "g" and a["model_name"] == "repeat" for a in answers)
    # /generate answers once: a decoupled model's several answers are refused there.
    many = server.http.post("/v2/models/repeat/generate", json={"N": 2})
    assert many.status_code == 400 and "generate_stream" in many.json()["error"]
    one = server.http.post("/v2/models/repeat/generate", json={"N": 1})
    assert one.status_code == 200 and one.json()["I"] == 0
    # An error answer mid-stream is an event; a bad field the request's own 400.
    with server.http.stream("POST", "/v2/models/repeat/generate_stream", json={"N": -1}) as bad:
        text = "".join(bad.iter_text())
    assert "N must be >= 0" in text
    unknown = server.http.post("/v2/models/repeat/generate", json={"N": 1, "text": "x"})
    assert unknown.status_code == 400
    assert unknown.json()["error"].startswith("text: model 'repeat' has no such input")
    wrong = server.http.post("/v2/models/repeat/generate", json={"N": "three"})
    assert wrong.status_code == 400 and "N: input of datatype INT32 takes numbers" in wrong.text


def test_streamed_requests_count_as_successes_never_as_failures(server: RemoteServer) -> None:
    """ModelStreamInfer asks for one answer first, then streams a decoupled model's: the
    refusal of the first must not count as the request's failure."""

    def failures() -> list[str]:
        return [
            line for line in server.http.get("/metrics").text.splitlines()
            if line.startswith("nv_inference_request_failure{") and 'model="repeat"' in line
        ]  # fmt: skip

    before = server.http.get("/v2/models/repeat/stats").json()["model_stats"][0]
    failed_before = failures()
    seen = _stream(server, {"c": 2, "d": 1})
    assert seen == {"c": [0, 1, "final"], "d": [0, "final"]}
    after = server.http.get("/v2/models/repeat/stats").json()["model_stats"][0]
    stats, old = after["inference_stats"], before["inference_stats"]
    assert stats["fail"]["count"] == old["fail"]["count"]
    assert stats["success"]["count"] == old["success"]["count"] + 2
    assert failed_before and failures() == failed_before
