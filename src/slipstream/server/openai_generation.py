"""Generation responses of the OpenAI routes: jobs from a request, the answer collected
or streamed as server-sent events, logprobs and tool calls in OpenAI's shapes."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from slipstream.errors import InvalidRequest, SlipstreamError
from slipstream.llm.api import GenerationService, Job
from slipstream.llm.engine import ContextLengthExceeded, Engine, SamplingParams, TokenLogprob
from slipstream.llm.text import TextDelta
from slipstream.llm.tools import (
    Tool,
    ToolChoice,
    call_constraint,
    checked,
    plain_messages,
    read_calls,
    template_messages,
)
from slipstream.protocol import openai_replies as replies
from slipstream.types import Constraint


def build_jobs(
    engine: Engine,
    body: Any,
    prompts: list[list[int]],
    max_tokens: int | None,
    default_max_tokens: int,
    logprobs: int | None,
    constraint: Constraint | None,
) -> list[Job]:
    """One job per prompt and choice (``n``), with the request's sampling settings."""
    stops = body.stops()
    bias = body.bias()
    stop_token_ids = tuple(body.stop_token_ids or ())
    jobs: list[Job] = []
    for prompt in prompts:
        limit = max_tokens
        if limit is None:  # OpenAI's default: as much as the context leaves, capped
            # One sequence's room: with a KV stream per sequence it is less than the cache.
            room = min(engine.max_model_len, engine.sequence_tokens) - len(prompt)
            limit = max(1, min(default_max_tokens, room))
            if body.min_tokens > limit:  # at least min_tokens, as vLLM's default allows
                _check_room(engine, body.min_tokens, len(prompt), room)
                limit = body.min_tokens
        for _ in range(body.n):
            seed = None if body.seed is None else body.seed + len(jobs)
            params = SamplingParams(
                max_tokens=limit,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=max(body.top_k, 0),
                seed=seed,
                ignore_eos=body.ignore_eos,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty,
                logit_bias=bias,
                logprobs=logprobs,
                constraint=constraint,
                min_p=body.min_p,
                min_tokens=body.min_tokens,
                stop_token_ids=stop_token_ids,
            )
            jobs.append(Job(len(jobs), prompt, params, stops, body.include_stop_str_in_output))
    return jobs


def _check_room(engine: Engine, min_tokens: int, prompt_tokens: int, room: int) -> None:
    """A 400 naming min_tokens when that many tokens cannot follow the prompt."""
    if min_tokens > room:
        raise InvalidRequest(
            f"min_tokens: {min_tokens} tokens after the prompt's {prompt_tokens} exceed this "
            f"model's context length of {room + prompt_tokens} tokens; send a smaller "
            "min_tokens or a shorter prompt"
        )


# The fields that can set a request's maximum completion length, and its prompt, per
# route (chat, completions, responses).
_MAX_FIELDS = ("max_completion_tokens", "max_output_tokens", "max_tokens")
_PROMPT_FIELDS = ("messages", "prompt", "input")


def admit(llm: GenerationService, body: Any, jobs: list[Job]) -> Engine:
    """``llm.admit``, with a context overflow named in the request's own fields: the
    maximum the client sent (max_completion_tokens, max_tokens...), or its prompt's field
    when it sent none (the engine cannot tell a default from a sent value)."""
    try:
        return llm.admit(body.model, jobs)
    except ContextLengthExceeded as exc:
        sent = next((f for f in _MAX_FIELDS if getattr(body, f, None) is not None), None)
        prompt_field = next((f for f in _PROMPT_FIELDS if hasattr(body, f)), "prompt")
        raise exc.naming(sent, prompt_field) from None


def own_constraint(body: Any) -> Constraint | None:
    """The request's own structured-output constraint, compiled once to check it: one
    that does not compile is a 400 naming the field that carried it (``guided_json``,
    ``json_schema``, ``guided_grammar``...), not the ``response_format`` the engine would
    name by the constraint's kind."""
    found = body.constraint_field()
    return checked(*found) if found is not None else None


def chat_with_tools(
    engine: Engine,
    messages: list[dict[str, Any]],
    tools: list[Tool],
    choice: ToolChoice,
    parallel: bool,
    constraint: Constraint | None,
    variables: dict[str, Any] | None = None,
) -> tuple[list[int], Constraint | None]:
    """The prompt of a chat offering ``tools`` (rendered by the chat template when it knows
    tools, else put in the system message), and the constraint to decode under: a call
    when ``choice`` requires one, else ``constraint``. ``variables``: the request's
    ``chat_template_kwargs``, more of the template's variables."""
    if engine.template_knows_tools:
        specs = [
            {"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.parameters}}
            for t in tools
        ] or None  # fmt: skip
        prompt = engine.chat_prompt(template_messages(messages), specs, variables)
    else:
        prompt = engine.chat_prompt(plain_messages(messages, tools), None, variables)
    if tools:
        constraint = call_constraint(tools, choice, parallel) or constraint
    return prompt, constraint


@dataclass
class Collected:
    """Every choice of a finished generation."""

    texts: list[str]
    reasons: list[str]
    # vLLM's stop_reason: the stop string or stop token id that ended the choice, or None.
    stop_reasons: list[replies.StopReason]
    completion_tokens: list[int]
    # Per choice: logprob entries, or None when the request asked for none.
    entries: list[list[replies.LogprobEntry] | None]
    # Per choice: the tool calls read from its text.
    calls: list[list[replies.CallItem]] = field(default_factory=list)

    def choices(self) -> list[replies.Choice]:
        return list(zip(self.texts, self.reasons, self.stop_reasons, self.entries, strict=True))


async def collect(
    stream: AsyncIterator[tuple[int, TextDelta]],
    choices: int,
    pieces: Pieces | None,
    echoes: list[str] | None = None,
) -> Collected:
    """Run a generation to its end and gather each choice's text, reason and logprobs."""
    texts = [[echo] for echo in echoes] if echoes else [[""] for _ in range(choices)]
    reasons = ["stop"] * choices
    stop_reasons: list[replies.StopReason] = [None] * choices
    completion_tokens = [0] * choices
    entries: list[list[replies.LogprobEntry] | None] = [
        [] if pieces is not None else None for _ in range(choices)
    ]
    async for index, delta in stream:
        texts[index].append(delta.text)
        completion_tokens[index] = delta.completion_tokens
        if pieces is not None:
            entries[index] = [*(entries[index] or []), *pieces.entries(delta.logprobs)]
        if delta.finish_reason is not None:
            reasons[index] = delta.finish_reason
            stop_reasons[index] = delta.stop_reason
    return Collected(["".join(parts) for parts in texts], reasons, stop_reasons,
                     completion_tokens, entries)  # fmt: skip


def read_tool_calls(collected: Collected, tools: list[Tool], choice: ToolChoice) -> None:
    """Turn each choice's text into its tool calls (finish_reason ``tool_calls``)."""
    for index, text in enumerate(collected.texts):
        try:
            content, calls = read_calls(text, tools, choice)
        except (json.JSONDecodeError, KeyError, TypeError):
            # A constrained call cut short by max_tokens: the text is what there is.
            content, calls = text, []
        collected.calls.append([(c.id, c.name, c.arguments) for c in calls])
        if calls:
            collected.texts[index] = content
            collected.reasons[index] = "tool_calls"


async def replay_events(
    collected: Collected, head: StreamHead, prompt_tokens: int
) -> AsyncIterator[bytes]:
    """A finished chat answer sent as the events a stream would have carried."""
    rid, created, model = head.rid, head.created, head.model
    extra = {"usage": None} if head.include_usage else {}
    for index, text in enumerate(collected.texts):
        role = {"role": "assistant", "content": ""}
        yield replies.sse(replies.chat_chunk(rid, created, model, index, role, None) | extra)
        if text:
            chunk = replies.chat_chunk(rid, created, model, index, {"content": text}, None,
                                      replies.chat_logprobs(collected.entries[index]))  # fmt: skip
            yield replies.sse(chunk | extra)
        if collected.calls[index]:
            delta: Any = {"tool_calls": replies.tool_calls(collected.calls[index])}
            yield replies.sse(replies.chat_chunk(rid, created, model, index, delta, None) | extra)
        last = replies.chat_chunk(rid, created, model, index, {}, collected.reasons[index],
                                  stop_reason=collected.stop_reasons[index])  # fmt: skip
        yield replies.sse(last | extra)
    if head.include_usage:
        use = replies.usage(prompt_tokens, sum(collected.completion_tokens))
        yield replies.usage_chunk(rid, created, model, "chat.completion.chunk", use)
    yield replies.SSE_DONE


class Pieces:
    """Token ids to the (text, bytes) OpenAI's logprobs show, remembered per engine."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._known: dict[int, tuple[str, bytes]] = {}

    def piece(self, token_id: int) -> tuple[str, bytes]:
        known = self._known.get(token_id)
        if known is None:
            raw = self._engine.token_bytes(token_id)
            known = self._known[token_id] = (raw.decode("utf-8", errors="replace"), raw)
        return known

    def entries(self, logprobs: Sequence[TokenLogprob]) -> list[replies.LogprobEntry]:
        out: list[replies.LogprobEntry] = []
        for item in logprobs:
            text, raw = self.piece(item.token_id)
            top = [(*self.piece(token), logprob) for token, logprob in item.top]
            out.append((text, raw, item.logprob, top))
        return out


@dataclass(frozen=True, slots=True)
class StreamHead:
    """What every event of one streamed response repeats."""

    rid: str
    created: int
    model: str
    chat: bool
    include_usage: bool
    pieces: Pieces | None
    # stream_options.continuous_usage_stats: each chunk's usage is the usage so far.
    continuous_usage: bool = False


def sse_events(
    stream: AsyncIterator[tuple[int, Any]],
    head: StreamHead,
    choices: int,
    prompt_tokens: int,
    echoes: list[str] | None,
) -> AsyncIterator[bytes]:
    """The server-sent events of a streamed completion: role first, reason last, [DONE]
    (after an error event too)."""
    completion_tokens = [0] * choices
    events = _completion_events(stream, head, choices, prompt_tokens, echoes, completion_tokens)
    kind = "chat.completion.chunk" if head.chat else "text_completion"
    return ended(events, stream, head, kind, lambda: (prompt_tokens, sum(completion_tokens)))


async def ended(
    events: AsyncIterator[bytes],
    stream: AsyncIterator[Any],
    head: StreamHead,
    kind: str,
    tokens: Callable[[], tuple[int, int]],
) -> AsyncIterator[bytes]:
    """``events``, then what ends every streamed chat or completion: an error event
    where the generation failed, the usage chunk (``tokens()``: prompt and completion
    tokens) where the request asked for it, and [DONE]. The generation's ``stream`` is
    closed however the events end (a client that left frees its sequence at once)."""
    try:
        async for event in events:
            yield event
    except SlipstreamError as exc:
        # [DONE] still ends the stream, as vLLM ends its error streams: clients that read
        # to [DONE] stop there (the openai SDK raises at the error event before it).
        yield replies.error_event(exc)
        yield replies.SSE_DONE
        return
    finally:
        for closable in (events, stream):
            aclose = getattr(closable, "aclose", None)
            if aclose is not None:
                await aclose()
    if head.include_usage:
        use = replies.usage(*tokens())
        yield replies.usage_chunk(head.rid, head.created, head.model, kind, use)
    yield replies.SSE_DONE


async def _completion_events(
    stream: AsyncIterator[tuple[int, Any]],
    head: StreamHead,
    choices: int,
    prompt_tokens: int,
    echoes: list[str] | None,
    completion_tokens: list[int],
) -> AsyncIterator[bytes]:
    """:func:`sse_events`' own events, counting each choice's tokens in
    ``completion_tokens``."""
    rid, created, model, chat, pieces = head.rid, head.created, head.model, head.chat, head.pieces
    extra: dict[str, Any] = {"usage": None} if head.include_usage else {}
    if chat:
        for index in range(choices):
            role = replies.chat_chunk(
                rid, created, model, index, {"role": "assistant", "content": ""}, None
            )
            yield replies.sse(role | extra)
    for index, echo in enumerate(echoes or []):
        yield replies.sse(replies.completion_chunk(rid, created, model, index, echo, None) | extra)
    # Characters sent so far per choice: the legacy logprobs' text_offset counts from it.
    offsets = [len(echo) for echo in echoes] if echoes else [0] * choices
    async for index, delta in stream:
        completion_tokens[index] = delta.completion_tokens
        if head.continuous_usage:
            extra = {"usage": replies.usage(prompt_tokens, sum(completion_tokens))}
        entries = pieces.entries(delta.logprobs) if pieces is not None else None
        if chat:
            if delta.text or entries:
                chunk = replies.chat_chunk(rid, created, model, index, {"content": delta.text},
                                          None, replies.chat_logprobs(entries))  # fmt: skip
                yield replies.sse(chunk | extra)
            if delta.finish_reason is not None:
                last = replies.chat_chunk(rid, created, model, index, {}, delta.finish_reason,
                                          stop_reason=delta.stop_reason)  # fmt: skip
                yield replies.sse(last | extra)
        else:
            logprobs = replies.completion_logprobs(entries, offsets[index])
            offsets[index] += sum(len(text) for text, *_ in entries or [])
            chunk = replies.completion_chunk(rid, created, model, index, delta.text,
                                            delta.finish_reason, logprobs,
                                            delta.stop_reason)  # fmt: skip
            yield replies.sse(chunk | extra)
