"""The OpenAPI paths and schemas of vLLM's scoring routes (:mod:`.openapi`): ``/v1/score``,
and ``/v1/rerank`` with the two other paths vLLM answers it at. The request schemas are
generated from the pydantic models that validate them (:mod:`.openai_score`)."""

from __future__ import annotations

from typing import Any

from slipstream.protocol.openai_score import RerankRequest, ScoreRequest
from slipstream.protocol.openapi_schemas import (
    MODEL_NAME_PATTERN,
    REF,
    json_content,
    ref,
    response,
)
from slipstream.protocol.openapi_statuses import openai_errors

RERANK_PATHS = ("/v1/rerank", "/rerank", "/v2/rerank")


def score_paths() -> dict[str, Any]:
    def post(summary: str, op: str, request: str, reply: str) -> dict[str, Any]:
        return {
            "post": {
                "summary": summary,
                "operationId": op,
                "requestBody": {"required": True, "content": json_content(ref(request))},
                "responses": {"200": response("Scores", json_content(ref(reply)))}
                | openai_errors("400", "404", body=True),
            }
        }

    paths = {
        "/v1/score": post(
            "vLLM's scores of text pairs: a cross-encoder's, or an embedding model's cosine",
            "vllm_score",
            "ScoreRequest",
            "ScoreList",
        )
    }
    for path in RERANK_PATHS:
        op = "vllm_rerank" + path.removesuffix("/rerank").replace("/", "_")
        paths[path] = post("Documents ranked against a query (Jina's, Cohere's and vLLM's "
                           "rerank)", op, "RerankRequest", "RerankList")  # fmt: skip
    return paths


def score_schemas() -> dict[str, Any]:
    schemas: dict[str, Any] = {}
    for model in (ScoreRequest, RerankRequest):
        schema = model.model_json_schema(ref_template=REF)
        schemas |= schema.pop("$defs", {})
        schema["properties"]["model"]["pattern"] = MODEL_NAME_PATTERN
        for name, refused in model.unserved.items():  # declared, as on the other routes
            schema["properties"].setdefault(name, {
                "enum": [None, *refused.same],
                "description": f"not served here: {refused.advice}; other values are a 400",
            })  # fmt: skip
        schemas[model.__name__] = schema
    usage = {
        "type": "object",
        "properties": {k: {"type": "integer", "minimum": 0}
                       for k in ("prompt_tokens", "total_tokens")},
        "required": ["prompt_tokens", "total_tokens"],
    }  # fmt: skip
    score = {
        "type": "object",
        "properties": {"index": {"type": "integer"}, "object": {"const": "score"},
                       "score": {"type": "number"}},
        "required": ["index", "object", "score"],
    }  # fmt: skip
    result = {
        "type": "object",
        "properties": {
            "index": {"type": "integer"},
            "relevance_score": {"type": "number"},
            "document": {"type": "object", "properties": {"text": {"type": "string"}},
                         "required": ["text"]},
        },
        "required": ["index", "relevance_score"],
    }  # fmt: skip
    return schemas | {
        "ScoreList": {
            "type": "object",
            "properties": {"id": {"type": "string"}, "object": {"const": "list"},
                           "created": {"type": "integer"}, "model": {"type": "string"},
                           "data": {"type": "array", "items": score}, "usage": usage},
            "required": ["id", "object", "created", "model", "data", "usage"],
        },
        "RerankList": {
            "type": "object",
            "description": "the documents by relevance_score, highest first",
            "properties": {"id": {"type": "string"}, "model": {"type": "string"},
                           "results": {"type": "array", "items": result}, "usage": usage},
            "required": ["id", "model", "results", "usage"],
        },
    }  # fmt: skip
