"""Triton's ``response_stats`` and ``memory_usage`` statistics, read as Triton users read
them: tritonclient's ``get_inference_statistics`` over HTTP and gRPC (its own generated
messages, so the fields must sit at Triton's field numbers).

A decoupled Python model's responses are counted per index ("0": each request's first
response), each as it ends: with outputs (success), an error (fail), a final flag alone
(empty_response), or the client gone before it (cancel). An ordinary ONNX model answers
each request once and, as in Triton, leaves ``response_stats`` empty; its instances'
weights are its ``memory_usage``.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper, numpy_helper

from tests.models import write_config, write_graph
from tests.utils import RemoteServer

# N >= 0: N answers I = 0..N-1, each after DELAY_S, then the final flag alone.
# N == -1: one answer, then an error answer that is the final one.
# N == -2: one answer, then waits for the client to leave and sends the final flag.
STEPS = """
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

DELAY_S = 0.05


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            sender = request.get_response_sender()
            threading.Thread(target=self._answer, args=(sender, count)).start()
        return None

    def _answer(self, sender, count):
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for index in range(max(count, 1)):
            time.sleep(DELAY_S)
            sender.send(pb_utils.InferenceResponse([_out(index)]))
        if count == -1:
            error = pb_utils.TritonError("the second answer failed")
            sender.send(pb_utils.InferenceResponse(error=error), flags=final)
            return
        if count == -2:
            deadline = time.monotonic() + 20
            while not sender.is_cancelled() and time.monotonic() < deadline:
                time.sleep(0.01)
        sender.send(flags=final)


def _out(index):
    return pb_utils.Tensor("I", np.array([index], dtype=np.int32))
"""

CONFIG = """
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "I" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

DELAY_NS = 50_000_000
ONNX_INSTANCES = 2
_RESPONSE_FIELDS = ["compute_infer", "compute_output", "success", "fail", "empty_response",
                    "cancel"]  # fmt: skip


def _weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "W": rng.standard_normal((16, 8)).astype(np.float32),
        "B": rng.standard_normal(8).astype(np.float32),
        "S": np.full(8, 2.0, np.float32),  # a Constant node's value, an initializer to ORT
    }


def build_repository(root: Path) -> Path:
    repo = root / "repo"
    (repo / "steps" / "1").mkdir(parents=True)
    (repo / "steps" / "1" / "model.py").write_text(STEPS)
    (repo / "steps" / "config.pbtxt").write_text(CONFIG)
    weights = _weights()
    graph = helper.make_graph(
        [
            helper.make_node("Constant", [], ["S"], value=numpy_helper.from_array(weights["S"])),
            helper.make_node("MatMul", ["X", "W"], ["XW"]),
            helper.make_node("Add", ["XW", "B"], ["XWB"]),
            helper.make_node("Mul", ["XWB", "S"], ["Y"]),
        ],
        "dense",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 8])],
        [numpy_helper.from_array(weights[name], name) for name in ("W", "B")],
    )
    write_graph(graph, repo, "dense")
    groups = [{"kind": "KIND_CPU", "count": ONNX_INSTANCES}]
    write_config(repo, "dense", {"max_batch_size": 8, "instance_group": groups})
    assert onnx.load(str(repo / "dense" / "1" / "model.onnx"))  # the file onnx reads back
    return repo


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    root = tmp_path_factory.mktemp("response-stats")
    with RemoteServer(build_repository(root), ["--trust-pickle"], log_dir=root) as running:
        yield running


def _stream(server: RemoteServer, count: int, leave_after: int = 0) -> list[Any]:
    """One request's answers on a gRPC stream (I values, "final", errors); with
    ``leave_after``, the stream is cancelled once that many answers came."""
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_address)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    seen: list[Any] = []
    try:
        tensor = grpcclient.InferInput("N", [1], "INT32")
        tensor.set_data_from_numpy(np.array([count], dtype=np.int32))
        client.async_stream_infer("steps", [tensor], enable_empty_final_response=True)
        while not leave_after or len(seen) < leave_after:
            result, error = answers.get(timeout=30)
            if error is not None:
                seen.append(f"error: {error.message()}")
                break
            response = result.get_response()
            if response.outputs:
                seen.append(int(result.as_numpy("I")[0]))
            if response.parameters["triton_final_response"].bool_param:
                seen.append("final")
                break
    finally:
        client.stop_stream(cancel_requests=bool(leave_after))
        client.close()
    return seen


def _statistics(server: RemoteServer, model: str) -> dict[str, Any]:
    """The model's entry over HTTP, checked equal to gRPC's read at the same moment (a
    cancel may still land between two reads: read again until they agree)."""
    http = httpclient.InferenceServerClient(server.http_address)
    grpc = grpcclient.InferenceServerClient(server.grpc_address)
    try:
        for _ in range(50):
            over_http: dict[str, Any] = http.get_inference_statistics(model)["model_stats"][0]
            over_grpc = grpc.get_inference_statistics(model, as_json=True)["model_stats"][0]
            if _from_grpc(over_grpc) == (over_http["response_stats"], over_http["memory_usage"]):
                return over_http
            time.sleep(0.05)
    finally:
        http.close()
        grpc.close()
    raise AssertionError(f"HTTP and gRPC disagree: {over_http} != {over_grpc}")


def _from_grpc(entry: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """tritonclient's gRPC entry's response_stats and memory_usage as the JSON has them
    (its messages as JSON: uint64 as text, zeros left out)."""
    responses = {
        index: {
            name: {"count": int(figures.get(name, {}).get("count", 0)),
                   "ns": int(figures.get(name, {}).get("ns", 0))}
            for name in _RESPONSE_FIELDS
        }
        for index, figures in entry.get("response_stats", {}).items()
    }  # fmt: skip
    memory = [
        {"type": usage["type"], "id": int(usage.get("id", 0)), "byte_size": int(usage["byte_size"])}
        for usage in entry.get("memory_usage", [])
    ]
    return responses, memory


def _counts(entry: dict[str, Any]) -> dict[str, dict[str, int]]:
    return {
        index: {name: figures[name]["count"] for name in _RESPONSE_FIELDS}
        for index, figures in entry["response_stats"].items()
    }


def _added(before: dict[str, Any], after: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Each index's counts that went up between two readings (those that did only)."""
    old, new = _counts(before), _counts(after)
    added = {}
    for index, counts in new.items():
        grown = {name: count - old.get(index, {}).get(name, 0) for name, count in counts.items()}
        if any(grown.values()):
            added[index] = {name: count for name, count in grown.items() if count}
    return added


def _added_ns(before: dict[str, Any], after: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Each index's durations added between two readings."""
    old = before["response_stats"]
    return {
        index: {
            name: figures[name]["ns"] - old.get(index, {}).get(name, {}).get("ns", 0)
            for name in _RESPONSE_FIELDS
        }
        for index, figures in after["response_stats"].items()
    }


def _ones(*names: str) -> dict[str, int]:
    return dict.fromkeys(names, 1)


def test_each_answer_counts_at_its_index_and_the_final_flag_alone_is_empty(
    server: RemoteServer,
) -> None:
    before = _statistics(server, "steps")
    assert _stream(server, 3) == [0, 1, 2, "final"]
    after = _statistics(server, "steps")
    answered = _ones("compute_infer", "compute_output", "success")
    assert _added(before, after) == {
        "0": answered, "1": answered, "2": answered,
        "3": _ones("compute_infer", "empty_response"),
    }  # fmt: skip
    took = _added_ns(before, after)
    # The model sleeps DELAY_NS before each answer, after execute took the request.
    assert took["0"]["compute_infer"] >= DELAY_NS
    for index in ("0", "1", "2"):
        assert took[index]["compute_infer"] > 0 and took[index]["compute_output"] > 0
        infer, output = took[index]["compute_infer"], took[index]["compute_output"]
        assert took[index]["success"] == infer + output
    assert took["3"]["empty_response"] == took["3"]["compute_infer"] > 0


def test_an_error_answer_counts_as_failed_at_its_index(server: RemoteServer) -> None:
    before = _statistics(server, "steps")
    seen = _stream(server, -1)
    assert seen[0] == 0 and "the second answer failed" in seen[1]
    after = _statistics(server, "steps")
    assert _added(before, after) == {
        "0": _ones("compute_infer", "compute_output", "success"),
        "1": _ones("compute_infer", "fail"),
    }
    assert int(after["inference_stats"]["fail"]["count"]) >= 1


def test_a_client_leaving_counts_a_cancel_at_the_answer_it_never_read(
    server: RemoteServer,
) -> None:
    before = _statistics(server, "steps")
    assert _stream(server, -2, leave_after=1) == [0]
    deadline = time.monotonic() + 10
    while "1" not in _added(before, after := _statistics(server, "steps")):
        assert time.monotonic() < deadline, "the stream's cancellation was never counted"
        time.sleep(0.05)
    assert _added(before, after) == {
        "0": _ones("compute_infer", "compute_output", "success"),
        "1": _ones("cancel"),
    }


def test_the_json_has_tritons_fields_in_tritons_order(server: RemoteServer) -> None:
    _stream(server, 1)
    reply = server.http.get("/v2/models/steps/versions/1/stats")
    assert reply.status_code == 200
    entry = reply.json()["model_stats"][0]
    assert list(entry) == ["name", "version", "last_inference", "inference_count",
                           "execution_count", "inference_stats", "response_stats",
                           "batch_stats", "memory_usage"]  # fmt: skip
    assert list(entry["response_stats"]["0"]) == _RESPONSE_FIELDS
    assert entry["response_stats"]["0"]["success"].keys() == {"count", "ns"}
    assert entry["memory_usage"] == []  # a Python model's memory is its own code's


def test_an_onnx_model_reports_its_weights_and_no_response_stats(server: RemoteServer) -> None:
    http = httpclient.InferenceServerClient(server.http_address)
    try:
        tensor = httpclient.InferInput("X", [2, 16], "FP32")
        tensor.set_data_from_numpy(np.ones((2, 16), np.float32))
        http.infer("dense", [tensor])
    finally:
        http.close()
    entry = _statistics(server, "dense")
    assert int(entry["inference_count"]) == 2
    # As Triton's onnxruntime backend: one answer per request, no response statistics.
    assert entry["response_stats"] == {}
    weights = sum(array.nbytes for array in _weights().values())
    assert entry["memory_usage"] == [
        {"type": "CPU", "id": 0, "byte_size": weights * ONNX_INSTANCES}
    ]


def test_the_split_layout_reports_the_engines_response_stats(tmp_path: Path) -> None:
    with RemoteServer(
        build_repository(tmp_path), ["--trust-pickle", "--frontends", "1"], log_dir=tmp_path
    ) as split:
        assert _stream(split, 2) == [0, 1, "final"]
        entry = _statistics(split, "steps")
        assert _counts(entry) == {
            "0": {**dict.fromkeys(_RESPONSE_FIELDS, 0), **_ones(
                "compute_infer", "compute_output", "success")},
            "1": {**dict.fromkeys(_RESPONSE_FIELDS, 0), **_ones(
                "compute_infer", "compute_output", "success")},
            "2": {**dict.fromkeys(_RESPONSE_FIELDS, 0), **_ones(
                "compute_infer", "empty_response")},
        }  # fmt: skip
        dense = _statistics(split, "dense")
        assert dense["memory_usage"][0]["byte_size"] > 0
