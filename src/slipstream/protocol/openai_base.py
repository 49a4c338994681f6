"""The base of every OpenAI request schema, top-level or nested: unknown fields are
ignored, as OpenAI does, and ``null`` for an optional field means its default.

OpenAI's reference types optional fields "X or null", and the openai SDK sends ``null``
for a keyword passed as ``None`` at any depth (a tool's ``description``, a call's
``id``), so the rule is kept here, below both :mod:`slipstream.protocol.openai_tools`
and :mod:`slipstream.protocol.openai_fields`. A required field stays required: ``null``
there is a 400.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, GetJsonSchemaHandler, model_validator
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

_NULL: dict[str, Any] = {"type": "null"}


class _Request(BaseModel):
    """Base of every OpenAI request schema; see the module docstring."""

    model_config = ConfigDict(extra="ignore")

    # The names (aliases where set) of the fields that have a default, set per class.
    _optional: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        cls._optional = frozenset(
            field.alias or name
            for name, field in cls.model_fields.items()
            if not field.is_required()
        )

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {
            key: value
            for key, value in data.items()
            if value is not None or key not in cls._optional
        }

    @classmethod
    def __get_pydantic_json_schema__(
        cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        """The documented schema (/openapi.json) says that every optional field takes
        ``null``, so generated clients and conformance checks know it."""
        schema = handler(core_schema)
        target = handler.resolve_ref_schema(schema)
        required = set(target.get("required", ()))
        properties = target.get("properties", {})
        for name, prop in properties.items():
            if name not in required:
                properties[name] = _nullable(prop)
        return schema


def _nullable(prop: dict[str, Any]) -> dict[str, Any]:
    """``prop`` allowing ``null`` too."""
    if _allows_null(prop):
        return prop
    if "anyOf" in prop:
        return {**prop, "anyOf": [*prop["anyOf"], _NULL]}
    meta: dict[str, Any] = {
        key: prop[key] for key in ("title", "description", "default") if key in prop
    }
    inner = {key: value for key, value in prop.items() if key not in meta}
    return {"anyOf": [inner, _NULL], **meta}


def _allows_null(prop: dict[str, Any]) -> bool:
    kind = prop.get("type")
    if kind == "null" or (isinstance(kind, list) and "null" in kind):
        return True
    if "const" in prop and prop["const"] is None:
        return True
    branches = prop.get("anyOf", ())
    return any(isinstance(branch, dict) and _allows_null(branch) for branch in branches)
