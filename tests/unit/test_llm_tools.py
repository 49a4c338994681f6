"""Tools into the prompt and calls out of the text, for templates that know no tools."""

from __future__ import annotations

import json

import pytest

from slipstream.errors import InvalidRequest
from slipstream.llm.tools import Tool, call_constraint, plain_messages, read_calls

WEATHER = Tool("get_weather", "Weather in a city",
               {"type": "object", "properties": {"city": {"type": "string"}}})  # fmt: skip
ADD = Tool("add", "Add", {"type": "object", "properties": {"a": {"type": "integer"}}})


def test_tools_join_the_system_message_and_history_becomes_text() -> None:
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "5 C"}]  # fmt: skip
    out = plain_messages(messages, [WEATHER])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n") and '"name": "get_weather"' in out[0][
        "content"]  # fmt: skip
    assert out[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    assert out[3]["content"] == "<tool_response>\n5 C\n</tool_response>"
    assert plain_messages([{"role": "user", "content": "hi"}], [])[0]["role"] == "user"
    assert plain_messages([{"role": "user", "content": "hi"}], [ADD])[0]["role"] == "system"


def test_calls_are_read_from_hermes_blocks_and_unknown_ones_stay_text() -> None:
    first = '{"name": "get_weather", "arguments": {"city": "Rome"}}'
    second = '{"name": "add", "arguments": {"a": 1}}'
    text = f"Let me check.\n<tool_call>\n{first}\n</tool_call>\n<tool_call>{second}</tool_call>"
    content, calls = read_calls(text, [WEATHER, ADD], "auto")
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Rome"}), ("add", {"a": 1})]  # fmt: skip
    assert len({c.id for c in calls}) == 2
    unknown = '<tool_call>{"name": "launch", "arguments": {}}</tool_call>'
    assert read_calls(unknown, [WEATHER], "auto") == (unknown, [])
    assert read_calls("<tool_call>{broken", [WEATHER], "auto") == ("<tool_call>{broken", [])
    assert read_calls("plain answer", [WEATHER], "none") == ("plain answer", [])


def test_constrained_choices_read_back_their_calls() -> None:
    _, [call] = read_calls('{"city": "Lima"}', [WEATHER, ADD], "get_weather")
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Lima"}')
    _, calls = read_calls('[{"name": "add", "arguments": {"a": 2}}]', [WEATHER, ADD], "required")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 2})]


def test_call_arguments_keep_their_characters() -> None:
    # Until 2026-11 "auto" and "required" escaped them ("S\\u00e3o"), a named choice not.
    said = '{"name": "get_weather", "arguments": {"city": "São Paulo"}}'
    _, [auto] = read_calls(f"<tool_call>{said}</tool_call>", [WEATHER], "auto")
    _, [required] = read_calls(f"[{said}]", [WEATHER], "required")
    _, [named] = read_calls('{"city": "São Paulo"}', [WEATHER], "get_weather")
    assert auto.arguments == required.arguments == named.arguments == '{"city": "São Paulo"}'


def test_the_constraint_of_each_choice() -> None:
    assert call_constraint([WEATHER], "auto", True) is None
    assert call_constraint([WEATHER], "none", True) is None
    named = call_constraint([WEATHER, ADD], "add", True)
    assert named is not None and json.loads(named.source) == ADD.parameters and named.strict
    required = call_constraint([WEATHER, ADD], "required", False)
    assert required is not None
    schema = json.loads(required.source)
    assert (schema["minItems"], schema["maxItems"]) == (1, 1)
    names = [option["properties"]["name"]["const"] for option in schema["items"]["anyOf"]]
    assert names == ["get_weather", "add"]
    parallel = call_constraint([WEATHER], "required", True)
    assert parallel is not None and "maxItems" not in json.loads(parallel.source)
    with pytest.raises(InvalidRequest, match="tool_choice: no tool named 'nope'"):
        call_constraint([WEATHER], "nope", True)
