"""The OpenAPI paths of Triton's logging and trace extensions (:mod:`.openapi`): the
settings a POST may carry, as the server accepts them (an unknown key, a value of another
type or a trace level other than OFF is a 400)."""

from __future__ import annotations

from typing import Any

from slipstream.protocol.openapi_schemas import json_content, response
from slipstream.protocol.openapi_statuses import v2_errors


def settings_paths(model: dict[str, Any]) -> dict[str, Any]:
    """Triton's logging and trace extensions (server/triton_settings.py); ``model`` is the
    model path parameter."""
    settings = json_content({"type": "object"})
    u32 = {"type": "integer", "minimum": 0, "maximum": 2**32 - 1}
    number = {"anyOf": [u32, {"type": "string", "pattern": "^[0-9]{1,9}$"}]}
    log = json_content({"type": "object", "additionalProperties": False, "properties": {
        "log_file": {"const": ""}, "log_info": {"type": "boolean"},
        "log_warning": {"type": "boolean"}, "log_error": {"type": "boolean"},
        "log_verbose_level": u32, "log_format": {"enum": ["default", "ISO8601"]},
    }})  # fmt: skip
    off = {"const": "OFF"}
    trace = json_content({"type": "object", "additionalProperties": False, "properties": {
        "trace_level": {"anyOf": [off, {"type": "array", "items": off, "minItems": 0,
                                        "maxItems": 1}]},
        "trace_rate": number, "log_frequency": number,
        "trace_count": {"anyOf": [{"type": "integer", "minimum": -1, "maximum": 2**31 - 1},
                                  {"type": "string", "pattern": "^(-1|[0-9]{1,9})$"}]},
        "trace_file": {"const": ""}, "trace_mode": {"const": "triton"},
    }})  # fmt: skip

    for content in (log, trace):  # null leaves a setting as it is (clears a trace one)
        fields = content["application/json"]["schema"]["properties"]
        for key, schema in fields.items():
            forms = [schema, {"type": "null"}]
            if content is trace and key != "trace_level":  # also as Triton's array of one
                text = next((f for f in schema.get("anyOf", [schema]) if "type" not in f
                             or f["type"] == "string"), schema)  # fmt: skip
                forms.append({"type": "array", "items": text, "maxItems": 1})
            fields[key] = {"anyOf": forms}

    def item(summary: str, op: str, extra: dict[str, Any]) -> dict[str, Any]:
        errors = ("400", "404") if extra else ("400",)
        body = log if op == "log_settings" else trace
        return extra | {
            "get": {"summary": summary, "operationId": op,
                    "responses": {"200": response("Settings", settings)} | v2_errors(*errors)},
            "post": {"summary": f"Change: {summary.lower()}", "operationId": f"update_{op}",
                     "requestBody": {"required": False, "content": body},
                     "responses": {"200": response("Settings", settings)}
                     | v2_errors(*errors, body=True)},
        }  # fmt: skip

    return {
        "/v2/logging": item("Log settings (Triton extension)", "log_settings", {}),
        "/v2/trace/setting": item("Trace settings (tracing is off)", "trace_settings", {}),
        "/v2/models/{model}/trace/setting": item(
            "A model's trace settings", "model_trace_settings", {"parameters": [model]}
        ),
    }
