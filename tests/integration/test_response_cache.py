"""Issue #13: the response cache in a real server (``--cache local:size=...``).

A repeated request is a hit that never reaches the batcher (the execution count does not
move), over HTTP and gRPC alike; another input is a miss; a model whose config does not
enable the cache is never cached; Triton's nv_cache_* metrics count it all. A hit answers
the parameters the model's response carried, as the run it was stored from did.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper

from tests.models import ADD_SUB_WIDTH, build_add_sub, write_config, write_graph
from tests.utils import RemoteServer

# Answers its input doubled, and in its response's parameters which run of execute
# made the answer: a hit's parameters name the run it was stored from.
COUNTED = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.runs = 0

    def execute(self, requests):
        self.runs += 1
        answers = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            parameters = {"run": self.runs, "model": "counted", "cached": False}
            answers.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 2)],
                                                      parameters=parameters))
        return answers
"""
COUNTED_CONFIG = """backend: "python"
max_batch_size: 0
input [{ name: "X" data_type: TYPE_FP32 dims: [ 2 ] }]
output [{ name: "Y" data_type: TYPE_FP32 dims: [ 2 ] }]
response_cache { enable: true }
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    root = tmp_path_factory.mktemp("cache")
    build_add_sub(root / "repo", "cached")
    write_config(root / "repo", "cached", {"response_cache": {"enable": True}})
    build_add_sub(root / "repo", "plain")
    (root / "repo" / "counted" / "1").mkdir(parents=True)
    (root / "repo" / "counted" / "1" / "model.py").write_text(COUNTED)
    (root / "repo" / "counted" / "config.pbtxt").write_text(COUNTED_CONFIG)
    args = ["--cache", "local:size=1MB", "--trust-pickle"]
    with RemoteServer(root / "repo", args, log_dir=root) as running:
        yield running


def metric(server: RemoteServer, name: str, model: str) -> float:
    text = httpx.get(server.url("/metrics")).text
    found = re.search(rf'^{name}{{model="{model}",version="1"}} (\S+)$', text, re.M)
    assert found, f"{name} of {model} missing from /metrics"
    return float(found.group(1))


def infer(client: object, module: object, model: str, value: float) -> np.ndarray:
    data = np.full((1, ADD_SUB_WIDTH), value, np.float32)
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = module.InferInput(name, [1, ADD_SUB_WIDTH], "FP32")  # type: ignore[attr-defined]
        tensor.set_data_from_numpy(data)
        inputs.append(tensor)
    result = client.infer(model, inputs)  # type: ignore[attr-defined]
    return np.asarray(result.as_numpy("OUTPUT0"))


def test_a_repeated_request_is_answered_from_the_cache_without_running(
    server: RemoteServer,
) -> None:
    http = httpclient.InferenceServerClient(server.http_address)
    grpc = grpcclient.InferenceServerClient(server.grpc_address)
    assert np.all(infer(http, httpclient, "cached", 1.0) == 2.0)  # a miss: runs
    executions = metric(server, "slipstream_execution_count_total", "cached")
    assert np.all(infer(http, httpclient, "cached", 1.0) == 2.0)  # a hit
    assert np.all(infer(grpc, grpcclient, "cached", 1.0) == 2.0)  # the same key over gRPC
    assert metric(server, "slipstream_execution_count_total", "cached") == executions
    assert metric(server, "nv_cache_num_hits_per_model", "cached") == 2
    assert metric(server, "nv_cache_num_misses_per_model", "cached") == 1
    assert metric(server, "nv_cache_hit_duration_per_model", "cached") > 0
    assert np.all(infer(http, httpclient, "cached", 3.0) == 6.0)  # other inputs: a miss
    assert metric(server, "nv_cache_num_misses_per_model", "cached") == 2
    stats = httpx.get(server.url("/v2/models/cached/stats")).json()["model_stats"][0]
    assert stats["inference_stats"]["cache_hit"]["count"] == 2

    # perf_analyzer reads whether a model caches from its config.
    for model, enabled in (("cached", True), ("plain", False)):
        assert http.get_model_config(model)["response_cache"] == {"enable": enabled}
        config = grpc.get_model_config(model, as_json=True)["config"]
        assert config.get("response_cache", {}).get("enable", False) is enabled

    for _ in range(2):  # not enabled in its config: runs every time
        infer(http, httpclient, "plain", 1.0)
    assert metric(server, "slipstream_execution_count_total", "plain") == 2
    assert metric(server, "nv_cache_num_hits_per_model", "plain") == 0
    http.close()
    grpc.close()


def test_new_weights_under_the_same_version_are_never_answered_from_the_old_ones(
    tmp_path: Path,
) -> None:
    """A reload of version 1 with other weights (or its wake-up, or a restart beside a
    shared Redis cache): the cache keys answers by the version's files too."""
    repo = tmp_path / "repo"
    build_add_sub(repo, "swapped")
    write_config(repo, "swapped", {"response_cache": {"enable": True}})
    args = ["--cache", "local:size=1MB", "--model-control-mode", "explicit",
            "--load-model", "swapped"]  # fmt: skip
    with RemoteServer(repo, args, log_dir=tmp_path) as server:
        http = httpclient.InferenceServerClient(server.http_address)
        try:
            assert np.all(infer(http, httpclient, "swapped", 3.0) == 6.0)  # 3 + 3
            assert np.all(infer(http, httpclient, "swapped", 3.0) == 6.0)  # a hit
            # Version 1's file replaced by a model computing INPUT0 * INPUT1, then loaded.
            shape: list[str | int] = ["batch", ADD_SUB_WIDTH]
            graph = helper.make_graph(
                [helper.make_node("Mul", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
                 helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"])],
                "swapped",
                [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape)
                 for n in ("INPUT0", "INPUT1")],
                [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape)
                 for n in ("OUTPUT0", "OUTPUT1")],
            )  # fmt: skip
            write_graph(graph, repo, "swapped")
            http.load_model("swapped")
            assert np.all(infer(http, httpclient, "swapped", 3.0) == 9.0)  # 3 * 3, run
        finally:
            http.close()


def test_a_hit_answers_the_parameters_of_the_response_it_was_stored_from(
    server: RemoteServer,
) -> None:
    http = httpclient.InferenceServerClient(server.http_address)
    grpc = grpcclient.InferenceServerClient(server.grpc_address)

    def ask(client: Any, module: Any, value: float) -> tuple[np.ndarray, dict[str, Any]]:
        tensor = module.InferInput("X", [2], "FP32")
        tensor.set_data_from_numpy(np.full(2, value, np.float32))
        result = client.infer("counted", [tensor])
        grpc_json = {"as_json": True} if module is grpcclient else {}
        return result.as_numpy("Y"), result.get_response(**grpc_json).get("parameters", {})

    try:
        first, expected = ask(http, httpclient, 1.5)  # a miss: a run of execute
        assert first.tolist() == [3.0, 3.0]
        assert expected == {"run": expected["run"], "model": "counted", "cached": False}
        for client, module in ((http, httpclient), (grpc, grpcclient)):
            again, parameters = ask(client, module, 1.5)  # hits
            assert again.tolist() == [3.0, 3.0]
            if module is grpcclient:  # gRPC's typed parameters, as JSON
                parameters = {key: next(iter(value.values())) for key, value in parameters.items()}
                parameters["run"] = int(parameters["run"])
            assert parameters == expected
        other, parameters = ask(http, httpclient, 2.0)  # a miss: the next run
        assert other.tolist() == [4.0, 4.0] and parameters["run"] == expected["run"] + 1
    finally:
        http.close()
        grpc.close()
