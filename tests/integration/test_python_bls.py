"""Triton's Python backend as Triton runs it: ``execute`` gets a batch as its requests,
each with its own tensors, id, parameters and requested outputs; a model runs other
models of the server with ``InferenceRequest.exec`` (and ``async_exec`` from an
``async def execute``), through the stock tritonclient."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.models import ADD_SUB_WIDTH, build_add_sub
from tests.utils import RemoteServer

W = ADD_SUB_WIDTH

# Scales its input by the request's own "scale" parameter; says which request it
# answered and how many requests its execute call was given.
SCALED = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        family = pb_utils.MetricFamily(
            name="scaled_requests", description="Requests scaled",
            kind=pb_utils.MetricFamily.COUNTER,
        )
        self.counted = family.Metric(labels={"model": args["model_name"]})

    def execute(self, requests):
        responses = []
        for request in requests:
            self.counted.increment(1)
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            parameters = json.loads(request.parameters())
            if parameters.get("fail"):
                raise RuntimeError("asked to fail")
            made = {
                "Y": x * float(parameters.get("scale", 1)),
                "ID": np.array([[request.request_id().encode()]] * len(x), dtype=object),
                "CALLS": np.full((len(x), 1), len(requests), dtype=np.int32),
            }
            wanted = request.requested_output_names()
            tensors = [pb_utils.Tensor(name, made[name]) for name in wanted]
            responses.append(pb_utils.InferenceResponse(tensors))
        return responses
"""

# OUTPUT0 of add_sub (an ONNX model of the server) plus one, through exec(); the
# "target" parameter names another model to call instead.
CALLER = """
import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            target = json.loads(request.parameters()).get("target", "add_sub")
            call = pb_utils.InferenceRequest(
                model_name=target,
                requested_output_names=["OUTPUT0"],
                inputs=[pb_utils.Tensor("INPUT0", x), pb_utils.Tensor("INPUT1", x)],
                preferred_memory=pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU, 0),
            )
            answer = call.exec()
            if answer.has_error():
                responses.append(pb_utils.InferenceResponse(error=answer.error()))
                continue
            total = pb_utils.get_output_tensor_by_name(answer, "OUTPUT0").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", total + 1)]))
        return responses
"""

# The same through async_exec, every request's call in flight at once.
ASYNC_CALLER = """
import asyncio

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        calls = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            calls.append(pb_utils.InferenceRequest(
                model_name="add_sub", requested_output_names=["OUTPUT1"],
                inputs=[pb_utils.Tensor("INPUT0", x), pb_utils.Tensor("INPUT1", x / 2)],
            ).async_exec())
        answers = await asyncio.gather(*calls)
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("Y", pb_utils.get_output_tensor_by_name(a, "OUTPUT1").as_numpy())]
            )
            for a in answers
        ]
"""

AUTO_COMPLETE = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        auto_complete_model_config.add_input({"name": "X", "data_type": "TYPE_FP32", "dims": [2]})
        auto_complete_model_config.add_output({"name": "N", "data_type": "TYPE_INT64", "dims": [2]})
        auto_complete_model_config.set_max_batch_size(4)
        return auto_complete_model_config

    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("N", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())]
            )
            for r in requests
        ]
"""

TENSOR = f'name: "X" data_type: TYPE_FP32 dims: [ {W} ]'
BATCHING = "dynamic_batching { max_queue_delay_microseconds: 300000 preferred_batch_size: [ 4 ] }"


def _model(repo: Path, name: str, source: str, outputs: str, extra: str = "") -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(source)
    (repo / name / "config.pbtxt").write_text(
        f'backend: "python"\nmax_batch_size: 8\ninput [ {{ {TENSOR} }} ]\n'
        f"output [ {outputs} ]\n{extra}\n"
    )


SCALING = f"""
platform: "ensemble"
max_batch_size: 8
input [ {{ {TENSOR} }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ {W} ] }} ]
ensemble_scheduling {{ step [ {{ model_name: "scaled" model_version: -1
  input_map {{ key: "X" value: "X" }} output_map {{ key: "Y" value: "Y" }} }} ] }}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    root = tmp_path_factory.mktemp("python_bls")
    repo = root / "repo"
    build_add_sub(repo)
    outputs = (
        f'{{ name: "Y" data_type: TYPE_FP32 dims: [ {W} ] }}, '
        '{ name: "ID" data_type: TYPE_STRING dims: [ 1 ] }, '
        '{ name: "CALLS" data_type: TYPE_INT32 dims: [ 1 ] }'
    )
    _model(repo, "scaled", SCALED, outputs, BATCHING)
    y = f'{{ name: "Y" data_type: TYPE_FP32 dims: [ {W} ] }}'
    _model(repo, "caller", CALLER, y)
    _model(repo, "async_caller", ASYNC_CALLER, y, BATCHING)
    (repo / "scaling" / "1").mkdir(parents=True)  # an ensemble of one step: scaled
    (repo / "scaling" / "config.pbtxt").write_text(SCALING)
    # Its config says only which backend: auto_complete_config declares the rest.
    (repo / "auto" / "1").mkdir(parents=True)
    (repo / "auto" / "1" / "model.py").write_text(AUTO_COMPLETE)
    (repo / "auto" / "config.pbtxt").write_text('backend: "python"\n')
    with RemoteServer(repo, ["--trust-pickle"], log_dir=root) as running:
        yield running


def _x(value: float) -> np.ndarray:
    return np.full((1, W), value, dtype=np.float32)


def _input(module: object, x: np.ndarray) -> object:
    tensor = module.InferInput("X", list(x.shape), "FP32")  # type: ignore[attr-defined]
    tensor.set_data_from_numpy(x)
    return tensor


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["http", "grpc"])
def test_execute_gets_each_request_with_its_own_parameters_id_and_outputs(
    server: RemoteServer, module: object
) -> None:
    address = server.http_address if module is httpclient else server.grpc_address
    client = module.InferenceServerClient(address)  # type: ignore[attr-defined]

    def one(index: int) -> tuple[np.ndarray, list[object], np.ndarray]:
        # A client per thread: tritonclient's HTTP client is not shared across threads.
        own = module.InferenceServerClient(address)  # type: ignore[attr-defined]
        try:
            outputs = [module.InferRequestedOutput(n) for n in ("Y", "ID", "CALLS")]  # type: ignore[attr-defined]
            result = own.infer(
                "scaled",
                [_input(module, _x(1.0))],
                outputs=outputs,
                request_id=f"r{index}",
                parameters={"scale": index + 2},
            )
        finally:
            own.close()
        return result.as_numpy("Y"), result.as_numpy("ID").tolist(), result.as_numpy("CALLS")

    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(one, range(4)))
        for index, (y, ids, _) in enumerate(answers):
            np.testing.assert_array_equal(y, _x(index + 2.0))
            assert ids == [[f"r{index}".encode()]]
        # The four waited for each other (a preferred batch of 4): one execute call.
        assert max(int(calls[0, 0]) for _, _, calls in answers) > 1
        # Only the outputs a request asks for are made and sent.
        alone = client.infer(
            "scaled",
            [_input(module, _x(3.0))],
            outputs=[module.InferRequestedOutput("Y")],  # type: ignore[attr-defined]
        )
        np.testing.assert_array_equal(alone.as_numpy("Y"), _x(3.0))
        assert alone.as_numpy("ID") is None
    finally:
        client.close()


def test_a_request_that_fails_execute_does_not_fail_its_batch_mates(server: RemoteServer) -> None:
    def one(fail: bool) -> int:
        body = {
            "inputs": [{"name": "X", "datatype": "FP32", "shape": [1, W], "data": [1.0] * W}],
            "parameters": {"fail": fail, "scale": 5},
        }
        # A connection per thread: one httpx client shared by threads leaks sockets.
        return httpx.post(server.url("/v2/models/scaled/infer"), json=body, timeout=30).status_code

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        statuses = list(pool.map(one, [True, False, False, False]))
    assert statuses == [500, 200, 200, 200]


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["http", "grpc"])
def test_a_python_model_runs_another_model_with_exec(server: RemoteServer, module: object) -> None:
    address = server.http_address if module is httpclient else server.grpc_address
    client = module.InferenceServerClient(address)  # type: ignore[attr-defined]
    before = server.http.get("/v2/models/add_sub/stats").json()["model_stats"][0]
    try:
        x = np.arange(2 * W, dtype=np.float32).reshape(2, W)
        answer = client.infer("caller", [_input(module, x)])
        np.testing.assert_array_equal(answer.as_numpy("Y"), 2 * x + 1)
    finally:
        client.close()
    after = server.http.get("/v2/models/add_sub/stats").json()["model_stats"][0]
    # The call went through add_sub's own batcher and statistics, as a client's would.
    assert after["inference_count"] == before["inference_count"] + 2


def test_async_execute_awaits_its_calls_together(server: RemoteServer) -> None:
    def one(value: float) -> np.ndarray:
        body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, W], "data": [value] * W}]}
        answer = httpx.post(server.url("/v2/models/async_caller/infer"), json=body, timeout=30)
        assert answer.status_code == 200, answer.text
        return np.array(answer.json()["outputs"][0]["data"], dtype=np.float32)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, [2.0, 4.0, 6.0, 8.0]))
    for value, y in zip([2.0, 4.0, 6.0, 8.0], results, strict=True):
        np.testing.assert_array_equal(y, np.full(W, value / 2, dtype=np.float32))


def test_exec_errors_come_back_as_error_responses(server: RemoteServer) -> None:
    body = {
        "inputs": [{"name": "X", "datatype": "FP32", "shape": [1, W], "data": [1.0] * W}],
        "parameters": {"target": "no_such_model"},
    }
    missing = server.http.post("/v2/models/caller/infer", json=body)
    assert missing.status_code == 400  # NOT_FOUND from the server, passed on by the model
    assert "no_such_model" in missing.json()["error"]
    body["parameters"] = {"target": "caller"}
    itself = server.http.post("/v2/models/caller/infer", json=body)
    assert itself.status_code == 500
    assert "cannot exec() itself" in itself.json()["error"]
    # The server goes on.
    body["parameters"] = {}
    assert server.http.post("/v2/models/caller/infer", json=body).status_code == 200


def test_exec_and_request_parameters_in_the_engine_process(tmp_path: Path) -> None:
    # A front end before the engine: the Python model runs in the engine, and its calls
    # go through the engine's serving core.
    repo = tmp_path / "repo"
    build_add_sub(repo)
    y = f'{{ name: "Y" data_type: TYPE_FP32 dims: [ {W} ] }}'
    _model(repo, "caller", CALLER, y)
    _model(repo, "scaled", SCALED, y)
    with RemoteServer(repo, ["--trust-pickle", "--frontends", "1"], log_dir=tmp_path) as split:
        x = [2.0] * W
        body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, W], "data": x}]}
        answer = split.http.post("/v2/models/caller/infer", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["outputs"][0]["data"] == [5.0] * W
        body["parameters"] = {"scale": 3}
        body["id"] = "mine"
        scaled = split.http.post("/v2/models/scaled/infer", json=body).json()
        assert scaled["id"] == "mine" and scaled["outputs"][0]["data"] == [6.0] * W


def test_auto_complete_config_fills_a_config_that_names_only_the_backend(
    server: RemoteServer,
) -> None:
    metadata = server.http.get("/v2/models/auto").json()
    assert metadata["inputs"] == [{"name": "X", "datatype": "FP32", "shape": [-1, 2]}]
    assert metadata["outputs"] == [{"name": "N", "datatype": "INT64", "shape": [-1, 2]}]
    config = server.http.get("/v2/models/auto/config").json()
    assert config["max_batch_size"] == 4
    body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 2], "data": [1.5, 2.0]}]}
    answer = server.http.post("/v2/models/auto/infer", json=body).json()
    assert answer["outputs"][0]["datatype"] == "INT64"
    assert answer["outputs"][0]["data"] == [1, 2]
    # Triton's generate extension: inputs by name in a flat JSON object.
    generated = server.http.post("/v2/models/auto/generate", json={"X": [1.5, 2.0]})
    assert generated.json() == {"model_name": "auto", "model_version": "1", "N": [1, 2]}


def test_a_python_models_own_metrics_are_on_the_servers_metrics(server: RemoteServer) -> None:
    body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, W], "data": [1.0] * W}]}

    def counted() -> float:
        text = server.http.get("/metrics").text
        line = next(ln for ln in text.splitlines() if ln.startswith("scaled_requests{"))
        assert line.startswith('scaled_requests{model="scaled"} ')
        return float(line.split()[-1])

    assert server.http.post("/v2/models/scaled/infer", json=body).status_code == 200
    before = counted()
    for _ in range(3):
        assert server.http.post("/v2/models/scaled/infer", json=body).status_code == 200
    assert counted() == before + 3


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["http", "grpc"])
def test_an_ensemble_hands_its_request_parameters_to_its_steps(
    server: RemoteServer, module: object
) -> None:
    """As Triton does (core#262): a step's model reads the ensemble request's parameters."""
    address = server.http_address if module is httpclient else server.grpc_address
    client = module.InferenceServerClient(address)  # type: ignore[attr-defined]
    try:
        result = client.infer("scaling", [_input(module, _x(1.5))], parameters={"scale": 4})
        np.testing.assert_array_equal(result.as_numpy("Y"), _x(6.0))
    finally:
        client.close()
