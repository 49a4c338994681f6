"""A Python model's ``execute`` gets a batch as its requests (Triton's contract): each
with its id, parameters, requested outputs, sequence id and flags; one call for the
batch; a raise retried request by request except within sequences."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from slipstream.config import ConfigError
from slipstream.errors import InternalError, InvalidRequest
from slipstream.runtime.base import RequestContext
from slipstream.runtime.python_model import PythonBackend
from slipstream.scheduling.execution import Pending, execute

SOURCE = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils

CALLS = []


class TritonPythonModel:
    def execute(self, requests):
        CALLS.append(len(requests))
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            parameters = json.loads(request.parameters())
            if parameters.get("raise"):
                raise RuntimeError("asked to raise")
            if parameters.get("code") is not None:
                error = pb_utils.TritonError("refused", parameters["code"])
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            flags = request.flags()
            made = {
                "Y": x + float(parameters.get("add", 0)),
                "META": np.array(
                    [[f"{request.request_id()}|{request.correlation_id()}|{flags}".encode()]],
                    dtype=object,
                ),
            }
            names = request.requested_output_names()
            tensors = [pb_utils.Tensor(n, made[n]) for n in names]
            responses.append(pb_utils.InferenceResponse(tensors))
        return responses
"""

ASYNC_SOURCE = """
import asyncio

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        await asyncio.sleep(0)
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * 2)]
            )
            for r in requests
        ]
"""

CONFIG = {
    "name": "m",
    "max_batch_size": 4,
    "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [1]}],
    "output": [
        {"name": "Y", "data_type": "TYPE_FP32", "dims": [1]},
        {"name": "META", "data_type": "TYPE_STRING", "dims": [1]},
    ],
}


def _backend(tmp_path: Path, source: str = SOURCE) -> PythonBackend:
    path = tmp_path / "m" / "1" / "model.py"
    path.parent.mkdir(parents=True)
    path.write_text(source)
    backend = PythonBackend.load(path, {}, 1)
    assert isinstance(backend, PythonBackend)
    backend.configure(CONFIG)
    return backend


def _x(value: float) -> dict[str, np.ndarray]:
    return {"X": np.array([[value]], dtype=np.float32)}


def _pending(value: float, context: RequestContext) -> Pending:
    loop = asyncio.new_event_loop()
    try:
        future = loop.create_future()
    finally:
        loop.close()
    return Pending(_x(value), 1, ((1,),), 0, future, 0, context=context)


def test_each_request_comes_with_its_own_context(tmp_path: Path) -> None:
    backend = _backend(tmp_path)
    requests = [
        (_x(1), RequestContext(id="a", parameters={"add": 1})),
        (_x(1), RequestContext(id="b", parameters={"add": 5}, outputs=("Y",))),
        (_x(2), RequestContext(correlation_id=7, sequence_start=True)),
        (_x(3), RequestContext(correlation_id="s", sequence_end=True)),
    ]
    first, second, third, fourth = backend.run_requests(requests, ["Y", "META"])
    assert isinstance(first, dict) and isinstance(second, dict)
    assert isinstance(third, dict) and isinstance(fourth, dict)
    np.testing.assert_array_equal(first["Y"], [[2.0]])
    assert first["META"].tolist() == [[b"a|0|0"]]
    assert list(second) == ["Y"]  # only what it asked for
    np.testing.assert_array_equal(second["Y"], [[6.0]])
    assert third["META"].tolist() == [[b"|7|1"]]  # TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
    assert fourth["META"].tolist() == [[b"|s|2"]]  # ..._END
    calls = type(backend._model).execute.__globals__["CALLS"]
    assert calls == [4]  # one execute call for the batch


def test_error_responses_fail_their_request_only(tmp_path: Path) -> None:
    backend = _backend(tmp_path)
    outcomes = backend.run_requests(
        [
            (_x(1), RequestContext(parameters={"code": 3})),  # INVALID_ARG
            (_x(1), RequestContext(parameters={"code": 1})),  # INTERNAL
            (_x(1), RequestContext()),
        ],
        ["Y", "META"],
    )
    assert isinstance(outcomes[0], InvalidRequest) and "refused" in str(outcomes[0])
    assert isinstance(outcomes[1], InternalError) and "refused" in str(outcomes[1])
    assert isinstance(outcomes[2], dict)


def test_a_raise_is_retried_per_request_except_in_sequences(tmp_path: Path) -> None:
    backend = _backend(tmp_path)
    batch = [
        _pending(1, RequestContext(parameters={"raise": True})),
        _pending(2, RequestContext()),
    ]
    result = execute(backend, batch, ["Y", "META"])
    assert isinstance(result.outcomes[0], RuntimeError)
    assert isinstance(result.outcomes[1], dict)
    np.testing.assert_array_equal(result.outcomes[1]["Y"], [[2.0]])
    # Requests of sequences are not run twice (a stateful model would count them twice).
    sequences = [
        _pending(1, RequestContext(parameters={"raise": True}, correlation_id=1)),
        _pending(2, RequestContext(correlation_id=2)),
    ]
    result = execute(backend, sequences, ["Y", "META"])
    assert all(isinstance(outcome, RuntimeError) for outcome in result.outcomes)


def test_async_execute_and_a_wrong_response_count(tmp_path: Path) -> None:
    backend = _backend(tmp_path, ASYNC_SOURCE)
    (answer,) = backend.run_requests([(_x(3), RequestContext(outputs=("Y",)))], ["Y", "META"])
    assert isinstance(answer, dict)
    np.testing.assert_array_equal(answer["Y"], [[6.0]])
    backend.close()
    short = _backend(tmp_path / "short", SOURCE.replace("return responses", "return responses[:1]"))
    # The model's fault: each request of the call fails with it, none is run again alone.
    answers = short.run_requests(
        [(_x(1), RequestContext()), (_x(1), RequestContext())], ["Y", "META"]
    )
    assert [type(answer) for answer in answers] == [InternalError, InternalError]
    assert all("execute returned 1 responses for 2 requests" in str(a) for a in answers)


def test_exec_outside_a_server_is_an_error_response(tmp_path: Path) -> None:
    from slipstream.runtime import python_utils

    request = python_utils.InferenceRequest(model_name="other", inputs=[])
    answer = request.exec()
    assert answer.has_error()
    error = answer.error()
    assert error is not None and "works inside initialize and execute only" in error.message()


AUTO_COMPLETE = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        config = auto_complete_model_config.as_dict()
        have = {tensor["name"] for tensor in config["input"]}
        x = {"name": "X", "data_type": "TYPE_FP32", "dims": [2]}
        if "X" not in have:
            auto_complete_model_config.add_input(x)
        y = {"name": "Y", "data_type": "TYPE_INT64", "dims": [2]}
        auto_complete_model_config.add_output(y)
        auto_complete_model_config.set_max_batch_size(8)
        auto_complete_model_config.set_dynamic_batching()
        return auto_complete_model_config

    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())]
            )
            for r in requests
        ]
"""


def test_auto_complete_config_declares_what_the_config_leaves_out(tmp_path: Path) -> None:
    from slipstream.config import parse_model_config
    from slipstream.repository.autocomplete import complete_config

    path = tmp_path / "m" / "1" / "model.py"
    path.parent.mkdir(parents=True)
    path.write_text(AUTO_COMPLETE)
    backend = PythonBackend.load(path, {}, 1)
    signature = backend.signature()
    completed = complete_config(parse_model_config({}, "m"), signature, "python")
    assert completed.max_batch_size == 8
    assert [(t.name, t.data_type, t.dims) for t in completed.input] == [("X", "FP32", [2])]
    assert [(t.name, t.data_type, t.dims) for t in completed.output] == [("Y", "INT64", [2])]
    # A config that says otherwise is refused, naming the tensor.
    wrong = {"input": [{"name": "X", "data_type": "TYPE_INT32", "dims": [2]}]}
    with pytest.raises(ConfigError, match="input 'X': data_type INT32 in the config"):
        complete_config(parse_model_config(wrong, "m"), signature, "python")


def test_metric_families_follow_their_kind() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from slipstream.runtime import python_utils as pb
    from slipstream.runtime.python_metrics import COLLECTOR, MetricError

    registry = CollectorRegistry()
    registry.register(COLLECTOR)
    counter = pb.MetricFamily("unit_counted", "Counted", pb.MetricFamily.COUNTER)
    one = counter.Metric(labels={"model": "m"})
    one.increment(2)
    # Declared again (a model loaded again): the same family and series.
    again = pb.MetricFamily("unit_counted", "Counted", pb.MetricFamily.COUNTER)
    again.Metric(labels={"model": "m"}).increment(1)
    assert one.value() == 3
    with pytest.raises(MetricError, match="a counter only goes up"):
        one.increment(-1)
    with pytest.raises(MetricError, match="only a gauge is set"):
        one.set(1)
    with pytest.raises(MetricError, match="already declared of another kind"):
        pb.MetricFamily("unit_counted", "Counted", pb.MetricFamily.GAUGE)
    with pytest.raises(MetricError, match="are the server's own"):
        pb.MetricFamily("nv_inference_count", "mine", pb.MetricFamily.GAUGE)
    histogram = pb.MetricFamily("unit_seconds", "Seconds", pb.MetricFamily.HISTOGRAM)
    with pytest.raises(MetricError, match="needs buckets"):
        histogram.Metric()
    seconds = histogram.Metric(labels={"step": "a"}, buckets=[1.0, 0.1])
    for value in (0.05, 0.5, 5.0):
        seconds.observe(value)
    text = generate_latest(registry).decode()
    assert 'unit_counted{model="m"} 3.0' in text
    assert 'unit_seconds_bucket{le="0.1",step="a"} 1.0' in text
    assert 'unit_seconds_bucket{le="1.0",step="a"} 2.0' in text
    assert 'unit_seconds_bucket{le="+Inf",step="a"} 3.0' in text
    assert 'unit_seconds_sum{step="a"} 5.55' in text


def test_exec_gives_up_when_the_servers_loop_stops() -> None:
    import threading
    import time

    from slipstream.runtime import python_bls
    from slipstream.runtime import python_utils as pb
    from slipstream.types import InferRequest, InferResponse

    loop = asyncio.new_event_loop()
    started = asyncio.Event()

    async def never(request: InferRequest) -> InferResponse:
        started.set()
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    runner = threading.Thread(target=loop.run_forever)
    runner.start()

    def stop_once_called() -> None:
        while not started.is_set():
            time.sleep(0.01)
        loop.call_soon_threadsafe(loop.stop)

    stopper = threading.Thread(target=stop_once_called)
    stopper.start()
    try:
        with python_bls.bound(never, loop, "m"):
            answer = pb.InferenceRequest(model_name="other").exec()
    finally:
        stopper.join()
        runner.join()
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()
    error = answer.error()
    assert error is not None and "shutting down" in error.message()


def test_tensors_cross_dlpack_both_ways_as_tritons_examples_pass_them() -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.dlpack import from_dlpack, to_dlpack

    from slipstream.runtime import python_utils as pb

    source = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    # Triton's BLS examples: pb_utils.Tensor.from_dlpack(name, to_dlpack(tensor)).
    tensor = pb.Tensor.from_dlpack("X", to_dlpack(source))
    np.testing.assert_array_equal(tensor.as_numpy(), source.numpy())
    assert pb.Tensor.from_dlpack("X", source).shape() == [2, 3]
    back = from_dlpack(pb.Tensor("Y", np.ones((2, 2), np.float32)).to_dlpack())
    assert back.sum().item() == 4.0


async def test_only_a_python_model_may_be_decoupled(tmp_path: Path) -> None:
    from slipstream.config import parse_model_config
    from slipstream.observability.metrics import ServerMetrics
    from slipstream.repository.triton_config import parse_triton_config
    from slipstream.serving.model import ModelVersion
    from tests.models import build_identity

    path = build_identity(tmp_path, "FP32")
    translated = parse_triton_config("model_transaction_policy { decoupled: true }", "p")
    assert translated["model_transaction_policy"] == {"decoupled": True}
    config = parse_model_config(translated, "m")
    metrics = ServerMetrics().for_model("m", "1")
    with pytest.raises(ConfigError, match=r"only a Python model .* sends its answers itself"):
        await ModelVersion.load("m", 1, path, config, metrics)
