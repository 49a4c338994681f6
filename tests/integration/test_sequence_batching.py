"""A Triton stateful model (``sequence_batching`` with control inputs and implicit state)
served as Triton serves it, through the stock tritonclient: each sequence's requests run
in order with their START / END / CORRID controls and the state the previous one left,
sequences interleaved and batched together; a request outside a running sequence, or
without an id, is refused naming why; an idle sequence is ended."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper, numpy_helper

from tests.models import write_graph
from tests.utils import RemoteServer

CONFIG = """
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [
  { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 1 ] },
  { name: "CORR" data_type: TYPE_FP32 dims: [ 1 ] },
  { name: "ENDED" data_type: TYPE_FP32 dims: [ 1 ] }
]
sequence_batching {
  max_sequence_idle_microseconds: 400000
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_INT64 } ] }
  ]
  state [ { input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_FP32 dims: [ 1 ]
            initial_state { data_type: TYPE_FP32 dims: [ 1 ] zero_data: true name: "zero" } } ]
  oldest { max_candidate_sequences: 8 preferred_batch_size: [ 4 ]
           max_queue_delay_microseconds: 2000 }
}
"""


def build_accumulator(repo: Path) -> None:
    """OUTPUT = INPUT + STATE_IN (STATE_IN ignored on START); STATE_OUT = OUTPUT; CORR and
    ENDED echo the CORRID and END controls."""
    row: list[str | int] = ["batch", 1]
    graph = helper.make_graph(
        [
            helper.make_node("Sub", ["one", "START"], ["keep"]),
            helper.make_node("Mul", ["STATE_IN", "keep"], ["kept"]),
            helper.make_node("Add", ["kept", "INPUT"], ["OUTPUT"]),
            helper.make_node("Identity", ["OUTPUT"], ["STATE_OUT"]),
            helper.make_node("Cast", ["CORRID"], ["CORR"], to=TensorProto.FLOAT),
            helper.make_node("Cast", ["END"], ["ENDED"], to=TensorProto.FLOAT),
        ],
        "accumulate",
        [
            helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, row),
            helper.make_tensor_value_info("START", TensorProto.FLOAT, row),
            helper.make_tensor_value_info("END", TensorProto.INT32, row),
            helper.make_tensor_value_info("CORRID", TensorProto.INT64, row),
            helper.make_tensor_value_info("STATE_IN", TensorProto.FLOAT, row),
        ],
        [
            helper.make_tensor_value_info(name, TensorProto.FLOAT, row)
            for name in ("OUTPUT", "STATE_OUT", "CORR", "ENDED")
        ],
        [numpy_helper.from_array(np.array(1.0, np.float32), "one")],
    )
    write_graph(graph, repo, "accumulate")
    (repo / "accumulate" / "config.pbtxt").write_text(CONFIG)


@pytest.fixture(scope="module", params=[[], ["--frontends", "1"]], ids=["one", "split"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RemoteServer]:
    root = tmp_path_factory.mktemp("sequences")
    build_accumulator(root / "repo")
    with RemoteServer(root / "repo", request.param, log_dir=root) as running:
        yield running


def _send(
    client: object, module: object, value: float, sequence: int, **flags: bool
) -> dict[str, float]:
    tensor = module.InferInput("INPUT", [1, 1], "FP32")  # type: ignore[attr-defined]
    tensor.set_data_from_numpy(np.array([[value]], dtype=np.float32))
    result = client.infer("accumulate", [tensor], sequence_id=sequence, **flags)  # type: ignore[attr-defined]
    return {name: float(result.as_numpy(name)[0, 0]) for name in ("OUTPUT", "CORR", "ENDED")}


def _sequence(
    address: str, module: object, sequence: int, values: list[float]
) -> list[dict[str, float]]:
    client = module.InferenceServerClient(address)  # type: ignore[attr-defined]
    try:
        answers = []
        for index, value in enumerate(values):
            flags = {"sequence_start": index == 0, "sequence_end": index == len(values) - 1}
            answers.append(_send(client, module, value, sequence, **flags))
        return answers
    finally:
        client.close()


def test_interleaved_sequences_each_carry_their_own_state(server: RemoteServer) -> None:
    plans = {100 + n: [float(n + step) for step in range(6)] for n in range(8)}
    with ThreadPoolExecutor(8) as pool:
        futures = {
            sequence: pool.submit(
                _sequence,
                server.grpc_address if sequence % 2 else server.http_address,
                grpcclient if sequence % 2 else httpclient,
                sequence,
                values,
            )
            for sequence, values in plans.items()
        }
        for sequence, future in futures.items():
            answers = future.result()
            assert [a["OUTPUT"] for a in answers] == list(np.cumsum(plans[sequence])), sequence
            assert {a["CORR"] for a in answers} == {float(sequence)}
            assert [a["ENDED"] for a in answers] == [0.0] * 5 + [1.0]


def test_requests_outside_a_running_sequence_are_refused_naming_why(server: RemoteServer) -> None:
    client = httpclient.InferenceServerClient(server.http_address)
    try:
        assert _send(client, httpclient, 2.0, 7, sequence_start=True)["OUTPUT"] == 2.0
        assert _send(client, httpclient, 3.0, 7, sequence_end=True)["OUTPUT"] == 5.0
        # Ended: the next request must start the sequence again.
        with pytest.raises(Exception, match="must set sequence_start on the first request"):
            _send(client, httpclient, 1.0, 7)
        assert _send(client, httpclient, 1.0, 7, sequence_start=True)["OUTPUT"] == 1.0
        # Idle past max_sequence_idle_microseconds (0.4 s): ended too.
        time.sleep(0.6)
        with pytest.raises(Exception, match="idle past max_sequence_idle_microseconds"):
            _send(client, httpclient, 1.0, 7)
    finally:
        client.close()
    body = {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}]}
    answer = server.http.post("/v2/models/accumulate/infer", json=body)
    assert answer.status_code == 400
    assert "parameters.sequence_id: model 'accumulate' is stateful" in answer.json()["error"]
    body["parameters"] = {"sequence_id": 9, "sequence_start": "yes"}
    answer = server.http.post("/v2/models/accumulate/infer", json=body)
    assert answer.status_code == 400
    assert "parameters.sequence_start: expected true or false" in answer.json()["error"]


def test_the_controls_and_state_are_not_the_client_s(server: RemoteServer) -> None:
    metadata = server.http.get("/v2/models/accumulate").json()
    assert [t["name"] for t in metadata["inputs"]] == ["INPUT"]
    assert [t["name"] for t in metadata["outputs"]] == ["OUTPUT", "CORR", "ENDED"]
    config = server.http.get("/v2/models/accumulate/config").json()
    controls = config["sequence_batching"]["control_input"]
    assert [c["name"] for c in controls] == ["START", "END", "CORRID"]
    assert "dynamic_batching" not in config
    grpc = grpcclient.InferenceServerClient(server.grpc_address)
    try:
        sequences = grpc.get_model_config("accumulate", as_json=True)["config"]["sequence_batching"]
        assert sequences["state"][0]["output_name"] == "STATE_OUT"
        assert sequences["control_input"][2]["control"][0]["data_type"] == "TYPE_INT64"
        initial = sequences["state"][0]["initial_state"][0]
        assert (initial["data_type"], initial["zero_data"]) == ("TYPE_FP32", True)
    finally:
        grpc.close()
