"""The OpenAI API's function-calling shapes: the tools a request offers, the choice
among them, and the calls earlier turns made. ``null`` for an optional field is its
default here too (:mod:`slipstream.protocol.openai_base`): the openai SDK sends it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from slipstream.protocol.openai_base import _Request


class FunctionCall(_Request):
    name: str = Field(min_length=1)
    # JSON text, as OpenAI sends it.
    arguments: str = "{}"


class ToolCallItem(_Request):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


# Functions one request may offer.
MAX_TOOLS = 128


class FunctionSpec(_Request):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class ToolSpec(_Request):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Request):
    name: str = Field(min_length=1)


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction
