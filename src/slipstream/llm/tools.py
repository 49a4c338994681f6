"""Function calling for any chat model: tools into the prompt, calls out of the text.

A chat template that knows tools (it reads the ``tools`` variable, as Qwen's, Llama 3's
and Hermes' do) renders them itself. For one that does not (SmolLM2's), the tools go
into the system message in the Hermes format most open models were tuned on, and past
calls and results are written back into the conversation in the same format:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

What the model writes is read back the same way. With ``tool_choice`` ``required`` or a
named function, decoding is constrained to a call whose arguments validate against the
function's schema (the constraint is the JSON schema built by :func:`call_constraint`),
so a call always comes back, well formed. A schema that does not compile is a 400 naming
the tool's ``parameters``, not the ``response_format`` the request never sent.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from slipstream.errors import InvalidRequest
from slipstream.llm.constraints import compile_constraint
from slipstream.types import Constraint

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


@dataclass(frozen=True, slots=True)
class Tool:
    """One function the model may call."""

    name: str
    description: str
    # The JSON schema of its arguments (an object schema).
    parameters: dict[str, Any]
    # The request field holding ``parameters``, for error messages; "" names chat's
    # ``tools[i].function.parameters`` by the tool's place in the list.
    field: str = ""


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call the model made: ``arguments`` is JSON text, as OpenAI sends it."""

    id: str
    name: str
    arguments: str


# none: the model never calls; auto: it may; required: at least one call; or a name.
ToolChoice = Literal["none", "auto", "required"] | str


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_prompt(tools: list[Tool]) -> str:
    """The system-message text that offers ``tools`` to a model whose template cannot."""
    lines = "\n".join(
        json.dumps({"type": "function", "function": {
            "name": tool.name, "description": tool.description, "parameters": tool.parameters}})
        for tool in tools
    )  # fmt: skip
    return (
        "You can call functions to answer the user. Their signatures, one JSON object a "
        f"line, are within <tools></tools>:\n<tools>\n{lines}\n</tools>\n\n"
        "To call one, answer with a JSON object holding its name and arguments within "
        "<tool_call></tool_call> tags, one block per call:\n"
        '<tool_call>\n{"name": <function name>, "arguments": <arguments object>}\n</tool_call>'
    )


def plain_messages(messages: list[dict[str, Any]], tools: list[Tool]) -> list[dict[str, str]]:
    """The conversation for a template that knows no tools: the tool prompt joins the
    system message; past calls and results become text in the Hermes format."""
    out: list[dict[str, str]] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            blocks = [
                "<tool_call>\n" + json.dumps({"name": call["function"]["name"],
                                               "arguments": _arguments(call)}) + "\n</tool_call>"
                for call in message["tool_calls"]
            ]  # fmt: skip
            content = "\n".join([content, *blocks]) if content else "\n".join(blocks)
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if tools:
        offer = tool_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{offer}"}
        else:
            out.insert(0, {"role": "system", "content": offer})
    return out


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation for a template that renders tools itself: call arguments as
    objects (what HF templates iterate over), everything else as it came."""
    out = []
    for message in messages:
        if message.get("tool_calls"):
            calls = [
                {**call, "function": {**call["function"], "arguments": _arguments(call)}}
                for call in message["tool_calls"]
            ]
            message = {**message, "tool_calls": calls}
        out.append(message)
    return out


def _arguments(call: dict[str, Any]) -> Any:
    raw = call["function"].get("arguments", "{}")
    try:
        return json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError:
        return raw


def call_constraint(tools: list[Tool], choice: ToolChoice, parallel: bool) -> Constraint | None:
    """The constraint that makes the model call: a named function's arguments, or (for
    ``required``) a list of {name, arguments} calls; None when the model may answer.
    InvalidRequest names the tool's ``parameters`` when its schema does not compile."""
    if choice in ("none", "auto"):
        return None
    if choice != "required":
        tool = _find(tools, choice)
        own = Constraint("json_schema", json.dumps(tool.parameters), strict=True)
        return checked(_field(tool, tools.index(tool)), own)
    lifted: dict[str, Any] = {}
    branches = []
    for index, tool in enumerate(tools):
        own = Constraint("json_schema", json.dumps(tool.parameters), strict=True)
        checked(_field(tool, index), own)
        arguments = _lift(tool.parameters, f"tool{index}", lifted)
        branches.append({"type": "object", "required": ["name", "arguments"],
                         "properties": {"name": {"const": tool.name}, "arguments": arguments},
                         "additionalProperties": False})  # fmt: skip
    calls: dict[str, Any] = {"type": "array", "items": {"anyOf": branches}, "minItems": 1}
    if not parallel:
        calls["maxItems"] = 1
    if lifted:
        calls["$defs"] = lifted
    return checked("tools", Constraint("json_schema", json.dumps(calls), strict=True))


def checked(field: str, constraint: Constraint) -> Constraint:
    """``constraint``, compiled once to check it: InvalidRequest names ``field`` (the
    request field it came from) when it does not compile."""
    try:
        compile_constraint(constraint)
    except InvalidRequest as exc:
        problem = exc.message.split(": ", 1)[-1]
        raise InvalidRequest(f"{field}: {problem}") from None
    return constraint


def _field(tool: Tool, index: int) -> str:
    return tool.field or f"tools[{index}].function.parameters"


# The keywords whose values are data, not schemas: a "$ref" key inside is no reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _lift(parameters: dict[str, Any], own: str, lifted: dict[str, Any]) -> dict[str, Any]:
    """A tool's schema placed below the root of the call schema with its references kept
    working (JSON pointers resolve from the root, which is no longer the tool's): the
    tool's ``$defs`` / ``definitions`` move into ``lifted`` (the root's ``$defs``) as
    ``own.name``, the rest of its schema as ``own``, and every local reference is
    rewritten to match. A schema without references comes back unchanged.

    pydantic's schemas (``openai.pydantic_function_tool``) refer to ``#/$defs/...``."""
    if "$ref" not in json.dumps(parameters):
        return parameters
    body = {k: v for k, v in parameters.items() if k not in ("$defs", "definitions")}
    # A pointer segment escapes "~" and "/" only; "own." adds neither, so the escaped
    # name of a definition in a pointer is "own." + its escaped name there.
    prefix = f"{own}."

    def ref(pointer: str) -> str:
        for container in ("/$defs/", "/definitions/"):
            if pointer.startswith(container):
                name, _, rest = pointer[len(container) :].partition("/")
                return f"#/$defs/{prefix}{name}" + (f"/{rest}" if rest else "")
        return f"#/$defs/{own}{pointer}"

    def rewrite(node: Any) -> Any:
        if isinstance(node, list):
            return [rewrite(item) for item in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and value.startswith("#"):
                out[key] = ref(value[1:])
            elif key in _DATA_KEYWORDS:
                out[key] = value
            else:
                out[key] = rewrite(value)
        return out

    for container in ("$defs", "definitions"):
        for name, schema in (parameters.get(container) or {}).items():
            lifted[f"{prefix}{name}"] = rewrite(schema)
    lifted[own] = rewrite(body)
    return {"$ref": f"#/$defs/{own}"}


def _find(tools: list[Tool], name: str) -> Tool:
    for tool in tools:
        if tool.name == name:
            return tool
    known = ", ".join(tool.name for tool in tools)
    raise InvalidRequest(f"tool_choice: no tool named {name!r} (tools: {known})")


def read_calls(text: str, tools: list[Tool], choice: ToolChoice) -> tuple[str, list[ToolCall]]:
    """(the text left for ``content``, the calls) of a finished completion.

    Constrained output (``required``, a name) is the call's JSON itself; free output
    (``auto``) holds zero or more ``<tool_call>`` blocks, and a block that is not a call
    of a known function stays in the text.
    """
    if choice == "none":
        return text, []
    if choice == "required":
        made = json.loads(text)
        return "", [ToolCall(new_call_id(), c["name"], _arguments_text(c["arguments"]))
                    for c in made]  # fmt: skip
    if choice != "auto":
        return "", [ToolCall(new_call_id(), _find(tools, choice).name, text)]
    names = {tool.name for tool in tools}
    calls: list[ToolCall] = []
    kept: list[str] = []
    last = 0
    for match in _CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or call.get("name") not in names:
            continue
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append(ToolCall(new_call_id(), call["name"], _arguments_text(arguments)))
        kept.append(text[last : match.start()])
        last = match.end()
    kept.append(text[last:])
    return "".join(kept).strip() if calls else text, calls


def _arguments_text(arguments: Any) -> str:
    """A call's arguments as JSON text, characters as the model wrote them (not ``\\u``
    escapes), as a named choice's arguments come and as vLLM sends them."""
    return json.dumps(arguments, ensure_ascii=False)
