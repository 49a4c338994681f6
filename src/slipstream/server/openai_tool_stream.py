"""A streamed chat answer with ``tool_choice: "auto"``: content as it is generated, calls
once complete.

Free text may hold ``<tool_call>`` blocks (the Hermes format). Text before the first
block is sent as it comes, as vLLM's Hermes parser streams it; from the block's opening
tag on (and a tail that may begin the tag, or trailing whitespace the final content would
strip) it is held until the choice ends, when the calls are read from the whole text and
sent as one ``tool_calls`` delta with ``finish_reason: "tool_calls"``. Until 2026-11 the
whole answer was generated first and then replayed, so a client saw no byte (not even the
role) until the last token: a long answer tripped proxies' and clients' read timeouts.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from slipstream.llm.text import TextDelta
from slipstream.llm.tools import Tool, read_calls
from slipstream.protocol import openai_replies as replies
from slipstream.server.openai_generation import StreamHead, ended

_OPEN_TAG = "<tool_call>"


def sendable_end(text: str, sent: int) -> int:
    """How much of ``text`` may be sent as content while the choice is still generating:
    up to the first ``<tool_call>`` or a tail that may begin one, without trailing
    whitespace (never less than ``sent``, what was already sent).

    >>> sendable_end("Let me check. <tool", 0)
    13
    """
    end = text.find(_OPEN_TAG)
    if end == -1:
        end = len(text)
        for keep in range(min(len(_OPEN_TAG) - 1, len(text)), 0, -1):
            if _OPEN_TAG.startswith(text[-keep:]):
                end -= keep
                break
    while end > sent and text[end - 1].isspace():
        end -= 1
    return max(end, sent)


def finish_auto(text: str, sent: str, tools: list[Tool]) -> tuple[str, list[replies.CallItem]]:
    """(content still to send, the calls) of a finished choice that sent ``sent``."""
    try:
        content, calls = read_calls(text, tools, "auto")
    except (json.JSONDecodeError, KeyError, TypeError):
        content, calls = text, []
    items = [(call.id, call.name, call.arguments) for call in calls]
    # With calls the content is stripped: what was sent kept its leading whitespace.
    for prefix in (sent, sent.lstrip()):
        if content.startswith(prefix):
            return content[len(prefix) :], items
    return "", items


def auto_tool_events(
    stream: AsyncIterator[tuple[int, TextDelta]],
    head: StreamHead,
    choices: int,
    prompt_tokens: int,
    tools: list[Tool],
) -> AsyncIterator[bytes]:
    """The server-sent events of a streamed chat offering tools with ``tool_choice:
    "auto"``: role first, content as it comes, calls and reason last, then [DONE]."""
    completion_tokens = [0] * choices
    events = _events(stream, head, choices, prompt_tokens, tools, completion_tokens)
    kind = "chat.completion.chunk"
    return ended(events, stream, head, kind, lambda: (prompt_tokens, sum(completion_tokens)))


async def _events(
    stream: AsyncIterator[tuple[int, TextDelta]],
    head: StreamHead,
    choices: int,
    prompt_tokens: int,
    tools: list[Tool],
    completion_tokens: list[int],
) -> AsyncIterator[bytes]:
    """:func:`auto_tool_events`' own events, counting each choice's tokens in
    ``completion_tokens``."""
    rid, created, model, pieces = head.rid, head.created, head.model, head.pieces
    extra: dict[str, Any] = {"usage": None} if head.include_usage else {}
    for index in range(choices):
        role = {"role": "assistant", "content": ""}
        yield replies.sse(replies.chat_chunk(rid, created, model, index, role, None) | extra)
    texts = [""] * choices
    sent = [0] * choices
    # Logprob entries of text not sent yet: they go with the delta that sends it.
    held: list[list[replies.LogprobEntry]] = [[] for _ in range(choices)]
    async for index, delta in stream:
        completion_tokens[index] = delta.completion_tokens
        if head.continuous_usage:
            extra = {"usage": replies.usage(prompt_tokens, sum(completion_tokens))}
        texts[index] += delta.text
        if pieces is not None:
            held[index].extend(pieces.entries(delta.logprobs))
        text, reason = texts[index], delta.finish_reason
        calls: list[replies.CallItem] = []
        if reason is None:
            end = sendable_end(text, sent[index])
            content = text[sent[index] : end]
            sent[index] = end
        else:
            content, calls = finish_auto(text, text[: sent[index]], tools)
        entries = held[index] if pieces is not None else None
        if content or (reason is not None and entries):
            logprobs = replies.chat_logprobs(entries)
            chunk = replies.chat_chunk(rid, created, model, index, {"content": content},
                                       None, logprobs)  # fmt: skip
            yield replies.sse(chunk | extra)
            held[index] = []
        if calls:
            tool_delta: Any = {"tool_calls": replies.tool_calls(calls)}
            chunk = replies.chat_chunk(rid, created, model, index, tool_delta, None)
            yield replies.sse(chunk | extra)
        if reason is not None:
            why = "tool_calls" if calls else reason
            last = replies.chat_chunk(rid, created, model, index, {}, why,
                                      stop_reason=delta.stop_reason)  # fmt: skip
            yield replies.sse(last | extra)
