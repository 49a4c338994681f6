"""OpenAI's Responses API (``POST /v1/responses``): its request, response and events.

Stateless: nothing is stored, so ``previous_response_id`` is refused and every response
says ``store: false``. The request maps onto the chat machinery: ``instructions`` is the
system message, ``input`` the conversation (text, messages, earlier function calls and
their outputs), ``tools`` the functions (in the Responses API's flat shape), and
``text.format`` the structured-output constraint.

It takes the Responses API's own names (``max_output_tokens``, ``text.format``,
``include`` / ``top_logprobs``); chat's names for the same things, and Responses fields
this server does not implement (``reasoning``, ``background``, ...), are a 400 naming the
field and what to send instead. The sampling extensions chat takes (``top_k``, ``seed``,
``stop``, the penalties, ``logit_bias``, vLLM's ``min_p``, ``min_tokens``,
``stop_token_ids`` and ``include_stop_str_in_output``, the ``guided_*`` constraints) and
its ``chat_template_kwargs`` apply here too.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

import orjson
from pydantic import ConfigDict, Field

from slipstream.errors import InvalidRequest
from slipstream.protocol.openai import (
    _NULL,
    _STREAM_OPTIONS_NEED_STREAM,
    MAX_TOP_LOGPROBS,
    ContentPart,
    _only,
    _response_format,
    _Sampling,
)
from slipstream.protocol.openai_fields import (
    TEMPLATE_KWARGS,
    VLLM_SAMPLING,
    Unserved,
    _Fields,
    check_template_kwargs,
)
from slipstream.protocol.openai_replies import CallItem
from slipstream.protocol.openai_tools import MAX_TOOLS
from slipstream.types import Constraint

# Chat's and completions' names, and the Responses fields this server does not implement.
_UNSERVED: Mapping[str, Unserved] = {
    **VLLM_SAMPLING,
    "max_tokens": Unserved("not a Responses field; send max_output_tokens"),
    "max_completion_tokens": Unserved("not a Responses field; send max_output_tokens"),
    "n": Unserved("the Responses API makes one response", (1,)),
    "response_format": Unserved("not a Responses field; send text.format"),
    "logprobs": Unserved(
        "not a Responses field; send top_logprobs, or include ['message.output_text.logprobs']"
    ),
    "reasoning": Unserved("not supported: this server's models do not reason on request"),
    "background": Unserved(
        "not supported: this server stores no responses; answers come in the request",
        (False,),
    ),
    "conversation": Unserved(
        "not supported: this server stores no conversations; send the whole conversation in input"
    ),
    "prompt": Unserved(
        "not supported: this server stores no prompt templates; send instructions and input"
    ),
    "truncation": Unserved(
        "only 'disabled' is supported: a conversation longer than the model's context is a 400",
        ("disabled",),
    ),
}

# OpenAI's include values: the output's logprobs, and what only items this server never
# makes (built-in tool calls, reasoning, input images) would carry, so asking changes
# nothing.
INCLUDE_LOGPROBS = "message.output_text.logprobs"
_INCLUDABLE = {
    INCLUDE_LOGPROBS, "reasoning.encrypted_content", "web_search_call.results",
    "web_search_call.action.sources", "file_search_call.results", "message.input_image.image_url",
    "computer_call_output.output.image_url", "code_interpreter_call.outputs",
}  # fmt: skip


class InputMessage(_Fields):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]


class InputFunctionCall(_Fields):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str = "{}"


class InputFunctionOutput(_Fields):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str


InputItem = InputMessage | InputFunctionCall | InputFunctionOutput

_TEXT_PARTS = {"input_text", "output_text", "text"}


class FunctionTool(_Fields):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class NamedFunctionChoice(_Fields):
    type: Literal["function"]
    name: str = Field(min_length=1)


class TextOptions(_Fields):
    format: dict[str, Any] = Field(default_factory=lambda: {"type": "text"})


class ResponsesStreamOptions(_Fields):
    # OpenAI's random padding of stream events against length side channels: it changes
    # no text a client reads, so it is accepted and not sent.
    include_obfuscation: bool = True


class ResponsesRequest(_Sampling):
    model_config = ConfigDict(extra="ignore", json_schema_extra=_STREAM_OPTIONS_NEED_STREAM)
    unserved = _UNSERVED
    # One response a request (the generation path reads n).
    n: ClassVar[int] = 1

    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    stream_options: ResponsesStreamOptions | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    include: Annotated[
        list[str] | None,
        _only({"type": "array", "items": {"enum": sorted(_INCLUDABLE)}}, _NULL,
              note=f"{INCLUDE_LOGPROBS!r} adds the output's logprobs"),
    ] = None  # fmt: skip
    service_tier: Literal["auto", "default"] | None = None
    store: bool | None = None
    previous_response_id: Annotated[
        str | None, _only(_NULL, note="stateless: send the whole conversation in input")
    ] = None
    metadata: dict[str, str] | None = None
    # As chat's (vLLM's own Responses route sets it from reasoning; this one takes it).
    chat_template_kwargs: Annotated[dict[str, Any] | None, TEMPLATE_KWARGS] = None

    def check_supported(self) -> None:
        super().check_supported()
        check_template_kwargs(self.chat_template_kwargs)
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options: only allowed when stream is true")
        for value in self.include or []:
            if value not in _INCLUDABLE:
                raise InvalidRequest(f"include: {value!r} is not one of {sorted(_INCLUDABLE)}")
        if self.previous_response_id is not None:
            raise InvalidRequest(
                "previous_response_id: this server stores no responses; send the whole "
                "conversation in input"
            )
        if isinstance(self.input, list) and not self.input:
            raise InvalidRequest("input: must not be empty")
        choice = self.choice()
        names = [tool.name for tool in self.tools or []]
        if choice not in ("none", "auto") and not names:
            raise InvalidRequest(f"tool_choice: {choice!r} needs tools")
        if choice not in ("none", "auto", "required") and choice not in names:
            raise InvalidRequest(f"tool_choice: no tool named {choice!r} (tools: {names})")
        if choice not in ("none", "auto") and self.constraint() is not None:
            raise InvalidRequest(
                "tool_choice: a required tool call cannot be combined with text.format "
                "or another constraint"
            )

    def maximum(self) -> tuple[str, int] | None:
        if self.max_output_tokens is None:
            return None
        return "max_output_tokens", self.max_output_tokens

    def choice(self) -> str:
        choice = self.tool_choice
        if choice is None:
            return "auto" if self.tools else "none"
        return choice if isinstance(choice, str) else choice.name

    def wanted_logprobs(self) -> int | None:
        """None, or how many alternatives each token's logprobs list: asked for by
        ``include`` (OpenAI's way) or by ``top_logprobs`` alone (vLLM's)."""
        if self.top_logprobs is None and INCLUDE_LOGPROBS not in (self.include or []):
            return None
        return self.top_logprobs or 0

    def _formats(self) -> list[tuple[str, Constraint]]:
        if self.text is None:
            return []
        fmt = self.text.format
        if fmt.get("type") == "json_schema":
            # The Responses API puts name, schema and strict beside the type.
            fmt = {"type": "json_schema", "json_schema": fmt}
        try:
            found = _response_format(fmt)
        except InvalidRequest as exc:
            raise InvalidRequest(exc.message.replace("response_format", "text.format")) from None
        return [] if found is None else [("text.format", found)]

    def chat(self) -> list[dict[str, Any]]:
        """The conversation as chat messages (OpenAI's chat shapes)."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        for index, item in enumerate(self.input):
            if isinstance(item, InputMessage):
                role = "system" if item.role == "developer" else item.role
                messages.append({"role": role, "content": _text(item.content, index)})
            elif isinstance(item, InputFunctionCall):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
                if (
                    messages
                    and messages[-1]["role"] == "assistant"
                    and messages[-1].get("tool_calls")
                ):
                    messages[-1]["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            else:
                messages.append(
                    {"role": "tool", "tool_call_id": item.call_id, "content": item.output}
                )
        return messages


def _text(content: str | list[ContentPart], index: int) -> str:
    if isinstance(content, str):
        return content
    kinds = tuple(sorted(_TEXT_PARTS))
    return "".join(
        part.checked_text(f"input[{index}].content[{number}]", kinds)
        for number, part in enumerate(content)
    )


# -- the response ---------------------------------------------------------------------------


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(
    mid: str, text: str, status: str = "completed", logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """An assistant message; ``status`` ``incomplete`` when max_output_tokens cut it short
    (its text is still there), ``in_progress`` (no content yet) while it streams."""
    content = [{"type": "output_text", "text": text, "annotations": [],
                "logprobs": logprobs or []}]  # fmt: skip
    return {"type": "message", "id": mid, "status": status, "role": "assistant",
            "content": content if status != "in_progress" else []}  # fmt: skip


def call_item(call: CallItem, status: str = "completed") -> dict[str, Any]:
    call_id, name, arguments = call
    return {"type": "function_call", "id": item_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments if status == "completed" else "", "status": status}  # fmt: skip


def response(
    rid: str,
    created: int,
    body: ResponsesRequest,
    output: list[dict[str, Any]],
    tokens: tuple[int, int] | None,
    incomplete: bool = False,
) -> dict[str, Any]:
    """The Response object; ``tokens`` (input, output) is None while in progress."""
    status = "in_progress" if tokens is None else "incomplete" if incomplete else "completed"
    usage = None
    if tokens is not None:
        usage = {"input_tokens": tokens[0], "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": tokens[1], "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": tokens[0] + tokens[1]}  # fmt: skip
    return {
        "id": rid, "object": "response", "created_at": created, "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "model": body.model, "output": output, "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": None, "reasoning": None, "store": False,
        "temperature": body.temperature, "top_p": body.top_p,
        "text": {"format": body.text.format if body.text else {"type": "text"}},
        "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
        "truncation": "disabled", "usage": usage, "user": body.user,
        "metadata": body.metadata or {},
    }  # fmt: skip


def event(kind: str, sequence: int, **fields: Any) -> bytes:
    """One server-sent event of a streamed response."""
    payload = orjson.dumps({"type": kind, "sequence_number": sequence, **fields})
    return b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n"
