"""``POST /v1/responses``: OpenAI's Responses API on the same generation machinery as chat.

A response holds one message (``output_text``) or the function calls the model made.
Streamed, it is the Responses API's event sequence: ``response.created``, the output
item and its content part opened, ``response.output_text.delta`` per piece of text, each
closed again, then ``response.completed`` (``response.incomplete`` when
``max_output_tokens`` cut the message short: the message item is ``incomplete`` too).
With tools offered and ``tool_choice`` ``auto``, the text streams up to a ``<tool_call>``
block and the calls follow as items once complete; a required or named call is read from
the whole text, so that stream is sent once the answer is complete. ``top_logprobs``
(or ``include`` ``message.output_text.logprobs``) puts each token's logprob on the
``output_text`` and on its deltas.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson

from slipstream.errors import SlipstreamError
from slipstream.llm.api import GenerationService
from slipstream.llm.text import TextDelta
from slipstream.llm.tools import Tool, checked
from slipstream.protocol import openai
from slipstream.protocol import openai_replies as replies
from slipstream.protocol.openai_responses import (
    ResponsesRequest,
    call_item,
    event,
    item_id,
    message_item,
    response,
)
from slipstream.server.http_messages import HttpResponse, StreamingResponse
from slipstream.server.openai_generation import (
    Pieces,
    admit,
    build_jobs,
    chat_with_tools,
    collect,
    read_tool_calls,
)
from slipstream.server.openai_tool_stream import finish_auto, sendable_end


async def respond(
    llm: GenerationService, raw: bytes, arrived: float
) -> HttpResponse | StreamingResponse:
    body: ResponsesRequest = openai.parse(raw, ResponsesRequest)
    await llm.wake(body.model)
    engine = llm.engine(body.model)
    choice = body.choice()
    offered = body.tools or [] if choice != "none" else []
    tools = [Tool(t.name, t.description, t.parameters, f"tools[{index}].parameters")
             for index, t in enumerate(offered)]  # fmt: skip
    found = body.constraint_field()
    # Checked here so that a schema that does not compile is named by its own field
    # (text.format), not by the response_format the request never sent.
    own = checked(*found) if found is not None else None
    prompt, constraint = chat_with_tools(
        engine, body.chat(), tools, choice, body.parallel_tool_calls, own,
        body.chat_template_kwargs,
    )  # fmt: skip
    jobs = build_jobs(engine, body, [prompt], body.max_output_tokens,
                      llm.default_max_tokens(body.model), body.wanted_logprobs(),
                      constraint)  # fmt: skip
    admit(llm, body, jobs)  # an overflow names max_output_tokens or input
    pieces = Pieces(engine) if jobs[0].params.logprobs is not None else None
    rid, created = item_id("resp"), replies.now()
    stream = llm.generate(body.model, jobs, arrived)
    if body.stream and not tools:
        events = _text_events(stream, rid, created, body, len(prompt), pieces)
        return StreamingResponse(200, events)
    if body.stream and choice == "auto":
        events = _auto_tool_events(stream, rid, created, body, len(prompt), pieces, tools)
        return StreamingResponse(200, events)
    collected = await collect(stream, 1, pieces)
    read_tool_calls(collected, tools, choice)
    calls = [call_item(call) for call in collected.calls[0]]
    incomplete = collected.reasons[0] == "length"
    output: list[dict[str, Any]] = []
    if collected.texts[0] or not calls:  # text said before a call is a message too
        status = "incomplete" if incomplete else "completed"
        logprobs = _logprobs(collected.entries[0])
        output.append(message_item(item_id("msg"), collected.texts[0], status, logprobs))
    output += calls
    tokens = (len(prompt), collected.completion_tokens[0])
    final = response(rid, created, body, output, tokens, incomplete)
    if body.stream:
        return StreamingResponse(200, _replay(final, body))
    return HttpResponse(200, orjson.dumps(final))


async def _text_events(
    stream: AsyncIterator[tuple[int, TextDelta]],
    rid: str,
    created: int,
    body: ResponsesRequest,
    prompt_tokens: int,
    pieces: Pieces | None,
) -> AsyncIterator[bytes]:
    sequence = _Counter()
    opening = response(rid, created, body, [], None)
    yield event("response.created", sequence(), response=opening)
    yield event("response.in_progress", sequence(), response=opening)
    mid = item_id("msg")
    where = {"item_id": mid, "output_index": 0, "content_index": 0}
    yield event("response.output_item.added", sequence(), output_index=0,
                item=message_item(mid, "", "in_progress"))  # fmt: skip
    part = {"type": "output_text", "text": "", "annotations": []}
    yield event("response.content_part.added", sequence(), part=part, **where)
    texts: list[str] = []
    logprobs: list[dict[str, Any]] = []
    generated, reason = 0, "stop"
    try:
        async for _, delta in stream:
            generated = delta.completion_tokens
            entries = _logprobs(pieces.entries(delta.logprobs) if pieces else None)
            logprobs += entries
            if delta.text or entries:
                texts.append(delta.text)
                yield event("response.output_text.delta", sequence(), delta=delta.text,
                            logprobs=entries, **where)  # fmt: skip
            if delta.finish_reason is not None:
                reason = delta.finish_reason
    except SlipstreamError as exc:
        failed = _failed(rid, created, body, (prompt_tokens, generated), exc)
        yield event("response.failed", sequence(), response=failed)
        return
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    text = "".join(texts)
    yield event("response.output_text.done", sequence(), text=text, logprobs=logprobs, **where)
    yield event("response.content_part.done", sequence(), part=part | {"text": text}, **where)
    incomplete = reason == "length"
    item = message_item(mid, text, "incomplete" if incomplete else "completed", logprobs)
    yield event("response.output_item.done", sequence(), output_index=0, item=item)
    final = response(rid, created, body, [item], (prompt_tokens, generated), incomplete)
    yield event(_last_event(final), sequence(), response=final)


async def _auto_tool_events(
    stream: AsyncIterator[tuple[int, TextDelta]],
    rid: str,
    created: int,
    body: ResponsesRequest,
    prompt_tokens: int,
    pieces: Pieces | None,
    tools: list[Tool],
) -> AsyncIterator[bytes]:
    """``tool_choice: "auto"`` streamed: the message's text as it comes (up to a
    ``<tool_call>`` block, see openai_tool_stream), then each call read from the whole
    text as a ``function_call`` item. The message item opens with its first text (a call
    alone has none); one with no call and no text is sent empty, as unstreamed."""
    sequence = _Counter()
    opening = response(rid, created, body, [], None)
    yield event("response.created", sequence(), response=opening)
    yield event("response.in_progress", sequence(), response=opening)
    mid = item_id("msg")
    where = {"item_id": mid, "output_index": 0, "content_index": 0}
    part = {"type": "output_text", "text": "", "annotations": []}
    text, sent, opened = "", "", False
    held: list[dict[str, Any]] = []  # logprobs of text not sent yet
    logprobs: list[dict[str, Any]] = []
    calls: list[replies.CallItem] = []
    generated, reason = 0, "stop"
    try:
        async for _, delta in stream:
            generated = delta.completion_tokens
            text += delta.text
            held += _logprobs(pieces.entries(delta.logprobs) if pieces else None)
            if delta.finish_reason is None:
                chunk = text[len(sent) : sendable_end(text, len(sent))]
            else:
                reason = delta.finish_reason
                chunk, calls = finish_auto(text, sent, tools)
            if not chunk and not (delta.finish_reason is not None and opened and held):
                continue
            if not opened:
                opened = True
                yield event("response.output_item.added", sequence(), output_index=0,
                            item=message_item(mid, "", "in_progress"))  # fmt: skip
                yield event("response.content_part.added", sequence(), part=part, **where)
            yield event("response.output_text.delta", sequence(), delta=chunk, logprobs=held,
                        **where)  # fmt: skip
            sent, logprobs, held = sent + chunk, logprobs + held, []
    except SlipstreamError as exc:
        failed = _failed(rid, created, body, (prompt_tokens, generated), exc)
        yield event("response.failed", sequence(), response=failed)
        return
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    incomplete = reason == "length" and not calls
    output: list[dict[str, Any]] = []
    if opened or not calls:
        if not opened:
            yield event("response.output_item.added", sequence(), output_index=0,
                        item=message_item(mid, "", "in_progress"))  # fmt: skip
            yield event("response.content_part.added", sequence(), part=part, **where)
        yield event("response.output_text.done", sequence(), text=sent, logprobs=logprobs,
                    **where)  # fmt: skip
        yield event("response.content_part.done", sequence(), part=part | {"text": sent},
                    **where)  # fmt: skip
        item = message_item(mid, sent, "incomplete" if incomplete else "completed", logprobs)
        yield event("response.output_item.done", sequence(), output_index=0, item=item)
        output.append(item)
    for call in calls:
        output.append(call_item(call))
        for chunk_event in _call_events(output[-1], len(output) - 1, sequence):
            yield chunk_event
    final = response(rid, created, body, output, (prompt_tokens, generated), incomplete)
    yield event(_last_event(final), sequence(), response=final)


def _call_events(item: dict[str, Any], index: int, sequence: _Counter) -> list[bytes]:
    """The events of one finished ``function_call`` output item."""
    where = {"item_id": item["id"], "output_index": index}
    return [
        event("response.output_item.added", sequence(), output_index=index,
              item=item | {"arguments": "", "status": "in_progress"}),
        event("response.function_call_arguments.delta", sequence(), delta=item["arguments"],
              **where),
        event("response.function_call_arguments.done", sequence(), arguments=item["arguments"],
              **where),
        event("response.output_item.done", sequence(), output_index=index, item=item),
    ]  # fmt: skip


async def _replay(final: dict[str, Any], body: ResponsesRequest) -> AsyncIterator[bytes]:
    """A finished response as the events a stream of it would have carried."""
    sequence = _Counter()
    opening = final | {"status": "in_progress", "output": [], "usage": None,
                       "incomplete_details": None}  # fmt: skip
    yield event("response.created", sequence(), response=opening)
    yield event("response.in_progress", sequence(), response=opening)
    for index, item in enumerate(final["output"]):
        if item["type"] == "function_call":
            for call_event in _call_events(item, index, sequence):
                yield call_event
            continue
        text = item["content"][0]["text"]
        logprobs = item["content"][0]["logprobs"]
        yield event("response.output_item.added", sequence(), output_index=index,
                    item=item | {"status": "in_progress", "content": []})  # fmt: skip
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        part = {"type": "output_text", "text": "", "annotations": []}
        yield event("response.content_part.added", sequence(), part=part, **where)
        yield event("response.output_text.delta", sequence(), delta=text, logprobs=logprobs,
                    **where)  # fmt: skip
        yield event("response.output_text.done", sequence(), text=text, logprobs=logprobs,
                    **where)  # fmt: skip
        yield event("response.content_part.done", sequence(), part=part | {"text": text},
                    **where)  # fmt: skip
        yield event("response.output_item.done", sequence(), output_index=index, item=item)
    yield event(_last_event(final), sequence(), response=final)


def _logprobs(entries: list[replies.LogprobEntry] | None) -> list[dict[str, Any]]:
    """The Responses API's ``logprobs`` of an ``output_text``: chat's entries."""
    found = replies.chat_logprobs(entries)
    return found["content"] if found is not None else []


def _last_event(final: dict[str, Any]) -> str:
    return "response.incomplete" if final["status"] == "incomplete" else "response.completed"


class _Counter:
    """The events' sequence numbers, from 0."""

    def __init__(self) -> None:
        self._next = 0

    def __call__(self) -> int:
        self._next += 1
        return self._next - 1


def _failed(
    rid: str, created: int, body: Any, tokens: tuple[int, int], exc: SlipstreamError
) -> dict[str, Any]:
    """A streamed response the generation failed: its ``response.failed`` object."""
    failed = response(rid, created, body, [], tokens)
    return failed | {"status": "failed", "error": {"code": "server_error", "message": exc.message}}
