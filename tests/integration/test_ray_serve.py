"""Issue #17, part 1: ``slipstream serve --ray`` on a local Ray cluster, driven by the
stock tritonclient through Ray Serve's HTTP proxy (V2 JSON and binary tensors).

``add_sub``'s config.yaml asks for two replicas (``ray_serve:``): both answer, and both
report /metrics. ``slow`` autoscales from one replica to two under load and back to one
after it, with delays of a second (and Ray's metrics pushed every half second) so the
test takes seconds. ``smol`` (SmolLM2 on llama.cpp) answers the stock openai SDK on the
OpenAI routes. A Ray cluster starts in ~5-10 s on two cores: one server serves every case.
"""

from __future__ import annotations

import asyncio
import doctest
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.llm_models import smollm2_gguf
from tests.models import ADD_SUB_WIDTH, build_add_sub, run_onnx, write_config
from tests.utils import RemoteServer

pytest.importorskip("ray.serve")
httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("ray_repo") / "models"
    path = build_add_sub(repo)
    write_config(repo, "add_sub", {"ray_serve": {"min_replicas": 2, "max_replicas": 2,
                                                 "num_cpus": 0.25}})  # fmt: skip
    return path


# Autoscaling decided on metrics pushed every half second (Ray's default: 10 s).
FAST_METRICS = {"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
                "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
                "RAY_SERVE_MIN_HANDLE_METRICS_TIMEOUT_S": "1"}  # fmt: skip
SLOW_WIDTH, SLOW_LAYERS, SLOW_ROWS = 1024, 8, 16
MAX_REQUEST_BYTES = 1 << 20


def build_slow(repo: Path) -> None:
    """X FP32 [-1, 8] -> Y [-1, 1] through 8 tanh(x @ W) layers of 1024: ~0.27 GFLOP for
    16 rows, tens of ms on one core: requests that stay ongoing under load."""
    rng = np.random.default_rng(0)
    first = rng.standard_normal((8, SLOW_WIDTH)).astype(np.float32) / 3
    weight = rng.standard_normal((SLOW_WIDTH, SLOW_WIDTH)).astype(np.float32) / 32
    nodes = [helper.make_node("MatMul", ["X", "W0"], ["h0"])]
    for layer in range(1, SLOW_LAYERS + 1):
        nodes.append(helper.make_node("MatMul", [f"h{layer - 1}", "W"], [f"m{layer}"]))
        nodes.append(helper.make_node("Tanh", [f"m{layer}"], [f"h{layer}"]))
    nodes.append(helper.make_node("ReduceSum", [f"h{SLOW_LAYERS}", "axes"], ["Y"], keepdims=1))
    graph = helper.make_graph(
        nodes, "slow",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 1])],
        [numpy_helper.from_array(first, "W0"), numpy_helper.from_array(weight, "W"),
         numpy_helper.from_array(np.array([1], np.int64), "axes")],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = repo / "slow" / "1" / "model.onnx"
    path.parent.mkdir(parents=True)
    onnx.save(model, str(path))
    write_config(repo, "slow", {
        "instance_group": [{"count": 1}],
        "parameters": {"intra_op_thread_count": "1"},
        "ray_serve": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
                      "upscale_delay_s": 0.5, "downscale_delay_s": 1, "look_back_period_s": 1,
                      "num_cpus": 0.5},
    })  # fmt: skip


def add_smollm2(repo: Path) -> None:
    """SmolLM2 on llama.cpp: the OpenAI routes' application (/v1)."""
    (repo / "smol" / "1").mkdir(parents=True)
    os.link(smollm2_gguf(), repo / "smol" / "1" / "model.gguf")
    generation = {"num_blocks": 64, "max_model_len": 1024}
    write_config(repo, "smol", {"backend": "llama_cpp", "ray_serve": {"num_cpus": 0.5},
                                "generation": generation})  # fmt: skip


@pytest.fixture(scope="module")
def server(model_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    repo = model_file.parents[2]
    build_slow(repo)
    add_smollm2(repo)
    # Scale to zero: no replica while idle, one started by a request (#24).
    build_add_sub(repo, "napper")
    write_config(repo, "napper", {"ray_serve": {
        "min_replicas": 0, "max_replicas": 1, "target_ongoing_requests": 1,
        "upscale_delay_s": 0, "downscale_delay_s": 1, "look_back_period_s": 1, "num_cpus": 0.25,
    }})  # fmt: skip
    # Batches of more than Ray's default 5 requests per replica (max_ongoing_requests).
    build_add_sub(repo, "batched")
    write_config(repo, "batched", {
        "max_batch_size": 32, "dynamic_batching": {"max_queue_delay_microseconds": 200_000},
        "ray_serve": {"num_cpus": 0},  # the 2 CPUs Ray sees are the other models' (slow's 2nd)
    })  # fmt: skip
    log_dir = tmp_path_factory.mktemp("ray_logs")
    # A small --max-request-bytes: a body over it is cheap to send (#2 of the audit).
    with RemoteServer(repo, ["--ray", "--max-request-bytes", str(MAX_REQUEST_BYTES)],
                      log_dir=log_dir, startup_timeout_s=180,
                      env=FAST_METRICS) as running:  # fmt: skip
        yield running


def test_tritonclient_infers_through_ray_serve_as_through_slipstream(
    server: RemoteServer, model_file: Path
) -> None:
    client = httpclient.InferenceServerClient(server.http_address, network_timeout=60)
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("add_sub")
        assert client.get_model_metadata("add_sub")["versions"] == ["1"]
        a = np.random.default_rng(0).standard_normal((3, ADD_SUB_WIDTH)).astype(np.float32)
        b = np.ones_like(a)
        expected = run_onnx(model_file, {"INPUT0": a, "INPUT1": b})
        for binary in (False, True):
            inputs = [httpclient.InferInput(n, list(a.shape), "FP32") for n in ("INPUT0", "INPUT1")]
            inputs[0].set_data_from_numpy(a, binary_data=binary)
            inputs[1].set_data_from_numpy(b, binary_data=binary)
            outputs = [httpclient.InferRequestedOutput(n, binary_data=binary)
                       for n in ("OUTPUT0", "OUTPUT1")]  # fmt: skip
            result = client.infer("add_sub", inputs, outputs=outputs)
            for name in ("OUTPUT0", "OUTPUT1"):
                np.testing.assert_array_equal(result.as_numpy(name), expected[name])
    finally:
        client.close()


def test_the_models_replicas_share_its_requests(server: RemoteServer) -> None:
    seen = set()
    with httpx.Client(base_url=server.http_url, timeout=30) as client:
        for _ in range(40):
            reply = client.get("/v2/models/add_sub/ready")
            assert reply.status_code == 200
            seen.add(reply.headers["x-slipstream-replica"])
            if len(seen) == 2:
                break
    assert len(seen) == 2  # ray_serve: {min_replicas: 2, max_replicas: 2}


def test_the_deployment_options_follow_the_model_config() -> None:
    from slipstream.rayserve import app, options

    assert doctest.testmod(app).failed == 0
    assert doctest.testmod(options).failed == 0


def test_a_model_scales_from_one_replica_to_two_under_load_and_back_after(
    server: RemoteServer,
) -> None:
    def replicas_logged(count: int) -> int:
        word = "replica" if count == 1 else "replicas"
        return server.log_text().count(f"model slow: {count} {word} running")

    wait_log(server, lambda: replicas_logged(1) >= 1, "slow at 1 replica")
    body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [SLOW_ROWS, 8],
                        "data": [0.5] * (SLOW_ROWS * 8)}]}  # fmt: skip
    stop = threading.Event()
    failures: list[int] = []

    def load() -> None:
        with httpx.Client(base_url=server.http_url, timeout=60) as client:
            while not stop.is_set():
                reply = client.post("/v2/models/slow/infer", json=body)
                if reply.status_code != 200:
                    failures.append(reply.status_code)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        wait_log(server, lambda: replicas_logged(2) >= 1, "slow at 2 replicas under load")
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert not failures
    wait_log(server, lambda: replicas_logged(1) >= 2, "slow back at 1 replica after the load")


def test_a_model_at_zero_replicas_is_woken_by_a_request_and_goes_back_to_zero(
    server: RemoteServer,
) -> None:
    def logged(count: int) -> int:
        word = "replica" if count == 1 else "replicas"
        return server.log_text().count(f"model napper: {count} {word} running")

    wait_log(server, lambda: logged(0) >= 1, "napper at zero replicas")
    data = [1.5] * ADD_SUB_WIDTH
    body = {"inputs": [{"name": name, "datatype": "FP32", "shape": [1, ADD_SUB_WIDTH],
                        "data": data} for name in ("INPUT0", "INPUT1")]}  # fmt: skip
    started = time.monotonic()
    reply = httpx.post(server.url("/v2/models/napper/infer"), json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    outputs = {output["name"]: output["data"] for output in reply.json()["outputs"]}
    assert outputs["OUTPUT0"] == [3.0] * ADD_SUB_WIDTH
    print(f"first request at zero replicas answered in {time.monotonic() - started:.2f} s")
    wait_log(server, lambda: logged(1) >= 1, "napper at one replica")
    wait_log(server, lambda: logged(0) >= 2, "napper back at zero replicas")


def wait_log(server: RemoteServer, condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{server.log_tail()}"
        time.sleep(0.05)


def test_metrics_at_the_root_hold_every_replicas_series_with_the_servers_names(
    server: RemoteServer,
) -> None:
    pattern = re.compile(
        r'^slipstream_request_success_total\{model="add_sub",.*replica="([^"]+)"', re.M
    )
    deadline = time.monotonic() + 30
    with httpx.Client(base_url=server.http_url, timeout=30) as client:
        while True:
            text = client.get("/metrics").text
            replicas = set(pattern.findall(text))
            if len(replicas) == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    assert len(replicas) == 2, text[-3000:]  # add_sub runs two replicas
    assert "# TYPE slipstream_request_duration_seconds histogram" in text


def test_the_openai_routes_serve_the_generative_models_streamed_or_not(
    server: RemoteServer,
) -> None:
    client = server.openai()
    assert [m.id for m in client.models.list().data] == ["smol"]
    messages = [{"role": "user", "content": "Say hello."}]
    reply = client.chat.completions.create(model="smol", messages=messages, max_tokens=4,
                                           temperature=0)  # fmt: skip
    text = reply.choices[0].message.content
    assert text and reply.usage is not None and reply.usage.completion_tokens <= 4
    stream = client.chat.completions.create(model="smol", messages=messages, max_tokens=4,
                                            temperature=0, stream=True)  # fmt: skip
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == text  # greedy: the same tokens, as server-sent events


def test_model_control_is_refused_naming_ray_serve_and_the_model_keeps_serving(
    server: RemoteServer,
) -> None:
    client = httpclient.InferenceServerClient(server.http_address, network_timeout=60)
    try:
        for action in ("load", "unload"):
            reply = httpx.post(server.url(f"/v2/repository/models/add_sub/{action}"), timeout=30)
            assert reply.status_code == 400, reply.text
            message = reply.json()["error"]
            assert f"model {action} is not available under serve --ray" in message
            assert "ray_serve:" in message and "restart slipstream serve --ray" in message
        assert client.is_model_ready("add_sub")  # the unload did nothing, and said so
    finally:
        client.close()


def test_the_repository_index_lists_each_model_as_its_replicas_report_it(
    server: RemoteServer,
) -> None:
    client = httpclient.InferenceServerClient(server.http_address, network_timeout=60)
    try:
        index = {entry["name"]: entry for entry in client.get_model_repository_index()}
        assert index["add_sub"] == {"name": "add_sub", "version": "1", "state": "READY"}
        assert index["smol"] == {"name": "smol", "version": "1", "state": "READY"}
        napper = index["napper"]  # scaled to zero: READY only while a replica runs
        assert napper["state"] == "READY" or "min_replicas 0" in napper["reason"], napper
        ready = httpx.post(server.url("/v2/repository/index"), json={"ready": True}, timeout=30)
        assert {"add_sub", "slow", "smol"} <= {entry["name"] for entry in ready.json()}
        assert all(entry["state"] == "READY" for entry in ready.json())
    finally:
        client.close()


def test_statistics_add_up_every_replica_of_a_model(server: RemoteServer) -> None:
    data = [0.5] * ADD_SUB_WIDTH
    body = {"inputs": [{"name": name, "datatype": "FP32", "shape": [1, ADD_SUB_WIDTH],
                        "data": data} for name in ("INPUT0", "INPUT1")]}  # fmt: skip
    served: dict[str, int] = {}
    with httpx.Client(base_url=server.http_url, timeout=30) as http:
        while min(served.values(), default=0) < 3 or len(served) < 2:
            reply = http.post("/v2/models/add_sub/infer", json=body)
            assert reply.status_code == 200, reply.text
            replica = reply.headers["x-slipstream-replica"]
            served[replica] = served.get(replica, 0) + 1
            assert sum(served.values()) < 200, served
    pattern = re.compile(
        r'^slipstream_request_success_total\{model="add_sub",.*replica="([^"]+)"[^}]*\} (\S+)', re.M
    )
    client = httpclient.InferenceServerClient(server.http_address, network_timeout=60)
    try:
        deadline = time.monotonic() + 30
        while True:
            # Each replica reports its counters and its statistics together: once every
            # replica has reported the requests above, the sum of the one is the other.
            per_replica = {
                r: float(n) for r, n in pattern.findall(server.http.get("/metrics").text)
            }
            every = client.get_inference_statistics()["model_stats"]
            mine = client.get_inference_statistics("add_sub")["model_stats"]
            total = sum(int(s["inference_stats"]["success"]["count"]) for s in every
                        if s["name"] == "add_sub")  # fmt: skip
            own = int(mine[0]["inference_stats"]["success"]["count"])
            settled = len(per_replica) == 2 and total == own == sum(per_replica.values())
            # Replicas report every few seconds, each on its own clock: wait for both to
            # have reported the requests above (the total can pass the count sent here
            # with earlier tests' requests while one replica's report is still due).
            reported = settled and min(per_replica.values()) >= 3
            if (reported and total >= sum(served.values())) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert settled and total >= sum(served.values()), (per_replica, total, own, served)
        assert min(per_replica.values()) >= 3  # both replicas' requests are in the total
    finally:
        client.close()


def test_a_body_over_max_request_bytes_is_refused_413_as_the_plain_server_does(
    server: RemoteServer,
) -> None:
    size = 2 * MAX_REQUEST_BYTES
    with httpx.Client(base_url=server.http_url, timeout=60) as http:
        reply = http.post("/v2/models/add_sub/infer", content=b" " * size)
        assert reply.status_code == 413
        assert reply.json() == {"error": f"request body of {size} bytes exceeds the limit of "
                                f"{MAX_REQUEST_BYTES} bytes (--max-request-bytes)"}  # fmt: skip

        def chunks() -> Iterator[bytes]:  # no Content-Length: refused as it streams in
            for _ in range(4):
                yield b" " * (MAX_REQUEST_BYTES // 2)

        reply = http.post("/v2/models/add_sub/infer", content=chunks())
        assert reply.status_code == 413
        assert reply.json() == {"error": f"request body exceeds the limit of "
                                f"{MAX_REQUEST_BYTES} bytes (--max-request-bytes)"}  # fmt: skip
        assert http.get("/v2/models/add_sub/ready").status_code == 200


def test_errors_name_what_is_true_under_ray(server: RemoteServer) -> None:
    with httpx.Client(base_url=server.http_url, timeout=30) as http:
        reply = http.post("/v1/embeddings", json={"model": "add_sub", "input": "hi"})
        assert reply.status_code == 404
        message = reply.json()["error"]["message"]
        assert message.startswith("/v1/embeddings is not served under serve --ray")
        assert "load it with" not in message


# -- a generative model on the V2 routes (Triton's vLLM backend's contract) --------------

PROMPT = "The capital of France is"
STEPS = 8


def _completion(server: RemoteServer) -> str:
    """/v1/completions' greedy text of PROMPT: what the V2 routes must answer too."""
    body = {"model": "smol", "prompt": PROMPT, "max_tokens": STEPS, "temperature": 0}
    reply = server.http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    text: str = reply.json()["choices"][0]["text"]
    assert text
    return text


def _text_inputs(stream: bool) -> list[Any]:
    sampling = {"temperature": 0, "max_tokens": STEPS}
    values = {"text_input": (np.array([PROMPT.encode()], dtype=object), "BYTES"),
              "stream": (np.array([stream]), "BOOL"),
              "sampling_parameters": (np.array([json.dumps(sampling).encode()], dtype=object),
                                      "BYTES"),
              "exclude_input_in_output": (np.array([True]), "BOOL")}  # fmt: skip
    inputs = []
    for name, (array, datatype) in values.items():
        tensor = httpclient.InferInput(name, [1], datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def test_a_generative_model_has_the_v2_routes_of_a_vllm_backend_model(
    server: RemoteServer,
) -> None:
    completion = _completion(server)
    client = httpclient.InferenceServerClient(server.http_address, network_timeout=60)
    try:
        assert client.is_model_ready("smol")
        metadata = client.get_model_metadata("smol")
        assert metadata["platform"] == "vllm" and metadata["versions"] == ["1"]
        inputs = {t["name"]: (t["datatype"], t["shape"]) for t in metadata["inputs"]}
        assert inputs["text_input"] == ("BYTES", [1]) and inputs["stream"] == ("BOOL", [1])
        config = client.get_model_config("smol")
        assert config["backend"] == "vllm"
        assert config["model_transaction_policy"] == {"decoupled": True}
        assert config["parameters"]["slipstream_backend"] == {"string_value": "llama_cpp"}
        result = client.infer("smol", _text_inputs(stream=False), request_id="u")
        assert result.as_numpy("text_output").tolist() == [completion.encode()]
        assert result.get_response()["id"] == "u"
        with pytest.raises(InferenceServerException) as info:  # a stream has many answers
            client.infer("smol", _text_inputs(stream=True))
        assert "generate_stream" in info.value.message()
    finally:
        client.close()


def test_generate_and_generate_stream_answer_as_on_the_plain_server(
    server: RemoteServer,
) -> None:
    completion = _completion(server)
    body = {"text_input": PROMPT, "parameters": {"temperature": 0, "max_tokens": STEPS}}
    reply = server.http.post("/v2/models/smol/generate", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["text_output"] == PROMPT + completion  # the prompt first, as vLLM's
    streamed = {**body, "parameters": {**body["parameters"], "stream": True}}
    with server.http.stream("POST", "/v2/models/smol/generate_stream", json=streamed) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[5:]) for line in answer.iter_lines() if line.startswith("data:")]
    assert len(events) > 1 and all(event["model_name"] == "smol" for event in events)
    assert "".join(event["text_output"] for event in events) == completion
    refused = server.http.post("/v2/models/smol/generate", json=streamed)
    assert refused.status_code == 400 and "generate_stream" in refused.json()["error"]
    unknown = server.http.post("/v2/models/smol/versions/7/generate", json=body)
    assert unknown.status_code == 404
    assert unknown.json()["error"] == "model 'smol' has no version '7'; version 1 is served"


def test_a_client_leaving_generate_stream_stops_its_generation_under_ray(
    server: RemoteServer,
) -> None:
    body = {"text_input": "Tell me a long story about", "parameters": {
        "stream": True, "max_tokens": 400, "ignore_eos": True}}  # fmt: skip
    before = _settled_tokens(server)
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", server.url("/v2/models/smol/generate_stream"), json=body) as answer,
    ):
        events = (line for line in answer.iter_lines() if line.startswith("data:"))
        for _ in range(3):
            next(events)
    # Tokens are counted when the sequence ends, and reach /metrics with its replica's
    # next report: 400 if the generation ran on after the client left.
    deadline = time.monotonic() + 60
    while (after := _generated_tokens(server)) == before:
        assert time.monotonic() < deadline, "the sequence never ended"
        time.sleep(0.2)
    assert 3 <= after - before < 80, (before, after)


def _generated_tokens(server: RemoteServer) -> float:
    text = server.http.get("/metrics").text
    pattern = r'^slipstream_llm_generation_tokens_total\{model="smol",[^}]*\} (\S+)'
    return sum(float(count) for count in re.findall(pattern, text, re.M))


def _settled_tokens(server: RemoteServer) -> float:
    """The count once the earlier tests' tokens are all in: unchanged over a report
    interval (2 s), so that the next change is the next sequence's alone."""
    last = _generated_tokens(server)
    while True:
        time.sleep(2.5)
        now = _generated_tokens(server)
        if now == last:
            return now
        last = now


def test_statistics_count_a_generative_models_v2_requests(server: RemoteServer) -> None:
    def own() -> int:
        stats = server.http.get("/v2/models/smol/stats").json()["model_stats"]
        return int(stats[0]["inference_stats"]["success"]["count"])

    before = own()
    body = {"text_input": PROMPT, "parameters": {"max_tokens": 2}}
    assert server.http.post("/v2/models/smol/generate", json=body).status_code == 200
    assert own() == before + 1
    deadline = time.monotonic() + 30
    while True:  # the server's statistics: as its replica last reported them
        every = server.http.get("/v2/models/stats").json()["model_stats"]
        counted = [int(s["inference_stats"]["success"]["count"]) for s in every
                   if s["name"] == "smol"]  # fmt: skip
        if (counted and counted[0] > before) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert counted == [before + 1], every


def test_shared_memory_registration_is_refused_naming_ray_serve(server: RemoteServer) -> None:
    client = httpclient.InferenceServerClient(server.http_address, network_timeout=60)
    try:
        client.unregister_system_shared_memory()  # cleaning up first works, as on Triton
        assert client.get_system_shared_memory_status() == []
        with pytest.raises(InferenceServerException) as info:
            client.register_system_shared_memory("inputs", "/inputs", 64)
        assert info.value.status() == "400"
        assert "shared memory is not served under serve --ray" in info.value.message()
        extensions = client.get_server_metadata()["extensions"]
        assert "system_shared_memory" not in extensions and "generate" in extensions
    finally:
        client.close()


def test_changes_a_replica_would_keep_to_itself_are_refused_naming_ray(
    server: RemoteServer,
) -> None:
    client = httpclient.InferenceServerClient(server.http_address, network_timeout=60)
    try:
        assert client.get_log_settings()["log_info"] is True  # reading answers
        with pytest.raises(InferenceServerException, match="not served under serve --ray"):
            client.update_log_settings({"log_verbose_level": 1})
        for model in ("", "add_sub", "smol"):  # the server's, a model's, a relayed one's
            assert client.get_trace_settings(model)["trace_level"] == ["OFF"]
            with pytest.raises(InferenceServerException) as info:
                client.update_trace_settings(model, {"trace_rate": "5"})
            assert info.value.status() == "400"
            assert "trace settings is not served under serve --ray" in info.value.message()
    finally:
        client.close()
    for model in ("add_sub", "smol"):
        reply = server.http.get(f"/v2/models/{model}/drift")
        assert reply.status_code == 404
        assert "has no drift monitor" in reply.json()["error"]  # as the plain server says
    assert server.http.get("/v2/models/add_sub/rollout").status_code == 200  # reading answers
    reply = server.http.post("/v2/models/add_sub/rollout", json={"candidate": "1"})
    assert reply.status_code == 400
    assert reply.json()["error"].startswith("progressive rollouts are not served under serve --ray")


def test_the_log_holds_the_replicas_lines_and_says_grpc_is_not_served(
    server: RemoteServer,
) -> None:
    log = server.log_text()
    assert "gRPC is not served under --ray" in log
    # Each replica's slipstream log, in slipstream serve's format, through Ray's driver.
    assert re.search(r"\(ServeReplica:add_sub:add_sub pid=\d+\).* INFO slipstream\.serving\."
                     r"manager: model add_sub version 1 is READY", log)  # fmt: skip


@pytest.mark.parametrize(
    ("option", "value"),
    [("auth_file", "keys.yaml"), ("jobs_redis", "redis://localhost:6379"),
     ("tls_client_ca", "ca.pem"), ("trace_config", ["mode=opentelemetry"]),
     ("access_log", True), ("allow_client_shm", True), ("price_per_hour", 2.5),
     ("trace_startup", "start.json")],
)  # fmt: skip
def test_options_ray_serve_would_ignore_are_refused_before_ray_starts(
    option: str, value: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    import ray

    from slipstream.config import ServerSettings
    from slipstream.rayserve.app import run

    def no_cluster(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("Ray was started: the option was not refused")

    monkeypatch.setattr(ray, "init", no_cluster)
    extra = {"tls_cert": "c.pem", "tls_key": "k.pem"} if option == "tls_client_ca" else {}
    settings = ServerSettings(model_repository=tmp_path, **{option: value, **extra})
    assert run(settings) == 1
    flag = "--" + option.replace("_", "-")
    assert f"{flag} is not served under --ray" in caplog.text


def test_a_replica_takes_a_whole_batch_of_requests_at_once(server: RemoteServer) -> None:
    """Ray's default max_ongoing_requests (5) would cap every batch at 5 requests."""
    row = {"datatype": "FP32", "shape": [1, ADD_SUB_WIDTH], "data": [1.0] * ADD_SUB_WIDTH}
    body = {"inputs": [{"name": name, **row} for name in ("INPUT0", "INPUT1")]}

    async def together(count: int) -> list[int]:
        async with httpx.AsyncClient(base_url=server.http_url, timeout=60) as client:
            replies = await asyncio.gather(
                *(client.post("/v2/models/batched/infer", json=body) for _ in range(count))
            )
        return [reply.status_code for reply in replies]

    assert asyncio.run(together(16)) == [200] * 16
    stats = server.http.get("/v2/models/batched/stats").json()["model_stats"][0]
    sizes = [entry["batch_size"] for entry in stats["batch_stats"]]
    assert max(sizes) > 5, stats["batch_stats"]
