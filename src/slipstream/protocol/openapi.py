"""The OpenAPI 3.1 document of the HTTP API, served at ``GET /openapi.json``.

Every route the HTTP front end answers, with every status it can answer: the V2 REST
routes (the Open Inference Protocol, Triton's binary tensor extension, its model config,
statistics and repository extensions), ``/metrics``, KServe's V1 ``:predict`` routes
(:mod:`.openapi_kserve_v1`), and the OpenAI routes. The OpenAI
request schemas are generated from the pydantic models that validate those requests
(:mod:`slipstream.protocol.openai`), so the document cannot drift from what the server
accepts; the V2 schemas follow KServe's published ``rest_predict_v2.yaml`` in shape, with
what Slipstream adds (datatypes as an enum, the model-name rule as a pattern, errors).

Besides each route's own statuses, every operation documents what the transport answers
before a route runs: 408 (headers or body too slow), 414 / 431 (URL or headers too
large), 413 (a body over ``--max-request-bytes``) and 503 (``--max-connections``), all
in the V2 error shape.

>>> doc = openapi_document("0.1.0")
>>> doc["openapi"], sorted(doc["paths"]["/v2/models/{model}/infer"])
('3.1.0', ['parameters', 'post'])
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

from slipstream.names import JOB_ID_PATTERN
from slipstream.protocol.openapi_batch import batch_paths, batch_schemas
from slipstream.protocol.openapi_classify import classify_paths, classify_schemas
from slipstream.protocol.openapi_kserve_v1 import kserve_v1_schemas, with_kserve_v1
from slipstream.protocol.openapi_schemas import (
    JSON,
    MODEL_NAME_PATTERN,
    job_schemas,
    json_content,
    openai_schemas,
    ref,
    response,
    v2_schemas,
)
from slipstream.protocol.openapi_score import score_paths, score_schemas
from slipstream.protocol.openapi_settings import settings_paths
from slipstream.protocol.openapi_statuses import (
    openai_errors as _openai_errors,
)
from slipstream.protocol.openapi_statuses import (
    v2_errors as _v2_errors,
)
from slipstream.protocol.openapi_statuses import with_front_door

__all__ = ["MODEL_NAME_PATTERN", "allowed_methods", "openapi_document"]

# -- parameters ----------------------------------------------------------------------------

_MODEL = {
    "name": "model",
    "in": "path",
    "required": True,
    "description": "Model name: 1 to 128 ASCII letters, digits, '_', '-' or '.', starting "
    "with a letter, digit or '_'",
    "schema": {"type": "string", "pattern": MODEL_NAME_PATTERN},
}
_VERSION = {
    "name": "version",
    "in": "path",
    "required": True,
    "description": "Model version (a directory number of the repository)",
    "schema": {"type": "string", "pattern": "^[0-9]{1,18}$"},
}
_HEADER_LENGTH = {
    "name": "Inference-Header-Content-Length",
    "in": "header",
    "required": False,
    "description": "Binary tensor extension: the body's first N bytes are the JSON "
    "request, the rest the inputs' raw data (see parameters.binary_data_size)",
    "schema": {"type": "integer", "minimum": 0},
}


_PREFER = {
    "name": "Prefer",
    "in": "header",
    "required": False,
    "description": "respond-async: run the request as a job (202 and its status; servers "
    "started with --jobs-redis), else it is answered synchronously",
    "schema": {"type": "string"},
}
_IDEMPOTENCY_KEY = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": False,
    "description": "The job's id: submitting the same key again returns that job",
    "schema": {"type": "string", "pattern": JOB_ID_PATTERN},
}
_JOB_ACCEPTED = {
    "202": response(
        "Job stored (or the existing job of this Idempotency-Key): its status; "
        "Location names /v2/jobs/{job}",
        json_content(ref("JobStatus")),
    )
}


def _jobs_paths() -> dict[str, Any]:
    """Asynchronous jobs (404 on a server without --jobs-redis)."""
    body = {"required": True, "content": json_content(ref("JobRequest"))}
    job = {"name": "job", "in": "path", "required": True,
           "schema": {"type": "string", "pattern": JOB_ID_PATTERN}}  # fmt: skip
    return {
        "/v2/jobs": {
            "post": {
                "summary": "Submit a job: a V2 inference request naming its model",
                "operationId": "job_submit",
                "parameters": [_IDEMPOTENCY_KEY, _HEADER_LENGTH],
                "requestBody": body,
                "responses": _JOB_ACCEPTED | _v2_errors("400", "404", body=True),
            }
        },
        "/v2/jobs/{job}": {
            "parameters": [job],
            "get": {
                "summary": "A job's status, and its result when done",
                "operationId": "job_status",
                "responses": {"200": response("Status", json_content(ref("JobStatus")))}
                | _v2_errors("400", "404"),
            },
        },
    }


def _v2_model_paths(prefix: str, params: list[dict[str, Any]]) -> dict[str, Any]:
    """The per-model routes under ``prefix`` (with or without /versions/{version})."""
    infer_body = {
        "required": True,
        "content": {
            JSON: {"schema": ref("InferenceRequest")},
            "application/octet-stream": {
                "schema": {"type": "string", "format": "binary"},
                "description": "Binary tensor extension (Inference-Header-Content-Length)",
            },
        },
    }
    infer_ok = {
        JSON: {"schema": ref("InferenceResponse")},
        "application/octet-stream": {
            "schema": {"type": "string", "format": "binary"},
            "description": "Binary outputs: the Inference-Header-Content-Length header "
            "says where the JSON ends",
        },
    }
    not_ready = {
        JSON: {"schema": ref("V2Error")},
        "text/plain": {"schema": {"type": "string", "maxLength": 0}},
    }
    return {
        prefix: {
            "parameters": params,
            "get": {
                "summary": "Model metadata",
                "operationId": _operation_id("model_metadata", prefix),
                "responses": {"200": response("Metadata", json_content(ref("ModelMetadata")))}
                | _v2_errors("400", "404"),
            },
        },
        prefix + "/ready": {
            "parameters": params,
            "get": {
                "summary": "Model ready",
                "operationId": _operation_id("model_ready", prefix),
                "responses": {
                    "200": response("Ready"),
                    "400": response("Not ready (empty body) or a bad model name", not_ready),
                }
                | _v2_errors(),
            },
        },
        prefix + "/infer": {
            "parameters": params,
            "post": {
                "summary": "Inference",
                "operationId": _operation_id("model_infer", prefix),
                "parameters": [_HEADER_LENGTH, _PREFER, _IDEMPOTENCY_KEY],
                "requestBody": infer_body,
                "responses": {"200": response("Outputs", infer_ok)}
                | _JOB_ACCEPTED
                | _v2_errors("400", "404", body=True),
            },
        },
        **{
            prefix + "/" + route: {
                "parameters": params,
                "post": {
                    "summary": summary,
                    "operationId": _operation_id(f"model_{route}", prefix),
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": {"type": "object"}}},
                    },
                    "responses": {"200": response(answer)} | _v2_errors("400", "404", body=True),
                },
            }
            for route, summary, answer in (
                (
                    "generate",
                    "Inputs by name, one answer (Triton's generate extension)",
                    "The outputs by name, in one flat JSON object",
                ),
                (
                    "generate_stream",
                    "Inputs by name, every answer as a server-sent event",
                    "text/event-stream: one data: event per answer",
                ),
            )
        },
        prefix + "/config": {
            "parameters": params,
            "get": {
                "summary": "Model configuration (Triton extension)",
                "operationId": _operation_id("model_config", prefix),
                "responses": {"200": response("Config", json_content(ref("ModelConfig")))}
                | _v2_errors("400", "404"),
            },
        },
        prefix + "/stats": {
            "parameters": params,
            "get": {
                "summary": "Model statistics (Triton extension)",
                "operationId": _operation_id("model_statistics", prefix),
                "responses": {"200": response("Statistics", json_content(ref("ModelStatistics")))}
                | _v2_errors("400", "404"),
            },
        },
        prefix + "/drift": {
            "parameters": params,
            "get": {
                "summary": "Drift of the last window against the reference (404: not monitored)",
                "operationId": _operation_id("model_drift", prefix),
                "responses": {"200": response("Drift", json_content({"type": "object"}))}
                | _v2_errors("400", "404"),
            },
        },
    }


def _operation_id(name: str, prefix: str) -> str:
    return name + ("_version" if "{version}" in prefix else "")


def _v2_paths() -> dict[str, Any]:
    def get(summary: str, op: str, ok: dict[str, Any]) -> dict[str, Any]:
        return {
            "get": {"summary": summary, "operationId": op, "responses": {"200": ok} | _v2_errors()}
        }

    bodies = {
        action: {"required": False, "content": json_content(ref(f"Repository{action}Request"))}
        for action in ("Load", "Unload")
    }
    paths: dict[str, Any] = {
        "/v2/health/live": get("Server live", "server_live", response("Live")),
        "/v2/health/ready": get("Server ready (503: not ready)", "server_ready", response("Ready")),
        "/v2": get(
            "Server metadata",
            "server_metadata",
            response("Metadata", json_content(ref("ServerMetadata"))),
        ),
        "/v2/models/stats": get(
            "Statistics of every model",
            "all_model_statistics",
            response("Statistics", json_content(ref("ModelStatistics"))),
        ),
        "/v2/repository/index": {
            "post": {
                "summary": "Repository index (Triton extension)",
                "operationId": "repository_index",
                "requestBody": {
                    "required": False,
                    "content": json_content(ref("RepositoryIndexRequest")),
                },
                "responses": {"200": response("Models", json_content(ref("RepositoryIndex")))}
                | _v2_errors("400", body=True),
            }
        },
    }
    for action in ("load", "unload"):
        paths[f"/v2/repository/models/{{model}}/{action}"] = {
            "parameters": [_MODEL],
            "post": {
                "summary": f"{action.title()} a model (--model-control-mode explicit; "
                "400 in the other modes)",
                "operationId": f"repository_model_{action}",
                "requestBody": bodies[action.title()],
                "responses": {"200": response("Done")} | _v2_errors("400", "404", body=True),
            },
        }
    paths |= _shared_memory_paths()
    paths |= _jobs_paths()
    paths |= settings_paths(_MODEL)

    rollout = json_content(ref("RolloutStatus"))
    paths["/v2/models/{model}/rollout"] = {
        "parameters": [_MODEL],
        "get": {
            "summary": "The model's rollout: status, weights, history (status none: no rollout)",
            "operationId": "model_rollout",
            "responses": {"200": response("Rollout", rollout)} | _v2_errors("400", "404"),
        },
        "post": {
            "summary": "Start a rollout, or pause, resume, promote or abort it",
            "operationId": "model_rollout_action",
            "requestBody": {"required": True, "content": json_content(ref("RolloutAction"))},
            "responses": {"200": response("Rollout", rollout)}
            | _v2_errors("400", "404", body=True),
        },
    }
    paths |= _v2_model_paths("/v2/models/{model}", [_MODEL])
    paths |= _v2_model_paths("/v2/models/{model}/versions/{version}", [_MODEL, _VERSION])
    text = {"text/plain": {"schema": {"type": "string"}}}
    paths["/metrics"] = get(
        "Prometheus metrics (text format)", "metrics", response("Metrics", text)
    )
    status = json_content({"type": "object", "properties": {"status": {"type": "string"}}})
    paths["/health"] = get(
        "Server ready, as vLLM's and llama-server's /health (503: not ready)",
        "health",
        response('{"status": "ok"}', status),
    )
    html = {"text/html": {"schema": {"type": "string"}}}
    paths["/dashboard"] = get(
        "Live charts of /metrics per model (an HTML page)", "dashboard", response("Page", html)
    )
    paths["/dashboard/{file}"] = {
        "parameters": [
            {"name": "file", "in": "path", "required": True, "schema": {"type": "string"}}
        ],
        "get": {
            "summary": "The dashboard's script, stylesheet and chart library",
            "operationId": "dashboard_file",
            "responses": {"200": response("File", {"*/*": {"schema": {"type": "string"}}})}
            | _v2_errors("404"),
        },
    }
    paths["/openapi.json"] = get(
        "This document", "openapi", response("OpenAPI 3.1", json_content({"type": "object"}))
    )
    return paths


def _shared_memory_paths() -> dict[str, Any]:
    """Triton's system and CUDA shared-memory extensions."""
    region = {
        "name": "region",
        "in": "path",
        "required": True,
        "description": "The region's name, chosen by the client",
        "schema": {"type": "string", "minLength": 1, "maxLength": 256},
    }
    size = {"type": "integer", "minimum": 0}
    kinds = {
        "system": (
            "System",
            {"name": {"type": "string"}, "key": {"type": "string"}, "offset": size,
             "byte_size": size},
            {"properties": {"key": {"type": "string"}, "offset": size, "byte_size": size},
             "required": ["key", "byte_size"]},
            "",
        ),
        "cuda": (
            "CUDA",
            {"name": {"type": "string"}, "device_id": size, "byte_size": size},
            {"properties": {
                "raw_handle": {"type": "object", "required": ["b64"], "properties": {
                    "b64": {"type": "string", "contentEncoding": "base64",
                            "pattern": "^[A-Za-z0-9+/]{86}==$",
                            "description": "cudaIpcGetMemHandle's 64 bytes"}}},
                "device_id": size, "byte_size": size},
             "required": ["raw_handle", "device_id", "byte_size"]},
            " (on a server with a CUDA device and the gpu extra; else a 400 saying why)",
        ),
    }  # fmt: skip
    paths: dict[str, Any] = {}
    for kind, (title, listed, body, note) in kinds.items():
        status = json_content({"type": "array", "items": {"type": "object", "properties": listed}})
        register = {"required": True, "content": json_content({"type": "object", **body})}
        base = f"/v2/{kind}sharedmemory"
        for prefix, params, scope in (
            (base, [], "every region"),
            (base + "/region/{region}", [region], "one region"),
        ):
            op = f"{kind}_shared_memory_%s" + ("_region" if params else "")
            paths[prefix + "/status"] = {
                "parameters": params,
                "get": {"summary": f"{title} shared-memory status of {scope}",
                        "operationId": op % "status",
                        "responses": {"200": response("Regions", status)}
                        | _v2_errors("400", "404")},
            }  # fmt: skip
            paths[prefix + "/unregister"] = {
                "parameters": params,
                "post": {"summary": f"Unregister {scope} ({kind} shared memory)",
                         "operationId": op % "unregister",
                         "responses": {"200": response("Done")} | _v2_errors("400", body=True)},
            }  # fmt: skip
        paths[base + "/region/{region}/register"] = {
            "parameters": [region],
            "post": {"summary": f"Register a {kind} shared-memory region{note}",
                     "operationId": f"{kind}_shared_memory_register",
                     "requestBody": register,
                     "responses": {"200": response("Registered")} | _v2_errors("400", body=True)},
        }  # fmt: skip
    return paths


def _openai_paths() -> dict[str, Any]:
    def events(chunk: str) -> dict[str, Any]:
        data = {"anyOf": [
            {"const": "[DONE]"},
            {"type": "string", "contentMediaType": JSON,
             "contentSchema": {"anyOf": [ref(chunk), ref("OpenAIError")]}},
        ]}  # fmt: skip
        return {"text/event-stream": {
            "schema": {"type": "object", "properties": {"data": data}, "required": ["data"]},
            "description": "With stream: true, server-sent events: chunks, then data: [DONE]; an "
            "error after the first event arrives as a last event holding an OpenAIError",
        }}  # fmt: skip

    def generate(summary: str, op: str, request: str, reply: str) -> dict[str, Any]:
        return {
            "post": {
                "summary": summary,
                "operationId": op,
                "requestBody": {"required": True, "content": json_content(ref(request))},
                "responses": {
                    "200": response(
                        "The result", json_content(ref(reply)) | events(reply + "Chunk")
                    )
                }
                | _openai_errors("400", "404", body=True),
            }
        }

    return {
        "/v1/models": {
            "get": {
                "summary": "Models served on the OpenAI routes",
                "operationId": "openai_list_models",
                "responses": {"200": response("Models", json_content(ref("ModelList")))}
                | _openai_errors(),
            }
        },
        "/v1/models/{model}": {
            "parameters": [_MODEL],
            "get": {
                "summary": "One model",
                "operationId": "openai_retrieve_model",
                "responses": {"200": response("The model", json_content(ref("Model")))}
                | _openai_errors("400", "404"),
            },
        },
        "/v1/completions": generate(
            "Text completion", "openai_completions", "CompletionRequest", "Completion"
        ),
        "/v1/chat/completions": generate(
            "Chat completion (the model's chat template)",
            "openai_chat_completions",
            "ChatRequest",
            "ChatCompletion",
        ),
        "/v1/responses": {
            "post": {
                "summary": "The Responses API (stateless)",
                "operationId": "openai_responses",
                "requestBody": {"required": True, "content": json_content(ref("ResponsesRequest"))},
                "responses": {
                    "200": response(
                        "The response",
                        json_content(ref("Response"))
                        | {
                            "text/event-stream": {
                                "schema": {"type": "object"},
                                "description": "With stream: true, the Responses API's events "
                                "(response.created ... response.completed), each with type and "
                                "sequence_number",
                            }
                        },
                    )
                }
                | _openai_errors("400", "404", body=True),
            }
        },
        "/v1/embeddings": {
            "post": {
                "summary": "Embeddings from a V2 model whose config names a tokenizer",
                "operationId": "openai_embeddings",
                "requestBody": {"required": True, "content": json_content(ref("EmbeddingRequest"))},
                "responses": {"200": response("Vectors", json_content(ref("EmbeddingList")))}
                | _openai_errors("400", "404", body=True),
            }
        },
    }


def openapi_document(version: str) -> dict[str, Any]:
    """The whole document; ``version`` is the server's (``info.version``)."""
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Slipstream",
            "version": version,
            "description": "Open Inference Protocol (V2) REST with Triton's extensions, "
            "KServe's V1 protocol, Prometheus metrics, and the OpenAI-compatible API. "
            'Errors: {"error": message} on V2 routes, KServe V1\'s :predict and the '
            'transport, OpenAI\'s {"error": {message, type, param, code}} on other /v1 routes.',
            "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"},
        },
        "paths": with_front_door(
            with_kserve_v1(
                _v2_paths() | _openai_paths() | score_paths() | classify_paths() | batch_paths(),
                _MODEL,
                _VERSION,
            )
        ),
        "components": {
            "schemas": v2_schemas()
            | job_schemas()
            | openai_schemas()
            | score_schemas()
            | classify_schemas()
            | batch_schemas()
            | kserve_v1_schemas(),
            "securitySchemes": {
                "apiKey": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "An API key of `slipstream keys create`, where the server "
                    "runs with --auth-file (gRPC: metadata `authorization`)",
                }
            },
        },
        # No key, or a key: a server without --auth-file asks for none.
        "security": [{}, {"apiKey": []}],
    }


@cache
def _route_patterns() -> tuple[tuple[re.Pattern[str], tuple[str, ...]], ...]:
    routes = []
    for template, item in openapi_document("")["paths"].items():
        methods = [m.upper() for m in item if m in ("get", "post", "delete")]
        if "GET" in methods:
            methods.append("HEAD")
        pattern = re.sub(r"\\\{[a-z_]+\\\}", "[^/]+", re.escape(template))
        routes.append((re.compile(pattern + "/?"), tuple(methods)))
    return tuple(routes)


def allowed_methods(path: str) -> list[str]:
    """The HTTP methods the routes matching ``path`` answer (empty: no such route).

    What a 405 answer's Allow header lists, from the same table the document holds.

    >>> allowed_methods("/v2/models/m/infer"), allowed_methods("/nowhere")
    (['POST'], [])
    """
    found: list[str] = []
    for pattern, methods in _route_patterns():
        if pattern.fullmatch(path):
            found += (m for m in methods if m not in found)
    return found
