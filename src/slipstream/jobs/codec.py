"""How a job's request and status are written: the request as a V2 binary body (tensors
as raw bytes, not JSON numbers), the status as the JSON ``GET /v2/jobs/{id}`` answers.

A stored request is read back with the server's own codec
(:func:`slipstream.protocol.v2.decode_infer_request`), so a worker decodes exactly what
the server accepted:

>>> import numpy as np
>>> from slipstream.protocol.v2 import decode_infer_request
>>> request = InferRequest("m", "", {"x": np.arange(3, dtype=np.float32)}, id="7")
>>> body, header_length = encode_stored_request(request)
>>> len(body) - header_length  # 3 FP32 values: 12 bytes
12
>>> decode_infer_request(body, header_length, "m", "").inputs["x"]
array([0., 1., 2.], dtype=float32)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import orjson

from slipstream.datatypes import v2_datatype
from slipstream.errors import InvalidRequest
from slipstream.types import InferRequest

_LENGTH_PREFIX = struct.Struct("<I")
JobState = Literal["pending", "done", "failed"]


@dataclass(frozen=True, slots=True)
class JobStatus:
    """One job as its record in Redis holds it."""

    job_id: str
    state: JobState
    model_name: str
    # "" when the job lets the worker pick the newest version.
    model_version: str
    # Times a worker started the job (more than one after a crash or a retried fault).
    attempts: int
    # The V2 JSON inference response, when done.
    result: bytes = b""
    # Why it failed, and the HTTP status the same failure has on the synchronous route.
    error: str = ""
    error_status: int = 0


def encode_stored_request(request: InferRequest) -> tuple[bytes, int]:
    """``request`` as a V2 binary-extension body: ``(body, json_header_length)``.

    Every input's data is raw (little-endian, row-major; BYTES elements length-prefixed),
    so an FP32 tensor costs 4 bytes a value in Redis instead of its JSON text. Outputs are
    asked for as JSON: a job's result is read back as JSON (``GET /v2/jobs/{id}``).
    """
    inputs: list[dict[str, Any]] = []
    payloads: list[bytes] = []
    for name, array in request.inputs.items():
        datatype = v2_datatype(array.dtype)
        if datatype == "BYTES":
            data = b"".join(
                _LENGTH_PREFIX.pack(len(item)) + item for item in map(_as_bytes, array.ravel())
            )
        else:
            data = np.ascontiguousarray(array).tobytes()
        inputs.append({"name": name, "datatype": datatype, "shape": list(array.shape),
                       "parameters": {"binary_data_size": len(data)}})  # fmt: skip
        payloads.append(data)
    parameters = dict(request.parameters)
    if request.priority:
        parameters["priority"] = request.priority
    if request.timeout_us:
        parameters["timeout"] = request.timeout_us
    doc: dict[str, Any] = {"inputs": inputs}
    if request.id:
        doc["id"] = request.id
    if parameters:
        doc["parameters"] = parameters
    if request.outputs:
        doc["outputs"] = [{"name": out.name} for out in request.outputs]
    header = orjson.dumps(doc)
    return b"".join([header, *payloads]), len(header)


def encode_status(status: JobStatus) -> bytes:
    """The JSON of ``GET /v2/jobs/{id}``: the job's state, and its V2 inference response
    (``result``) when done or its error when failed.

    >>> encode_status(JobStatus("j1", "pending", "m", "", 0))
    b'{"job_id":"j1","status":"pending","model_name":"m","model_version":"","attempts":0}'
    """
    doc: dict[str, Any] = {
        "job_id": status.job_id,
        "status": status.state,
        "model_name": status.model_name,
        "model_version": status.model_version,
        "attempts": status.attempts,
    }
    if status.state == "failed":
        doc["error"] = status.error
        doc["error_status"] = status.error_status
    body = orjson.dumps(doc)
    if status.state != "done":
        return body
    # The stored response is already V2 JSON: spliced in, not parsed and written again.
    return body[:-1] + b',"result":' + status.result + b"}"


def _as_bytes(item: Any) -> bytes:
    if isinstance(item, bytes):
        return item
    if isinstance(item, str):
        return item.encode()
    raise InvalidRequest(f"BYTES input elements must be bytes or str, got {type(item).__name__}")
