"""Triton's Python backend: a repository's ``model.py`` models served as they are, with
Triton's own idioms (``initialize`` reading the model config through
``triton_python_backend_utils``, ``execute`` answering a list of requests,
``finalize``), alone and as steps of an ensemble with an ONNX model, through the stock
tritonclient; a model.py loads only when trusted; its errors are the client's (400) or
the model's (500) as its TritonError code says."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.models import ADD_SUB_WIDTH, build_add_sub
from tests.utils import RemoteServer

W = ADD_SUB_WIDTH

# Written as Triton's Python backend examples write models.
TOKENIZE = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        output = pb_utils.get_output_config_by_name(self.model_config, "IDS")
        self.dtype = pb_utils.triton_string_to_numpy(output["data_type"])
        self.name = args["model_name"]

    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
            if any(b"!" in row[0] for row in text):
                error = pb_utils.TritonError("no shouting", pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
                continue
            ids = np.zeros((len(text), %(W)d), dtype=self.dtype)
            for row, (value,) in enumerate(text):
                codes = [byte %% 7 for byte in value[:%(W)d]]
                ids[row, :len(codes)] = codes
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("IDS", ids)]))
        return responses

    def finalize(self):
        with open(%(marker)r, "w") as marker:
            marker.write(self.name)
"""

LABEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            total = pb_utils.get_input_tensor_by_name(request, "SCORES").as_numpy().sum(axis=1)
            if (total > 1e6).any():
                raise ValueError("scores out of range")
            words = np.array([["big" if t > 20 else "small"] for t in total])  # numpy str
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("WORD", words)]))
        return responses
"""


def _python_model(repo: Path, name: str, source: str, inputs: str, outputs: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(source)
    (repo / name / "config.pbtxt").write_text(
        f'backend: "python"\nmax_batch_size: 8\ninput [ {inputs} ]\noutput [ {outputs} ]\n'
    )


PIPELINE = f"""
platform: "ensemble"
max_batch_size: 8
input [ {{ name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] }} ]
output [ {{ name: "WORD" data_type: TYPE_STRING dims: [ 1 ] }},
         {{ name: "SUM" data_type: TYPE_FP32 dims: [ {W} ] }} ]
ensemble_scheduling {{ step [
  {{ model_name: "tokenize" model_version: -1
     input_map {{ key: "TEXT" value: "TEXT" }} output_map {{ key: "IDS" value: "ids" }} }},
  {{ model_name: "add_sub" model_version: -1
     input_map {{ key: "INPUT0" value: "ids" }} input_map {{ key: "INPUT1" value: "ids" }}
     output_map {{ key: "OUTPUT0" value: "SUM" }} }},
  {{ model_name: "label" model_version: -1
     input_map {{ key: "SCORES" value: "SUM" }} output_map {{ key: "WORD" value: "WORD" }} }}
] }}
"""


def build_repository(root: Path) -> Path:
    repo = root / "repo"
    build_add_sub(repo)
    marker = root / "finalized"
    _python_model(
        repo, "tokenize", TOKENIZE % {"W": W, "marker": str(marker)},
        '{ name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] }',
        f'{{ name: "IDS" data_type: TYPE_FP32 dims: [ {W} ] }}',
    )  # fmt: skip
    _python_model(
        repo, "label", LABEL, f'{{ name: "SCORES" data_type: TYPE_FP32 dims: [ {W} ] }}',
        '{ name: "WORD" data_type: TYPE_STRING dims: [ 1 ] }',
    )  # fmt: skip
    (repo / "pipeline" / "1").mkdir(parents=True)
    (repo / "pipeline" / "config.pbtxt").write_text(PIPELINE)
    return repo


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    root = tmp_path_factory.mktemp("python_model")
    args = ["--trust-pickle", "--model-control-mode", "explicit", "--load-model", "pipeline"]
    with RemoteServer(build_repository(root), args, log_dir=root) as running:
        yield running


def _text(module: object, rows: list[bytes]) -> object:
    tensor = module.InferInput("TEXT", [len(rows), 1], "BYTES")  # type: ignore[attr-defined]
    tensor.set_data_from_numpy(np.array([[row] for row in rows], dtype=object))
    return tensor


def _ids(text: bytes) -> np.ndarray:
    ids = np.zeros(W, dtype=np.float32)
    codes = [byte % 7 for byte in text[:W]]
    ids[: len(codes)] = codes
    return ids


def test_python_models_run_alone_and_as_ensemble_steps(server: RemoteServer) -> None:
    rows = [b"hello", b"a much longer sentence"]
    http = httpclient.InferenceServerClient(server.http_address)
    grpc = grpcclient.InferenceServerClient(server.grpc_address)
    try:
        for client, module in ((http, httpclient), (grpc, grpcclient)):
            ids = client.infer("tokenize", [_text(module, rows)]).as_numpy("IDS")
            assert ids.dtype == np.float32
            np.testing.assert_array_equal(ids, [_ids(row) for row in rows])
            result = client.infer("pipeline", [_text(module, rows)])
            sums = [2 * _ids(row) for row in rows]
            np.testing.assert_array_equal(result.as_numpy("SUM"), sums)
            expected = [[b"big" if s.sum() > 20 else b"small"] for s in sums]
            assert result.as_numpy("WORD").tolist() == expected
    finally:
        http.close()
        grpc.close()


def test_a_python_model_s_errors_are_the_client_s_or_its_own(server: RemoteServer) -> None:
    body = {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1, 1], "data": ["hi!"]}]}
    refused = server.http.post("/v2/models/tokenize/infer", json=body)
    assert refused.status_code == 400
    assert "the model refused the request: no shouting" in refused.json()["error"]
    scores = {"name": "SCORES", "datatype": "FP32", "shape": [1, W], "data": [1e7] * W}
    failed = server.http.post("/v2/models/label/infer", json={"inputs": [scores]})
    assert failed.status_code == 500
    # The server goes on: the same model answers the next request.
    scores["data"] = [1.0] * W
    assert server.http.post("/v2/models/label/infer", json={"inputs": [scores]}).json()["outputs"][
        0
    ]["data"] == ["small"]


def test_unloading_a_python_model_runs_its_finalize(server: RemoteServer) -> None:
    marker = server.repository.parent / "finalized"
    assert not marker.exists()
    assert server.http.post("/v2/repository/models/pipeline/unload").status_code == 200
    assert server.http.post("/v2/repository/models/tokenize/unload").status_code == 200
    assert marker.read_text() == "tokenize"


def test_a_model_py_loads_only_when_trusted(tmp_path: Path) -> None:
    args = ["--model-control-mode", "explicit"]
    with RemoteServer(build_repository(tmp_path), args, log_dir=tmp_path) as server:
        answer = server.http.post("/v2/repository/models/label/load")
        assert answer.status_code == 400
        error = answer.json()["error"]
        assert "model.py is Python code (python backend)" in error
        assert "trust_pickle: true" in error and "--trust-pickle" in error
