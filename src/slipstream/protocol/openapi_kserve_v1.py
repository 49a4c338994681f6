"""The OpenAPI paths and schemas of KServe's V1 protocol (:mod:`.openapi`): the
``:predict`` routes (:mod:`.kserve_v1`), and what KServe adds to the two OpenAI routes it
shares, ``GET /v1/models`` (``models``) and ``GET /v1/models/{model}`` (``name``,
``ready``; server/kserve_v1_rest.py)."""

from __future__ import annotations

from typing import Any

from slipstream.protocol.openapi_schemas import json_content, ref, response
from slipstream.protocol.openapi_statuses import v2_errors


def with_kserve_v1(
    paths: dict[str, Any], model: dict[str, Any], version: dict[str, Any]
) -> dict[str, Any]:
    """``paths`` (the OpenAI ones among them) with KServe V1's; ``model`` and ``version``
    are the path parameters."""
    listing = paths["/v1/models"]["get"]
    listing["summary"] = "Models served: OpenAI's list (data) and KServe V1's (models)"
    listing["responses"]["200"] = response("Models", json_content(ref("KServeV1ModelList")))
    one = paths["/v1/models/{model}"]["get"]
    one["summary"] = "One model: OpenAI's object (models of the OpenAI routes) or KServe V1's"
    either = {"anyOf": [ref("Model"), ref("KServeV1ModelReady")]}
    one["responses"]["200"] = response("The model, ready", json_content(either))
    one["responses"]["503"]["description"] += (
        '; a model of the repository not ready: {"name", "ready": false, "error"}'
    )
    body = {"required": True, "content": json_content(ref("KServeV1Request"))}
    for prefix, params, op in (
        ("/v1/models/{model}", [model], "kserve_v1_predict"),
        ("/v1/models/{model}/versions/{version}", [model, version], "kserve_v1_predict_version"),
    ):
        paths[prefix + ":predict"] = {
            "parameters": params,
            "post": {
                "summary": "KServe V1 (TensorFlow Serving) prediction: rows or columns",
                "operationId": op,
                "requestBody": body,
                "responses": {"200": response("Predictions", json_content(ref("KServeV1Response")))}
                | v2_errors("400", "404", body=True),
            },
        }
    return paths


def kserve_v1_schemas() -> dict[str, Any]:
    return {
        "KServeV1Request": {
            "type": "object",
            "description": "Exactly one of instances (row format: one entry per row, an "
            "object keyed by input name for a model of several inputs) and inputs (columnar: "
            'a tensor, or tensors keyed by input name). BYTES: strings or {"b64": ...}.',
            "properties": {
                "instances": {"type": "array", "minItems": 1},
                "inputs": {},
                "signature_name": {"type": "string", "description": "Ignored"},
            },
            "oneOf": [{"required": ["instances"]}, {"required": ["inputs"]}],
        },
        "KServeV1Response": {
            "type": "object",
            "description": "predictions (one entry per row; an object keyed by output name "
            "for a model of several outputs) for instances, outputs for inputs",
            "properties": {"predictions": {"type": "array"}, "outputs": {}},
            "oneOf": [{"required": ["predictions"]}, {"required": ["outputs"]}],
        },
        "KServeV1ModelReady": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "ready": {"const": True}},
            "required": ["name", "ready"],
        },
        "KServeV1ModelList": {
            "allOf": [
                ref("ModelList"),
                {
                    "type": "object",
                    "properties": {"models": {"type": "array", "items": {"type": "string"}}},
                    "required": ["models"],
                },
            ],
        },
    }
