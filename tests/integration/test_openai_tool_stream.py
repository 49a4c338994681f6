"""Streamed chat with tools offered and ``tool_choice: "auto"`` on the llama.cpp engine,
driven by the stock openai SDK and raw server-sent events.

Content is streamed as it is generated (text before a ``<tool_call>`` block), calls come
once complete. The model's text is pinned with ``guided_regex`` so the call is certain.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from typing import Any

import openai
import orjson
import pytest

from tests.llm_models import smollm2_gguf
from tests.models import write_config
from tests.utils import RemoteServer

pytest.importorskip("llama_cpp", reason="the llama extra is not installed")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"}}}}}  # fmt: skip
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
# Some text, then a Hermes call block, as a model that calls a tool writes it.
SAID = "Let me check the weather."
CALLING = (
    r"Let me check the weather\.\n<tool_call>\n"
    r'\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}\n</tool_call>'
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    repo = tmp_path_factory.mktemp("tool-stream-repo")
    (repo / "smol" / "1").mkdir(parents=True)
    os.link(smollm2_gguf(), repo / "smol" / "1" / "model.gguf")
    generation = {"num_blocks": 128, "block_size": 16, "max_num_seqs": 4, "max_model_len": 1024}
    write_config(repo, "smol", {"backend": "llama_cpp", "generation": generation})
    with RemoteServer(repo, log_dir=repo) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0) as sdk:
        yield sdk


def running(server: RemoteServer) -> float:
    text = server.http.get("/metrics").text
    match = re.search(r'^slipstream_llm_sequences_running\{model="smol"\} (\S+)$', text, re.M)
    assert match, "slipstream_llm_sequences_running not in /metrics"
    return float(match.group(1))


def test_auto_streams_content_as_generated_then_the_call(client: openai.OpenAI) -> None:
    request: dict[str, Any] = dict(
        model="smol", messages=QUESTION, tools=[WEATHER], tool_choice="auto", max_tokens=60,
        temperature=0, extra_body={"guided_regex": CALLING},
    )  # fmt: skip
    whole = client.chat.completions.create(**request).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == SAID

    contents: list[str] = []
    calls: list[Any] = []
    reasons: list[str] = []
    usage = None
    for chunk in client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **request
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                assert not calls, "content after the call"
                contents.append(choice.delta.content)
            calls.extend(choice.delta.tool_calls or [])
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    # Token by token, not one delta replayed after the last token.
    assert len(contents) > 1 and "".join(contents) == SAID
    assert [(c.index, c.function.name, c.function.arguments) for c in calls] == [
        (0, "get_weather", '{"city": "Paris"}')
    ]
    assert calls[0].id and calls[0].type == "function"
    assert reasons == ["tool_calls"]
    assert usage is not None and usage.completion_tokens > len(contents)


def test_auto_stream_sends_while_generating_and_a_disconnect_frees_it(
    server: RemoteServer,
) -> None:
    body = {"model": "smol", "messages": QUESTION, "tools": [WEATHER], "tool_choice": "auto",
            "max_tokens": 400, "ignore_eos": True, "stream": True}  # fmt: skip
    with server.http.stream("POST", "/v1/chat/completions", json=body, timeout=30) as reply:
        events = (line[6:] for line in reply.iter_lines() if line.startswith("data: "))
        role = orjson.loads(next(events))
        assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        first = orjson.loads(next(events))
        assert first["choices"][0]["delta"]["content"]
        # The first words arrive while the sequence is still generating.
        assert running(server) == 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and running(server):
        time.sleep(0.05)
    assert running(server) == 0


def test_responses_auto_streams_the_message_then_the_call_item(client: openai.OpenAI) -> None:
    tool = {"type": "function", **WEATHER["function"]}  # the Responses API's flat shape
    request: dict[str, Any] = dict(
        model="smol", input=QUESTION[0]["content"], tools=[tool], tool_choice="auto",
        max_output_tokens=60, temperature=0, extra_body={"guided_regex": CALLING},
    )  # fmt: skip
    whole = client.responses.create(**request)
    assert [item.type for item in whole.output] == ["message", "function_call"]
    assert whole.output_text == SAID

    events = list(client.responses.create(stream=True, **request))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    # The message's words as they come, then the call as an item of its own.
    assert len(deltas) > 1 and "".join(deltas) == SAID
    assert kinds.index("response.function_call_arguments.done") > kinds.index(
        "response.output_text.done"
    )
    final = events[-1]
    assert final.type == "response.completed"
    call = final.response.output[1]
    assert call.type == "function_call"
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Paris"}')
    assert [e.sequence_number for e in events] == list(range(len(events)))
