"""Triton's generate extension: ``POST /v2/models/<m>[/versions/<v>]/generate`` and
``generate_stream``, a flat JSON form of a request for text-oriented clients (curl
scripts written for Triton's LLM pipelines).

The request is a JSON object whose fields are the model's inputs by name (a string, a
number, a boolean, or an array of them), beside ``id`` and ``parameters`` (the request's
parameters)::

    {"text_input": "What is ML?", "max_tokens": 20, "parameters": {"temperature": 0.1}}

Each value becomes its input's tensor in the input's datatype, shaped as the input's
dims say: a fixed shape must hold exactly the value's elements; with variable dims the
last takes the elements (a batching model's batch dim among them), the others 1. Any
other field is a 400 naming it and the inputs. As in Triton, a ``parameters`` entry named
as an input is that input (``{"parameters": {"stream": true}}`` to a vLLM-style model).
The answer is one JSON object with ``model_name``, ``model_version``, the ``id`` if one
was sent, and each output by name: one element as a JSON scalar (a string for BYTES),
more as a flat array.

``/generate`` answers once: a decoupled model that answers more than once is refused
there, naming ``generate_stream``. ``/generate_stream`` sends each answer as a
server-sent event ``data: {...}`` as it comes (a decoupled model's every answer, any
other model's one); a failure before the first answer is the request's status and
error, a failure after it an event ``data: {"error": ...}``.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import orjson

from slipstream.datatypes import V2_TO_NUMPY
from slipstream.errors import InvalidRequest, SlipstreamError
from slipstream.protocol import v2
from slipstream.server.httpd import HttpResponse, StreamingResponse
from slipstream.serving.service import InferenceService, StreamItem
from slipstream.types import InferRequest, InferResponse, TensorMetadata

# Fields of the request that are not inputs.
_RESERVED = ("id", "parameters")


async def generate(
    service: InferenceService, name: str, version: str, body: bytes, owner: str, stream: bool
) -> HttpResponse | StreamingResponse:
    """Answer one generate (``stream`` False) or generate_stream request."""
    document = v2.load_json_object(body)
    metadata = await service.model_metadata(name, version)
    request = _request(name, version, document, metadata.inputs)
    request.owner = owner
    answers = service.infer_stream(request)
    first = await anext(answers, None)  # an error here is the request's status
    if first is None:
        raise InvalidRequest(f"model {name!r} sent no answer")
    if not stream:
        return await _one_answer(name, request, first, answers)
    return StreamingResponse(200, _events(request, first, answers))


async def _one_answer(
    name: str, request: InferRequest, first: StreamItem, rest: AsyncIterator[StreamItem]
) -> HttpResponse:
    responses: list[InferResponse] = []
    item: StreamItem | None = first
    try:
        while item is not None:
            response, message, _ = item
            if message:
                return HttpResponse(400, v2.encode_error(message))
            if response is not None:
                responses.append(response)
            if len(responses) > 1:  # refused at once: the model's other answers never run
                raise InvalidRequest(
                    f"model {name!r} answered more than once; /generate returns exactly one "
                    "answer: use /generate_stream"
                )
            item = await anext(rest, None)
    finally:
        await _close(rest)
    if not responses:
        raise InvalidRequest(f"model {name!r} sent no answer")
    return HttpResponse(200, orjson.dumps(_answer_json(request, responses[0])))


async def _events(
    request: InferRequest, first: StreamItem, rest: AsyncIterator[StreamItem]
) -> AsyncIterator[bytes]:
    item: StreamItem | None = first
    try:
        while item is not None:
            response, message, _ = item
            if message:
                yield _event({"error": message})
            elif response is not None:
                yield _event(_answer_json(request, response))
            item = await anext(rest, None)
    except SlipstreamError as exc:
        yield _event({"error": exc.message})
    finally:  # a client that left stops the model's answers (an LLM's generation) now
        await _close(rest)


async def _close(answers: AsyncIterator[StreamItem]) -> None:
    aclose = getattr(answers, "aclose", None)
    if aclose is not None:
        await aclose()


def _event(document: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(document) + b"\n\n"


def _request(
    name: str, version: str, document: dict[str, Any], inputs: list[TensorMetadata]
) -> InferRequest:
    known = {tensor.name: tensor for tensor in inputs}
    tensors: dict[str, np.ndarray] = {}
    for field, value in document.items():
        if field in _RESERVED:
            continue
        tensor = known.get(field)
        if tensor is None:
            raise InvalidRequest(
                f"{field}: model {name!r} has no such input (inputs: {', '.join(known)}; "
                "and id, parameters)"
            )
        tensors[field] = _tensor(tensor, value)
    parameters = document.get("parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidRequest(f"parameters: expected a JSON object, got {type(parameters).__name__}")
    parameters = dict(parameters)
    for field in [field for field in parameters if field in known]:
        if field in tensors:  # a parameter named as an input is that input (Triton's)
            raise InvalidRequest(f"parameters.{field}: input {field!r} is given twice; keep one")
        tensors[field] = _tensor(known[field], parameters.pop(field))
    request_id = document.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidRequest(f"id: expected a string, got {type(request_id).__name__}")
    return InferRequest(name, version, tensors, id=request_id, parameters=parameters)


def _tensor(tensor: TensorMetadata, value: Any) -> np.ndarray:
    values = _flat(tensor.name, value)
    datatype = tensor.datatype
    try:
        if datatype == "BYTES":
            if not all(isinstance(v, str) for v in values):
                raise TypeError("strings")
            array = np.array([v.encode() for v in values], dtype=object)
        elif datatype == "BOOL":
            if not all(isinstance(v, bool) for v in values):
                raise TypeError("true or false")
            array = np.array(values, dtype=np.bool_)
        else:
            numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
            if not numeric:
                raise TypeError("numbers")
            array = np.array(values, dtype=V2_TO_NUMPY[datatype])
    except TypeError as exc:
        raise InvalidRequest(
            f"{tensor.name}: input of datatype {datatype} takes {exc.args[0]}; got {value!r}"
        ) from None
    except (ValueError, OverflowError) as exc:
        raise InvalidRequest(f"{tensor.name}: {value!r} is not {datatype} ({exc})") from None
    return array.reshape(_shape(tensor, len(values)))


def _flat(name: str, value: Any) -> list[Any]:
    if not isinstance(value, list):
        return [value]
    flat: list[Any] = []
    for item in value:
        flat.extend(_flat(name, item) if isinstance(item, list) else [item])
    if not flat:
        raise InvalidRequest(f"{name}: an empty array gives the input no elements")
    return flat


def _shape(tensor: TensorMetadata, count: int) -> list[int]:
    dims = list(tensor.shape)
    fixed = math.prod(d for d in dims if d != -1)
    variable = [i for i, d in enumerate(dims) if d == -1]
    if not variable:
        if count != fixed:
            raise InvalidRequest(
                f"{tensor.name}: the input's shape {dims} holds {fixed} elements; got {count}"
            )
        return dims
    if count % fixed:
        raise InvalidRequest(
            f"{tensor.name}: {count} elements do not fill the input's shape {dims}"
        )
    for index in variable:
        dims[index] = 1
    dims[variable[-1]] = count // fixed
    return dims


def _answer_json(request: InferRequest, response: InferResponse) -> dict[str, Any]:
    document: dict[str, Any] = {
        "model_name": response.model_name,
        "model_version": response.model_version,
    }
    if request.id:
        document["id"] = request.id
    for name, array in response.outputs.items():
        values = [_json_value(v) for v in np.asarray(array).reshape(-1).tolist()]
        document[name] = values[0] if len(values) == 1 else values
    return document


def _json_value(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return value
