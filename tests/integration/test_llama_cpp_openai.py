"""The OpenAI API in depth on the llama.cpp engine: logprobs, penalties, logit bias,
echo and structured outputs, driven by the stock openai SDK.

Logprobs and penalties are checked against llama.cpp alone (llama-cpp-python's
``Llama`` on the same GGUF): a greedy path recomputed in numpy from its logits, with the
penalties applied as OpenAI (presence, frequency) and HF/vLLM (repetition) define them,
must give the same tokens and the same log-probabilities (to 1e-4). The served model
keeps no prefix cache, so each request's steps have the shapes llama.cpp alone runs.
Structured outputs are validated with ``jsonschema`` against the schema that was asked.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import jsonschema
import numpy as np
import openai
import pytest

from tests.llama_greedy import greedy_path
from tests.llm_models import smollm2_gguf
from tests.models import write_config
from tests.utils import RemoteServer

llama_cpp = pytest.importorskip("llama_cpp", reason="the llama extra is not installed")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    repo = tmp_path_factory.mktemp("llama-openai-repo")
    (repo / "smol" / "1").mkdir(parents=True)
    os.link(smollm2_gguf(), repo / "smol" / "1" / "model.gguf")
    write_config(repo, "smol", {"backend": "llama_cpp", "generation": {
        "num_blocks": 256, "block_size": 16, "max_num_seqs": 24, "max_batch_tokens": 512,
        "max_model_len": 2048, "prefix_caching": False}})  # fmt: skip
    with RemoteServer(repo, log_dir=repo) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def alone() -> Any:
    """llama.cpp alone, every position's logits kept (flash attention on, as served)."""
    return llama_cpp.Llama(
        str(smollm2_gguf()),
        n_ctx=2048,
        n_threads=1,
        flash_attn=True,
        logits_all=True,
        verbose=False,
    )


Penalty = Callable[[np.ndarray, list[int], list[int]], np.ndarray]


def reference(alone: Any, prompt: list[int], steps: int, penalize: Penalty | None = None) -> Any:
    """Greedy tokens and their log-softmax, from llama.cpp's own logits (and penalties)."""
    alone.reset()
    alone.eval(prompt)
    tokens: list[int] = []
    logprobs: list[float] = []
    rows: list[np.ndarray] = []
    for _ in range(steps):
        scores = np.array(alone.scores[alone.n_tokens - 1], dtype=np.float64)
        if penalize is not None:
            scores = penalize(scores, prompt, tokens)
        log_total = scores.max() + np.log(np.exp(scores - scores.max()).sum())
        token = int(scores.argmax())
        tokens.append(token)
        logprobs.append(float(scores[token] - log_total))
        rows.append(scores - log_total)
        alone.eval([token])
    return tokens, logprobs, rows


def piece(alone: Any, token: int) -> bytes:
    return bytes(alone.detokenize([token], special=True))


def ids(alone: Any, text: str) -> list[int]:
    return [int(t) for t in alone.tokenize(text.encode(), add_bos=False, special=True)]


# -- logprobs ------------------------------------------------------------------------------


def test_completion_logprobs_are_llama_cpp_s_log_softmax(client: openai.OpenAI, alone: Any) -> None:
    prompt = ids(alone, "The three primary colours are")
    reply = client.completions.create(
        model="smol", prompt=prompt, max_tokens=12, temperature=0, logprobs=5,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    tokens, logprobs, rows = reference(alone, prompt, 12)
    got = reply.choices[0].logprobs
    assert got is not None and got.tokens and got.token_logprobs and got.top_logprobs
    assert [t.encode() for t in got.tokens] == [piece(alone, t) for t in tokens]
    assert np.allclose(got.token_logprobs, logprobs, atol=1e-4)
    for row, top, chosen in zip(rows, got.top_logprobs, got.token_logprobs, strict=True):
        best = np.sort(row)[::-1][:5]
        assert np.allclose(sorted(top.values(), reverse=True), best, atol=1e-4)
        assert max(top.values()) == pytest.approx(chosen)  # greedy: the chosen is the best
    assert "".join(got.tokens) == reply.choices[0].text
    assert got.text_offset == list(np.cumsum([0] + [len(t) for t in got.tokens[:-1]]))


def test_chat_logprobs_stream_the_same_as_they_answer(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": "smol", "messages": [{"role": "user", "content": "Name three fruits."}],
        "max_tokens": 10, "temperature": 0, "logprobs": True, "top_logprobs": 3,
    }  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.logprobs is not None and whole.logprobs.content
    content = whole.logprobs.content
    assert "".join(item.token for item in content) == whole.message.content
    assert all(len(item.top_logprobs) == 3 for item in content)
    assert all(bytes(item.bytes or []).decode() == item.token for item in content)
    streamed = []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            streamed.extend(chunk.choices[0].logprobs.content)
    assert [(i.token, round(i.logprob, 6)) for i in streamed] == [
        (i.token, round(i.logprob, 6)) for i in content
    ]


def test_sampled_logprobs_are_of_the_tempered_distribution(
    client: openai.OpenAI, alone: Any
) -> None:
    """At temperature 0.5 the first token's logprob is log-softmax(logits / 0.5)."""
    prompt = ids(alone, "My favourite animal is the")
    reply = client.completions.create(
        model="smol", prompt=prompt, max_tokens=1, temperature=0.5, seed=3, logprobs=1
    )
    alone.reset()
    alone.eval(prompt)
    scores = np.array(alone.scores[alone.n_tokens - 1], dtype=np.float64) / 0.5
    log_softmax = scores - (scores.max() + np.log(np.exp(scores - scores.max()).sum()))
    got = reply.choices[0].logprobs
    assert got is not None and got.tokens and got.token_logprobs and got.top_logprobs
    chosen = next(t for t in range(len(log_softmax)) if piece(alone, t) == got.tokens[0].encode())
    assert got.token_logprobs[0] == pytest.approx(log_softmax[chosen], abs=1e-4)
    assert next(iter(got.top_logprobs[0].values())) == pytest.approx(log_softmax.max(), abs=1e-4)


# -- penalties and bias ----------------------------------------------------------------------


def _openai_penalties(frequency: float, presence: float) -> Penalty:
    def apply(scores: np.ndarray, _prompt: list[int], out: list[int]) -> np.ndarray:
        for token in set(out):
            scores[token] -= out.count(token) * frequency + presence
        return scores

    return apply


def _repetition(penalty: float) -> Penalty:
    def apply(scores: np.ndarray, prompt: list[int], out: list[int]) -> np.ndarray:
        for token in set(prompt) | set(out):
            value = scores[token]
            scores[token] = value / penalty if value > 0 else value * penalty
        return scores

    return apply


@pytest.mark.parametrize(
    ("extra", "penalize"),
    [
        ({"frequency_penalty": 1.2, "presence_penalty": 0.6}, _openai_penalties(1.2, 0.6)),
        ({"extra_body": {"repetition_penalty": 1.3}}, _repetition(1.3)),
    ],
    ids=["frequency-presence", "repetition"],
)
def test_penalties_follow_their_definitions(
    client: openai.OpenAI, alone: Any, extra: dict[str, Any], penalize: Penalty
) -> None:
    prompt = ids(alone, "Repeat after me: la la la la la la la la la la")
    body = {"extra_body": {"ignore_eos": True, **extra.pop("extra_body", {})}, **extra}
    reply = client.completions.create(
        model="smol", prompt=prompt, max_tokens=16, temperature=0, logprobs=0, **body
    )
    tokens, logprobs, _rows = reference(alone, prompt, 16, penalize)
    plain, _, _ = reference(alone, prompt, 16)
    assert tokens != plain, "the penalty changes nothing here: the test would prove nothing"
    got = reply.choices[0].logprobs
    assert got is not None and got.tokens and got.token_logprobs
    assert [t.encode() for t in got.tokens] == [piece(alone, t) for t in tokens]
    assert np.allclose(got.token_logprobs, logprobs, atol=1e-4)


def test_logit_bias_forces_and_forbids_tokens(client: openai.OpenAI, alone: Any) -> None:
    prompt = ids(alone, "The capital of France is")
    plain, _, _ = reference(alone, prompt, 1)
    banned = client.completions.create(
        model="smol", prompt=prompt, max_tokens=1, temperature=0,
        logit_bias={str(plain[0]): -100},
    )  # fmt: skip
    assert banned.choices[0].text.encode() != piece(alone, plain[0])
    forced = ids(alone, " banana")[0]
    reply = client.completions.create(
        model="smol", prompt=prompt, max_tokens=3, temperature=0,
        logit_bias={str(forced): 100}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert reply.choices[0].text.encode() == piece(alone, forced) * 3


def test_echo_prepends_the_prompt(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": "smol", "prompt": "Once upon a time", "max_tokens": 6,
                              "temperature": 0}  # fmt: skip
    plain = client.completions.create(**kwargs).choices[0].text
    echoed = client.completions.create(**kwargs, echo=True).choices[0].text
    assert echoed == "Once upon a time" + plain
    pieces = [c.choices[0].text for c in client.completions.create(**kwargs, echo=True,
                                                                     stream=True)]  # fmt: skip
    assert pieces[0] == "Once upon a time" and "".join(pieces) == echoed


# -- structured outputs --------------------------------------------------------------------

_NAME = {"type": "string", "minLength": 1, "maxLength": 20}
SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("a person", {"type": "object", "properties": {"name": _NAME, "age": {
        "type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"]}),
    ("a colour", {"type": "object", "properties": {"colour": {
        "enum": ["red", "green", "blue"]}}, "required": ["colour"]}),
    ("a list of three fruits", {"type": "object", "properties": {"fruits": {
        "type": "array", "items": _NAME, "minItems": 3, "maxItems": 3}},
        "required": ["fruits"]}),
    ("a yes or no answer", {"type": "object", "properties": {"answer": {"type": "boolean"}},
                            "required": ["answer"]}),
    ("a book", {"type": "object", "properties": {"title": _NAME, "author": {
        "type": "object", "properties": {"first": _NAME, "last": _NAME},
        "required": ["first", "last"]}, "year": {"type": "integer", "minimum": 1000,
        "maximum": 2100}}, "required": ["title", "author", "year"]}),
    ("a point", {"type": "object", "properties": {"x": {"type": "integer", "minimum": -10,
        "maximum": 10}, "y": {"type": "integer", "minimum": -10, "maximum": 10}},
        "required": ["x", "y"]}),
    ("a temperature reading", {"type": "object", "properties": {"celsius": {
        "type": "number"}, "unit": {"const": "C"}}, "required": ["celsius", "unit"]}),
    ("a list of numbers", {"type": "array", "items": {"type": "integer", "minimum": 0,
        "maximum": 9}, "minItems": 1, "maxItems": 5}),
    ("a city", {"type": "object", "properties": {"city": _NAME, "country": _NAME,
        "population": {"type": "integer", "minimum": 0}}, "required": ["city", "country"]}),
    ("a traffic light state", {"enum": ["red", "amber", "green"]}),
    ("a pet", {"type": "object", "properties": {"kind": {"enum": ["cat", "dog", "fish"]},
        "name": _NAME, "legs": {"type": "integer", "minimum": 0, "maximum": 4}},
        "required": ["kind", "name", "legs"], "additionalProperties": False}),
    ("a shopping list", {"type": "object", "properties": {"items": {"type": "array",
        "items": {"type": "object", "properties": {"item": _NAME, "count": {
            "type": "integer", "minimum": 1, "maximum": 12}}, "required": ["item", "count"]},
        "minItems": 1, "maxItems": 3}}, "required": ["items"]}),
    ("a date", {"type": "object", "properties": {"day": {"type": "integer", "minimum": 1,
        "maximum": 31}, "month": {"type": "integer", "minimum": 1, "maximum": 12}},
        "required": ["day", "month"]}),
    ("a word", {"type": "string", "minLength": 1, "maxLength": 12}),
    ("a rating", {"type": "object", "properties": {"stars": {"type": "integer",
        "minimum": 1, "maximum": 5}, "comment": _NAME}, "required": ["stars"]}),
    ("a user", {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1},
        "tags": {"type": "array", "items": {"enum": ["admin", "guest", "staff"]},
                 "maxItems": 2}, "active": {"type": "boolean"}},
        "required": ["id", "tags", "active"]}),
    ("a nullable note", {"type": "object", "properties": {"note": {"type": ["string",
        "null"], "maxLength": 20}}, "required": ["note"]}),
    ("a team", {"type": "object", "properties": {"name": _NAME, "members": {
        "type": "array", "items": {"type": "object", "properties": {"name": _NAME,
        "role": {"enum": ["lead", "dev"]}}, "required": ["name", "role"]},
        "minItems": 2, "maxItems": 2}}, "required": ["name", "members"]}),
    ("a size", {"type": "object", "properties": {"size": {"enum": ["S", "M", "L"]},
        "price": {"type": "integer", "minimum": 1, "maximum": 500}},
        "required": ["size", "price"]}),
    ("a flag", {"type": "boolean"}),
    ("a product code", {"type": "object", "properties": {"code": {"type": "string",
        "pattern": "^[A-Z]{3}-[0-9]{3}$"}}, "required": ["code"]}),
]  # fmt: skip


def test_json_schema_outputs_always_validate(server: RemoteServer) -> None:
    """A suite of schemas (nested objects, arrays, enums, bounded integers, patterns),
    all at once in one continuous batch: every reply parses and validates."""

    async def ask(http: httpx.AsyncClient, what: str, schema: dict[str, Any]) -> Any:
        body = {"model": "smol", "temperature": 0, "max_tokens": 160,
                "messages": [{"role": "user", "content": f"Give me {what} as JSON."}],
                "response_format": {"type": "json_schema", "json_schema": {
                    "name": "answer", "schema": schema, "strict": True}}}  # fmt: skip
        reply = await http.post(server.url("/v1/chat/completions"), json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]

    async def run() -> list[Any]:
        async with httpx.AsyncClient(timeout=180) as http:
            return await asyncio.gather(*(ask(http, what, schema) for what, schema in SCHEMAS))

    choices = asyncio.run(run())
    assert len(SCHEMAS) >= 20
    for (what, schema), choice in zip(SCHEMAS, choices, strict=True):
        assert choice["finish_reason"] == "stop", (what, choice)
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_json_object_choice_and_grammar(client: openai.OpenAI) -> None:
    ask = 'Reply with a JSON object holding one key, "name", a dog\'s name.'
    reply = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": ask}], max_tokens=200,
        temperature=0, response_format={"type": "json_object"},
    ).choices[0]  # fmt: skip
    assert reply.finish_reason == "stop"
    assert isinstance(json.loads(reply.message.content or ""), dict)
    for temperature in (0.0, 1.0):
        choice = client.completions.create(
            model="smol", prompt="Is the sea wet? Answer:", max_tokens=8, temperature=temperature,
            seed=5, extra_body={"guided_choice": ["yes", "no", "maybe"]},
        ).choices[0]  # fmt: skip
        assert choice.text in {"yes", "no", "maybe"} and choice.finish_reason == "stop"
    digits = client.completions.create(
        model="smol", prompt="Pick a number:", max_tokens=8, temperature=1.0, seed=9,
        extra_body={"grammar": 'root ::= [1-9] [0-9] [0-9]'},
    ).choices[0].text  # fmt: skip
    assert len(digits) == 3 and digits.isdigit()
    code = client.completions.create(
        model="smol", prompt="A product code:", max_tokens=12, temperature=1.0, seed=2,
        extra_body={"guided_regex": "[A-Z]{3}-[0-9]{3}"},
    ).choices[0]  # fmt: skip
    assert re.fullmatch("[A-Z]{3}-[0-9]{3}", code.text) and code.finish_reason == "stop"


def test_constrained_sequences_do_not_change_their_neighbours(
    server: RemoteServer, alone: Any
) -> None:
    """An unconstrained greedy request stays llama.cpp's greedy path beside constrained
    ones (a grammar that leaked into it would force its tokens far off that path; beside
    other sequences a near-tie may swap, so not token for token the text it gets alone)."""
    prompt = [int(t) for t in alone.tokenize(b"The weather today is", add_bos=False)]
    plain = {"model": "smol", "prompt": prompt, "max_tokens": 20, "temperature": 0,
             "ignore_eos": True}  # fmt: skip

    async def together() -> list[httpx.Response]:
        constrained = {**plain, "max_tokens": 40, "ignore_eos": False, "guided_json": {
            "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
            "additionalProperties": False}}  # fmt: skip
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(
                http.post(server.url("/v1/completions"), json=plain),
                *(http.post(server.url("/v1/completions"), json=constrained) for _ in range(3)),
            )

    first, *others = asyncio.run(together())
    greedy_path(alone, prompt, first.json()["choices"][0]["text"], 20)
    for other in others:
        assert json.loads(other.json()["choices"][0]["text"]) in ({"ok": True}, {"ok": False})


def test_a_constraint_the_vocabulary_cannot_follow_is_400_and_ends_alone(
    server: RemoteServer,
) -> None:
    """llguidance's mask allows "3" after U+0089 where the choice needs the control byte
    0x16 first (found by schemathesis): the request is a 400 naming its field, and the
    greedy request decoding in the same steps finishes as usual."""
    plain = {"model": "smol", "prompt": "The weather today is", "max_tokens": 12,
             "temperature": 0, "ignore_eos": True}  # fmt: skip
    unfollowable = {"model": "smol", "prompt": "hi", "max_tokens": 8,
                    "guided_choice": ["\u0089\u00163"]}  # fmt: skip

    async def together() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(
                http.post(server.url("/v1/completions"), json=plain),
                http.post(server.url("/v1/completions"), json=unfollowable),
            )

    first, refused = asyncio.run(together())
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "guided_choice" and "cannot follow" in error["message"], error
    assert "<state>" not in error["message"]  # llguidance's parser dump stays out
    assert first.status_code == 200 and first.json()["choices"][0]["finish_reason"] == "length"


# -- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("route", "extra", "param"),
    [
        ("chat", {"top_logprobs": 3}, "top_logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("completions", {"logprobs": 21}, "logprobs"),
        ("completions", {"logprobs": 1, "echo": True}, "echo"),
        ("chat", {"response_format": {"type": "xml"}}, "response_format.type"),
        ("chat", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            "chat",
            {"response_format": {"type": "json_object"}, "guided_choice": ["a"]},
            "guided_choice",
        ),
        ("completions", {"grammar": "root ::= ("}, "grammar"),
        ("completions", {"guided_regex": "[a-"}, "guided_regex"),
        ("completions", {"guided_json": "{not json"}, "guided_json"),
        ("completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
        ("completions", {"logit_bias": {"5": 101}}, "logit_bias"),
        ("completions", {"logit_bias": {"99999999": 1}}, "logit_bias"),
        ("completions", {"frequency_penalty": 2.5}, "frequency_penalty"),
        ("completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ],
)
def test_bad_feature_requests_are_400_naming_the_field(
    server: RemoteServer, route: str, extra: dict[str, Any], param: str
) -> None:
    body: dict[str, Any] = {"model": "smol", "max_tokens": 2, **extra}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    reply = server.http.post(path, json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param, error
    # The server is unharmed.
    assert server.http.post("/v1/completions", json={
        "model": "smol", "prompt": "hi", "max_tokens": 1}).status_code == 200  # fmt: skip


# -- tools -----------------------------------------------------------------------------------


def _function(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description,
            "parameters": {"type": "object", "properties": properties,
                           "required": list(properties)}}}  # fmt: skip


_CITY = {"type": "string", "minLength": 1, "maxLength": 24}
TOOL_SETS: list[tuple[str, list[dict[str, Any]]]] = [
    ("What is the weather in Paris?", [
        _function("get_weather", "Current weather in a city", {
            "city": _CITY, "unit": {"enum": ["C", "F"]}})]),
    ("Add 2 and 40.", [
        _function("add", "Add two integers", {"a": {"type": "integer"},
                                              "b": {"type": "integer"}}),
        _function("multiply", "Multiply two integers", {"a": {"type": "integer"},
                                                        "b": {"type": "integer"}})]),
    ("Book a table for four at 8pm.", [
        _function("book_table", "Reserve a restaurant table", {
            "people": {"type": "integer", "minimum": 1, "maximum": 12},
            "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}})]),
    ("Send an email to Ann saying hello.", [
        _function("send_email", "Send an email", {
            "to": _CITY, "subject": _CITY, "urgent": {"type": "boolean"}})]),
    ("Turn the kitchen lights off.", [
        _function("set_light", "Switch a light", {
            "room": {"enum": ["kitchen", "hall", "bedroom"]}, "on": {"type": "boolean"}}),
        _function("set_heating", "Set the heating", {
            "celsius": {"type": "integer", "minimum": 10, "maximum": 30}})]),
    ("Find flights from Oslo to Rome.", [
        _function("search_flights", "Search flights", {
            "origin": _CITY, "destination": _CITY,
            "passengers": {"type": "integer", "minimum": 1, "maximum": 9}})]),
    ("Convert 100 dollars to euros.", [
        _function("convert", "Convert money", {
            "amount": {"type": "number", "minimum": 0},
            "from": {"enum": ["USD", "EUR", "GBP"]}, "to": {"enum": ["USD", "EUR", "GBP"]}})]),
    ("Remind me to call mum tomorrow.", [
        _function("create_reminder", "Create a reminder", {
            "text": _CITY, "day": {"enum": ["today", "tomorrow"]}})]),
    ("Play some jazz.", [
        _function("play_music", "Play music", {"genre": _CITY,
                                               "volume": {"type": "integer", "minimum": 0,
                                                          "maximum": 10}}),
        _function("stop_music", "Stop the music", {})]),
    ("Translate 'cat' to French.", [
        _function("translate", "Translate a word", {
            "word": _CITY, "language": {"enum": ["fr", "de", "es"]}})]),
]  # fmt: skip


def test_required_tool_calls_always_validate(server: RemoteServer) -> None:
    """tool_choice required, six tool sets at once (a string pattern, enums, integers with
    bounds, several functions, one without parameters): every reply is a call of one of
    the offered functions whose arguments validate against its schema."""

    async def ask(http: httpx.AsyncClient, question: str, tools: list[dict[str, Any]]) -> Any:
        body = {"model": "smol", "temperature": 0, "max_tokens": 120, "tools": tools,
                "tool_choice": "required", "parallel_tool_calls": False,
                "messages": [{"role": "user", "content": question}]}  # fmt: skip
        reply = await http.post(server.url("/v1/chat/completions"), json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]

    async def run() -> list[Any]:
        async with httpx.AsyncClient(timeout=180) as http:
            return await asyncio.gather(*(ask(http, q, tools) for q, tools in asked))

    asked = TOOL_SETS[:3] + TOOL_SETS[-3:]
    for (question, tools), choice in zip(asked, asyncio.run(run()), strict=True):
        assert choice["finish_reason"] == "tool_calls", (question, choice)
        [call] = choice["message"]["tool_calls"]
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
        assert call["type"] == "function" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]),
                            schemas[call["function"]["name"]])  # fmt: skip


def test_a_named_tool_choice_calls_that_function_streamed_or_not(client: openai.OpenAI) -> None:
    question, tools = TOOL_SETS[1]
    kwargs: dict[str, Any] = {
        "model": "smol", "messages": [{"role": "user", "content": question}], "tools": tools,
        "tool_choice": {"type": "function", "function": {"name": "multiply"}},
        "max_tokens": 60, "temperature": 0}  # fmt: skip
    reply = client.chat.completions.create(**kwargs).choices[0]
    assert reply.finish_reason == "tool_calls" and reply.message.tool_calls
    call = reply.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "multiply"
    assert set(json.loads(call.function.arguments)) == {"a", "b"}
    deltas = [c.choices[0] for c in client.chat.completions.create(**kwargs, stream=True)]
    assert deltas[0].delta.role == "assistant" and deltas[-1].finish_reason == "tool_calls"
    [streamed] = [d.delta.tool_calls for d in deltas if d.delta.tool_calls]
    assert streamed[0].function and streamed[0].function.name == "multiply"
    assert streamed[0].function.arguments == call.function.arguments


def test_a_conversation_with_calls_and_results_is_answered(client: openai.OpenAI) -> None:
    question, tools = TOOL_SETS[0]
    call = {"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}  # fmt: skip
    result = {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}
    asked = {"role": "assistant", "content": None, "tool_calls": [call]}
    messages: Any = [{"role": "user", "content": question}, asked, result]
    reply = client.chat.completions.create(
        model="smol", messages=messages, tools=tools, tool_choice="none", max_tokens=20,
        temperature=0,
    )  # fmt: skip
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOL_SETS[0][1], "tool_choice": {"type": "function",
                                                     "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tools": [_function("bad name!", "", {})]}, "tools.0.function.name"),
        ({"tools": TOOL_SETS[0][1], "tool_choice": "required",
          "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400_naming_the_field(
    server: RemoteServer, extra: dict[str, Any], param: str
) -> None:
    body = {"model": "smol", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
            **extra}  # fmt: skip
    reply = server.http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.json()


# -- the Responses API -------------------------------------------------------------------------


def test_a_response_says_what_the_chat_route_says(client: openai.OpenAI) -> None:
    """Instructions and input become the same prompt as a chat's system and user
    messages: the same greedy text and the same token counts."""
    reply = client.responses.create(
        model="smol", instructions="Answer briefly.", input="What is the capital of Italy?",
        max_output_tokens=40, temperature=0,
    )  # fmt: skip
    chat = client.chat.completions.create(
        model="smol", max_tokens=40, temperature=0,
        messages=[{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": "What is the capital of Italy?"}],
    )  # fmt: skip
    assert reply.output_text == chat.choices[0].message.content
    assert reply.usage is not None and chat.usage is not None
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    assert reply.usage.output_tokens == chat.usage.completion_tokens
    finished = chat.choices[0].finish_reason == "stop"
    assert reply.status == ("completed" if finished else "incomplete")
    assert reply.id.startswith("resp_") and reply.store is False


def test_a_streamed_response_sends_the_events_in_order(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": "smol", "input": "Say hello.", "temperature": 0,
                              "max_output_tokens": 60}  # fmt: skip
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{whole.status}"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    if whole.status == "completed":
        with client.responses.stream(**kwargs) as stream:
            assert stream.get_final_response().output_text == whole.output_text


def test_response_text_format_and_function_calls(client: openai.OpenAI) -> None:
    schema = SCHEMAS[0][1]
    reply = client.responses.create(
        model="smol", input="Give me a person as JSON.", max_output_tokens=100, temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                         "strict": True}},
    )  # fmt: skip
    jsonschema.validate(json.loads(reply.output_text), schema)
    question, tools = TOOL_SETS[0]
    flat = [{"type": "function", **tool["function"]} for tool in tools]
    kwargs: dict[str, Any] = {"model": "smol", "input": question, "tools": flat,
                              "tool_choice": "required", "max_output_tokens": 80,
                              "temperature": 0}  # fmt: skip
    called = client.responses.create(**kwargs)
    [item] = called.output
    assert item.type == "function_call" and item.name == "get_weather"
    jsonschema.validate(json.loads(item.arguments), flat[0]["parameters"])
    kinds = [e.type for e in client.responses.create(**kwargs, stream=True)]
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    follow_up = client.responses.create(
        model="smol", max_output_tokens=20, temperature=0, tools=flat,
        input=[{"role": "user", "content": question},
               {"type": "function_call", "call_id": item.call_id, "name": item.name,
                "arguments": item.arguments},
               {"type": "function_call_output", "call_id": item.call_id, "output": "18 C"}],
    )  # fmt: skip
    assert follow_up.output_text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"n": 2}, "n"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"input": []}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
         "input[0].content[0]"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)  # fmt: skip
def test_bad_response_requests_are_400_naming_the_field(
    server: RemoteServer, extra: dict[str, Any], param: str
) -> None:
    body = {"model": "smol", "input": "hi", **extra}
    reply = server.http.post("/v1/responses", json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.json()
