"""A Triton ensemble (``platform: "ensemble"``, ``ensemble_scheduling``) served as Triton
serves it, through the stock tritonclient over HTTP and gRPC: loading it in explicit mode
loads its models; its steps pass tensors by name, the independent ones side by side; its
config, metadata, index entry and statistics; a bad request or a bad step named."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper, numpy_helper

from tests.models import ADD_SUB_WIDTH, build_add_sub, write_graph
from tests.utils import RemoteServer

W = ADD_SUB_WIDTH

PIPELINE = f"""
name: "pipeline"
platform: "ensemble"
max_batch_size: 8
input [
  {{ name: "A" data_type: TYPE_FP32 dims: [ {W} ] }},
  {{ name: "B" data_type: TYPE_FP32 dims: [ {W} ] }}
]
output [
  {{ name: "DOUBLED_SUM" data_type: TYPE_FP32 dims: [ {W} ] label_filename: "l.txt" }},
  {{ name: "DOUBLED_DIFF" data_type: TYPE_FP32 dims: [ {W} ] }},
  {{ name: "DIFF" data_type: TYPE_FP32 dims: [ {W} ] }}
]
ensemble_scheduling {{
  step [
    {{
      model_name: "double"
      model_version: -1
      input_map {{ key: "INPUT0" value: "sum" }}
      output_map {{ key: "OUTPUT0" value: "DOUBLED_SUM" }}
    }},
    {{
      model_name: "add_sub"
      model_version: 1
      input_map {{ key: "INPUT0" value: "A" }}
      input_map {{ key: "INPUT1" value: "B" }}
      output_map {{ key: "OUTPUT0" value: "sum" }}
      output_map {{ key: "OUTPUT1" value: "DIFF" }}
    }},
    {{
      model_name: "double"
      model_version: -1
      input_map {{ key: "INPUT0" value: "DIFF" }}
      output_map {{ key: "OUTPUT0" value: "DOUBLED_DIFF" }}
    }}
  ]
}}
"""


def build_double(repo: Path) -> None:
    """INPUT0 FP32 [-1, W] -> OUTPUT0 = 2 * INPUT0."""
    shape: list[str | int] = ["batch", W]
    graph = helper.make_graph(
        [helper.make_node("Mul", ["INPUT0", "two"], ["OUTPUT0"])],
        "double",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, shape)],
        [numpy_helper.from_array(np.array(2.0, np.float32), "two")],
    )
    write_graph(graph, repo, "double")


@pytest.fixture(scope="module", params=[[], ["--frontends", "1"]], ids=["one", "split"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RemoteServer]:
    root = tmp_path_factory.mktemp("ensemble")
    repo = root / "repo"
    build_add_sub(repo)
    build_double(repo)
    (repo / "pipeline" / "1").mkdir(parents=True)  # Triton's empty version directory
    (repo / "pipeline" / "config.pbtxt").write_text(PIPELINE)
    (repo / "pipeline" / "l.txt").write_text("".join(f"c{i}\n" for i in range(W)))
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "l.txt").write_text("")
    (repo / "broken" / "config.pbtxt").write_text(
        PIPELINE.replace('name: "pipeline"', 'name: "broken"').replace(
            'key: "INPUT1" value: "B"', 'key: "INPUT7" value: "B"'
        )
    )
    args = ["--model-control-mode", "explicit", "--load-model", "pipeline", *request.param]
    with RemoteServer(repo, args, log_dir=root) as running:
        yield running


def _inputs(module: object, a: np.ndarray, b: np.ndarray) -> list[object]:
    made = []
    for name, array in (("A", a), ("B", b)):
        tensor = module.InferInput(name, list(array.shape), "FP32")  # type: ignore[attr-defined]
        tensor.set_data_from_numpy(array)
        made.append(tensor)
    return made


def test_an_ensemble_runs_its_steps_over_http_and_grpc(server: RemoteServer) -> None:
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((3, W)).astype(np.float32) for _ in range(2))
    http = httpclient.InferenceServerClient(server.http_address)
    grpc = grpcclient.InferenceServerClient(server.grpc_address)
    try:
        for client, module in ((http, httpclient), (grpc, grpcclient)):
            result = client.infer("pipeline", _inputs(module, a, b))
            np.testing.assert_allclose(result.as_numpy("DOUBLED_SUM"), 2 * (a + b), rtol=1e-6)
            np.testing.assert_allclose(result.as_numpy("DOUBLED_DIFF"), 2 * (a - b), rtol=1e-6)
            np.testing.assert_allclose(result.as_numpy("DIFF"), a - b, rtol=1e-6)
            only = [module.InferRequestedOutput("DIFF")]
            result = client.infer("pipeline", _inputs(module, a, b), outputs=only)
            assert result.as_numpy("DOUBLED_SUM") is None
            np.testing.assert_allclose(result.as_numpy("DIFF"), a - b, rtol=1e-6)
            # The ensemble's own label file, for its outputs' top classes.
            top = [module.InferRequestedOutput("DOUBLED_SUM", class_count=1)]
            result = client.infer("pipeline", _inputs(module, a, b), outputs=top)
            best = (2 * (a + b)).argmax(axis=1)
            assert [row[0].decode().split(":")[1:] for row in result.as_numpy("DOUBLED_SUM")] == [
                [str(i), f"c{i}"] for i in best
            ]
    finally:
        http.close()
        grpc.close()


def test_loading_the_ensemble_loaded_its_models_and_it_is_described_as_triton_does(
    server: RemoteServer,
) -> None:
    http = httpclient.InferenceServerClient(server.http_address)
    grpc = grpcclient.InferenceServerClient(server.grpc_address)
    try:
        index = {e["name"]: e.get("state") for e in http.get_model_repository_index()}
        assert index["pipeline"] == index["add_sub"] == index["double"] == "READY"
        for config in (http.get_model_config("pipeline"),
                       grpc.get_model_config("pipeline", as_json=True)["config"]):  # fmt: skip
            assert config["platform"] == "ensemble"
            steps = config["ensemble_scheduling"]["step"]
            assert [s["model_name"] for s in steps] == ["double", "add_sub", "double"]
            assert steps[1]["input_map"] == {"INPUT0": "A", "INPUT1": "B"}
            assert "dynamic_batching" not in config
        metadata = http.get_model_metadata("pipeline")
        assert metadata["platform"] == "ensemble"
        assert [(t["name"], t["shape"]) for t in metadata["inputs"]] == [
            ("A", [-1, W]),
            ("B", [-1, W]),
        ]
        stats = http.get_inference_statistics("pipeline")["model_stats"][0]
        assert stats["name"] == "pipeline" and stats["inference_stats"]["success"]["count"] > 0
        # Counted as Triton counts an ensemble: each request one execution of its rows.
        assert int(stats["inference_count"]) >= int(stats["execution_count"]) > 0
    finally:
        http.close()
        grpc.close()


def test_bad_requests_name_the_ensemble_s_input_or_the_failing_step(
    server: RemoteServer,
) -> None:
    url = "/v2/models/pipeline/infer"
    row = {"datatype": "FP32", "shape": [1, W], "data": [0.0] * W}
    unknown = server.http.post(url, json={"inputs": [{"name": "C", **row}]})
    assert unknown.status_code == 400
    assert "input 'C': ensemble 'pipeline' has no such input" in unknown.json()["error"]
    missing = server.http.post(url, json={"inputs": [{"name": "A", **row}]})
    assert missing.status_code == 400
    assert "input 'B': missing" in missing.json()["error"]
    narrow = {"datatype": "FP32", "shape": [1, 3], "data": [0.0] * 3}
    wrong = server.http.post(url, json={"inputs": [{"name": "A", **narrow},
                                                   {"name": "B", **narrow}]})  # fmt: skip
    assert wrong.status_code == 400
    assert "ensemble 'pipeline' step add_sub:1: input 'INPUT" in wrong.json()["error"]


def test_an_ensemble_whose_step_does_not_fit_its_model_fails_to_load_naming_it(
    server: RemoteServer,
) -> None:
    answer = server.http.post("/v2/repository/models/broken/load")
    assert answer.status_code == 400
    assert "steps[1] (add_sub:1): model 'add_sub' has no input 'INPUT7'" in answer.json()["error"]
    index = {e["name"]: e for e in server.http.post("/v2/repository/index", json={}).json()}
    assert index["broken"]["state"] == "UNAVAILABLE"
    assert server.http.get("/v2/models/pipeline/ready").status_code == 200


def test_an_ensemble_is_ready_only_while_its_models_are(server: RemoteServer) -> None:
    def index() -> dict[str, dict[str, str]]:
        entries = server.http.post("/v2/repository/index", json={}).json()
        return {e["name"]: e for e in entries}

    assert server.http.post("/v2/repository/models/double/unload").status_code == 200
    assert server.http.get("/v2/models/pipeline/ready").status_code != 200
    entry = index()["pipeline"]
    assert entry["state"] == "UNAVAILABLE"
    assert entry["reason"] == "model 'double', which it runs, is not loaded"
    assert server.http.post("/v2/repository/models/double/load").status_code == 200
    assert server.http.get("/v2/models/pipeline/ready").status_code == 200
    # Unloaded, an ensemble is listed as Triton lists an unloaded model.
    assert server.http.post("/v2/repository/models/pipeline/unload").status_code == 200
    assert (index()["pipeline"]["state"], index()["pipeline"]["reason"]) == (
        "UNAVAILABLE",
        "unloaded",
    )
    assert server.http.post("/v2/repository/models/pipeline/load").status_code == 200
    assert server.http.get("/v2/models/pipeline/ready").status_code == 200
