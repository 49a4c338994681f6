"""The OpenAPI path and schemas of vLLM's ``/classify`` (:mod:`.openapi`). The request
schema is generated from the pydantic model that validates it (:mod:`.openai_classify`)."""

from __future__ import annotations

from typing import Any

from slipstream.protocol.openai_classify import ClassifyRequest
from slipstream.protocol.openapi_schemas import (
    MODEL_NAME_PATTERN,
    REF,
    json_content,
    ref,
    response,
)
from slipstream.protocol.openapi_statuses import openai_errors


def classify_paths() -> dict[str, Any]:
    return {
        "/classify": {
            "post": {
                "summary": "vLLM's classification: each text's class probabilities and label",
                "operationId": "vllm_classify",
                "requestBody": {"required": True, "content": json_content(ref("ClassifyRequest"))},
                "responses": {"200": response("Classes", json_content(ref("ClassificationList")))}
                | openai_errors("400", "404", body=True),
            }
        }
    }


def classify_schemas() -> dict[str, Any]:
    schema = ClassifyRequest.model_json_schema(ref_template=REF)
    schemas: dict[str, Any] = schema.pop("$defs", {})
    schema["properties"]["model"]["pattern"] = MODEL_NAME_PATTERN
    for name, refused in ClassifyRequest.unserved.items():  # declared, as on the other routes
        schema["properties"].setdefault(name, {
            "enum": [None, *refused.same],
            "description": f"not served here: {refused.advice}; other values are a 400",
        })  # fmt: skip
    entry = {
        "type": "object",
        "properties": {
            "index": {"type": "integer", "minimum": 0},
            "label": {"type": "string", "description": "the class with the highest probs"},
            "probs": {"type": "array", "items": {"type": "number"}, "minItems": 2},
            "num_classes": {"type": "integer", "minimum": 2},
        },
        "required": ["index", "label", "probs", "num_classes"],
    }
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    usage = {
        "type": "object",
        "properties": {k: {"type": "integer", "minimum": 0} for k in counts},
        "required": list(counts),
    }
    return schemas | {
        "ClassifyRequest": schema,
        "ClassificationList": {
            "type": "object",
            "properties": {"id": {"type": "string"}, "object": {"const": "list"},
                           "created": {"type": "integer"}, "model": {"type": "string"},
                           "data": {"type": "array", "items": entry}, "usage": usage},
            "required": ["id", "object", "created", "model", "data", "usage"],
        },
    }  # fmt: skip
