"""The OpenAI schemas' new fields (penalties, logit bias, logprobs, structured outputs)
and the text layer carrying logprobs through to the deltas. No sockets."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from slipstream.errors import InvalidRequest
from slipstream.llm.engine import EngineStep, TokenLogprob
from slipstream.llm.text import stream_text
from slipstream.protocol import openai
from slipstream.protocol import openai_replies as replies
from slipstream.types import Constraint


def chat(**fields: Any) -> openai.ChatRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    request: openai.ChatRequest = openai.parse(orjson.dumps(body), openai.ChatRequest)
    return request


def completion(**fields: Any) -> openai.CompletionRequest:
    body = {"model": "m", "prompt": "hi", **fields}
    request: openai.CompletionRequest = openai.parse(orjson.dumps(body), openai.CompletionRequest)
    return request


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
SCHEMA_TEXT = json.dumps(SCHEMA, separators=(",", ":"))


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, Constraint("json_object")),
        (
            {"response_format": {"type": "json_schema",
                                 "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
            Constraint("json_schema", SCHEMA_TEXT, strict=True),
        ),
        ({"guided_json": SCHEMA}, Constraint("json_schema", SCHEMA_TEXT)),
        ({"guided_json": json.dumps(SCHEMA)},
         Constraint("json_schema", SCHEMA_TEXT)),
        ({"json_schema": SCHEMA}, Constraint("json_schema", SCHEMA_TEXT)),
        ({"guided_choice": ["yes", "no"]}, Constraint("choice", choices=("yes", "no"))),
        ({"guided_regex": "[a-z]+"}, Constraint("regex", "[a-z]+")),
        ({"grammar": "root ::= [a-z]"}, Constraint("gbnf", "root ::= [a-z]")),
        ({"guided_grammar": "root ::= [a-z]"}, Constraint("gbnf", "root ::= [a-z]")),
    ],
)  # fmt: skip
def test_each_way_of_asking_for_structure_gives_one_constraint(
    fields: dict[str, Any], expected: Constraint | None
) -> None:
    assert chat(**fields).constraint() == expected
    assert completion(**fields).constraint() == expected


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema"),
        ({"guided_json": "{nope"}, "guided_json"),
        ({"guided_json": [1, 2]}, "guided_json"),
        ({"grammar": "  "}, "grammar"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a"], "grammar": "root ::= [a]"}, "grammar"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"3": -101}}, "logit_bias"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"repetition_penalty": -1}, "repetition_penalty"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ],
)  # fmt: skip
def test_bad_feature_fields_name_themselves(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequest, match=rf"^{field}: "):
        chat(**fields)


def test_logit_bias_and_logprobs_settings() -> None:
    assert chat(logit_bias={"7": 2.5, "11": -100}).bias() == ((7, 2.5), (11, -100.0))
    assert chat().wanted_logprobs() is None
    assert chat(logprobs=True).wanted_logprobs() == 0
    assert chat(logprobs=True, top_logprobs=4).wanted_logprobs() == 4
    assert completion(logprobs=0).logprobs == 0
    with pytest.raises(InvalidRequest, match=r"^echo: "):
        completion(logprobs=1, echo=True)
    with pytest.raises(InvalidRequest, match=r"^logprobs: "):
        completion(logprobs=21)


def test_logprob_shapes() -> None:
    entries: list[replies.LogprobEntry] = [
        ("Hel", b"Hel", -0.5, [("Hel", b"Hel", -0.5), ("Hi", b"Hi", -1.5)]),
        ("lo", b"lo", -0.25, [("lo", b"lo", -0.25), ("p", b"p", -2.0)]),
    ]
    chat_shape = replies.chat_logprobs(entries)
    assert chat_shape == {"refusal": None, "content": [
        {"token": "Hel", "logprob": -0.5, "bytes": [72, 101, 108], "top_logprobs": [
            {"token": "Hel", "logprob": -0.5, "bytes": [72, 101, 108]},
            {"token": "Hi", "logprob": -1.5, "bytes": [72, 105]}]},
        {"token": "lo", "logprob": -0.25, "bytes": [108, 111], "top_logprobs": [
            {"token": "lo", "logprob": -0.25, "bytes": [108, 111]},
            {"token": "p", "logprob": -2.0, "bytes": [112]}]}]}  # fmt: skip
    assert replies.completion_logprobs(entries, 10) == {
        "tokens": ["Hel", "lo"], "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{"Hel": -0.5, "Hi": -1.5}, {"lo": -0.25, "p": -2.0}],
        "text_offset": [10, 13]}  # fmt: skip
    assert replies.chat_logprobs(None) is None and replies.completion_logprobs(None, 0) is None


async def test_logprobs_travel_with_the_text_they_belong_to() -> None:
    """Held-back text (a partial UTF-8 character) holds its tokens' logprobs back too."""
    pieces = {0: b"A", 1: b"\xc3", 2: b"\xa9", 3: b"!"}

    def decode(ids: Any) -> str:
        return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    async def steps() -> AsyncIterator[EngineStep]:
        for token in range(4):
            yield EngineStep([token], "length" if token == 3 else None,
                             [TokenLogprob(token, -float(token))])  # fmt: skip

    deltas = [delta async for delta in stream_text(steps(), decode)]
    assert [(d.text, [lp.token_id for lp in d.logprobs]) for d in deltas] == [
        ("A", [0]), ("é", [1, 2]), ("!", [3])]  # fmt: skip


@pytest.mark.parametrize("role", ["user", "system", "developer", "tool"])
def test_only_an_assistant_message_may_leave_out_its_content(role: str) -> None:
    # Until 2026-11 a user turn without content was rendered as an empty turn, not a 400.
    missing = chat(messages=[{"role": "user", "content": "hi"}, {"role": role}])
    with pytest.raises(InvalidRequest, match=rf"^messages\[1\]\.content: a {role} message"):
        missing.chat()
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    turns = chat(messages=[{"role": "user", "content": "hi"},
                           {"role": "assistant", "tool_calls": calls}]).chat()  # fmt: skip
    assert turns[1]["content"] == ""
