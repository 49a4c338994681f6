"""The OpenAPI paths and schemas of OpenAI's Files and Batch APIs (:mod:`.openapi`). The
create-batch schema is generated from the pydantic model that validates it
(:mod:`.openai_batch`)."""

from __future__ import annotations

from typing import Any

from slipstream.protocol.openai_batch import PURPOSES, UPLOAD_PURPOSES, CreateBatchRequest
from slipstream.protocol.openapi_schemas import REF, json_content, ref, response
from slipstream.protocol.openapi_statuses import OPENAI_ERROR, openai_errors

_ID = {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}
_STATUSES = ["validating", "failed", "in_progress", "finalizing", "completed", "expired",
             "cancelling", "cancelled"]  # fmt: skip
_CONFLICT = {"409": response("The batch's status does not allow it", OPENAI_ERROR)}


def _param(name: str, where: str = "path", schema: Any = None, required: bool = True
           ) -> dict[str, Any]:  # fmt: skip
    return {"name": name, "in": where, "required": required, "schema": schema or _ID}


def _list_params(*extra: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        _param("after", "query", {"type": "string"}, required=False),
        _param("limit", "query", {"type": "integer", "minimum": 1, "maximum": 100}, required=False),
        *extra,
    ]


def batch_paths() -> dict[str, Any]:
    file_id, batch_id = _param("file_id"), _param("batch_id")
    upload = {
        "required": True,
        "content": {"multipart/form-data": {"schema": ref("FileUpload")}},
    }
    file_ok = {"200": response("The file object", json_content(ref("OpenAIFile")))}
    batch_ok = {"200": response("The batch object", json_content(ref("Batch")))}
    return {
        "/v1/files": {
            "post": {
                "summary": "Upload a batch input file (JSON Lines; 400 names a bad line)",
                "operationId": "openai_file_upload",
                "requestBody": upload,
                "responses": file_ok | openai_errors("400", body=True),
            },
            "get": {
                "summary": "The files this key sees",
                "operationId": "openai_file_list",
                "parameters": [
                    _param("purpose", "query", {"enum": list(PURPOSES)}, required=False),
                    _param("order", "query", {"enum": ["asc", "desc"]}, required=False),
                    _param("after", "query", {"type": "string"}, required=False),
                    _param(
                        "limit",
                        "query",
                        {"type": "integer", "minimum": 1, "maximum": 10_000},
                        required=False,
                    ),
                ],
                "responses": {"200": response("Files", json_content(ref("FileList")))}
                | openai_errors("400"),
            },
        },
        "/v1/files/{file_id}": {
            "parameters": [file_id],
            "get": {
                "summary": "A file object",
                "operationId": "openai_file_get",
                "responses": file_ok | openai_errors("400", "404"),
            },
            "delete": {
                "summary": "Delete a file",
                "operationId": "openai_file_delete",
                "responses": {"200": response("Deleted", json_content(ref("FileDeleted")))}
                | openai_errors("400", "404"),
            },
        },
        "/v1/files/{file_id}/content": {
            "parameters": [file_id],
            "get": {
                "summary": "A file's bytes (a batch's output: one JSON line per request)",
                "operationId": "openai_file_content",
                "responses": {
                    "200": response(
                        "Its bytes",
                        {
                            "application/octet-stream": {
                                "schema": {"type": "string", "format": "binary"}
                            }
                        },
                    )
                }
                | openai_errors("400", "404"),
            },
        },
        "/v1/batches": {
            "post": {
                "summary": "Run a batch input file's requests in the background",
                "operationId": "openai_batch_create",
                "requestBody": {
                    "required": True,
                    "content": json_content(ref("CreateBatchRequest")),
                },
                "responses": batch_ok | openai_errors("400", "404", body=True),
            },
            "get": {
                "summary": "The batches this key sees, newest first",
                "operationId": "openai_batch_list",
                "parameters": _list_params(),
                "responses": {"200": response("Batches", json_content(ref("BatchList")))}
                | openai_errors("400"),
            },
        },
        "/v1/batches/{batch_id}": {
            "parameters": [batch_id],
            "get": {
                "summary": "A batch: status, request counts, output and error files",
                "operationId": "openai_batch_get",
                "responses": batch_ok | openai_errors("400", "404"),
            },
        },
        "/v1/batches/{batch_id}/cancel": {
            "parameters": [batch_id],
            "post": {
                "summary": "Cancel a batch: no new request starts; it ends cancelled",
                "operationId": "openai_batch_cancel",
                "responses": batch_ok | _CONFLICT | openai_errors("400", "404", body=True),
            },
        },
    }


def batch_schemas() -> dict[str, Any]:
    create = CreateBatchRequest.model_json_schema(ref_template=REF)
    stamp = {"type": ["integer", "null"]}
    file_object = {
        "type": "object",
        "properties": {
            "id": {"type": "string"}, "object": {"const": "file"},
            "bytes": {"type": "integer", "minimum": 0}, "created_at": {"type": "integer"},
            "filename": {"type": "string"}, "purpose": {"enum": list(PURPOSES)},
            "status": {"const": "processed"}, "expires_at": stamp,
            "status_details": {"type": ["string", "null"]},
        },
        "required": ["id", "object", "bytes", "created_at", "filename", "purpose"],
    }  # fmt: skip
    counts = {"type": "object", "required": ["total", "completed", "failed"],
              "properties": {k: {"type": "integer", "minimum": 0}
                             for k in ("total", "completed", "failed")}}  # fmt: skip
    batch = {
        "type": "object",
        "properties": {
            "id": {"type": "string"}, "object": {"const": "batch"},
            "endpoint": {"type": "string"}, "input_file_id": {"type": "string"},
            "completion_window": {"const": "24h"}, "status": {"enum": _STATUSES},
            "output_file_id": {"type": ["string", "null"]},
            "error_file_id": {"type": ["string", "null"]},
            "errors": {"type": ["object", "null"]}, "request_counts": counts,
            "metadata": {"type": ["object", "null"], "additionalProperties": {"type": "string"}},
            **{f"{name}_at": stamp for name in ("in_progress", "expires", "finalizing",
                                                "completed", "failed", "expired",
                                                "cancelling", "cancelled")},
            "created_at": {"type": "integer"},
        },
        "required": ["id", "object", "endpoint", "input_file_id", "completion_window",
                     "status", "created_at", "request_counts"],
    }  # fmt: skip
    return {
        "CreateBatchRequest": create,
        "FileUpload": {
            "type": "object",
            "properties": {
                "file": {
                    "type": "string",
                    "format": "binary",
                    "description": "JSON Lines: custom_id (unique), method POST, url "
                    "(one endpoint for the file), body",
                },
                "purpose": {"enum": list(UPLOAD_PURPOSES)},
            },
            "required": ["file", "purpose"],
        },
        "OpenAIFile": file_object,
        "FileDeleted": {
            "type": "object",
            "properties": {
                "id": {"type": "string"},
                "object": {"const": "file"},
                "deleted": {"const": True},
            },
            "required": ["id", "object", "deleted"],
        },
        "FileList": _page("OpenAIFile"),
        "Batch": batch,
        "BatchList": _page("Batch"),
    }


def _page(item: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": ref(item)},
                       "first_id": {"type": ["string", "null"]},
                       "last_id": {"type": ["string", "null"]}, "has_more": {"type": "boolean"}},
        "required": ["object", "data", "has_more"],
    }  # fmt: skip
