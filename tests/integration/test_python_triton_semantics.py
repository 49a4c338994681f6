"""Triton Python-backend semantics a ported ``model.py`` relies on, through tritonclient
(HTTP and gRPC, one client per thread): one request per ``execute`` without
dynamic_batching, a miscounted answer failing its own request, ``is_ready`` as the
model's readiness, Triton's instance names, a decoupled ``async def execute`` awaiting
requests side by side, a decoupled model's error code through BLS, response parameters,
and ``unload_dependents``."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.utils import RemoteServer

# Written as models for Triton's default scheduler may be: the first request read, its
# answer given to each (right only where execute gets one request); each answer says
# how many requests its execute got.
FIRST_ONLY = """
import time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        request = requests[0]
        time.sleep(0.05)  # long enough for requests to queue behind it
        x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
        out = pb_utils.Tensor("Y", x * 2)
        seen = pb_utils.Tensor("N", np.full(x.shape, len(requests), dtype=np.int32))
        parameters = {"requests": len(requests), "model": "first_only", "doubled": True}
        return [pb_utils.InferenceResponse([out, seen], parameters=parameters)] * len(requests)
"""

# Answers a negative X twice: a miscounted execute.
EXTRA = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            out = pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 2)])
            responses.extend([out, out] if (x < 0).any() else [out])
        return responses
"""

# Ready while its flag file says so; "raise" in it makes is_ready raise, "hang" makes it
# wait until the flag changes. Each call of is_ready adds a line to the file "asked".
GATED = """
import time
from pathlib import Path
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.flag = Path(args["model_repository"]) / "flag"
        names = Path(args["model_repository"]) / "instances"
        with names.open("a") as out:
            out.write(" ".join([args["model_instance_name"], args["model_instance_kind"],
                                args["model_instance_device_id"]]) + "\\n")

    def is_ready(self):
        with (self.flag.parent / "asked").open("a") as asked:
            asked.write("asked\\n")
        while (text := self.flag.read_text()) == "hang":
            time.sleep(0.05)
        if text == "raise":
            raise RuntimeError("the flag says raise")
        return text == "ready"

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", r.inputs()[0].as_numpy())])
                for r in requests]
"""

# Decoupled, async: each request sleeps without holding the instance.
SLEEPER = """
import asyncio
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    async def execute(self, requests):
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            await asyncio.sleep(0.2)
            sender = request.get_response_sender()
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)],
                                                   parameters={"slept_ms": 200}))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""

# Decoupled: answers with an error of the code X names.
CODED = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            code = int(pb_utils.get_input_tensor_by_name(request, "X").as_numpy()[0])
            error = pb_utils.TritonError("refused on purpose", code)
            request.get_response_sender().send(
                pb_utils.InferenceResponse(error=error),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""

# Calls "coded" through BLS and answers the code of the error it read.
CALLER = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            call = pb_utils.InferenceRequest(
                model_name="coded", inputs=[pb_utils.get_input_tensor_by_name(request, "X")],
                requested_output_names=["Y"])
            codes = [r.error().code() for r in call.exec(decoupled=True) if r.has_error()]
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("Y", np.array(codes, dtype=np.int32))]))
        return responses
"""

ENSEMBLE = """
platform: "ensemble"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_INT32 dims: [ 1 ] } ]
ensemble_scheduling { step [ { model_name: "extra" model_version: -1
  input_map { key: "X" value: "X" } output_map { key: "Y" value: "Y" } } ] }
"""

# A stateful model: each answer's parameters name its sequence.
STATEFUL = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(
                    [pb_utils.Tensor("Y", r.inputs()[0].as_numpy())],
                    parameters={"sequence": r.correlation_id(), "flags": r.flags()})
                for r in requests]
"""

TENSORS = """
input [ { name: "X" data_type: TYPE_BF16 dims: [ 3 ] } ]
output [ { name: "Y" data_type: TYPE_BF16 dims: [ 3 ] } ]
"""

TENSORS = """
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_INT32 dims: [ -1 ] } %s ]
"""
MODELS: dict[str, tuple[str, str]] = {
    "first_only": (FIRST_ONLY, "max_batch_size: 8\ninstance_group [ { count: 1 } ]"),
    "extra": (EXTRA, "max_batch_size: 0"),
    "gated": (GATED, 'max_batch_size: 0\ninstance_group [ { count: 2 }, { name: "solo" } ]'),
    "sleeper": (SLEEPER, "max_batch_size: 0\nmodel_transaction_policy { decoupled: true }"),
    "coded": (CODED, "max_batch_size: 0\nmodel_transaction_policy { decoupled: true }"),
    "caller": (CALLER, "max_batch_size: 0"),
    "stateful": (STATEFUL, "max_batch_size: 0\nsequence_batching { }"),
}


def build_repository(root: Path) -> Path:
    repo = root / "repo"
    for name, (source, settings) in MODELS.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(source)
        seen = ', { name: "N" data_type: TYPE_INT32 dims: [ 1 ] }' if name == "first_only" else ""
        tensors = TENSORS % seen
        (repo / name / "config.pbtxt").write_text(f'backend: "python"\n{settings}\n{tensors}')
    (repo / "gated" / "flag").write_text("ready")
    (repo / "ens" / "1").mkdir(parents=True)
    (repo / "ens" / "config.pbtxt").write_text(ENSEMBLE)
    return repo


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    root = tmp_path_factory.mktemp("python_semantics")
    load = [arg for name in [*MODELS, "ens"] for arg in ("--load-model", name)]
    args = ["--trust-pickle", "--model-control-mode", "explicit", *load]
    with RemoteServer(build_repository(root), args, log_dir=root) as running:
        yield running


def _x(module: Any, values: list[int]) -> Any:
    tensor = module.InferInput("X", [len(values)], "INT32")
    tensor.set_data_from_numpy(np.array(values, dtype=np.int32))
    return tensor


def _each_thread(count: int, call: Callable[[int], Any]) -> list[Any]:
    """``call(index)`` on ``count`` threads at once (each makes its own client)."""
    start = threading.Barrier(count)

    def run(index: int) -> Any:
        start.wait()
        try:
            return call(index)
        except InferenceServerException as exc:
            return exc

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(run, range(count)))


def test_without_dynamic_batching_execute_gets_one_request(server: RemoteServer) -> None:
    def infer(index: int) -> Any:
        client = httpclient.InferenceServerClient(server.http_address)
        try:
            x = httpclient.InferInput("X", [1, 1], "INT32")
            x.set_data_from_numpy(np.array([[index]], dtype=np.int32))
            return client.infer("first_only", [x])
        finally:
            client.close()

    results = _each_thread(6, infer)
    for index, result in enumerate(results):
        assert not isinstance(result, Exception), result
        assert result.as_numpy("Y").tolist() == [[2 * index]]
        assert result.as_numpy("N").tolist() == [[1]]


def test_response_parameters_reach_http_and_grpc_clients(server: RemoteServer) -> None:
    http = httpclient.InferenceServerClient(server.http_address)
    x = httpclient.InferInput("X", [1, 1], "INT32")
    x.set_data_from_numpy(np.array([[3]], dtype=np.int32))
    try:
        answer = http.infer("first_only", [x]).get_response()
    finally:
        http.close()
    assert answer["parameters"] == {"requests": 1, "model": "first_only", "doubled": True}
    grpc = grpcclient.InferenceServerClient(server.grpc_address)
    y = grpcclient.InferInput("X", [1, 1], "INT32")
    y.set_data_from_numpy(np.array([[3]], dtype=np.int32))
    try:
        parameters = grpc.infer("first_only", [y]).get_response().parameters
    finally:
        grpc.close()
    assert parameters["requests"].int64_param == 1
    assert parameters["model"].string_param == "first_only"
    assert parameters["doubled"].bool_param is True


def test_a_stateful_model_s_response_parameters_reach_the_client(server: RemoteServer) -> None:
    http = httpclient.InferenceServerClient(server.http_address)
    try:
        first = http.infer("stateful", [_x(httpclient, [1])], sequence_id=7, sequence_start=True)
        last = http.infer("stateful", [_x(httpclient, [2])], sequence_id=7, sequence_end=True)
    finally:
        http.close()
    assert first.get_response()["parameters"] == {"sequence": 7, "flags": 1}  # START
    assert last.get_response()["parameters"] == {"sequence": 7, "flags": 2}  # END


def test_a_miscounted_answer_fails_its_own_request_with_the_reason(server: RemoteServer) -> None:
    def infer(index: int) -> Any:
        client = httpclient.InferenceServerClient(server.http_address)
        try:
            return client.infer("extra", [_x(httpclient, [-1 if index == 0 else index])])
        finally:
            client.close()

    bad, *good = _each_thread(4, infer)
    assert isinstance(bad, InferenceServerException)
    assert "execute returned 2 responses for 1 requests" in str(bad.message())
    for index, result in enumerate(good, 1):
        assert not isinstance(result, Exception), result
        assert result.as_numpy("Y").tolist() == [2 * index]


def test_is_ready_is_the_models_readiness(server: RemoteServer) -> None:
    flag = server.repository / "gated" / "flag"
    http = httpclient.InferenceServerClient(server.http_address)
    grpc = grpcclient.InferenceServerClient(server.grpc_address)
    try:
        assert http.is_model_ready("gated") and grpc.is_model_ready("gated")
        flag.write_text("not yet")
        assert not http.is_model_ready("gated") and not grpc.is_model_ready("gated")
        flag.write_text("raise")
        assert not http.is_model_ready("gated") and not grpc.is_model_ready("gated")
        assert not http.is_model_ready("gated")
        flag.write_text("ready")
        assert http.is_model_ready("gated") and grpc.is_model_ready("gated")
    finally:
        flag.write_text("ready")
        http.close()
        grpc.close()
    assert server.log_text().count("is_ready raised") == 1


def test_an_is_ready_that_hangs_is_not_ready_and_asked_once(server: RemoteServer) -> None:
    """Readiness probes of a model whose is_ready hangs answer not ready within about a
    second each, and share the one question in flight (no thread per probe)."""
    flag, asked = server.repository / "gated" / "flag", server.repository / "gated" / "asked"
    flag.write_text("hang")
    try:
        before = len(asked.read_text().splitlines()) if asked.exists() else 0
        started = time.monotonic()
        url = server.url("/v2/models/gated/ready")

        def probe(_: int) -> int:  # a connection each (one httpx client across threads
            with httpx.Client() as client:  # leaks its sockets)
                return client.get(url, timeout=30).status_code

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(probe, range(8)))
        assert all(status != 200 for status in answers), answers
        assert time.monotonic() - started < 5
        # Two instances: one question each at most, however many probes asked.
        assert len(asked.read_text().splitlines()) - before <= 2
    finally:
        flag.write_text("ready")
    wait_ready = time.monotonic() + 10
    while server.http.get("/v2/models/gated/ready").status_code != 200:
        assert time.monotonic() < wait_ready, "gated never ready again"
        time.sleep(0.05)
    assert server.log_text().count("is_ready has not answered") == 1


def test_each_instance_has_tritons_name_kind_and_device(server: RemoteServer) -> None:
    lines = (server.repository / "gated" / "instances").read_text().splitlines()
    assert sorted(lines) == ["gated_0_0 CPU 0", "gated_0_1 CPU 0", "solo_0 CPU 0"]


def test_an_async_decoupled_model_awaits_requests_side_by_side(server: RemoteServer) -> None:
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_address)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    count = 8
    try:
        started = time.perf_counter()
        for index in range(count):
            client.async_stream_infer("sleeper", [_x(grpcclient, [index])], request_id=str(index))
        seen = {}
        for _ in range(count):
            result, error = answers.get(timeout=30)
            assert error is None, error
            response = result.get_response()
            seen[response.id] = (
                int(result.as_numpy("Y")[0]),
                response.parameters["slept_ms"].int64_param,
            )
        elapsed_s = time.perf_counter() - started
    finally:
        client.stop_stream()
        client.close()
    # One after another would take count * 0.2 s = 1.6 s.
    assert elapsed_s < 0.8, f"{count} requests of 0.2 s took {elapsed_s:.2f} s"
    assert seen == {str(index): (index, 200) for index in range(count)}


@pytest.mark.parametrize("code", [2, 3, 4, 5, 6, 7])
def test_a_decoupled_models_error_code_survives_bls(server: RemoteServer, code: int) -> None:
    client = httpclient.InferenceServerClient(server.http_address)
    try:
        result = client.infer("caller", [_x(httpclient, [code])])
    finally:
        client.close()
    assert result.as_numpy("Y").tolist() == [code]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_unload_dependents_unloads_an_ensembles_models(server: RemoteServer, protocol: str) -> None:
    module: Any = httpclient if protocol == "http" else grpcclient
    address = server.http_address if protocol == "http" else server.grpc_address
    client = module.InferenceServerClient(address)
    try:
        client.load_model("ens")
        client.unload_model("ens")
        assert not client.is_model_ready("ens") and client.is_model_ready("extra")
        client.load_model("ens")
        client.unload_model("ens", unload_dependents=True)
        assert not client.is_model_ready("ens") and not client.is_model_ready("extra")
        client.load_model("ens")  # loads its model again, as Triton does
        assert client.is_model_ready("extra")
        assert client.infer("ens", [_x(module, [4])]).as_numpy("Y").tolist() == [8]
    finally:
        client.close()
