"""The OpenAI routes' field rules against a real server, driven by the openai SDK: the
SDK's nulls are defaults, tools with ``$defs`` work with ``tool_choice: required``,
unimplemented vLLM and Responses fields are 400s naming them, and the Responses API's
logprobs and incomplete status.

One server per module serves a tiny random-weight Llama (nothing is downloaded).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.llm_models import build_tiny_llama
from tests.models import write_config
from tests.utils import RemoteServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

MESSAGES: Any = [{"role": "user", "content": "Hi"}]
# What openai.pydantic_function_tool emits for a model with a nested model: $defs.
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"loc": {"$ref": "#/$defs/Loc"}},
            "required": ["loc"],
            "$defs": {"Loc": {"type": "object", "required": ["city"],
                              "properties": {"city": {"enum": ["Paris", "Rome"]}}}},
        },
    },
}  # fmt: skip
BROKEN: Any = {"type": "function", "function": {"name": "broken", "parameters": {
    "type": "object", "properties": {"x": {"$ref": "#/$defs/Missing"}}}}}  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    # Room for the tool prompt (about 550 tokens) and a call.
    tiny = build_tiny_llama(tmp_path_factory.mktemp("tiny") / "hf", max_positions=2048)
    repo = tmp_path_factory.mktemp("llm-repo")
    shutil.copytree(tiny, repo / "tiny" / "1")
    generation = {"num_blocks": 64, "block_size": 16}
    write_config(repo, "tiny", {"backend": "transformers", "generation": generation})
    with RemoteServer(repo, log_dir=repo) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0) as sdk:
        yield sdk


def _refused(call: Any, **kwargs: Any) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as refused:
        call(**kwargs)
    return refused.value


def test_the_sdks_nulls_are_the_defaults(client: openai.OpenAI, server: RemoteServer) -> None:
    chat: Any = client.chat.completions.create  # the SDK's overloads take no None stream
    reply = chat(
        model="tiny", messages=MESSAGES, max_tokens=2, temperature=None, top_p=None, n=None,
        presence_penalty=None, frequency_penalty=None, stream=None, logprobs=None,
        parallel_tool_calls=None,
        extra_body={"top_k": None, "ignore_eos": None, "repetition_penalty": None},
    )  # fmt: skip
    assert len(reply.choices) == 1 and reply.choices[0].logprobs is None
    text = client.completions.create(model="tiny", prompt="Hi", max_tokens=2, temperature=None)
    assert text.choices[0].text is not None
    response = client.responses.create(
        model="tiny", input="Hi", max_output_tokens=2, temperature=None, top_p=None
    )
    assert response.status in ("completed", "incomplete")
    for path, body in (
        ("/v1/chat/completions", {"model": "tiny", "messages": None}),
        ("/v1/completions", {"model": "tiny", "prompt": None}),
        ("/v1/responses", {"model": None, "input": "Hi"}),
    ):
        reply_ = server.http.post(path, json=body)
        required = "model" if body["model"] is None else next(k for k in body if k != "model")
        assert reply_.status_code == 400 and reply_.json()["error"]["param"] == required


def test_a_required_call_of_a_tool_with_defs_validates(client: openai.OpenAI) -> None:
    """Before: a 400 "response_format: does not compile: Pointer '/$defs/Loc' does not
    exist". One call at most, so that random weights cannot run on to max_tokens."""
    chat: Any = client.chat.completions.create
    reply = chat(
        model="tiny", messages=MESSAGES, max_tokens=60, temperature=0, tools=[WEATHER],
        tool_choice="required", parallel_tool_calls=False,
    ).choices[0]  # fmt: skip
    assert reply.finish_reason == "tool_calls" and reply.message.tool_calls
    arguments = json.loads(reply.message.tool_calls[0].function.arguments)
    assert arguments["loc"]["city"] in ("Paris", "Rome")
    # Several calls allowed: the same schema compiles (the text may run to max_tokens).
    several = chat(model="tiny", messages=MESSAGES, max_tokens=8, tools=[WEATHER],
                   tool_choice="required")  # fmt: skip
    assert several.choices[0].finish_reason in ("tool_calls", "length")
    create: Any = client.responses.create
    flat = {"type": "function", **WEATHER["function"]}
    response = create(
        model="tiny", input="Hi", max_output_tokens=60, temperature=0, tools=[flat],
        tool_choice="required", parallel_tool_calls=False,
    )  # fmt: skip
    call = response.output[0]
    assert call.type == "function_call"
    assert json.loads(call.arguments)["loc"]["city"] in ("Paris", "Rome")


def test_a_schema_that_does_not_compile_is_named_by_its_own_field(client: openai.OpenAI) -> None:
    for choice in ("required", {"type": "function", "function": {"name": "broken"}}):
        error = _refused(client.chat.completions.create, model="tiny", messages=MESSAGES,
                         max_tokens=4, tools=[WEATHER, BROKEN], tool_choice=choice)  # fmt: skip
        assert error.param == "tools[1].function.parameters", error.body
        assert "does not compile" in error.message
    flat = {"type": "function", **BROKEN["function"]}
    error = _refused(client.responses.create, model="tiny", input="Hi", tools=[flat],
                     tool_choice="required")  # fmt: skip
    assert error.param == "tools[0].parameters", error.body
    bad_format: Any = {"format": {"type": "json_schema", "name": "x",
                                  "schema": {"$ref": "#/$defs/Missing"}}}  # fmt: skip
    error = _refused(client.responses.create, model="tiny", input="Hi", text=bad_format)
    assert error.param == "text.format", error.body


@pytest.mark.parametrize(
    ("field", "value"),
    [("use_beam_search", True), ("skip_special_tokens", False), ("bad_words", ["x"]),
     ("chat_template", "{{ messages }}"), ("truncate_prompt_tokens", 4)],
)  # fmt: skip
def test_vllm_fields_this_server_does_not_implement_are_refused(
    client: openai.OpenAI, field: str, value: Any
) -> None:
    error = _refused(client.chat.completions.create, model="tiny", messages=MESSAGES,
                     max_tokens=2, extra_body={field: value})  # fmt: skip
    assert error.param == field, error.body
    # Their no-op values, the implemented extensions and unknown fields are accepted.
    client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=2,
        extra_body={"use_beam_search": False, "skip_special_tokens": True, "top_k": 4,
                    "min_p": 0.1, "vendor_x": 1},
    )  # fmt: skip


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_tokens", 4), ("n", 2), ("response_format", {"type": "json_object"}),
     ("reasoning", {"effort": "low"}), ("include", ["no.such.thing"])],
)  # fmt: skip
def test_responses_refuses_the_fields_it_does_not_implement(
    client: openai.OpenAI, field: str, value: Any
) -> None:
    error = _refused(client.responses.create, model="tiny", input="Hi", max_output_tokens=2,
                     extra_body={field: value})  # fmt: skip
    assert error.param == field, error.body


def test_responses_top_logprobs_come_with_the_text(client: openai.OpenAI) -> None:
    kwargs: Any = {"model": "tiny", "input": "Hi", "max_output_tokens": 4, "temperature": 0,
                   "top_logprobs": 2, "extra_body": {"ignore_eos": True}}  # fmt: skip
    response = client.responses.create(**kwargs)
    part = response.output[0].content[0]
    assert part.type == "output_text" and part.logprobs and len(part.logprobs) == 4
    assert "".join(entry.token for entry in part.logprobs) == part.text
    assert all(len(entry.top_logprobs) == 2 for entry in part.logprobs)
    assert all(entry.logprob <= 0 for entry in part.logprobs)
    events = list(client.responses.create(**kwargs, stream=True))
    streamed = [e.logprobs for e in events if e.type == "response.output_text.delta"]
    assert [entry.token for batch in streamed for entry in batch] == [
        entry.token for entry in part.logprobs
    ]
    quiet = client.responses.create(**{**kwargs, "top_logprobs": None})
    assert quiet.output[0].content[0].logprobs == []


def test_a_response_cut_short_marks_its_message_incomplete(client: openai.OpenAI) -> None:
    kwargs: Any = {"model": "tiny", "input": "Hi", "max_output_tokens": 3, "temperature": 0,
                   "extra_body": {"ignore_eos": True}}  # fmt: skip
    response = client.responses.create(**kwargs)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    message = response.output[0]
    assert message.type == "message" and message.status == "incomplete"
    assert response.output_text
    events = list(client.responses.create(**kwargs, stream=True))
    assert events[-1].type == "response.incomplete"
    done = [e for e in events if e.type == "response.output_item.done"]
    assert done[0].item.status == "incomplete"
    create: Any = client.responses.create
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    whole = create(**kwargs, tools=[tool], tool_choice="none")
    assert whole.output[0].status == "incomplete"


def test_a_text_part_without_text_is_a_400_naming_it(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": [{"type": "text"}]}]
    error = _refused(client.chat.completions.create, model="tiny", messages=messages,
                     max_tokens=2)  # fmt: skip
    assert error.param == "messages[0].content[0].text", error.body
    assert "missing" in error.message
