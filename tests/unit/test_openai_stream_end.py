"""A streamed completion that fails after its 200 ends with an error event and then
``data: [DONE]``, as vLLM ends its error streams; the openai SDK still raises the error."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from slipstream.errors import Unavailable
from slipstream.llm.text import TextDelta
from slipstream.server.openai_generation import StreamHead, sse_events


async def _failing() -> AsyncIterator[tuple[int, Any]]:
    yield 0, TextDelta("Hel", 1)
    raise Unavailable("the generation engine is stopping", retry_after_s=5)


def _events(chat: bool) -> bytes:
    head = StreamHead("cmpl-1", 1, "m", chat, include_usage=False, pieces=None)

    async def gather() -> bytes:
        return b"".join([event async for event in sse_events(_failing(), head, 1, 3, None)])

    return asyncio.run(gather())


@pytest.mark.parametrize("chat", [True, False])
def test_an_error_event_is_followed_by_done(chat: bool) -> None:
    events = _events(chat).split(b"\n\n")
    assert events[-1] == b""
    assert events[-3].startswith(b'data: {"error":') and b"stopping" in events[-3]
    assert events[-2] == b"data: [DONE]"


@pytest.mark.parametrize("chat", [True, False])
def test_the_openai_sdk_raises_the_error_before_done(chat: bool) -> None:
    body = _events(chat)
    transport = httpx.MockTransport(
        lambda request: httpx.Response(
            200, content=body, headers={"content-type": "text/event-stream"}
        )
    )
    with (
        httpx.Client(transport=transport) as http,
        openai.OpenAI(base_url="http://test/v1", api_key="x", http_client=http) as sdk,
    ):
        if chat:
            stream: Any = sdk.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "Hi"}], stream=True
            )
        else:
            stream = sdk.completions.create(model="m", prompt="Hi", stream=True)
        texts = []
        with pytest.raises(openai.APIError, match="stopping"):
            for chunk in stream:
                texts.append(chunk)
        assert texts  # the chunks before the error were delivered
