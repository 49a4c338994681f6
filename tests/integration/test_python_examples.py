"""Models written as Triton's own Python backend examples write them (add_sub, bls,
bls_decoupled, decoupled square, auto_complete) run here unchanged, through tritonclient:
helper modules beside model.py, BLS calls named by a BYTES input, ``exec(decoupled=True)``
over a decoupled model's answers (sync, async, cancelled), a response sent through the
sender by a model that is not decoupled, ``pb_utils.is_model_ready``, a raised
``TritonModelException``'s message, rescheduling refused by name, and an
``auto_complete_config`` that adds to the tensors its config lists."""

from __future__ import annotations

import json
import queue
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import InferResult
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from tests.utils import RemoteServer

# Triton's add_sub, its arithmetic in a module beside model.py (Triton puts the version
# directory on sys.path); sub_add has a helper module of the same name doing the opposite.
ADD_SUB = """
import json

import triton_python_backend_utils as pb_utils
from helper import combine


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        out0 = pb_utils.get_output_config_by_name(self.model_config, "OUTPUT0")
        self.dtype = pb_utils.triton_string_to_numpy(out0["data_type"])
        pb_utils.Logger.log("add_sub: initialized", pb_utils.Logger.INFO)
        pb_utils.Logger.log("add_sub: verbose", pb_utils.Logger.LogLevel.VERBOSE)

    def execute(self, requests):
        responses = []
        for request in requests:
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            in_1 = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            out_0, out_1 = combine(in_0, in_1)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT0", out_0.astype(self.dtype)),
                pb_utils.Tensor("OUTPUT1", out_1.astype(self.dtype)),
            ]))
        return responses
"""

ADD_SUB_CONFIG = """
backend: "python"
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
input [ { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
instance_group [{ kind: KIND_CPU }]
"""

# Triton's decoupled "square": IN answers of OUT = IN from a thread, then the final flag
# alone.
SQUARE = """
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            count = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            threading.Thread(
                target=self.answer, args=(request.get_response_sender(), count), daemon=True
            ).start()
        return None

    def answer(self, sender, count):
        for _ in range(count[0]):
            out = pb_utils.Tensor("OUT", np.array([count[0]], np.int32))
            sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""

SQUARE_CONFIG = """
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: True }
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

# A decoupled model that answers until its client goes (Triton's request cancellation:
# the sender's is_cancelled), then says so in the log.
ENDLESS = """
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self.answer, args=(request,), daemon=True).start()
        return None

    def answer(self, request):
        sender = request.get_response_sender()
        for index in range(500):
            if sender.is_cancelled() and request.is_cancelled():
                pb_utils.Logger.log_info(f"endless: cancelled after {index} answers")
                break
            out = pb_utils.Tensor("OUT", np.array([index], np.int32))
            sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
            time.sleep(0.01)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""

# Triton's bls_decoupled, sync and async: SUM of square's answers (twice, async).
BLS_DECOUPLED_SYNC = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        count = pb_utils.get_input_tensor_by_name(requests[0], "IN")
        request = pb_utils.InferenceRequest(
            model_name="square_int32", inputs=[count], requested_output_names=["OUT"]
        )
        total = np.array([0])
        for response in request.exec(decoupled=True):
            if response.has_error():
                raise pb_utils.TritonModelException(response.error().message())
            if len(response.output_tensors()) > 0:
                total += pb_utils.get_output_tensor_by_name(response, "OUT").as_numpy()
        return [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("SUM", total)])]
"""

BLS_DECOUPLED_ASYNC = """
import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        count = pb_utils.get_input_tensor_by_name(requests[0], "IN")
        calls = [
            pb_utils.InferenceRequest(
                model_name="square_int32", inputs=[count], requested_output_names=["OUT"]
            ).async_exec(decoupled=True)
            for _ in range(2)
        ]
        total = np.array([0])
        for responses in await asyncio.gather(*calls):
            for response in responses:
                if response.has_error():
                    raise pb_utils.TritonModelException(response.error().message())
                if len(response.output_tensors()) > 0:
                    total += pb_utils.get_output_tensor_by_name(response, "OUT").as_numpy()
        return [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("SUM", total)])]
"""

BLS_DECOUPLED_CONFIG = """
backend: "python"
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "SUM" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

# Triton's bls example: the model to call named by a BYTES input (bytes in numpy).
BLS_SYNC = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            name = pb_utils.get_input_tensor_by_name(request, "MODEL_NAME").as_numpy()[0]
            call = pb_utils.InferenceRequest(
                model_name=name,
                requested_output_names=["OUTPUT0", "OUTPUT1"],
                inputs=[
                    pb_utils.get_input_tensor_by_name(request, "INPUT0"),
                    pb_utils.get_input_tensor_by_name(request, "INPUT1"),
                ],
            )
            response = call.exec()
            if response.has_error():
                raise pb_utils.TritonModelException(response.error().message())
            responses.append(pb_utils.InferenceResponse(response.output_tensors()))
        return responses
"""

BLS_SYNC_CONFIG = """
backend: "python"
input [ { name: "MODEL_NAME" data_type: TYPE_STRING dims: [ 1 ] } ]
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
input [ { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""

# One model, an API each by MODE: 0 the sender of a model that is not decoupled, 1
# rescheduling, 2 is_model_ready, 3 a raised TritonModelException, 4 a cancelled
# decoupled call (the code of its last answer), 5 a plain exec of a decoupled model (its
# error passed on), 6 exec(decoupled=True) of a model that is not (its one answer).
MISC = """
import numpy as np
import triton_python_backend_utils as pb_utils


def answer(value):
    return pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array([value], np.int32))])


class TritonPythonModel:
    def execute(self, requests):
        mode = int(pb_utils.get_input_tensor_by_name(requests[0], "MODE").as_numpy()[0])
        if mode == 0:
            for request in requests:
                sender = request.get_response_sender()
                assert not sender.is_cancelled()
                sender.send(answer(7), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return None
        if mode == 1:
            requests[0].set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
        if mode == 2:
            ready = pb_utils.is_model_ready("add_sub") and not pb_utils.is_model_ready("nope")
            return [answer(int(ready))]
        if mode == 3:
            raise pb_utils.TritonModelException("MODE 3 is refused by the model")
        if mode in (5, 6):
            call = pb_utils.InferenceRequest(
                model_name="square_int32" if mode == 5 else "auto_complete",
                inputs=[
                    pb_utils.Tensor(name, np.ones([1, 4], np.float32))
                    for name in ("INPUT0", "INPUT1")
                ] if mode == 6 else [pb_utils.Tensor("IN", np.array([2], np.int32))],
                requested_output_names=["OUT"] if mode == 5 else ["OUTPUT0"],
            )
            if mode == 5:
                raise pb_utils.TritonModelException(call.exec().error().message())
            (only,) = list(call.exec(decoupled=True))
            return [answer(int(only.output_tensors()[0].as_numpy().sum()))]
        count = pb_utils.Tensor("IN", np.array([1000], np.int32))
        call = pb_utils.InferenceRequest(
            model_name="square_int32", inputs=[count], requested_output_names=["OUT"]
        )
        responses = call.exec(decoupled=True)
        first = next(responses)
        assert first.output_tensors()
        responses.cancel()
        last = list(responses)[-1]
        return [answer(last.error().code())]
"""

MISC_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "MODE" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

# Triton's auto_complete example against a config that lists one of its two inputs.
AUTO_COMPLETE = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        inputs = [
            {"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]},
            {"name": "INPUT1", "data_type": "TYPE_FP32", "dims": [4]},
        ]
        outputs = [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]}]
        config = auto_complete_model_config.as_dict()
        assert config["name"] == "auto_complete"
        input_names = [tensor["name"] for tensor in config["input"]]
        output_names = [tensor["name"] for tensor in config["output"]]
        for tensor in inputs:
            if tensor["name"] not in input_names:
                auto_complete_model_config.add_input(tensor)
        for tensor in outputs:
            if tensor["name"] not in output_names:
                auto_complete_model_config.add_output(tensor)
        auto_complete_model_config.set_max_batch_size(4)
        auto_complete_model_config.set_dynamic_batching()
        return auto_complete_model_config

    def execute(self, requests):
        responses = []
        for request in requests:
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            in_1 = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", in_0 + in_1)]))
        return responses
"""

AUTO_COMPLETE_CONFIG = """
backend: "python"
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""


def _model(repo: Path, name: str, config: str, source: str, **beside: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(config)
    (repo / name / "1" / "model.py").write_text(source)
    for module, text in beside.items():
        (repo / name / "1" / f"{module}.py").write_text(text)


def build_repository(root: Path) -> Path:
    repo = root / "repo"
    _model(
        repo,
        "add_sub",
        ADD_SUB_CONFIG,
        ADD_SUB,
        helper="def combine(a, b):\n    return a + b, a - b\n",
    )
    _model(
        repo,
        "sub_add",
        ADD_SUB_CONFIG,
        ADD_SUB,
        helper="def combine(a, b):\n    return a - b, a + b\n",
    )
    _model(repo, "square_int32", SQUARE_CONFIG, SQUARE)
    _model(repo, "bls_decoupled_sync", BLS_DECOUPLED_CONFIG, BLS_DECOUPLED_SYNC)
    _model(repo, "bls_decoupled_async", BLS_DECOUPLED_CONFIG, BLS_DECOUPLED_ASYNC)
    _model(repo, "bls_sync", BLS_SYNC_CONFIG, BLS_SYNC)
    _model(repo, "misc", MISC_CONFIG, MISC)
    _model(repo, "auto_complete", AUTO_COMPLETE_CONFIG, AUTO_COMPLETE)
    _model(repo, "endless", SQUARE_CONFIG, ENDLESS)
    return repo


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    root = tmp_path_factory.mktemp("python_examples")
    with RemoteServer(build_repository(root), ["--trust-pickle"], log_dir=root) as running:
        yield running


def _infer(server: RemoteServer, model: str, **arrays: np.ndarray) -> httpclient.InferResult:
    client = httpclient.InferenceServerClient(server.http_address)
    try:
        tensors = []
        for name, array in arrays.items():
            tensor = httpclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        return client.infer(model, tensors)
    finally:
        client.close()


X = np.arange(4, dtype=np.float32)
Y = np.full(4, 10, dtype=np.float32)


def test_helper_modules_beside_model_py_import_each_its_own(server: RemoteServer) -> None:
    added = _infer(server, "add_sub", INPUT0=X, INPUT1=Y)
    assert added.as_numpy("OUTPUT0").tolist() == (X + Y).tolist()
    subtracted = _infer(server, "sub_add", INPUT0=X, INPUT1=Y)
    assert subtracted.as_numpy("OUTPUT0").tolist() == (X - Y).tolist()
    assert "add_sub: initialized" in server.log_path.read_text()


def test_bls_names_the_model_to_call_from_a_bytes_input(server: RemoteServer) -> None:
    name = np.array([b"sub_add"], dtype=object)
    result = _infer(server, "bls_sync", MODEL_NAME=name, INPUT0=X, INPUT1=Y)
    assert result.as_numpy("OUTPUT1").tolist() == (X + Y).tolist()


@pytest.mark.parametrize("model,calls", [("bls_decoupled_sync", 1), ("bls_decoupled_async", 2)])
def test_exec_decoupled_iterates_a_decoupled_models_answers(
    server: RemoteServer, model: str, calls: int
) -> None:
    for count in (3, 0):
        result = _infer(server, model, IN=np.array([count], np.int32))
        assert result.as_numpy("SUM").tolist() == [calls * count * count]


def test_exec_decoupled_cancel_ends_with_a_cancelled_answer(server: RemoteServer) -> None:
    result = _infer(server, "misc", MODE=np.array([4], np.int32))
    assert result.as_numpy("Y").tolist() == [7]  # TritonError.CANCELLED


def test_a_model_that_is_not_decoupled_may_answer_through_its_sender(
    server: RemoteServer,
) -> None:
    result = _infer(server, "misc", MODE=np.array([0], np.int32))
    assert result.as_numpy("Y").tolist() == [7]
    client = grpcclient.InferenceServerClient(server.grpc_address)
    try:
        tensor = grpcclient.InferInput("MODE", [1], "INT32")
        tensor.set_data_from_numpy(np.array([0], np.int32))
        assert client.infer("misc", [tensor]).as_numpy("Y").tolist() == [7]
    finally:
        client.close()


def test_is_model_ready_asks_the_server(server: RemoteServer) -> None:
    result = _infer(server, "misc", MODE=np.array([2], np.int32))
    assert result.as_numpy("Y").tolist() == [1]


def test_exec_decoupled_of_a_model_that_is_not_gives_its_one_answer(
    server: RemoteServer,
) -> None:
    result = _infer(server, "misc", MODE=np.array([6], np.int32))
    assert result.as_numpy("Y").tolist() == [8]


@pytest.mark.parametrize(
    "mode,message",
    [
        (1, "set_release_flags: Slipstream does not reschedule requests"),
        (3, "MODE 3 is refused by the model"),
        (5, "'square_int32' is decoupled (it may answer any number of times); call exec("),
    ],
)
def test_a_model_exceptions_message_reaches_the_client(
    server: RemoteServer, mode: int, message: str
) -> None:
    with pytest.raises(InferenceServerException) as raised:
        _infer(server, "misc", MODE=np.array([mode], np.int32))
    assert raised.value.status() == "500"
    assert message in str(raised.value.message())


def test_auto_complete_config_adds_to_the_tensors_a_config_lists(server: RemoteServer) -> None:
    config = server.http.get("/v2/models/auto_complete/config").json()
    assert [tensor["name"] for tensor in config["input"]] == ["INPUT0", "INPUT1"]
    assert config["max_batch_size"] == 4
    result = _infer(server, "auto_complete", INPUT0=X[None], INPUT1=Y[None])
    assert result.as_numpy("OUTPUT0").tolist() == [(X + Y).tolist()]
    assert json.dumps(config["output"][0]["dims"]) == "[4]"


def test_a_decoupled_model_sees_its_client_go(server: RemoteServer) -> None:
    answers: queue.Queue[InferResult | None] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_address)
    client.start_stream(callback=lambda result, error: answers.put(result))
    try:
        tensor = grpcclient.InferInput("IN", [1], "INT32")
        tensor.set_data_from_numpy(np.array([1], np.int32))
        client.async_stream_infer("endless", [tensor])
        for _ in range(2):
            assert answers.get(timeout=10) is not None
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    deadline = time.monotonic() + 3
    while "endless: cancelled after" not in server.log_path.read_text():
        assert time.monotonic() < deadline, "the model never saw its client go"
        time.sleep(0.05)
