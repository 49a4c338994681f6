"""``pb_utils`` as Triton's own Python backend examples and README call it: its datatype
tables and BYTES codecs, ``ModelConfig`` built from JSON and merging a tensor added
twice, the logger's levels, names given as bytes, response parameters, the DLPack
protocol, rescheduling refused by name, ``exec(decoupled=True)`` outside a server, and
the response sender of a model that is not decoupled."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from slipstream.errors import InternalError
from slipstream.runtime import python_utils as pb_utils
from slipstream.runtime.base import RequestContext
from slipstream.runtime.python_model import PythonBackend


def test_bytes_codecs_and_datatype_numbers_are_tritons() -> None:
    strings = np.array([[b"ab", "\u00e9"], [b"", b"xyz"]], dtype=object)
    encoded = pb_utils.serialize_byte_tensor(strings)
    assert encoded[:6] == b"\x02\x00\x00\x00ab"
    decoded = pb_utils.deserialize_bytes_tensor(encoded)
    assert decoded.tolist() == [b"ab", "\u00e9".encode(), b"", b"xyz"]
    assert pb_utils.serialize_byte_tensor(np.array([], dtype=object)) == ()
    assert pb_utils.serialize_byte_tensor(np.zeros(2, np.float32)) is None
    assert pb_utils.triton_to_numpy_type(11) is np.float32
    assert pb_utils.triton_to_numpy_type(13) is np.object_
    assert pb_utils.numpy_to_triton_type(np.int32) == 8
    assert pb_utils.numpy_to_triton_type(np.bytes_) == 13
    assert pb_utils.TRITON_STRING_TO_NUMPY["TYPE_STRING"] is np.object_


def test_model_config_from_json_merges_a_tensor_added_again() -> None:
    config = pb_utils.ModelConfig(json.dumps({"name": "m", "input": [], "output": []}))
    tensor = {"name": "X", "data_type": "TYPE_FP32", "dims": [4]}
    config.add_input(tensor)
    config.add_input(dict(tensor))  # Triton merges an equal one
    assert config.as_dict()["input"] == [tensor]
    with pytest.raises(pb_utils.TritonModelException, match="already there as TYPE_FP32"):
        config.add_input({"name": "X", "data_type": "TYPE_INT32", "dims": [4]})


def test_logger_levels(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="slipstream.python_model"):
        pb_utils.Logger.log("warned", pb_utils.Logger.WARNING)
        pb_utils.Logger.log("verbose", pb_utils.Logger.LogLevel.VERBOSE)
        pb_utils.Logger.log("plain")
    levels = {record.getMessage(): record.levelno for record in caplog.records}
    assert levels == {"warned": logging.WARNING, "verbose": logging.DEBUG, "plain": logging.INFO}


def test_requests_and_responses_take_what_tritons_take() -> None:
    request = pb_utils.InferenceRequest(
        model_name=b"other", inputs=[], requested_output_names=[b"Y"], request_id=b"r"
    )
    assert (request.model_name(), request.requested_output_names(), request.request_id()) == (
        "other",
        ["Y"],
        "r",
    )
    request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL)  # the default
    with pytest.raises(pb_utils.TritonModelException, match="does not reschedule"):
        request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
    response = pb_utils.InferenceResponse(output_tensors=[], parameters={"k": 1})
    assert json.loads(response.parameters()) == {"k": 1}
    tensor = pb_utils.Tensor("T", np.arange(3, dtype=np.int32))
    assert np.from_dlpack(tensor).tolist() == [0, 1, 2]  # __dlpack__ / __dlpack_device__


def test_exec_decoupled_outside_a_server_iterates_one_error() -> None:
    request = pb_utils.InferenceRequest(model_name="other", inputs=[])
    answers = list(request.exec(decoupled=True))
    assert len(answers) == 1 and answers[0].has_error()
    error = answers[0].error()
    assert error is not None and error.code() == pb_utils.TritonError.UNSUPPORTED
    with pytest.raises(pb_utils.TritonModelException, match="inside initialize and execute"):
        pb_utils.is_model_ready("other")


SENDER = """
import numpy as np
import triton_python_backend_utils as pb_utils

SENDERS = []


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            sender = request.get_response_sender()
            SENDERS.append(sender)
            if x[0] >= 0:
                answer = pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 2)])
                sender.send(answer, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


def test_a_model_that_is_not_decoupled_answers_through_its_sender(tmp_path: Path) -> None:
    path = tmp_path / "m" / "1" / "model.py"
    path.parent.mkdir(parents=True)
    path.write_text(SENDER)
    backend = PythonBackend.load(path, {}, 1)
    assert isinstance(backend, PythonBackend)
    backend.configure({
        "name": "m",
        "input": [{"name": "X", "data_type": "TYPE_INT32", "dims": [1]}],
        "output": [{"name": "Y", "data_type": "TYPE_INT32", "dims": [1]}],
    })  # fmt: skip
    requests = [({"X": np.array([value], np.int32)}, RequestContext()) for value in (1, 2)]
    first, second = backend.run_requests(requests, ["Y"])
    assert isinstance(first, dict) and first["Y"].tolist() == [2]
    assert isinstance(second, dict) and second["Y"].tolist() == [4]
    # One request left unanswered: it fails, naming what is missing; the other is answered.
    some = [({"X": np.array([value], np.int32)}, RequestContext()) for value in (1, -1)]
    answered, unanswered = backend.run_requests(some, ["Y"])
    assert isinstance(answered, dict) and answered["Y"].tolist() == [2]
    assert isinstance(unanswered, InternalError)
    assert "sent no response for this request" in str(unanswered)
    # After execute the sender is closed: a late answer is refused by name.
    late = type(backend._model).execute.__globals__["SENDERS"][-1]
    with pytest.raises(pb_utils.TritonModelException, match="before execute returns"):
        late.send(pb_utils.InferenceResponse([]))


def test_a_bls_request_to_a_stateful_model_names_its_sequence() -> None:
    from slipstream.runtime import python_bls

    flags = pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
    request = pb_utils.InferenceRequest(
        model_name="counter", inputs=[], correlation_id="ex-4", flags=flags, parameters={"k": 1}
    )
    v2 = python_bls._to_v2(request)
    assert v2.parameters == {
        "k": 1,
        "sequence_id": "ex-4",
        "sequence_start": True,
        "sequence_end": False,
    }
    plain = python_bls._to_v2(pb_utils.InferenceRequest(model_name="m", inputs=[]))
    assert plain.parameters == {}
