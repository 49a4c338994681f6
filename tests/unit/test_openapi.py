"""The OpenAPI document (``GET /openapi.json``): complete, self-consistent, and in step
with the code it describes (the model-name rule, the OpenAI request models).

The server is checked against the document by schemathesis in
``tests/integration/test_openapi_conformance.py``.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slipstream.names import model_name_problem
from slipstream.protocol import openai
from slipstream.protocol.openapi import MODEL_NAME_PATTERN, openapi_document

DOC = openapi_document("0.0.0")
OPERATIONS = [
    (path, method, op)
    for path, item in DOC["paths"].items()
    for method, op in item.items()
    if method in ("get", "post")
]

# Every route the HTTP front end answers (v2_rest.py, openai_rest.py): a new route must
# be documented, and a documented route must exist.
ROUTES = {
    ("get", "/v2/health/live"), ("get", "/v2/health/ready"), ("get", "/v2"),
    ("get", "/v2/models/stats"), ("post", "/v2/repository/index"),
    ("post", "/v2/repository/models/{model}/load"),
    ("post", "/v2/repository/models/{model}/unload"),
    ("get", "/metrics"), ("get", "/openapi.json"), ("get", "/health"),
    ("get", "/dashboard"), ("get", "/dashboard/{file}"),
    ("get", "/v1/models"), ("get", "/v1/models/{model}"), ("post", "/v1/completions"),
    ("post", "/v1/chat/completions"), ("post", "/v1/embeddings"), ("post", "/v1/responses"),
    ("get", "/v2/models/{model}/rollout"), ("post", "/v2/models/{model}/rollout"),
} | {
    (method, prefix + suffix)
    for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}")
    for method, suffix in (("get", ""), ("get", "/ready"), ("post", "/infer"),
                           ("get", "/config"), ("get", "/stats"), ("get", "/drift"),
                           ("post", "/generate"), ("post", "/generate_stream"))
}  # fmt: skip
# Triton's shared-memory extensions: status and unregister of all regions or one.
ROUTES |= {
    (method, f"/v2/{kind}sharedmemory{region}/{action}")
    for kind in ("system", "cuda")
    for region in ("", "/region/{region}")
    for method, action in (("get", "status"), ("post", "unregister"))
} | {("post", f"/v2/{kind}sharedmemory/region/{{region}}/register") for kind in ("system", "cuda")}
# Asynchronous jobs (issue #17).
ROUTES |= {("post", "/v2/jobs"), ("get", "/v2/jobs/{job}")}
# vLLM's scoring routes, rerank at each path vLLM answers it at.
ROUTES |= {("post", path) for path in ("/v1/score", "/v1/rerank", "/rerank", "/v2/rerank")}
# vLLM's classification route, which it answers outside /v1/ only.
ROUTES |= {("post", "/classify")}
# KServe's V1 protocol.
ROUTES |= {("post", "/v1/models/{model}:predict"),
           ("post", "/v1/models/{model}/versions/{version}:predict")}  # fmt: skip
# OpenAI's files and batches (DELETE /v1/files/{file_id} too).
ROUTES |= {("post", "/v1/files"), ("get", "/v1/files"), ("get", "/v1/files/{file_id}"),
           ("get", "/v1/files/{file_id}/content"), ("post", "/v1/batches"),
           ("get", "/v1/batches"), ("get", "/v1/batches/{batch_id}"),
           ("post", "/v1/batches/{batch_id}/cancel")}  # fmt: skip
# Triton's logging and trace settings.
ROUTES |= {
    (method, path)
    for path in ("/v2/logging", "/v2/trace/setting", "/v2/models/{model}/trace/setting")
    for method in ("get", "post")
}


def test_every_route_is_documented_and_nothing_else() -> None:
    assert {(method, path) for path, method, _ in OPERATIONS} == ROUTES


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return found + [ref for value in node.values() for ref in _refs(value)]
    if isinstance(node, list):
        return [ref for value in node for ref in _refs(value)]
    return []


def test_every_reference_resolves() -> None:
    refs = _refs(DOC)
    assert refs
    schemas = DOC["components"]["schemas"]
    for ref in refs:
        assert ref.startswith("#/components/schemas/"), ref
        assert ref.removeprefix("#/components/schemas/") in schemas, ref


def test_operation_ids_are_unique() -> None:
    ids = [op["operationId"] for _, _, op in OPERATIONS]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize(
    ("path", "method", "op"), OPERATIONS, ids=[f"{m} {p}" for p, m, _ in OPERATIONS]
)
def test_every_operation_documents_the_transport_and_fault_statuses(
    path: str, method: str, op: dict[str, Any]
) -> None:
    statuses = set(op["responses"])
    # A job submission's success is 202 (accepted), every other route's 200.
    assert {"202" if path == "/v2/jobs" else "200", "408", "414", "431", "500", "503"} <= statuses
    # A body (or a path parameter) can be refused by the route: 400 with the field named.
    if method == "post":
        assert {"400", "413"} <= statuses
    if "{model}" in path:
        # /ready answers an unknown model 400 (not ready), as Triton does.
        assert {"400", "404"} - ({"404"} if path.endswith("/ready") else set()) <= statuses
    for status, response in op["responses"].items():
        if status not in ("200", "202"):
            assert "content" in response, (path, status)


@given(st.text(alphabet=st.characters(codec="ascii"), max_size=140))
def test_the_model_name_pattern_is_the_server_rule(name: str) -> None:
    matches = re.fullmatch(MODEL_NAME_PATTERN.strip("^$"), name) is not None
    assert matches == (model_name_problem(name) is None)


@pytest.mark.parametrize(
    "model", [openai.CompletionRequest, openai.ChatRequest, openai.EmbeddingRequest]
)
def test_openai_request_schemas_are_the_validating_models(model: Any) -> None:
    schema = DOC["components"]["schemas"][model.__name__]
    # The model's fields, and the other servers' fields it refuses by name (each with the
    # values it accepts: null, or what the server does anyway).
    assert set(schema["properties"]) == set(model.model_fields) | set(model.unserved)
    for name, refused in model.unserved.items():
        if name not in model.model_fields:
            assert schema["properties"][name]["enum"] == [None, *refused.same]
    assert set(schema.get("required", [])) == {
        name for name, field in model.model_fields.items() if field.is_required()
    }


def test_every_operation_documents_the_front_doors_refusals() -> None:
    document = openapi_document("test")
    assert document["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"
    for template, item in document["paths"].items():
        # KServe V1's :predict answers in its own shape, V2's.
        openai_shape = template.startswith("/v1/") and not template.endswith(":predict")
        shape = "OpenAIError" if openai_shape else "V2Error"
        for method, operation in item.items():
            if method == "parameters":
                continue
            responses = operation["responses"]
            for status in ("401", "403", "429"):
                schema = responses[status]["content"]["application/json"]["schema"]
                assert schema["$ref"].endswith(shape), (method, template, status)
            assert {"Retry-After", "RateLimit", "RateLimit-Policy"} <= set(
                responses["429"]["headers"]
            )
