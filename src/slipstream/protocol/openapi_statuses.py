"""The error statuses the OpenAPI document (:mod:`.openapi`) gives its routes: each
route's own, and what the transport answers before any route runs."""

from __future__ import annotations

from typing import Any

from slipstream.protocol.openapi_schemas import json_content, ref, response

V2_ERROR = json_content(ref("V2Error"))
OPENAI_ERROR = json_content(ref("OpenAIError"))
# What the transport answers before any route runs (V2 error shape on every route).
TRANSPORT = {
    "408": response("The request's headers or body arrived too slowly", V2_ERROR),
    "414": response("The URL is longer than --max-header-bytes", V2_ERROR),
    "431": response("Request headers too large or too many", V2_ERROR),
}
TOO_LARGE = {"413": response("The body is larger than --max-request-bytes", V2_ERROR)}
RETRY_AFTER = {
    "Retry-After": {
        "description": "Seconds to wait before retrying (queue full)",
        "schema": {"type": "integer", "minimum": 0},
    }
}


def v2_errors(*statuses: str, body: bool = False) -> dict[str, Any]:
    """Error responses of a V2 route: its own ``statuses``, then the transport's."""
    meaning = {
        "400": "Bad request: the message names the field, the value and what was expected",
        "404": "Unknown model, version or route",
        "503": "Not ready, queue full (with Retry-After), timed out in the queue, or the "
        "server at --max-connections",
    }
    # 503 on every route: the transport refuses a connection at --max-connections.
    out = {s: response(meaning[s], V2_ERROR) for s in (*statuses, "503")}
    out["503"]["headers"] = RETRY_AFTER
    out["500"] = response("Internal fault; the details are only in the server log", V2_ERROR)
    return out | TRANSPORT | (TOO_LARGE if body else {})


def openai_errors(*statuses: str, body: bool = False) -> dict[str, Any]:
    meaning = {
        "400": "Invalid request: error.param names the field",
        "404": "Unknown model (error.code model_not_found) or route",
    }
    out = {s: response(meaning[s], OPENAI_ERROR) for s in statuses}
    out["500"] = response("Internal fault; the details are only in the server log", OPENAI_ERROR)
    either = {"anyOf": [ref("OpenAIError"), ref("V2Error")]}
    out["503"] = response(
        "Model not ready or its queue full (OpenAI shape, with Retry-After), or the "
        "server at --max-connections (V2 shape)",
        json_content(either),
    )
    out["503"]["headers"] = RETRY_AFTER
    return out | TRANSPORT | (TOO_LARGE if body else {})


_RATE_LIMIT_HEADERS = RETRY_AFTER | {
    "RateLimit-Policy": {
        "description": 'The limit that refused the request, e.g. "requests";q=10;w=1 '
        "(draft-ietf-httpapi-ratelimit-headers)",
        "schema": {"type": "string"},
    },
    "RateLimit": {
        "description": 'What is left of it, e.g. "requests";r=0;t=1',
        "schema": {"type": "string"},
    },
}


def with_front_door(paths: dict[str, Any]) -> dict[str, Any]:
    """Every operation's answers of the front door (servers with --auth-file; which
    routes need which role: security/access.py), in its route's error shape."""
    for template, item in paths.items():
        openai_shape = template.startswith("/v1/") and not template.endswith(":predict")
        shape = OPENAI_ERROR if openai_shape else V2_ERROR
        for method, operation in item.items():
            if method not in ("get", "post", "put", "delete", "patch"):
                continue  # the path's shared parameters
            limited = response("Over a rate limit of the key", shape)
            limited["headers"] = _RATE_LIMIT_HEADERS
            operation["responses"] |= {
                "401": response("No API key, or one this server does not know", shape),
                "403": response("The key's role or models do not allow this", shape),
                "429": limited,
            }
    return paths
