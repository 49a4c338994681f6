"""The OpenAI request schemas' shared field rules: ``null`` is an optional field's
default, vLLM's extensions this server implements are read and checked, those it does
not are refused naming them, and the Responses API takes its own names only."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from slipstream.errors import InvalidRequest
from slipstream.llm.constraints import compile_constraint
from slipstream.llm.tools import Tool, call_constraint
from slipstream.protocol import openai
from slipstream.protocol.openai_responses import ResponsesRequest, message_item
from slipstream.protocol.openapi import openapi_document

MESSAGES = [{"role": "user", "content": "Hi"}]
MINIMAL: dict[type[Any], dict[str, Any]] = {
    openai.CompletionRequest: {"model": "m", "prompt": "Hi"},
    openai.ChatRequest: {"model": "m", "messages": MESSAGES},
    openai.EmbeddingRequest: {"model": "m", "input": "Hi"},
    ResponsesRequest: {"model": "m", "input": "Hi"},
}
OPTIONAL = [
    (schema, name)
    for schema in MINIMAL
    for name, field in schema.model_fields.items()
    if not field.is_required()
]


def parse(schema: type[Any], body: dict[str, Any]) -> Any:
    return openai.parse(orjson.dumps(body), schema)


def refused(schema: type[Any], body: dict[str, Any]) -> str:
    with pytest.raises(InvalidRequest) as error:
        parse(schema, body)
    return error.value.message


@pytest.mark.parametrize(("schema", "name"), OPTIONAL, ids=lambda v: getattr(v, "__name__", v))
def test_null_for_any_optional_field_is_its_default(schema: type[Any], name: str) -> None:
    """The openai SDK sends ``temperature=None`` as ``"temperature": null``."""
    request = parse(schema, {**MINIMAL[schema], name: None})
    assert getattr(request, name) == getattr(parse(schema, MINIMAL[schema]), name)


def test_the_sdks_nulls_on_chat_all_at_once() -> None:
    nulls = dict.fromkeys(
        ["temperature", "top_p", "n", "presence_penalty", "frequency_penalty", "stream",
         "logprobs", "parallel_tool_calls", "top_k", "ignore_eos", "repetition_penalty"]
    )  # fmt: skip
    request = parse(openai.ChatRequest, {**MINIMAL[openai.ChatRequest], **nulls})
    assert (request.temperature, request.top_p, request.n, request.stream) == (1.0, 1.0, 1, False)
    assert request.parallel_tool_calls is True and request.logprobs is False


@pytest.mark.parametrize(
    ("schema", "name"),
    [(openai.ChatRequest, "model"), (openai.ChatRequest, "messages"),
     (openai.CompletionRequest, "prompt"), (openai.EmbeddingRequest, "input"),
     (ResponsesRequest, "input")],
)  # fmt: skip
def test_null_for_a_required_field_is_a_400_naming_it(schema: type[Any], name: str) -> None:
    assert refused(schema, {**MINIMAL[schema], name: None}).startswith(f"{name}: ")


def test_nested_nulls_are_defaults_too() -> None:
    body = {"model": "m", "stream": True, "stream_options": {"include_usage": None},
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}],
                          "name": None}]}  # fmt: skip
    request = parse(openai.ChatRequest, body)
    assert request.stream_options.include_usage is False
    assert request.chat()[0]["content"] == "Hi"


def test_the_documented_schema_says_optional_fields_take_null() -> None:
    schemas = openapi_document("0")["components"]["schemas"]
    chat = schemas["ChatRequest"]["properties"]
    assert {"type": "null"} in chat["temperature"]["anyOf"]
    assert chat["temperature"]["default"] == 1.0
    assert {"type": "null"} in chat["stream"]["anyOf"]
    assert "anyOf" not in chat["model"]
    assert {"type": "null"} in schemas["ResponsesRequest"]["properties"]["top_p"]["anyOf"]


# -- vLLM's extensions ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "advice"),
    [
        ("skip_special_tokens", False, "only true"),
        ("truncate_prompt_tokens", 10, "shorten it"),
        ("use_beam_search", True, "beam search"),
        ("length_penalty", 0.5, "beam search"),
        ("bad_words", ["x"], "logit_bias"),
        ("allowed_token_ids", [1, 2], "logit_bias"),
        ("prompt_logprobs", 1, "generated tokens"),
        ("chat_template", "{{ x }}", "own chat template"),
        ("add_generation_prompt", False, "only true"),
        ("continue_final_message", True, "not supported"),
        ("structured_outputs", {"regex": "a+"}, "guided_regex"),
        ("priority", 5, "priority"),
    ],
)
def test_vllm_extensions_not_implemented_are_refused_naming_them(
    field: str, value: Any, advice: str
) -> None:
    message = refused(openai.ChatRequest, {**MINIMAL[openai.ChatRequest], field: value})
    assert message.startswith(f"{field}: ") and advice in message


def test_vllm_values_that_ask_for_what_the_server_does_are_accepted() -> None:
    same = {"skip_special_tokens": True, "use_beam_search": False,
            "add_generation_prompt": True, "continue_final_message": False, "priority": 0,
            "length_penalty": 1.0, "truncate_prompt_tokens": None, "chat_template": None,
            # Changes no text, and a field nobody defines: ignored.
            "guided_decoding_backend": "xgrammar", "vendor_thing": {"x": 1}}  # fmt: skip
    parse(openai.ChatRequest, {**MINIMAL[openai.ChatRequest], **same})
    # A bool is not a number: use_beam_search 0 is not false, length_penalty true not 1.
    for field, value in (("use_beam_search", 0), ("length_penalty", True)):
        assert refused(openai.ChatRequest, {**MINIMAL[openai.ChatRequest], field: value})


@pytest.mark.parametrize("schema", [openai.CompletionRequest, openai.ChatRequest,
                                    ResponsesRequest])  # fmt: skip
def test_vllm_s_sampling_extensions_are_read(schema: type[Any]) -> None:
    body = {**MINIMAL[schema], "min_p": 0.25, "min_tokens": 3, "stop_token_ids": [7, 9],
            "include_stop_str_in_output": True}  # fmt: skip
    request = parse(schema, body)
    assert (request.min_p, request.min_tokens, request.stop_token_ids) == (0.25, 3, [7, 9])
    assert request.include_stop_str_in_output is True
    plain = parse(schema, MINIMAL[schema])
    assert (plain.min_p, plain.min_tokens, plain.stop_token_ids) == (0.0, 0, None)
    assert plain.include_stop_str_in_output is False


@pytest.mark.parametrize(
    ("schema", "extra", "named"),
    [
        (openai.ChatRequest, {"min_p": 1.5}, "min_p: Input should be less than or equal to 1"),
        (openai.ChatRequest, {"min_p": -0.1}, "min_p: Input should be greater than or equal"),
        (openai.CompletionRequest, {"min_tokens": -1}, "min_tokens: Input should be greater"),
        (openai.CompletionRequest, {"min_tokens": 5, "max_tokens": 4},
         "min_tokens: 5 cannot be combined with max_tokens 4"),
        (openai.ChatRequest, {"min_tokens": 9, "max_tokens": 20, "max_completion_tokens": 8},
         "min_tokens: 9 cannot be combined with max_completion_tokens 8"),
        (ResponsesRequest, {"min_tokens": 3, "max_output_tokens": 2},
         "min_tokens: 3 cannot be combined with max_output_tokens 2"),
        (openai.ChatRequest, {"stop_token_ids": [-1]}, "stop_token_ids.0: Input should be greater"),
        (openai.ChatRequest, {"stop_token_ids": 5}, "stop_token_ids: Input should be a valid list"),
        (openai.ChatRequest, {"include_stop_str_in_output": "maybe"},
         "include_stop_str_in_output: Input should be a valid boolean"),
        (openai.ChatRequest, {"chat_template_kwargs": ["enable_thinking"]},
         "chat_template_kwargs: Input should be a valid dictionary"),
        (openai.ChatRequest, {"chat_template_kwargs": {"messages": []}},
         "chat_template_kwargs.messages: a name this server sets itself"),
        (ResponsesRequest, {"chat_template_kwargs": {"add_generation_prompt": False}},
         "chat_template_kwargs.add_generation_prompt: "),
    ],
)  # fmt: skip
def test_bad_vllm_sampling_values_are_400s_naming_the_field(
    schema: type[Any], extra: dict[str, Any], named: str
) -> None:
    assert refused(schema, {**MINIMAL[schema], **extra}).startswith(named)


def test_min_tokens_up_to_the_maximum_and_template_variables_are_accepted() -> None:
    parse(openai.CompletionRequest, {**MINIMAL[openai.CompletionRequest], "min_tokens": 4,
                                     "max_tokens": 4})  # fmt: skip
    body = {**MINIMAL[openai.ChatRequest], "min_tokens": 8, "max_completion_tokens": 8,
            "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    chat = parse(openai.ChatRequest, body)
    assert chat.chat_template_kwargs == {"enable_thinking": False}


def test_the_extensions_this_server_implements_still_work() -> None:
    body = {**MINIMAL[openai.CompletionRequest], "top_k": 5, "repetition_penalty": 1.2,
            "ignore_eos": True, "guided_regex": "a+"}  # fmt: skip
    request = parse(openai.CompletionRequest, body)
    assert request.constraint_field()[0] == "guided_regex"
    assert refused(openai.EmbeddingRequest, {**MINIMAL[openai.EmbeddingRequest],
                                             "truncate_prompt_tokens": 8}).startswith(
        "truncate_prompt_tokens: "
    )  # fmt: skip


# -- the Responses API -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "advice"),
    [
        ("max_tokens", 5, "max_output_tokens"),
        ("max_completion_tokens", 5, "max_output_tokens"),
        ("n", 2, "one response"),
        ("response_format", {"type": "json_object"}, "text.format"),
        ("logprobs", True, "top_logprobs"),
        ("reasoning", {"effort": "low"}, "not supported"),
        ("background", True, "stores no responses"),
        ("truncation", "auto", "disabled"),
        ("conversation", "conv_1", "whole conversation"),
        ("include", ["nonsense"], "is not one of"),
        ("use_beam_search", True, "beam search"),
    ],
)
def test_responses_refuses_what_it_does_not_implement(field: str, value: Any, advice: str) -> None:
    message = refused(ResponsesRequest, {**MINIMAL[ResponsesRequest], field: value})
    assert message.startswith(f"{field}: ") and advice in message


def test_responses_logprobs_are_asked_for_by_top_logprobs_or_include() -> None:
    base = MINIMAL[ResponsesRequest]
    assert parse(ResponsesRequest, base).wanted_logprobs() is None
    assert parse(ResponsesRequest, {**base, "top_logprobs": 3}).wanted_logprobs() == 3
    include = {**base, "include": ["message.output_text.logprobs", "reasoning.encrypted_content"]}
    assert parse(ResponsesRequest, include).wanted_logprobs() == 0
    accepted = {**base, "n": 1, "truncation": "disabled", "background": False,
                "stream": True, "stream_options": {"include_obfuscation": False}}  # fmt: skip
    assert parse(ResponsesRequest, accepted).n == 1


def test_responses_text_format_and_another_constraint_conflict() -> None:
    body = {**MINIMAL[ResponsesRequest], "text": {"format": {"type": "json_object"}},
            "guided_regex": "a+"}  # fmt: skip
    assert refused(ResponsesRequest, body).startswith("guided_regex: set one constraint")
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    body = {**MINIMAL[ResponsesRequest], "tools": [tool], "tool_choice": "required",
            "text": {"format": {"type": "json_object"}}}  # fmt: skip
    assert refused(ResponsesRequest, body).startswith("tool_choice: ")


def test_an_incomplete_message_item_keeps_its_text_and_says_incomplete() -> None:
    item = message_item("msg_1", "Hello", "incomplete")
    assert item["status"] == "incomplete" and item["content"][0]["text"] == "Hello"
    assert message_item("msg_1", "", "in_progress")["content"] == []


# -- content parts -------------------------------------------------------------------------


def test_a_text_part_without_text_is_named_by_its_text_field() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]}
    with pytest.raises(InvalidRequest) as error:
        parse(openai.ChatRequest, body).chat()
    assert error.value.message.startswith("messages[0].content[0].text: missing")
    body = {"model": "m", "input": [{"role": "user", "content": [{"type": "input_text"}]}]}
    with pytest.raises(InvalidRequest) as error:
        parse(ResponsesRequest, body).chat()
    assert error.value.message.startswith("input[0].content[0].text: missing")
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    with pytest.raises(InvalidRequest) as error:
        parse(openai.ChatRequest, body).chat()
    assert "only text parts are supported, got type 'image_url'" in error.value.message


# -- embeddings ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "inputs"),
    [
        ("Hi", ["Hi"]),
        (["a", "b"], ["a", "b"]),
        ([101, 2023, 102], [[101, 2023, 102]]),
        ([[101, 2023, 102], [7]], [[101, 2023, 102], [7]]),
    ],
)
def test_embedding_inputs_are_texts_or_token_ids(value: Any, inputs: list[Any]) -> None:
    assert parse(openai.EmbeddingRequest, {"model": "m", "input": value}).inputs() == inputs


def test_embedding_token_ids_and_dimensions_are_checked() -> None:
    request = parse(openai.EmbeddingRequest, {"model": "m", "input": [[1], [2, -3]]})
    with pytest.raises(InvalidRequest, match=r"^input\[1\]: holds a negative token id -3"):
        request.inputs()
    request = parse(openai.EmbeddingRequest, {"model": "m", "input": "x", "dimensions": 8})
    request.check_dimensions(8)
    with pytest.raises(InvalidRequest, match=r"^dimensions: 4 is not supported.* 8 dim"):
        parse(openai.EmbeddingRequest, {"model": "m", "input": "x", "dimensions": 4}
              ).check_dimensions(8)  # fmt: skip
    # A route that embeds text only names what it cannot do.
    with pytest.raises(InvalidRequest, match=r"^input: token ids are not supported"):
        parse(openai.EmbeddingRequest, {"model": "m", "input": [5, 6]}).texts()


# -- tools whose schemas refer to their own definitions ----------------------------------------

LOCATION = {
    "type": "object",
    "properties": {"loc": {"$ref": "#/$defs/Loc"}, "again": {"$ref": "#/properties/loc"}},
    "required": ["loc"],
    "$defs": {"Loc": {"type": "object", "properties": {
        "city": {"type": "string"}, "near": {"anyOf": [{"$ref": "#/$defs/Loc"}, {"type": "null"}]},
        "note": {"const": {"$ref": "#/$defs/Loc"}}}, "required": ["city"]}},
}  # fmt: skip
LEGACY = {
    "type": "object",
    "properties": {"n": {"$ref": "#/definitions/N"}},
    "definitions": {"Loc": {"type": "integer"}, "N": {"$ref": "#/definitions/Loc"}},
}


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_keep_each_tools_definitions(parallel: bool) -> None:
    """pydantic's schemas (openai.pydantic_function_tool) refer to #/$defs/...: nested in
    the call schema, each tool's references must still resolve, to its own definitions."""
    tools = [Tool("get_weather", "", LOCATION), Tool("count", "", LEGACY)]
    constraint = call_constraint(tools, "required", parallel)
    assert constraint is not None
    compile_constraint(constraint)
    schema = json.loads(constraint.source)
    defs = schema["$defs"]
    assert defs["tool0.Loc"]["properties"]["near"]["anyOf"][0] == {"$ref": "#/$defs/tool0.Loc"}
    assert defs["tool0"]["properties"]["again"] == {"$ref": "#/$defs/tool0/properties/loc"}
    # Data is not a schema: a const holding "$ref" stays as it was.
    assert defs["tool0.Loc"]["properties"]["note"] == {"const": {"$ref": "#/$defs/Loc"}}
    assert defs["tool1.N"] == {"$ref": "#/$defs/tool1.Loc"} and defs["tool1.Loc"]["type"]
    assert schema.get("maxItems") == (None if parallel else 1)
    plain = Tool("f", "", {"type": "object", "properties": {"x": {"type": "integer"}}})
    plain_schema = json.loads(call_constraint([plain], "required", True).source)  # type: ignore[union-attr]
    assert "$defs" not in plain_schema


@pytest.mark.parametrize("choice", ["required", "bad"])
def test_a_tool_schema_that_does_not_compile_is_named_by_its_field(choice: str) -> None:
    bad = {"type": "object", "properties": {"x": {"$ref": "#/$defs/Missing"}}}
    tools = [Tool("good", "", LOCATION), Tool("bad", "", bad)]
    with pytest.raises(InvalidRequest, match=r"^tools\[1\]\.function\.parameters: does not comp"):
        call_constraint(tools, choice, True)
    tools = [
        Tool("good", "", LOCATION, "tools[0].parameters"),
        Tool("bad", "", bad, "tools[1].parameters"),
    ]
    with pytest.raises(InvalidRequest, match=r"^tools\[1\]\.parameters: does not compile"):
        call_constraint(tools, choice, True)


@pytest.mark.parametrize("schema", ["CompletionRequest", "ChatRequest", "ResponsesRequest"])
def test_the_vllm_fields_served_are_documented_with_their_bounds(schema: str) -> None:
    """Documented as fields (types, bounds, defaults), no longer as refused values."""
    properties = openapi_document("0")["components"]["schemas"][schema]["properties"]
    for name in ("min_p", "min_tokens", "stop_token_ids", "include_stop_str_in_output"):
        assert "not served here" not in properties[name].get("description", ""), name
    min_p = properties["min_p"]["anyOf"][0]
    assert (min_p["type"], min_p["minimum"], min_p["maximum"]) == ("number", 0.0, 1.0)
    min_tokens = properties["min_tokens"]["anyOf"][0]
    assert (min_tokens["type"], min_tokens["minimum"]) == ("integer", 0)
    items = properties["stop_token_ids"]["anyOf"][0]["items"]
    assert (items["type"], items["minimum"], items["maximum"]) == ("integer", 0, 2**31 - 1)
    assert properties["include_stop_str_in_output"]["default"] is False
    if schema != "CompletionRequest":
        kwargs = properties["chat_template_kwargs"]["anyOf"][0]
        assert kwargs["type"] == "object"
        assert "messages" in kwargs["propertyNames"]["not"]["enum"]
