"""Triton's image-classifier quickstart shape, served as Triton serves it: a model that
takes ``[1, 3, H, W]`` behind ``dims: [3, H, W]`` with a ``reshape``, answers
``[1, C, 1, 1]`` behind ``dims: [C]``, and a ``label_filename``; clients ask for the top
classes (``class_count``) over HTTP and gRPC with the stock tritonclient, in one process
and with a front end before the engine."""

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

CLASSES = 10
LABELS = [f"class {i}" for i in range(CLASSES)]
WEIGHTS = np.random.default_rng(7).standard_normal((3 * 4 * 4, CLASSES)).astype(np.float32)

# Triton's densenet_onnx quickstart config, the model made small.
DENSENET_PBTXT = """
name: "densenet"
platform: "onnxruntime_onnx"
max_batch_size : 0
input [
  {
    name: "data_0"
    data_type: TYPE_FP32
    format: FORMAT_NCHW
    dims: [ 3, 4, 4 ]
    reshape { shape: [ 1, 3, 4, 4 ] }
  }
]
output [
  {
    name: "fc6_1"
    data_type: TYPE_FP32
    dims: [ 10 ]
    reshape { shape: [ 1, 10, 1, 1 ] }
    label_filename: "labels.txt"
  }
]
"""

ADD_SUB_PBTXT = f"""
max_batch_size: 8
input [
  {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ {ADD_SUB_WIDTH} ] }},
  {{ name: "INPUT1" data_type: TYPE_FP32 dims: [ 2, {ADD_SUB_WIDTH // 2} ]
     reshape {{ shape: [ {ADD_SUB_WIDTH} ] }} }}
]
output [
  {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ {ADD_SUB_WIDTH} ] label_filename: "l.txt" }},
  {{ name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4, 4 ] reshape {{ shape: [ 16 ] }} }}
]
"""


def _build_densenet(repo: Path) -> None:
    graph = helper.make_graph(
        [
            helper.make_node("Reshape", ["data_0", "flat"], ["rows"]),
            helper.make_node("MatMul", ["rows", "weights"], ["scores"]),
            helper.make_node("Reshape", ["scores", "image"], ["fc6_1"]),
        ],
        "densenet",
        [helper.make_tensor_value_info("data_0", TensorProto.FLOAT, [1, 3, 4, 4])],
        [helper.make_tensor_value_info("fc6_1", TensorProto.FLOAT, [1, CLASSES, 1, 1])],
        initializer=[
            numpy_helper.from_array(np.array([1, 48], dtype=np.int64), "flat"),
            numpy_helper.from_array(WEIGHTS, "weights"),
            numpy_helper.from_array(np.array([1, CLASSES, 1, 1], dtype=np.int64), "image"),
        ],
    )
    write_graph(graph, repo, "densenet")
    (repo / "densenet" / "config.pbtxt").write_text(DENSENET_PBTXT)
    (repo / "densenet" / "labels.txt").write_text("\n".join(LABELS) + "\n")


@pytest.fixture(scope="module", params=[[], ["--frontends", "1"]], ids=["one", "split"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RemoteServer]:
    tmp_path = tmp_path_factory.mktemp("classification")
    repo = tmp_path / "repo"
    _build_densenet(repo)
    build_add_sub(repo)
    (repo / "add_sub" / "config.pbtxt").write_text(ADD_SUB_PBTXT)
    (repo / "add_sub" / "l.txt").write_text("\n".join(f"w{i}" for i in range(16)))
    with RemoteServer(repo, request.param, log_dir=tmp_path) as running:
        yield running


def _top(scores: np.ndarray, count: int, labels: list[str] | None) -> list[bytes]:
    order = sorted(range(scores.size), key=lambda i: (-scores[i], i))[:count]
    return [(f"{scores[i]:f}:{i}" + (f":{labels[i]}" if labels else "")).encode() for i in order]


def test_the_top_classes_of_a_reshaped_model_come_with_their_labels(server: RemoteServer) -> None:
    image = np.random.default_rng(1).standard_normal((3, 4, 4)).astype(np.float32)
    scores = image.reshape(1, 48) @ WEIGHTS
    expected = _top(scores[0], 3, LABELS)
    clients = [
        (httpclient.InferenceServerClient(server.http_address), httpclient),
        (grpcclient.InferenceServerClient(server.grpc_address), grpcclient),
    ]
    for client, module in clients:
        try:
            tensor = module.InferInput("data_0", [3, 4, 4], "FP32")
            tensor.set_data_from_numpy(image)
            wanted = [module.InferRequestedOutput("fc6_1", class_count=3)]
            result = client.infer("densenet", [tensor], outputs=wanted)
            assert result.as_numpy("fc6_1").tolist() == expected
            output = result.get_output("fc6_1")
            datatype = output["datatype"] if isinstance(output, dict) else output.datatype
            assert datatype == "BYTES"
            # Without classification: the raw scores, in the shape the config's dims say.
            raw = client.infer("densenet", [tensor]).as_numpy("fc6_1")
            assert raw.shape == (CLASSES,)
            np.testing.assert_allclose(raw, scores[0], rtol=1e-5)
            assert "classification" in client.get_server_metadata(**_json(module))["extensions"]
        finally:
            client.close()


def test_the_config_shows_the_reshape_and_label_file(server: RemoteServer) -> None:
    http = httpclient.InferenceServerClient(server.http_address)
    grpc = grpcclient.InferenceServerClient(server.grpc_address)
    try:
        for config in (http.get_model_config("densenet"),
                       grpc.get_model_config("densenet", as_json=True)["config"]):  # fmt: skip
            (tensor,) = config["input"]
            assert [int(d) for d in tensor["reshape"]["shape"]] == [1, 3, 4, 4]
            (output,) = config["output"]
            assert output["label_filename"] == "labels.txt"
            assert [int(d) for d in output["reshape"]["shape"]] == [1, CLASSES, 1, 1]
        metadata = http.get_model_metadata("densenet")
        assert metadata["inputs"][0]["shape"] == [3, 4, 4]
        assert metadata["outputs"][0]["shape"] == [CLASSES]
    finally:
        http.close()
        grpc.close()


def test_a_batching_model_is_classified_row_by_row(server: RemoteServer) -> None:
    a = np.random.default_rng(2).standard_normal((3, ADD_SUB_WIDTH)).astype(np.float32)
    b = np.random.default_rng(3).standard_normal((3, 2, ADD_SUB_WIDTH // 2)).astype(np.float32)
    client = grpcclient.InferenceServerClient(server.grpc_address)
    try:
        inputs = [grpcclient.InferInput("INPUT0", list(a.shape), "FP32"),
                  grpcclient.InferInput("INPUT1", list(b.shape), "FP32")]  # fmt: skip
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(b)
        wanted = [grpcclient.InferRequestedOutput("OUTPUT0", class_count=2),
                  grpcclient.InferRequestedOutput("OUTPUT1")]  # fmt: skip
        result = client.infer("add_sub", inputs, outputs=wanted)
        total = a + b.reshape(3, ADD_SUB_WIDTH)
        labels = [f"w{i}" for i in range(16)]
        assert result.as_numpy("OUTPUT0").tolist() == [_top(row, 2, labels) for row in total]
        np.testing.assert_array_equal(
            result.as_numpy("OUTPUT1"), (a - b.reshape(3, ADD_SUB_WIDTH)).reshape(3, 4, 4)
        )
    finally:
        client.close()


def test_a_bad_class_count_is_a_400_naming_the_output(server: RemoteServer) -> None:
    body = {
        "inputs": [{"name": "data_0", "datatype": "FP32", "shape": [3, 4, 4], "data": [0.0] * 48}],
        "outputs": [{"name": "fc6_1", "parameters": {"classification": -1}}],
    }
    answer = server.http.post("/v2/models/densenet/infer", json=body)
    assert answer.status_code == 400
    assert "output 'fc6_1': parameters.classification" in answer.json()["error"]


def _json(module: object) -> dict[str, bool]:
    return {"as_json": True} if module is grpcclient else {}
