"""The schemas (``components.schemas``) of the OpenAPI document: see :mod:`.openapi`.

The OpenAI request schemas are generated from the pydantic models that validate those
requests; the V2 ones are written here, in the shape of KServe's ``rest_predict_v2.yaml``.
"""

from __future__ import annotations

from typing import Any

from slipstream.datatypes import V2_ITEM_SIZE
from slipstream.names import MAX_MODEL_NAME_LENGTH
from slipstream.protocol import openai
from slipstream.protocol.openai_responses import ResponsesRequest

# names.py's rule as a JSON Schema pattern (ECMA-262, anchored).
MODEL_NAME_PATTERN = f"^[A-Za-z0-9_][A-Za-z0-9_.-]{{0,{MAX_MODEL_NAME_LENGTH - 1}}}$"

REF = "#/components/schemas/{model}"
JSON = "application/json"


def ref(name: str) -> dict[str, str]:
    return {"$ref": REF.format(model=name)}


def json_content(schema: dict[str, Any]) -> dict[str, Any]:
    return {JSON: {"schema": schema}}


def response(description: str, content: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"description": description}
    if content:
        out["content"] = content
    return out


# -- V2 ----------------------------------------------------------------------------


def v2_schemas() -> dict[str, Any]:
    # BYTES too: text inputs and outputs (a generative model's text_input, classification).
    datatype = {"type": "string", "enum": sorted([*V2_ITEM_SIZE, "BYTES"])}
    shape = {"type": "array", "items": {"type": "integer", "minimum": 0}}
    parameters = {"type": "object", "description": "Free-form parameters"}
    count_ns = {
        "type": "object",
        "properties": {"count": {"type": "integer"}, "ns": {"type": "integer"}},
        "required": ["count", "ns"],
    }
    return _rollout_schemas() | {
        "V2Error": {
            "type": "object",
            "properties": {"error": {"type": "string"}},
            "required": ["error"],
        },
        "ServerMetadata": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "version": {"type": "string"},
                "extensions": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["name", "version", "extensions"],
        },
        "TensorMetadata": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "datatype": datatype,
                # -1 for a variable dimension
                "shape": {"type": "array", "items": {"type": "integer", "minimum": -1}},
            },
            "required": ["name", "datatype", "shape"],
        },
        "ModelMetadata": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "versions": {"type": "array", "items": {"type": "string"}},
                "platform": {"type": "string"},
                "inputs": {"type": "array", "items": ref("TensorMetadata")},
                "outputs": {"type": "array", "items": ref("TensorMetadata")},
            },
            "required": ["name", "versions", "platform", "inputs", "outputs"],
        },
        "TensorData": {
            "description": "Row-major values, flat or nested",
            "type": "array",
            "items": {
                "anyOf": [
                    ref("TensorData"),
                    {"type": "number"},
                    {"type": "string"},
                    {"type": "boolean"},
                    {"type": "null"},  # NaN and infinity in JSON outputs
                ]
            },
        },
        "RequestInput": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "shape": shape,
                "datatype": datatype,
                "parameters": {
                    "type": "object",
                    "properties": {"binary_data_size": {"type": "integer", "minimum": 0}},
                },
                "data": ref("TensorData"),
            },
            "required": ["name", "shape", "datatype"],
        },
        "RequestOutput": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "parameters": {
                    "type": "object",
                    "properties": {
                        "binary_data": {"type": "boolean"},
                        # Triton's classification extension: the top N classes as BYTES.
                        "classification": {"type": "integer", "minimum": 0},
                    },
                },
            },
            "required": ["name"],
        },
        "InferenceRequest": {
            "type": "object",
            "properties": {
                "id": {"type": ["string", "null"]},
                "parameters": {
                    "type": "object",
                    "properties": {
                        "priority": {"type": "integer", "minimum": 0},
                        "timeout": {
                            "type": "integer",
                            "minimum": 0,
                            "description": "Queue timeout in microseconds",
                        },
                        "binary_data_output": {"type": "boolean"},
                    },
                },
                "inputs": {"type": "array", "items": ref("RequestInput")},
                "outputs": {"type": "array", "items": ref("RequestOutput")},
            },
            "required": ["inputs"],
        },
        "ResponseOutput": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "shape": shape,
                "datatype": datatype,
                "parameters": parameters,
                "data": ref("TensorData"),
            },
            "required": ["name", "shape", "datatype"],
        },
        "InferenceResponse": {
            "type": "object",
            "properties": {
                "model_name": {"type": "string"},
                "model_version": {"type": "string"},
                "id": {"type": "string"},
                "parameters": parameters,
                "outputs": {"type": "array", "items": ref("ResponseOutput")},
            },
            "required": ["model_name", "model_version", "outputs"],
        },
        "ModelConfig": {
            "description": "The completed model config in Triton's JSON form",
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "platform": {"type": "string"},
                "backend": {"type": "string"},
                "max_batch_size": {"type": "integer", "minimum": 0},
                "input": {"type": "array", "items": {"type": "object"}},
                "output": {"type": "array", "items": {"type": "object"}},
            },
            "required": ["name", "max_batch_size", "input", "output"],
        },
        "ModelStatistics": {
            "type": "object",
            "properties": {
                "model_stats": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string"},
                            "version": {"type": "string"},
                            "last_inference": {"type": "integer"},
                            "inference_count": {"type": "integer"},
                            "execution_count": {"type": "integer"},
                            "inference_stats": {
                                "type": "object",
                                "additionalProperties": count_ns,
                            },
                            "response_stats": {
                                "type": "object",
                                "additionalProperties": {
                                    "type": "object",
                                    "additionalProperties": count_ns,
                                },
                            },
                            "batch_stats": {"type": "array", "items": {"type": "object"}},
                            "memory_usage": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "properties": {
                                        "type": {"enum": ["CPU", "CPU_PINNED", "GPU"]},
                                        "id": {"type": "integer"},
                                        "byte_size": {"type": "integer"},
                                    },
                                    "required": ["type", "id", "byte_size"],
                                },
                            },
                        },
                        "required": ["name", "version", "inference_stats"],
                    },
                }
            },
            "required": ["model_stats"],
        },
        "RepositoryIndexRequest": {
            "type": "object",
            "properties": {"ready": {"type": "boolean"}},
        },
        "RepositoryIndex": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "version": {"type": "string"},
                    "state": {"type": "string"},
                    "reason": {"type": "string"},
                },
                "required": ["name"],
            },
        },
        "RepositoryLoadRequest": {
            "type": "object",
            "properties": {
                "parameters": {
                    "type": "object",
                    "properties": {
                        "config": {
                            "type": "string",
                            "description": "Triton's config override: the model config in "
                            "its JSON form, used instead of the repository's until a load "
                            "without one",
                        }
                    },
                    "additionalProperties": False,
                    "description": "Triton's file: parameters are refused with 400: model "
                    "files load from the repository only",
                }
            },
        },
        "RepositoryUnloadRequest": {
            "type": "object",
            "properties": {
                "parameters": {
                    "type": "object",
                    "properties": {
                        "unload_dependents": {
                            "type": "boolean",
                            "description": "Triton's: an ensemble's (or cascade's) models "
                            "are unloaded too, but those another loaded one still runs",
                        }
                    },
                    "description": "other parameters are ignored",
                }
            },
        },
    }


# -- OpenAI --------------------------------------------------------------------------------


def openai_schemas() -> dict[str, Any]:
    schemas: dict[str, Any] = {}
    for model in (openai.CompletionRequest, openai.ChatRequest, openai.EmbeddingRequest,
                  ResponsesRequest):  # fmt: skip
        schema = model.model_json_schema(ref_template=REF)
        schemas |= schema.pop("$defs", {})
        schema["properties"]["model"]["pattern"] = MODEL_NAME_PATTERN
        # Other servers' fields refused by name (protocol/openai_fields.py): declared, so
        # that a client (and a schema-driven fuzzer) sees the values accepted for each.
        for name, refused in getattr(model, "unserved", {}).items():
            schema["properties"].setdefault(name, {
                "enum": [None, *refused.same],
                "description": f"not served here: {refused.advice}; other values are a 400",
            })  # fmt: skip
        schemas[model.__name__] = schema
    for schema in schemas.values():
        _bound_integers(schema)
    usage = {
        "type": "object",
        "properties": {
            k: {"type": "integer", "minimum": 0}
            for k in ("prompt_tokens", "completion_tokens", "total_tokens")
        },
        "required": ["prompt_tokens", "total_tokens"],
    }
    reason = {"type": ["string", "null"]}
    stop_reason = {"type": ["string", "integer", "null"],
                   "description": "vLLM's: the stop string or stop token id that ended the "
                   "text; null for end-of-sequence or length"}  # fmt: skip

    def listing(obj: str, choice: dict[str, Any]) -> dict[str, Any]:
        whole = _chunk(obj, choice)
        whole["properties"]["usage"] = ref("Usage")
        whole["required"] = [*whole["required"], "usage"]
        return whole

    text_choice: dict[str, Any] = {
        "type": "object",
        "properties": {
            "index": {"type": "integer"},
            "text": {"type": "string"},
            "finish_reason": reason,
            "stop_reason": stop_reason,
        },
        "required": ["index", "text", "finish_reason"],
    }
    calls = {"type": "array", "items": {"type": "object", "properties": {
        "id": {"type": "string"}, "type": {"const": "function"},
        "function": {"type": "object", "properties": {
            "name": {"type": "string"}, "arguments": {"type": "string"}}}}}}  # fmt: skip
    logprobs = {"type": ["object", "null"],
                "description": "chat: {content: [{token, logprob, bytes, top_logprobs}]}; "
                "completions: {tokens, token_logprobs, top_logprobs, text_offset}"}  # fmt: skip
    text_choice["properties"]["logprobs"] = logprobs
    message = {
        "type": "object",
        "properties": {
            "role": {"const": "assistant"},
            "content": {"type": ["string", "null"]},
            "tool_calls": calls,
        },
        "required": ["role", "content"],
    }
    chat_choice = {
        "type": "object",
        "properties": {
            "index": {"type": "integer"},
            "message": message,
            "finish_reason": reason,
            "stop_reason": stop_reason,
            "logprobs": logprobs,
        },
        "required": ["index", "message", "finish_reason"],
    }
    delta = {
        "type": "object",
        "properties": {
            "role": {"const": "assistant"},
            "content": {"type": ["string", "null"]},
            "tool_calls": calls,
        },
    }
    delta_choice = {
        "type": "object",
        "properties": {
            "index": {"type": "integer"},
            "delta": delta,
            "finish_reason": reason,
            "stop_reason": stop_reason,
        },
        "required": ["index", "delta", "finish_reason"],
    }
    card = {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "model"},
            "created": {"type": "integer"},
            "owned_by": {"type": "string"},
        },
        "required": ["id", "object", "created", "owned_by"],
    }
    embedding = {
        "type": "object",
        "properties": {
            "object": {"const": "embedding"},
            "index": {"type": "integer"},
            "embedding": {
                "anyOf": [
                    {"type": "array", "items": {"type": "number"}},
                    {"type": "string", "description": "base64 of little-endian float32"},
                ]
            },
        },
        "required": ["object", "index", "embedding"],
    }
    return schemas | {
        "OpenAIError": {
            "type": "object",
            "properties": {
                "error": {
                    "type": "object",
                    "properties": {
                        "message": {"type": "string"},
                        "type": {"type": "string"},
                        "param": {"type": ["string", "null"]},
                        "code": {"type": ["string", "null"]},
                    },
                    "required": ["message", "type", "param", "code"],
                }
            },
            "required": ["error"],
        },
        "Usage": usage,
        "Model": card,
        "ModelList": {
            "type": "object",
            "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": card}},
            "required": ["object", "data"],
        },
        "Response": {
            "type": "object",
            "description": "OpenAI's Response object (stateless: store is always false)",
            "properties": {
                "id": {"type": "string"},
                "object": {"const": "response"},
                "created_at": {"type": "integer"},
                "status": {"enum": ["completed", "incomplete", "in_progress", "failed"]},
                "model": {"type": "string"},
                "output": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"type": {"enum": ["message", "function_call"]}},
                    },
                },
                "usage": {"type": ["object", "null"]},
                "store": {"const": False},
            },
            "required": ["id", "object", "created_at", "status", "model", "output"],
        },
        "Completion": listing("text_completion", text_choice),
        "ChatCompletion": listing("chat.completion", chat_choice),
        "CompletionChunk": _chunk("text_completion", text_choice),
        "ChatCompletionChunk": _chunk("chat.completion.chunk", delta_choice),
        "EmbeddingList": {
            "type": "object",
            "properties": {
                "object": {"const": "list"},
                "data": {"type": "array", "items": embedding},
                "model": {"type": "string"},
                "usage": usage,
            },
            "required": ["object", "data", "model", "usage"],
        },
    }


def _chunk(obj: str, choice: dict[str, Any]) -> dict[str, Any]:
    """One streamed event's JSON: choices (none in the usage chunk), usage when asked."""
    return {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "object": {"const": obj},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": choice},
            "usage": {"anyOf": [ref("Usage"), {"type": "null"}]},
        },
        "required": ["id", "object", "created", "model", "choices"],
    }


# JSON integers the server reads: 64-bit (orjson's range); larger ones are a 400.
_INT64 = (-(2**63), 2**63 - 1)


def _bound_integers(schema: Any) -> None:
    """Give every integer of a generated request schema the 64-bit range it is read in."""
    if isinstance(schema, dict):
        if schema.get("type") == "integer":
            schema.setdefault("minimum", _INT64[0])
            schema.setdefault("maximum", _INT64[1])
        for value in schema.values():
            _bound_integers(value)
    elif isinstance(schema, list):
        for value in schema:
            _bound_integers(value)


# GET /v2/jobs/{job}'s answer.
JOB_STATUS_SCHEMA = {
    "type": "object",
    "properties": {
        "job_id": {"type": "string"},
        "status": {"enum": ["pending", "done", "failed"]},
        "model_name": {"type": "string"},
        "model_version": {"type": "string"},
        "attempts": {"type": "integer", "minimum": 0},
        "result": ref("InferenceResponse"),
        "error": {"type": "string"},
        "error_status": {"type": "integer"},
    },
    "required": ["job_id", "status", "model_name", "model_version", "attempts"],
}


def job_schemas() -> dict[str, Any]:
    """The asynchronous jobs' request (a V2 request naming its model) and status."""
    request = {
        "allOf": [ref("InferenceRequest")],
        "type": "object",
        "properties": {
            "model": {"type": "string", "pattern": MODEL_NAME_PATTERN},
            "model_version": {"type": "string", "pattern": "^[0-9]{0,18}$"},
        },
        "required": ["model"],
    }
    return {"JobRequest": request, "JobStatus": JOB_STATUS_SCHEMA}


def _rollout_schemas() -> dict[str, Any]:
    """The rollout admin API (serving/rollout_state.py's RolloutPlan is the full check)."""
    version = {"type": "string", "pattern": "^[1-9][0-9]{0,17}$"}
    return {
        "RolloutAction": {
            "type": "object",
            "description": "start: the plan's fields beside the action (steps increasing, "
            "the baseline another loaded version than the candidate, the candidate loaded, "
            "no other rollout active); pause, resume, promote, abort: the action alone, "
            "possible in the states the status names",
            "properties": {
                "action": {"enum": ["start", "pause", "resume", "promote", "abort"]},
                "candidate": version,
                "baseline": {"type": "string", "pattern": "^([1-9][0-9]{0,17})?$"},
                "steps": {
                    "type": "array",
                    "minItems": 1,
                    "items": {"type": "number", "exclusiveMinimum": 0, "maximum": 100},
                },
                "interval_s": {"type": "number", "exclusiveMinimum": 0},
                "failure_limit": {"type": "integer", "minimum": 1},
                "min_requests": {"type": "integer", "minimum": 1},
                "max_error_rate_increase": {"type": "number", "minimum": 0, "maximum": 1},
                "max_p99_ratio": {"type": "number", "exclusiveMinimum": 0},
                "min_p99_delta_ms": {"type": "number", "minimum": 0},
                "min_agreement": {"type": "number", "minimum": 0, "maximum": 1},
                "shadow_share": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["action"],
            "if": {"properties": {"action": {"const": "start"}}},
            "then": {"required": ["candidate"]},
            "additionalProperties": False,
        },
        "RolloutStatus": {
            "type": "object",
            "properties": {
                "model": {"type": "string"},
                "status": {
                    "enum": ["none", "running", "paused", "promoted", "rolled_back", "aborted"]
                },
                "weights": {"type": "object", "additionalProperties": {"type": "number"}},
                "step": {"type": "integer"},
                "history": {"type": "array", "items": {"type": "object"}},
            },
            "required": ["model", "status", "weights"],
        },
    }
