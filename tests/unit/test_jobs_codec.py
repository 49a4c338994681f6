"""How a job's request and status are stored (jobs/codec.py): the request read back by
the server's own V2 codec is the request submitted, with its tensors as raw bytes."""

from __future__ import annotations

import doctest

import numpy as np
import orjson
import pytest

from slipstream import names
from slipstream.errors import InvalidRequest
from slipstream.jobs import codec
from slipstream.jobs.codec import JobStatus, encode_status, encode_stored_request
from slipstream.protocol.v2 import decode_infer_request
from slipstream.types import InferRequest, RequestedOutput


def test_a_stored_request_decodes_to_the_request_submitted() -> None:
    request = InferRequest(
        "m", "2",
        {"x": np.arange(6, dtype=np.float16).reshape(2, 3),
         "ids": np.array([[1, -2**40]], np.int64),
         "flags": np.array([True, False]),
         "text": np.array([b"caf\xc3\xa9", b"", b"\x00\xff"], dtype=object)},
        id="r-1", outputs=[RequestedOutput("y", binary_data=True)], priority=2,
        timeout_us=5000, binary_data_output=True, parameters={"custom": "kept"},
    )  # fmt: skip
    body, header_length = encode_stored_request(request)
    back = decode_infer_request(body, header_length, "m", "2")
    assert back.inputs.keys() == request.inputs.keys()
    for name, array in request.inputs.items():
        assert back.inputs[name].dtype == array.dtype and back.inputs[name].shape == array.shape
        assert back.inputs[name].tolist() == array.tolist(), name
    assert (back.id, back.priority, back.timeout_us) == ("r-1", 2, 5000)
    assert back.parameters == {"custom": "kept"}
    # A job's result is read as JSON: outputs are asked for without binary data.
    assert [out.name for out in back.outputs or []] == ["y"]
    assert not back.binary_data_output and back.outputs and back.outputs[0].binary_data is None


def test_tensors_are_stored_as_raw_bytes_not_json_numbers() -> None:
    x = np.random.default_rng(0).standard_normal((64, 384)).astype(np.float32)
    body, header_length = encode_stored_request(InferRequest("m", "", {"x": x}))
    assert len(body) - header_length == x.nbytes
    as_json = orjson.dumps({"inputs": [{"data": x.ravel().tolist()}]})
    assert len(body) < len(as_json) / 2


def test_the_status_carries_the_v2_response_when_done_and_the_error_when_failed() -> None:
    response = b'{"model_name":"m","model_version":"1","outputs":[]}'
    done = orjson.loads(encode_status(JobStatus("j", "done", "m", "", 1, result=response)))
    assert done["status"] == "done" and done["result"] == orjson.loads(response)
    failed = orjson.loads(encode_status(JobStatus("j", "failed", "m", "1", 3, error="no",
                                                  error_status=500)))  # fmt: skip
    assert (failed["error"], failed["error_status"], failed["attempts"]) == ("no", 500, 3)
    assert "result" not in failed


@pytest.mark.parametrize("bad", ["", "a/b", "../x", "-x", "x" * 129, "caf\u00e9", "a b"])
def test_a_bad_job_id_is_refused_naming_where_it_came_from(bad: str) -> None:
    with pytest.raises(InvalidRequest, match="Idempotency-Key"):
        names.check_job_id(bad)


def test_the_docstring_examples_hold() -> None:
    for module in (codec, names):
        assert doctest.testmod(module).failed == 0
