"""OpenAI's Files and Batch APIs on the wire: the multipart upload, the batch input file's
rules, the create-batch body, and the file, batch and output-line objects. Pure
functions, no I/O; the store and the runner are :mod:`slipstream.server.openai_batches`.

A batch input file is JSON Lines, one request a line, as OpenAI validates it::

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "smollm2", "messages": [...], "max_tokens": 8}}

>>> lines = check_batch_input(b'{"custom_id": "a", "method": "POST", '
...     b'"url": "/v1/embeddings", "body": {"model": "m", "input": "x"}}\\n')
>>> lines[0].custom_id, lines[0].url
('a', '/v1/embeddings')
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, MultipartState, parse_options_header

from slipstream.errors import InvalidRequest

# The routes a batch may run: OpenAI's, and this server's other POST routes that answer
# JSON (vLLM's scoring and classification).
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
             "/v1/score", "/v1/rerank", "/classify")  # fmt: skip
# The generative ones: their tokens count against an API key's tokens per minute.
GENERATIVE_ENDPOINTS = frozenset(("/v1/chat/completions", "/v1/completions", "/v1/responses"))
# OpenAI's limit on the requests of one batch.
MAX_BATCH_LINES = 50_000
# Purposes a file may be uploaded with here: batch input (checked as OpenAI checks it).
UPLOAD_PURPOSES = ("batch",)
# Every purpose a stored file may have (the outputs are written by the server).
PURPOSES = ("batch", "batch_output")
_ID_PATTERN = re.compile(r"^(file|batch)-[0-9a-f]{32}$")


class Conflict(InvalidRequest):
    """A request the object's state does not allow (cancelling a finished batch): 409."""

    http_status = 409


def new_file_id() -> str:
    return f"file-{secrets.token_hex(16)}"


def new_batch_id() -> str:
    return f"batch-{secrets.token_hex(16)}"


def is_object_id(text: str) -> bool:
    """Whether ``text`` has the shape of this server's file and batch ids (which are
    also their file names on disk: nothing else may reach the filesystem)."""
    return _ID_PATTERN.fullmatch(text) is not None


# -- the multipart upload ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FormPart:
    """One part of a multipart/form-data body."""

    name: str  # its Content-Disposition ``name``
    filename: str | None  # its ``filename``, when it is a file
    data: bytes


def parse_form(content_type: bytes | None, body: bytes) -> dict[str, FormPart]:
    """The parts of a multipart/form-data ``body`` (RFC 7578) by name, the first of a name
    kept; InvalidRequest naming what is wrong. Parsed by python-multipart (Starlette's
    parser): ~25 ms for a 33 MB upload here (the standard library's email parser: 0.68 s)."""
    kind, params = parse_options_header(content_type)
    if kind != b"multipart/form-data":
        raise InvalidRequest(
            "Content-Type: expected multipart/form-data with the fields file and purpose, "
            f"got {kind.decode('latin-1') or 'none'!r}"
        )
    boundary = params.get(b"boundary")
    if not boundary:
        raise InvalidRequest("Content-Type: multipart/form-data needs a boundary parameter")
    form = _Form()
    parser = MultipartParser(boundary, form.callbacks())
    try:
        parser.write(body)
    except MultipartParseError as exc:
        raise InvalidRequest(
            f"body: not the multipart form its boundary delimits ({exc})"
        ) from None
    if parser.state != MultipartState.END:
        raise InvalidRequest("body: the multipart form does not end with its closing boundary")
    return form.parts


class _Form:
    """What python-multipart's callbacks report, gathered into parts."""

    def __init__(self) -> None:
        self.parts: dict[str, FormPart] = {}
        self._headers: dict[bytes, bytes] = {}
        self._field = bytearray()
        self._value = bytearray()
        self._data: list[bytes] = []

    def callbacks(self) -> Any:
        return {
            "on_part_begin": self._begin,
            "on_header_field": lambda data, start, end: self._field.extend(data[start:end]),
            "on_header_value": lambda data, start, end: self._value.extend(data[start:end]),
            "on_header_end": self._header_end,
            "on_part_data": lambda data, start, end: self._data.append(data[start:end]),
            "on_part_end": self._end,
        }

    def _begin(self) -> None:
        self._headers.clear()
        self._data.clear()

    def _header_end(self) -> None:
        self._headers[bytes(self._field).strip().lower()] = bytes(self._value).strip()
        self._field.clear()
        self._value.clear()

    def _end(self) -> None:
        disposition = self._headers.get(b"content-disposition")
        if disposition is None:
            return
        _, options = parse_options_header(disposition)
        name = options.get(b"name")
        if name is None:
            return
        filename = options.get(b"filename")
        key = name.decode("utf-8", "replace")
        part = FormPart(key, None if filename is None else filename.decode("utf-8", "replace"),
                        b"".join(self._data))  # fmt: skip
        self.parts.setdefault(key, part)


def upload_parts(content_type: bytes | None, body: bytes) -> tuple[FormPart, str]:
    """The ``file`` part and the ``purpose`` of a ``POST /v1/files``."""
    parts = parse_form(content_type, body)
    purpose_part = parts.get("purpose")
    if purpose_part is None:
        raise InvalidRequest(f"purpose: required; one of {list(UPLOAD_PURPOSES)}")
    purpose = purpose_part.data.decode("utf-8", "replace")
    if purpose not in UPLOAD_PURPOSES:
        raise InvalidRequest(
            f"purpose: {purpose!r} is not served here; this server takes files for "
            f"{list(UPLOAD_PURPOSES)} (batch input: JSON Lines of requests)"
        )
    file = parts.get("file")
    if file is None:
        raise InvalidRequest("file: required; send the JSON Lines file as the form's file field")
    return file, purpose


# -- the batch input file ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BatchLine:
    """One request of a batch input file."""

    index: int  # its place among the file's requests, from 0
    custom_id: str
    url: str
    body: dict[str, Any]


def check_batch_input(data: bytes, endpoint: str | None = None) -> list[BatchLine]:
    """The requests of a batch input file; InvalidRequest names the first bad line (from
    1, as an editor counts them) and field. ``endpoint``: the url every line must name
    (a batch's), else any one of :data:`ENDPOINTS`, the same on every line."""
    lines: list[BatchLine] = []
    seen: set[str] = set()
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        line = _check_line(raw, number)
        if line.custom_id in seen:
            raise InvalidRequest(
                f"file: line {number}: custom_id: {line.custom_id!r} is used by an earlier "
                "line; each request's custom_id must be unique in the file"
            )
        wanted = endpoint or (lines[0].url if lines else None)
        if wanted is not None and line.url != wanted:
            raise InvalidRequest(
                f"file: line {number}: url: {line.url!r}, where the batch's requests are all "
                f"for {wanted!r}: one endpoint per batch file"
            )
        seen.add(line.custom_id)
        lines.append(BatchLine(len(lines), line.custom_id, line.url, line.body))
        if len(lines) > MAX_BATCH_LINES:
            raise InvalidRequest(
                f"file: more than {MAX_BATCH_LINES} requests; split it into several batches"
            )
    if not lines:
        raise InvalidRequest("file: no requests; expected JSON Lines, one request a line")
    return lines


def _check_line(raw: bytes, number: int) -> BatchLine:
    where = f"file: line {number}"
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"{where}: not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidRequest(f"{where}: expected a JSON object with custom_id, method, url, body")
    custom_id = doc.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise InvalidRequest(f"{where}: custom_id: expected a non-empty string, got {custom_id!r}")
    if doc.get("method") != "POST":
        raise InvalidRequest(f"{where}: method: expected 'POST', got {doc.get('method')!r}")
    url = doc.get("url")
    if url not in ENDPOINTS:
        raise InvalidRequest(f"{where}: url: expected one of {list(ENDPOINTS)}, got {url!r}")
    body = doc.get("body")
    if not isinstance(body, dict):
        raise InvalidRequest(f"{where}: body: expected the request's JSON object, got {body!r}")
    if body.get("stream"):
        raise InvalidRequest(f"{where}: body.stream: a batch's requests are not streamed; "
                             "leave stream out or false")  # fmt: skip
    return BatchLine(number - 1, custom_id, str(url), body)


# -- POST /v1/batches --------------------------------------------------------------------


class CreateBatchRequest(BaseModel):
    """The body of ``POST /v1/batches``."""

    model_config = ConfigDict(extra="ignore")

    input_file_id: str = Field(description="A file uploaded with purpose batch")
    endpoint: Literal[ENDPOINTS] = Field(  # type: ignore[valid-type]
        description="The route every request of the file names in its url"
    )
    completion_window: Literal["24h"] = Field(description="Only 24h, as OpenAI's")
    metadata: dict[str, str] | None = Field(
        None, description="Up to 16 pairs: keys up to 64 characters, values up to 512"
    )

    @classmethod
    def parse(cls, body: bytes) -> CreateBatchRequest:
        """Validate a JSON body; InvalidRequest names the first bad field."""
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise InvalidRequest(f"body: not valid JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise InvalidRequest("body: expected a JSON object")
        try:
            request = cls.model_validate(doc)
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(part) for part in first["loc"]) or "body"
            raise InvalidRequest(f"{field}: {first['msg']}") from None
        metadata = request.metadata or {}
        if len(metadata) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in metadata.items()):
            raise InvalidRequest("metadata: at most 16 pairs, keys up to 64 characters and "
                                 "values up to 512")  # fmt: skip
        return request


# -- objects -----------------------------------------------------------------------------


def file_object(file_id: str, size: int, created_at: int, filename: str, purpose: str
                ) -> dict[str, Any]:  # fmt: skip
    """OpenAI's file object."""
    return {"id": file_id, "object": "file", "bytes": size, "created_at": created_at,
            "filename": filename, "purpose": purpose, "status": "processed",
            "expires_at": None, "status_details": None}  # fmt: skip


def batch_object(batch_id: str, request: CreateBatchRequest, created_at: int, total: int,
                 window_s: int) -> dict[str, Any]:  # fmt: skip
    """A new batch, as OpenAI's batch object: validating."""
    return {
        "id": batch_id, "object": "batch", "endpoint": request.endpoint, "errors": None,
        "input_file_id": request.input_file_id,
        "completion_window": request.completion_window, "status": "validating",
        "output_file_id": None, "error_file_id": None, "created_at": created_at,
        "in_progress_at": None, "expires_at": created_at + window_s, "finalizing_at": None,
        "completed_at": None, "failed_at": None, "expired_at": None, "cancelling_at": None,
        "cancelled_at": None, "request_counts": {"total": total, "completed": 0, "failed": 0},
        "metadata": request.metadata,
    }  # fmt: skip


def output_line(custom_id: str, status: int, request_id: str, body: Any) -> dict[str, Any]:
    """One line of a batch's output or error file: the request's response."""
    return {"id": f"batch_req_{secrets.token_hex(16)}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body},
            "error": None}  # fmt: skip


def unanswered_line(custom_id: str, code: str, message: str) -> dict[str, Any]:
    """One line of a batch's error file for a request that was never run (expired)."""
    return {"id": f"batch_req_{secrets.token_hex(16)}", "custom_id": custom_id,
            "response": None, "error": {"code": code, "message": message}}  # fmt: skip


def page(objects: list[dict[str, Any]], after: str | None, limit: int) -> bytes:
    """A list page as OpenAI's cursor pages: the objects after ``after``'s, ``limit`` of
    them, with first_id, last_id and has_more; an ``after`` not listed: an empty page."""
    start = 0
    if after is not None:  # one no longer listed (deleted) leaves nothing after it
        ids = [obj["id"] for obj in objects]
        start = ids.index(after) + 1 if after in ids else len(objects)
    shown = objects[start : start + limit]
    return orjson.dumps({
        "object": "list", "data": shown,
        "first_id": shown[0]["id"] if shown else None,
        "last_id": shown[-1]["id"] if shown else None,
        "has_more": start + limit < len(objects),
    })  # fmt: skip


def list_limit(query: dict[str, str], default: int, most: int) -> int:
    """The ``limit`` query parameter, 1 to ``most``."""
    given = query.get("limit")
    if given is None:
        return default
    if not given.isdigit() or not 1 <= int(given) <= most:
        raise InvalidRequest(f"limit: expected an integer from 1 to {most}, got {given!r}")
    return int(given)
