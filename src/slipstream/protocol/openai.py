"""The OpenAI API's wire format: request schemas with validation, response builders.

Pure codec, no I/O. Fields OpenAI defines but Slipstream does not implement (logprobs,
penalties, logit_bias, tools, ...) are refused with a 400 naming the field, never
silently ignored; unknown extra fields are ignored as OpenAI-compatible servers do.
``top_k`` and ``ignore_eos`` are accepted as the vLLM extensions of the same names.
"""

from __future__ import annotations

import base64
import re
import time
import uuid
from typing import Annotated, Any, Literal

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema

from slipstream.errors import InvalidRequest, SlipstreamError
from slipstream.names import validate_model_name

MAX_CHOICES = 16
MAX_STOPS = 4
# Inputs one /v1/embeddings request may carry: OpenAI's own limit.
MAX_EMBEDDING_INPUTS = 2048

_PARAM = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


def _only(*schemas: dict[str, Any], note: str) -> WithJsonSchema:
    """The documented schema of a field accepted wider than it is served: the values
    Slipstream serves, while validation (``check_supported``) names the field when a
    request sends another (the OpenAPI document at /openapi.json shows this schema)."""
    return WithJsonSchema({"anyOf": list(schemas), "description": note})


_NULL: dict[str, Any] = {"type": "null"}
_ZERO = {"type": "number", "enum": [0]}


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


# stream_options is refused unless stream is true (check_supported); the schema says so.
_STREAM_OPTIONS_NEED_STREAM: dict[str, Any] = {
    "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
}


class _Sampling(_Request):
    model_config = ConfigDict(extra="ignore", json_schema_extra=_STREAM_OPTIONS_NEED_STREAM)

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[
        str | list[str] | None,
        _only({"type": "string"}, {"type": "array", "items": {"type": "string"},
               "maxItems": MAX_STOPS}, _NULL, note=f"at most {MAX_STOPS} stop sequences"),
    ] = None  # fmt: skip
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: Annotated[float, _only(_ZERO, note="penalties are not supported")] = 0.0
    frequency_penalty: Annotated[float, _only(_ZERO, note="penalties are not supported")] = 0.0
    logit_bias: Annotated[
        dict[str, float] | None,
        _only({"type": "object", "maxProperties": 0}, _NULL, note="not supported"),
    ] = None
    user: str | None = None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS:
            raise InvalidRequest(f"stop: at most {MAX_STOPS} stop sequences, got {len(stops)}")
        return stops

    def check_supported(self) -> None:
        if self.presence_penalty or self.frequency_penalty:
            field = "presence_penalty" if self.presence_penalty else "frequency_penalty"
            raise InvalidRequest(f"{field}: penalties are not supported; leave it at 0")
        if self.logit_bias:
            raise InvalidRequest("logit_bias: not supported")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options: only allowed when stream is true")


# llama.cpp's token ids are int32.
_TOKEN_IDS = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1},
    "minItems": 1,
}


class CompletionRequest(_Sampling):
    prompt: Annotated[
        str | list[str] | list[int] | list[list[int]],
        _only({"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1},
              _TOKEN_IDS, {"type": "array", "items": _TOKEN_IDS, "minItems": 1},
              note="text, texts, token ids, or lists of token ids"),
    ]  # fmt: skip
    echo: Annotated[bool, _only({"const": False}, note="not supported")] = False
    logprobs: Annotated[int | None, _only(_NULL, note="not supported")] = None
    best_of: Annotated[int | None, _only({"const": 1}, _NULL, note="only 1 is supported")] = None
    suffix: Annotated[str | None, _only({"const": ""}, _NULL, note="not supported")] = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs is not None:
            raise InvalidRequest("logprobs: not supported by this server")
        if self.echo:
            raise InvalidRequest("echo: not supported by this server")
        if self.best_of not in (None, 1):
            raise InvalidRequest("best_of: only 1 is supported")
        if self.suffix:
            raise InvalidRequest("suffix: not supported by this server")

    def prompts(self) -> list[str | list[int]]:
        """Each prompt, as text or as token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise InvalidRequest("prompt: must not be empty")
        if all(isinstance(p, int) for p in prompt):
            prompts: list[Any] = [prompt]
        else:
            prompts = list(prompt)
        for index, item in enumerate(prompts):
            if isinstance(item, list) and (not item or min(item) < 0):
                where = "prompt" if prompts[0] is prompt else f"prompt[{index}]"
                problem = "is empty" if not item else f"holds a negative token id {min(item)}"
                raise InvalidRequest(f"{where}: {problem}; expected token ids (>= 0)")
        return prompts


class ContentPart(_Request):
    # Only text parts are served (ChatMessage.text names a part of another type).
    model_config = ConfigDict(extra="ignore", json_schema_extra={"required": ["type", "text"]})

    type: Annotated[str, WithJsonSchema({"const": "text"})]
    text: Annotated[str | None, WithJsonSchema({"type": "string"})] = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self, index: int) -> str:
        content = self.content
        if content is None:
            return ""
        if isinstance(content, str):
            return content
        pieces = []
        for number, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise InvalidRequest(
                    f"messages[{index}].content[{number}]: only text parts are supported, "
                    f"got type {part.type!r}"
                )
            pieces.append(part.text)
        return "".join(pieces)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: Annotated[bool, _only({"const": False}, note="not supported")] = False
    top_logprobs: Annotated[int | None, _only({"const": 0}, _NULL, note="not supported")] = None
    tools: Annotated[
        list[Any] | None, _only({"type": "array", "maxItems": 0}, _NULL, note="not supported")
    ] = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs or self.top_logprobs:
            raise InvalidRequest("logprobs: not supported by this server")
        if self.tools:
            raise InvalidRequest("tools: tool calling is not supported by this server")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise InvalidRequest("response_format: only {'type': 'text'} is supported")

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def chat(self) -> list[dict[str, str]]:
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text(i)}
            for i, m in enumerate(self.messages)
        ]


class EmbeddingRequest(_Request):
    model: str = Field(min_length=1)
    input: Annotated[
        str | list[str],
        Field(min_length=1),
        _only({"type": "string", "minLength": 1},
              {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1,
               "maxItems": MAX_EMBEDDING_INPUTS}, note="non-empty strings"),
    ]  # fmt: skip
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int | None, _only(_NULL, note="embeddings have the model's width")] = None
    user: str | None = None

    def texts(self) -> list[str]:
        if self.dimensions is not None:
            raise InvalidRequest("dimensions: not supported; embeddings have the model's width")
        texts = [self.input] if isinstance(self.input, str) else list(self.input)
        if len(texts) > MAX_EMBEDDING_INPUTS:
            raise InvalidRequest(
                f"input: {len(texts)} inputs; at most {MAX_EMBEDDING_INPUTS} in one request "
                "(send the rest in further requests)"
            )
        for index, text in enumerate(texts):
            if not text:
                raise InvalidRequest(f"input[{index}]: must be a non-empty string")
        return texts


# A part of a pydantic error location that names a branch of a union, not a field:
# "str", "list[int]", "function-after[...]", a model's class name.
_UNION_BRANCH = re.compile(r"^(str|int|float|bool|none|[A-Z]\w*|.*\[.*\])$")


def _first_problem(exc: ValidationError) -> str:
    """``field: problem`` for the first field in error. A value that matches no branch of
    a union (``prompt``: a string, strings, token ids...) is named by the branch that got
    furthest, without the branch's name: ``prompt.2.11: Input should be ...``."""
    errors = exc.errors()
    first = errors[0]["loc"][:1]
    problem = max((e for e in errors if e["loc"][:1] == first), key=lambda e: len(e["loc"]))
    parts = [p for p in problem["loc"] if not (isinstance(p, str) and _UNION_BRANCH.match(p))]
    field = ".".join(str(part) for part in parts) or "body"
    return f"{field}: {problem['msg']}"


def parse(body: bytes, schema: type[_Request]) -> Any:
    """Validate a JSON body; InvalidRequest names the first bad field."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"body: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequest("body: expected a JSON object")
    try:
        request = schema.model_validate(data)
    except ValidationError as exc:
        raise InvalidRequest(_first_problem(exc)) from None
    if isinstance(request, _Sampling | EmbeddingRequest):
        validate_model_name(request.model, "model")
    check = getattr(request, "check_supported", None)
    if check is not None:
        check()
    return request


# -- responses ---------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion(
    rid: str, created: int, model: str, texts: list[tuple[str, str]], use: dict[str, int]
) -> bytes:
    """A text_completion; ``texts`` holds (text, finish_reason) per choice."""
    choices = [
        {"index": i, "text": text, "logprobs": None, "finish_reason": reason}
        for i, (text, reason) in enumerate(texts)
    ]
    return orjson.dumps({"id": rid, "object": "text_completion", "created": created,
                         "model": model, "choices": choices, "usage": use})  # fmt: skip


def chat_completion(
    rid: str, created: int, model: str, texts: list[tuple[str, str]], use: dict[str, int]
) -> bytes:
    choices = [
        {"index": i, "message": {"role": "assistant", "content": text},
         "logprobs": None, "finish_reason": reason}
        for i, (text, reason) in enumerate(texts)
    ]  # fmt: skip
    return orjson.dumps({"id": rid, "object": "chat.completion", "created": created,
                         "model": model, "choices": choices, "usage": use})  # fmt: skip


def sse(payload: Any) -> bytes:
    """One server-sent event carrying ``payload`` as JSON."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def completion_chunk(
    rid: str, created: int, model: str, index: int, text: str, reason: str | None
) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": None,
                         "finish_reason": reason}]}  # fmt: skip


def chat_chunk(
    rid: str, created: int, model: str, index: int, delta: dict[str, str], reason: str | None
) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": None,
                         "finish_reason": reason}]}  # fmt: skip


def usage_chunk(rid: str, created: int, model: str, obj: str, use: dict[str, int]) -> bytes:
    return sse({"id": rid, "object": obj, "created": created, "model": model,
                "choices": [], "usage": use})  # fmt: skip


def _card(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "slipstream"}


def model_card(name: str, created: int) -> bytes:
    return orjson.dumps(_card(name, created))


def models_list(models: list[tuple[str, int]]) -> bytes:
    data = [_card(name, created) for name, created in models]
    return orjson.dumps({"object": "list", "data": data})


def embeddings(model: str, vectors: np.ndarray, encoding: str, prompt_tokens: int) -> bytes:
    data = []
    for index, row in enumerate(np.asarray(vectors, dtype=np.float32)):
        value: Any = (
            base64.b64encode(row.astype("<f4").tobytes()).decode("ascii")
            if encoding == "base64"
            else row.tolist()
        )
        data.append({"object": "embedding", "index": index, "embedding": value})
    return orjson.dumps({"object": "list", "data": data, "model": model,
                         "usage": {"prompt_tokens": prompt_tokens,
                                   "total_tokens": prompt_tokens}})  # fmt: skip


def error(exc: SlipstreamError) -> bytes:
    """``{"error": {message, type, param, code}}`` as OpenAI writes it."""
    status = exc.http_status
    match = _PARAM.match(exc.message)
    param = match.group(1) if match and status < 500 else None
    if status == 404:
        kind, code = "invalid_request_error", "model_not_found"
    elif status < 500:
        kind, code = "invalid_request_error", None
    else:
        kind, code = "server_error", "service_unavailable" if status == 503 else None
    return orjson.dumps({"error": {"message": exc.message, "type": kind, "param": param,
                                   "code": code}})  # fmt: skip


def error_event(exc: SlipstreamError) -> bytes:
    """An error met after a stream began, sent as its last event."""
    return b"data: " + error(exc) + b"\n\n"
