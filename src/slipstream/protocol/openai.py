"""The OpenAI API's requests: schemas with validation (the replies are built by
:mod:`slipstream.protocol.openai_replies`).

Pure codec, no I/O. Fields OpenAI defines but Slipstream does not implement
(``suffix``, ``best_of`` > 1, ...) are refused with a 400 naming the field, never
silently ignored, and so are vLLM's extensions it does not implement
(:mod:`slipstream.protocol.openai_fields`); unknown extra fields are ignored as
OpenAI-compatible servers do. ``null`` for an optional field means its default.
``top_k``, ``min_p``, ``min_tokens``, ``stop_token_ids``, ``include_stop_str_in_output``,
``ignore_eos``, ``repetition_penalty``, chat's ``chat_template_kwargs`` and the
``guided_json`` / ``guided_choice`` / ``guided_regex`` / ``guided_grammar`` constraints
are accepted as the vLLM extensions of the same names (with vLLM's semantics, see
:class:`slipstream.llm.engine.SamplingParams`), ``grammar`` and ``json_schema`` as
llama.cpp's server has them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

import orjson
from pydantic import ConfigDict, Field, ValidationError, WithJsonSchema

from slipstream.errors import InvalidRequest
from slipstream.names import validate_model_name
from slipstream.protocol.openai_base import _Request
from slipstream.protocol.openai_fields import (
    TEMPLATE_KWARGS,
    VLLM_CHAT,
    VLLM_COMPLETION,
    VLLM_EMBEDDING,
    VLLM_SAMPLING,
    Unserved,
    _Fields,
    check_template_kwargs,
)
from slipstream.protocol.openai_tools import (
    MAX_TOOLS,
    NamedToolChoice,
    ToolCallItem,
    ToolSpec,
)
from slipstream.types import Constraint

MAX_CHOICES = 16
MAX_STOPS = 4
# Alternatives per token in top_logprobs (OpenAI's limit for chat).
MAX_TOP_LOGPROBS = 20
# Inputs one /v1/embeddings request may carry: OpenAI's own limit.
MAX_EMBEDDING_INPUTS = 2048


def _only(*schemas: dict[str, Any], note: str) -> WithJsonSchema:
    """The documented schema of a field accepted wider than it is served: the values
    Slipstream serves, while validation (``check_supported``) names the field when a
    request sends another (the OpenAPI document at /openapi.json shows this schema)."""
    return WithJsonSchema({"anyOf": list(schemas), "description": note})


_NULL: dict[str, Any] = {"type": "null"}
_ZERO = {"type": "number", "enum": [0]}


class StreamOptions(_Fields):
    include_usage: bool = False
    # vLLM's: every chunk carries the usage so far (guidellm and vLLM's tools ask for it).
    continuous_usage_stats: bool = False


# stream_options is refused unless stream is true (check_supported); the schema says so.
_STREAM_OPTIONS_NEED_STREAM: dict[str, Any] = {
    "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
}


class _Sampling(_Fields):
    """What every generation route takes: the sampling settings and the constraint
    extensions. ``_formats`` adds the route's own structured-output field."""

    unserved = VLLM_SAMPLING

    model: str = Field(min_length=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    stream: bool = False
    stop: Annotated[
        str | list[str] | None,
        _only({"type": "string"}, {"type": "array", "items": {"type": "string"},
               "maxItems": MAX_STOPS}, _NULL, note=f"at most {MAX_STOPS} stop sequences"),
    ] = None  # fmt: skip
    # OpenAI's range: a signed 64-bit integer.
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    logit_bias: Annotated[
        dict[str, float] | None,
        _only({"type": "object", "propertyNames": {"pattern": "^[0-9]{1,9}$"},
               "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
              _NULL, note="token id -> bias in [-100, 100]; ids beyond the vocabulary: 400"),
    ] = None  # fmt: skip
    user: str | None = None
    # vLLM's sampling extensions (its SamplingParams' meanings: llm/engine.py).
    # fmt: off
    min_p: float = Field(0.0, ge=0.0, le=1.0, description=(
        "vLLM's: a sampled token is at least min_p times as likely as the most likely one "
        "(after temperature); 0: no cut"))
    min_tokens: int = Field(0, ge=0, description=(
        "vLLM's: no end, stop token or stop string before this many tokens; at most the "
        "request's maximum (max_tokens...), more is a 400"))
    stop_token_ids: list[Annotated[int, Field(ge=0, le=2**31 - 1)]] | None = Field(
        None, description=("vLLM's: token ids that end the text (finish_reason stop); ids "
                           "beyond the vocabulary: 400"))
    include_stop_str_in_output: bool = Field(False, description=(
        "vLLM's: the stop string, or the stop token's text, ends the text"))
    # fmt: on
    # Structured outputs: the route's own field (_formats), and the extensions users know.
    # One constraint a request; a grammar, regex or schema that does not compile is a 400.
    guided_json: dict[str, Any] | str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_regex: str | None = None
    guided_grammar: Annotated[
        str | None, _only({"type": "string", "pattern": "\\S"}, _NULL, note="GBNF")
    ] = None
    grammar: Annotated[
        str | None, _only({"type": "string", "pattern": "\\S"}, _NULL, note="GBNF")
    ] = None
    json_schema: dict[str, Any] | None = None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS:
            raise InvalidRequest(f"stop: at most {MAX_STOPS} stop sequences, got {len(stops)}")
        return stops

    def check_supported(self) -> None:
        self.bias()
        self.constraint()
        sent = self.maximum()
        if sent is not None and self.min_tokens > sent[1]:
            raise InvalidRequest(
                f"min_tokens: {self.min_tokens} cannot be combined with {sent[0]} {sent[1]} "
                f"(a text of at least {self.min_tokens} tokens and at most {sent[1]}); send "
                f"a min_tokens of at most {sent[0]}"
            )

    def maximum(self) -> tuple[str, int] | None:
        """(field, value) of the maximum completion length the request sent, if any."""
        return None

    def bias(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs."""
        pairs = []
        for key, value in (self.logit_bias or {}).items():
            if not key.isdigit():
                raise InvalidRequest(f"logit_bias: keys are token ids, got {key!r}")
            if not -100.0 <= value <= 100.0:
                raise InvalidRequest(
                    f"logit_bias: bias of token {key} is {value}; it must be in [-100, 100]"
                )
            pairs.append((int(key), float(value)))
        return tuple(pairs)

    def constraint(self) -> Constraint | None:
        """The one structured-output constraint the request sets, if any."""
        found = self.constraint_field()
        return found[1] if found else None

    def constraint_field(self) -> tuple[str, Constraint] | None:
        """(the field that set it, the constraint): the one the request sets, if any."""
        found = self._formats()
        for field, schema in (("guided_json", self.guided_json), ("json_schema", self.json_schema)):
            if schema is not None:
                found.append((field, _schema_constraint(field, schema)))
        if self.guided_choice is not None:
            found.append(("guided_choice", Constraint("choice", choices=tuple(self.guided_choice))))
        if self.guided_regex is not None:
            found.append(("guided_regex", Constraint("regex", self.guided_regex)))
        for field, text in (("guided_grammar", self.guided_grammar), ("grammar", self.grammar)):
            if text is not None:
                if not text.strip():
                    raise InvalidRequest(f"{field}: must not be empty")
                found.append((field, Constraint("gbnf", text)))
        if len(found) > 1:
            names = " and ".join(field for field, _ in found)
            raise InvalidRequest(f"{found[1][0]}: set one constraint, not {names}")
        return found[0] if found else None

    def _formats(self) -> list[tuple[str, Constraint]]:
        """The constraint of the route's own structured-output field, if set."""
        return []


class _Classic(_Sampling):
    """The fields chat and completions share beyond sampling (the Responses API has its
    own names for them: max_output_tokens, text.format)."""

    model_config = ConfigDict(extra="ignore", json_schema_extra=_STREAM_OPTIONS_NEED_STREAM)

    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream_options: StreamOptions | None = None
    # OpenAI's structured outputs.
    response_format: Annotated[
        dict[str, Any] | None,
        _only({"type": "object", "properties": {"type": {"enum": ["text", "json_object"]}},
               "required": ["type"]},
              {"type": "object", "properties": {"type": {"const": "json_schema"},
               "json_schema": {"type": "object", "properties": {
                   "name": {"type": "string"}, "schema": {"type": "object"},
                   "strict": {"type": "boolean"}}, "required": ["schema"]}},
               "required": ["type", "json_schema"]},
              _NULL, note="text, json_object, or json_schema {name, schema, strict}"),
    ] = None  # fmt: skip

    def check_supported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options: only allowed when stream is true")
        super().check_supported()

    def maximum(self) -> tuple[str, int] | None:
        return None if self.max_tokens is None else ("max_tokens", self.max_tokens)

    def _formats(self) -> list[tuple[str, Constraint]]:
        if self.response_format is not None:
            constraint = _response_format(self.response_format)
            if constraint is not None:
                return [("response_format", constraint)]
        return []


def _response_format(value: dict[str, Any]) -> Constraint | None:
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise InvalidRequest(
                "response_format.json_schema: expected an object with 'name' and 'schema'"
            )
        constraint = _schema_constraint("response_format.json_schema.schema", spec["schema"])
        return Constraint("json_schema", constraint.source, strict=bool(spec.get("strict")))
    raise InvalidRequest(
        f"response_format.type: {kind!r} is not one of 'text', 'json_object', 'json_schema'"
    )


def _schema_constraint(field: str, schema: Any) -> Constraint:
    if isinstance(schema, str):
        try:
            schema = orjson.loads(schema)
        except orjson.JSONDecodeError as exc:
            raise InvalidRequest(f"{field}: does not compile: not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{field}: does not compile: a JSON schema must be an object")
    return Constraint("json_schema", orjson.dumps(schema).decode())


# llama.cpp's token ids are int32.
_TOKEN_IDS = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1},
    "minItems": 1,
}


class CompletionRequest(_Classic):
    unserved: ClassVar[Mapping[str, Unserved]] = {**VLLM_SAMPLING, **VLLM_COMPLETION}

    prompt: Annotated[
        str | list[str] | list[int] | list[list[int]],
        _only({"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1},
              _TOKEN_IDS, {"type": "array", "items": _TOKEN_IDS, "minItems": 1},
              note="text, texts, token ids, or lists of token ids"),
    ]  # fmt: skip
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: Annotated[int | None, _only({"const": 1}, _NULL, note="only 1 is supported")] = None
    suffix: Annotated[str | None, _only({"const": ""}, _NULL, note="not supported")] = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo and self.logprobs is not None:
            raise InvalidRequest(
                "echo: not supported together with logprobs (prompt logprobs are not "
                "computed); use one or the other"
            )
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


class ContentPart(_Fields):
    # Only text parts are served (ChatMessage.text names a part of another type).
    model_config = ConfigDict(extra="ignore", json_schema_extra={"required": ["type", "text"]})

    type: Annotated[str, WithJsonSchema({"const": "text"})]
    text: Annotated[str | None, WithJsonSchema({"type": "string"})] = None

    def checked_text(self, where: str, kinds: tuple[str, ...]) -> str:
        """The part's text; InvalidRequest naming ``where`` for a part of another type, or
        a text part without its ``text``."""
        if self.type not in kinds:
            raise InvalidRequest(f"{where}: only text parts are supported, got type {self.type!r}")
        if self.text is None:
            raise InvalidRequest(f"{where}.text: missing; a {self.type!r} part needs its text")
        return self.text


class ChatMessage(_Fields):
    # The document says what text() enforces: only an assistant message may leave out
    # its content (OpenAI's rule too).
    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={
            "anyOf": [
                {"properties": {"role": {"const": "assistant"}}},
                {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
            ]
        },
    )

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # An assistant's earlier calls, and a tool message's answer to one of them.
    tool_calls: list[ToolCallItem] | None = None
    tool_call_id: str | None = None

    def text(self, index: int) -> str:
        content = self.content
        if content is None:
            if self.role != "assistant":  # OpenAI's 400 too: a turn without its text
                raise InvalidRequest(
                    f"messages[{index}].content: a {self.role} message needs content (a"
                    " string or text parts); only an assistant message may leave it out"
                )
            return ""
        if isinstance(content, str):
            return content
        pieces = []
        for number, part in enumerate(content):
            pieces.append(part.checked_text(f"messages[{index}].content[{number}]", ("text",)))
        return "".join(pieces)


class ChatRequest(_Classic):
    unserved: ClassVar[Mapping[str, Unserved]] = {**VLLM_SAMPLING, **VLLM_CHAT}

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolSpec] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # OpenAI's fields for what this server does not do: each refused naming it (below).
    functions: Annotated[Any, _only(_NULL, note="legacy: send tools")] = None
    function_call: Annotated[Any, _only(_NULL, note="legacy: send tool_choice")] = None
    audio: Annotated[Any, _only(_NULL, note="text only")] = None
    modalities: Annotated[
        list[str] | None,
        _only({"type": "array", "items": {"const": "text"}}, _NULL, note="text only"),
    ] = None
    web_search_options: Annotated[Any, _only(_NULL, note="not supported")] = None
    reasoning_effort: Annotated[Any, _only(_NULL, note="not supported")] = None
    # A latency hint: the text is the same without it, so it is accepted and not used.
    prediction: dict[str, Any] | None = None
    service_tier: Literal["auto", "default"] | None = None
    # vLLM's: more variables for the chat template (Qwen3's enable_thinking...).
    chat_template_kwargs: Annotated[dict[str, Any] | None, TEMPLATE_KWARGS] = None

    def check_supported(self) -> None:
        super().check_supported()
        check_template_kwargs(self.chat_template_kwargs)
        for field, use in (("functions", "tools"), ("function_call", "tool_choice")):
            if getattr(self, field) is not None:
                raise InvalidRequest(
                    f"{field}: the legacy function-calling fields are not supported; send "
                    f"{use} instead"
                )
        if self.audio is not None or (self.modalities and set(self.modalities) != {"text"}):
            field = "audio" if self.audio is not None else "modalities"
            raise InvalidRequest(f"{field}: this server generates text only")
        for field in ("web_search_options", "reasoning_effort"):
            if getattr(self, field) is not None:
                raise InvalidRequest(f"{field}: not supported by this server")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs: only allowed when logprobs is true")
        choice = self.choice()
        if choice not in ("none", "auto") and not self.tools:
            raise InvalidRequest(f"tool_choice: {choice!r} needs tools")
        if choice not in ("none", "auto", "required"):
            names = [tool.function.name for tool in self.tools or []]
            if choice not in names:
                raise InvalidRequest(f"tool_choice: no tool named {choice!r} (tools: {names})")
        if choice not in ("none", "auto") and self.constraint() is not None:
            raise InvalidRequest(
                "tool_choice: a required tool call cannot be combined with response_format "
                "or another constraint"
            )

    def choice(self) -> str:
        """'none', 'auto', 'required' or the name of the function to call."""
        choice = self.tool_choice
        if choice is None:
            return "auto" if self.tools else "none"
        return choice if isinstance(choice, str) else choice.function.name

    def wanted_logprobs(self) -> int | None:
        """None, or how many alternatives each token's logprobs list."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def maximum(self) -> tuple[str, int] | None:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return super().maximum()

    def chat(self) -> list[dict[str, Any]]:
        """The conversation as chat templates take it (OpenAI's message dicts)."""
        messages: list[dict[str, Any]] = []
        for index, message in enumerate(self.messages):
            item: dict[str, Any] = {
                "role": "system" if message.role == "developer" else message.role,
                "content": message.text(index),
            }
            if message.tool_calls:
                item["tool_calls"] = [call.model_dump() for call in message.tool_calls]
            if message.tool_call_id is not None:
                item["tool_call_id"] = message.tool_call_id
            messages.append(item)
        return messages


class EmbeddingRequest(_Fields):
    """OpenAI's embeddings request. ``input`` is text, texts, token ids or lists of token
    ids (LangChain's OpenAIEmbeddings sends token lists by default); ``dimensions`` may
    only name the model's own width, since vectors are never truncated.

    ``inputs()`` and ``check_dimensions()`` serve the /v1/embeddings route, which embeds
    token ids and knows the model's width; ``texts()`` serves a caller that embeds text
    only, refusing the rest naming the field.
    """

    unserved = VLLM_EMBEDDING

    model: str = Field(min_length=1)
    input: Annotated[
        str | list[str] | list[int] | list[list[int]],
        Field(min_length=1),
        _only({"type": "string", "minLength": 1},
              {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1,
               "maxItems": MAX_EMBEDDING_INPUTS},
              _TOKEN_IDS,
              {"type": "array", "items": _TOKEN_IDS, "minItems": 1,
               "maxItems": MAX_EMBEDDING_INPUTS},
              note="a non-empty string, strings, token ids, or lists of token ids (ids "
                   "beyond the model's vocabulary: 400)"),
    ]  # fmt: skip
    encoding_format: Literal["float", "base64"] = "float"
    # Documented as null: the one width accepted depends on the model, which no schema of
    # the route can know (a conformance run would call any other width a wrong 400).
    dimensions: Annotated[
        int | None,
        Field(ge=1),
        _only(_NULL, note="the model's own width is accepted too (vectors are never "
                          "truncated); another width is a 400"),
    ] = None  # fmt: skip
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        """Each input, as non-empty text or non-empty token ids."""
        found = self.input
        items: list[Any] = [found] if isinstance(found, str) or _ids(found) else list(found)
        if len(items) > MAX_EMBEDDING_INPUTS:
            raise InvalidRequest(
                f"input: {len(items)} inputs; at most {MAX_EMBEDDING_INPUTS} in one request "
                "(send the rest in further requests)"
            )
        for index, item in enumerate(items):
            where = "input" if items[0] is found else f"input[{index}]"
            if not item:
                raise InvalidRequest(f"{where}: must not be empty")
            if isinstance(item, list) and min(item) < 0:
                raise InvalidRequest(
                    f"{where}: holds a negative token id {min(item)}; expected token ids (>= 0)"
                )
        return items

    def texts(self) -> list[str]:
        """The inputs as texts, for a route that cannot embed token ids or compare
        ``dimensions`` with the model's width: either is a 400 naming it."""
        if self.dimensions is not None:
            raise InvalidRequest("dimensions: not supported; embeddings have the model's width")
        texts = self.inputs()
        for index, text in enumerate(texts):
            if not isinstance(text, str):
                where = "input" if len(texts) == 1 and _ids(self.input) else f"input[{index}]"
                raise InvalidRequest(f"{where}: token ids are not supported here; send text")
        return [text for text in texts if isinstance(text, str)]

    def check_dimensions(self, width: int) -> None:
        """A 400 naming ``dimensions`` unless it is unset or the model's ``width``: the
        vectors are the model's own, never truncated."""
        if self.dimensions is not None and self.dimensions != width:
            raise InvalidRequest(
                f"dimensions: {self.dimensions} is not supported; model {self.model!r} "
                f"embeds in {width} dimensions (leave dimensions out, or send {width})"
            )


def _ids(value: object) -> bool:
    """Whether ``value`` is one list of token ids (not a list of texts or id lists)."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], int)


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
        validate_model_name(request.model, "model:")  # "model: ...": the field named
    check = getattr(request, "check_supported", None)
    if check is not None:
        check()
    return request
