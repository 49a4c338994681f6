"""A generative model on the V2 routes, as Triton's vLLM backend serves one, driven as
Triton users drive it: curl-like httpx on /generate and /generate_stream, tritonclient
over HTTP and gRPC (ModelStreamInfer with text_input, stream and sampling_parameters, as
genai-perf's triton service kind sends them), in one process and in the split layout.

Greedy texts are compared with what /v1/completions answers for the same prompt: the two
routes share the LLM lane's generation.
"""

from __future__ import annotations

import json
import os
import queue
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.llm_models import smollm2_gguf
from tests.models import write_config
from tests.utils import RemoteServer

pytestmark = [pytest.mark.timeout(240)]

MODEL = "smol"
SLEEPY = "sleepy"
PROMPT = "The capital of France is"
STEPS = 8


@pytest.fixture(scope="module", params=["one", "split"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RemoteServer]:
    repo = tmp_path_factory.mktemp("llm-v2")
    (repo / MODEL / "1").mkdir(parents=True)
    os.link(smollm2_gguf(), repo / MODEL / "1" / "model.gguf")
    write_config(repo, MODEL, {"backend": "llama_cpp", "generation": {
        "max_model_len": 512, "max_num_seqs": 4, "threads": 1}})  # fmt: skip
    # The same model again, unloaded after a moment idle (scale to zero).
    (repo / SLEEPY / "1").mkdir(parents=True)
    os.link(smollm2_gguf(), repo / SLEEPY / "1" / "model.gguf")
    write_config(repo, SLEEPY, {"backend": "llama_cpp", "idle_unload_seconds": 0.5,
                                "generation": {"max_model_len": 256, "threads": 1}})  # fmt: skip
    args = ["--frontends", "1"] if request.param == "split" else []
    with RemoteServer(repo, args, log_dir=repo) as running:
        yield running


@pytest.fixture(scope="module")
def completion(server: RemoteServer) -> str:
    """/v1/completions' greedy text of PROMPT, STEPS tokens."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": STEPS, "temperature": 0}
    reply = server.http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    text: str = reply.json()["choices"][0]["text"]
    assert text
    return text


def _generate_body(**parameters: Any) -> dict[str, Any]:
    sampling = {"temperature": 0, "max_tokens": STEPS}
    return {"text_input": PROMPT, "parameters": {**sampling, **parameters}}


# -- how the model appears ---------------------------------------------------------------


def test_metadata_config_index_and_ready_show_a_vllm_backend_model(server: RemoteServer) -> None:
    http = httpclient.InferenceServerClient(server.http_address)
    grpc = grpcclient.InferenceServerClient(server.grpc_address)
    try:
        assert http.is_model_ready(MODEL) and grpc.is_model_ready(MODEL)
        for metadata in (http.get_model_metadata(MODEL),
                         grpc.get_model_metadata(MODEL, as_json=True)):  # fmt: skip
            assert metadata["platform"] == "vllm" and metadata["versions"] == ["1"]
            inputs = {t["name"]: (t["datatype"], [int(d) for d in t["shape"]])
                      for t in metadata["inputs"]}  # fmt: skip
            assert inputs["text_input"] == ("BYTES", [1])
            assert inputs["stream"] == ("BOOL", [1])
            assert inputs["sampling_parameters"] == ("BYTES", [1])
            assert inputs["exclude_input_in_output"] == ("BOOL", [1])
            assert metadata["outputs"][0]["name"] == "text_output"
        for config in (http.get_model_config(MODEL),
                       grpc.get_model_config(MODEL, as_json=True)["config"]):  # fmt: skip
            assert config["backend"] == "vllm"
            assert config["model_transaction_policy"] == {"decoupled": True}
            assert int(config.get("max_batch_size", 0)) == 0
            assert config["parameters"]["slipstream_backend"] == {"string_value": "llama_cpp"}
            optional = {t["name"]: t.get("optional", False) for t in config["input"]}
            assert optional["text_input"] is False and optional["stream"] is True
        index = http.get_model_repository_index()
        assert {"name": MODEL, "version": "1", "state": "READY"}.items() <= next(
            entry for entry in index if entry["name"] == MODEL
        ).items()
        stats = http.get_inference_statistics(MODEL)["model_stats"]
        assert stats[0]["name"] == MODEL
    finally:
        http.close()
        grpc.close()


# -- the generate extension --------------------------------------------------------------


def test_generate_answers_the_completion_after_its_prompt(
    server: RemoteServer, completion: str
) -> None:
    reply = server.http.post(f"/v2/models/{MODEL}/generate", json=_generate_body(stream=False))
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert (answer["model_name"], answer["model_version"]) == (MODEL, "1")
    assert answer["text_output"] == PROMPT + completion  # the backend's default: prompt first
    body = _generate_body(stream=False, exclude_input_in_output=True)
    body["parameters"]["return_finish_reason"] = True
    body["parameters"]["return_num_output_tokens"] = True
    answer = server.http.post(f"/v2/models/{MODEL}/generate", json=body).json()
    assert answer["text_output"] == completion
    assert answer["finish_reason"] == "length" and answer["num_output_tokens"] == STEPS


def test_generate_stream_sends_each_new_piece_of_text(
    server: RemoteServer, completion: str
) -> None:
    with server.http.stream(
        "POST", f"/v2/models/{MODEL}/generate_stream", json=_generate_body(stream=True)
    ) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[5:]) for line in reply.iter_lines() if line.startswith("data:")]
    assert len(events) > 1
    assert all(event["model_name"] == MODEL for event in events)
    assert "".join(event["text_output"] for event in events) == completion


def test_a_client_leaving_generate_stream_stops_its_generation(server: RemoteServer) -> None:
    body = {"text_input": "Tell me a long story about", "parameters": {
        "stream": True, "max_tokens": 400, "ignore_eos": True}}  # fmt: skip
    before = _generated_tokens(server)
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", server.url(f"/v2/models/{MODEL}/generate_stream"), json=body) as answer,
    ):
        events = (line for line in answer.iter_lines() if line.startswith("data:"))
        for _ in range(3):
            next(events)
    deadline = time.monotonic() + 10
    while _generated_tokens(server) == before:  # counted when the sequence ends
        assert time.monotonic() < deadline, "the sequence never ended"
        time.sleep(0.05)
    time.sleep(1.0)  # a sequence still running would add ~100 tokens a second here
    assert 3 <= _generated_tokens(server) - before < 80


def _generated_tokens(server: RemoteServer) -> float:
    text = server.http.get("/metrics").text
    found = re.search(rf'slipstream_llm_generation_tokens_total\{{model="{MODEL}"\}} (\S+)', text)
    return float(found.group(1)) if found else 0.0


# -- tritonclient -------------------------------------------------------------------------


def _inputs(mod: Any, stream: bool, sampling: dict[str, Any], exclude: bool | None) -> list[Any]:
    values: dict[str, tuple[np.ndarray, str]] = {
        "text_input": (np.array([PROMPT.encode()], dtype=object), "BYTES"),
        "stream": (np.array([stream]), "BOOL"),
        "sampling_parameters": (np.array([json.dumps(sampling).encode()], dtype=object), "BYTES"),
    }
    if exclude is not None:
        values["exclude_input_in_output"] = (np.array([exclude]), "BOOL")
    tensors = []
    for name, (array, datatype) in values.items():
        tensor = mod.InferInput(name, [1], datatype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def test_grpc_model_stream_infer_streams_text_as_genai_perf_asks(
    server: RemoteServer, completion: str
) -> None:
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_address)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        sampling = {"temperature": 0, "max_tokens": STEPS}
        client.async_stream_infer(MODEL, _inputs(grpcclient, True, sampling, True),
                                  request_id="s", enable_empty_final_response=True)  # fmt: skip
        client.async_stream_infer(MODEL, _inputs(grpcclient, False, sampling, None),
                                  request_id="w")  # fmt: skip
        texts: dict[str, list[str]] = {"s": [], "w": []}
        finals = 0
        while finals < 2:
            result, error = answers.get(timeout=60)
            assert error is None, error
            response = result.get_response()
            if response.outputs:
                texts[response.id].append(result.as_numpy("text_output")[0].decode())
            finals += response.parameters["triton_final_response"].bool_param
    finally:
        client.stop_stream()
        client.close()
    assert len(texts["s"]) > 1 and "".join(texts["s"]) == completion
    assert texts["w"] == [PROMPT + completion]  # one answer, the prompt first


def test_a_grpc_stream_closed_mid_generation_stops_it(server: RemoteServer) -> None:
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_address)
    before = _generated_tokens(server)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        sampling = {"max_tokens": 400, "ignore_eos": True}
        client.async_stream_infer(MODEL, _inputs(grpcclient, True, sampling, True))
        for _ in range(3):
            _, error = answers.get(timeout=60)
            assert error is None, error
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    deadline = time.monotonic() + 10
    while _generated_tokens(server) == before:
        assert time.monotonic() < deadline, "the sequence never ended"
        time.sleep(0.05)
    time.sleep(1.0)
    assert 3 <= _generated_tokens(server) - before < 80


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_unary_infer_answers_one_whole_text(
    server: RemoteServer, completion: str, protocol: str
) -> None:
    mod: Any = httpclient if protocol == "http" else grpcclient
    address = server.http_address if protocol == "http" else server.grpc_address
    client = mod.InferenceServerClient(address)
    try:
        sampling = {"temperature": 0, "max_tokens": STEPS}
        result = client.infer(MODEL, _inputs(mod, False, sampling, True), request_id="u")
        assert result.as_numpy("text_output").tolist() == [completion.encode()]
        response = result.get_response()
        assert (response["id"] if protocol == "http" else response.id) == "u"
        with pytest.raises(InferenceServerException) as info:  # a stream has many answers
            client.infer(MODEL, _inputs(mod, True, sampling, True))
        assert "generate_stream" in info.value.message()
    finally:
        client.close()


# -- bad requests ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"parameters": {"max_tokens": 2}}, "text_input: missing"),
        ({"text_input": 7}, "text_input"),
        ({"text_input": "x", "sampling_parameters": "{not json"}, "sampling_parameters: not valid"),
        ({"text_input": "x", "sampling_parameters": "[1]"}, "sampling_parameters: expected a JSON"),
        ({"text_input": "x", "parameters": {"tempurature": 0}}, "parameters.tempurature"),
        ({"text_input": "x", "parameters": {"temperature": "hot"}}, "parameters.temperature"),
        ({"text_input": "x", "sampling_parameters": '{"top_p": 5}'},
         "sampling_parameters.top_p"),
        ({"text_input": "x", "parameters": {"min_p": 1.5}}, "parameters.min_p"),
        ({"text_input": "x", "parameters": {"bad_words": ["x"]}}, "parameters.bad_words"),
        ({"text_input": "x", "parameters": {"stream": True, "exclude_input_in_output": False}},
         "exclude_input_in_output"),
        ({"text_input": "x", "parameters": {"stream": True}}, "generate_stream"),
        ({"text_input": "x", "parameters": {"max_tokens": 5000}}, "max_tokens"),
    ],
)  # fmt: skip
def test_bad_generate_requests_are_400_naming_the_field(
    server: RemoteServer, body: dict[str, Any], named: str
) -> None:
    reply = server.http.post(f"/v2/models/{MODEL}/generate", json=body)
    assert reply.status_code == 400, reply.text
    assert named in reply.json()["error"]


def test_bad_infer_inputs_are_400_naming_them(server: RemoteServer) -> None:
    client = httpclient.InferenceServerClient(server.http_address)
    try:
        wrong = httpclient.InferInput("text_input", [1], "FP32")
        wrong.set_data_from_numpy(np.array([1.0], dtype=np.float32))
        with pytest.raises(InferenceServerException, match="text_input: expected datatype BYTES"):
            client.infer(MODEL, [wrong])
        flag = httpclient.InferInput("stream", [1], "INT32")
        flag.set_data_from_numpy(np.array([1], dtype=np.int32))
        text = _inputs(httpclient, False, {}, None)[0]
        with pytest.raises(InferenceServerException, match="stream: expected datatype BOOL"):
            client.infer(MODEL, [text, flag])
        other = httpclient.InferInput("INPUT0", [1], "FP32")
        other.set_data_from_numpy(np.array([1.0], dtype=np.float32))
        with pytest.raises(InferenceServerException, match="INPUT0: model 'smol' has no such"):
            client.infer(MODEL, [text, other])
    finally:
        client.close()


# -- statistics and scale to zero ------------------------------------------------------------


def test_statistics_count_the_v2_requests(server: RemoteServer) -> None:
    grpc = grpcclient.InferenceServerClient(server.grpc_address)
    try:
        before = grpc.get_inference_statistics(MODEL, as_json=True)["model_stats"][0]
        reply = server.http.post(f"/v2/models/{MODEL}/generate", json=_generate_body())
        assert reply.status_code == 200
        after = grpc.get_inference_statistics(MODEL, as_json=True)["model_stats"][0]
        everything = grpc.get_inference_statistics(as_json=True)["model_stats"]
    finally:
        grpc.close()
    assert int(after["inference_count"]) == int(before.get("inference_count", 0)) + 1
    assert int(after["inference_stats"]["success"]["count"]) >= 1
    assert MODEL in [entry["name"] for entry in everything]


def test_statistics_count_each_streamed_answer_at_its_index(server: RemoteServer) -> None:
    def responses() -> dict[str, Any]:
        reply = server.http.get(f"/v2/models/{MODEL}/stats")
        found: dict[str, Any] = reply.json()["model_stats"][0]["response_stats"]
        return found

    def added(before: dict[str, Any], after: dict[str, Any], name: str) -> dict[str, int]:
        return {index: figures[name]["count"] - before.get(index, {}).get(name, {}).get("count", 0)
                for index, figures in after.items()}  # fmt: skip

    before = responses()
    with server.http.stream(
        "POST", f"/v2/models/{MODEL}/generate_stream", json=_generate_body(stream=True)
    ) as reply:
        events = [line for line in reply.iter_lines() if line.startswith("data:")]
    after = responses()
    sent = {str(index): 1 for index in range(len(events))}
    assert {i: n for i, n in added(before, after, "success").items() if n} == sent
    assert after["0"]["compute_output"]["ns"] > 0  # the answer made from the engine's text
    # A client leaving mid-stream: the answer it never read counts as cancelled.
    body = {"text_input": PROMPT, "parameters": {"stream": True, "max_tokens": 400,
                                                 "ignore_eos": True}}  # fmt: skip
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", server.url(f"/v2/models/{MODEL}/generate_stream"), json=body) as answer,
    ):
        lines = (line for line in answer.iter_lines() if line.startswith("data:"))
        for _ in range(3):
            next(lines)
    deadline = time.monotonic() + 10
    while not any(added(after, later := responses(), "cancel").values()):
        assert time.monotonic() < deadline, "the stream's cancellation was never counted"
        time.sleep(0.05)
    assert sum(added(after, later, "cancel").values()) == 1


def test_an_asleep_model_keeps_its_metadata_and_its_next_request_loads_it(
    server: RemoteServer,
) -> None:
    deadline = time.monotonic() + 30
    while (entry := _entry(server, SLEEPY)) != ("UNAVAILABLE", "idle"):
        assert time.monotonic() < deadline, f"{SLEEPY} never slept: {entry}"
        time.sleep(0.1)
    assert server.http.get(f"/v2/models/{SLEEPY}").json()["platform"] == "vllm"
    assert server.http.get(f"/v2/models/{SLEEPY}/ready").status_code == 200
    body = {"text_input": PROMPT, "parameters": {"temperature": 0, "max_tokens": 4}}
    reply = server.http.post(f"/v2/models/{SLEEPY}/generate", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["text_output"].startswith(PROMPT)


def _entry(server: RemoteServer, name: str) -> tuple[str, str]:
    index = server.http.post("/v2/repository/index", json={}).json()
    found = next(entry for entry in index if entry["name"] == name)
    return found.get("state", ""), found.get("reason", "")
