"""OpenAI's batches: a JSONL file of requests run in the background against this
server's own OpenAI routes, their answers written to an output and an error file.

    <files-dir>/batches/<id>.json      the batch object, its owner and the models its
                                       key may use
    <files-dir>/batches/<id>.answers   one JSON line per request answered (a journal)

Each request runs through the very handler of the live route (the OpenAI app's, given
a built :class:`HttpRequest`), so validation, batching and statistics are the live
path's. At most ``concurrency`` requests of all batches are in flight at once, which is
what keeps live traffic's latency: a batch never holds more of the batchers than that.
A 429 or 503 answer (a model loading, a queue full, the key's token budget spent) is
tried again after its Retry-After, for up to ``_RETRY_FOR_S``; other answers are final.

Statuses move as OpenAI's: ``validating`` (the file is read and checked against the
endpoint) -> ``in_progress`` -> ``finalizing`` (the output files written) ->
``completed``; ``failed`` when the input does not validate; ``expired`` past the 24 h
window (requests not run go to the error file as ``batch_expired``); ``cancelling`` ->
``cancelled`` (no new request starts, those in flight finish, their answers kept).
A server stopped mid-batch resumes it when it is ready again: requests the journal
holds are not run again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from slipstream.errors import InvalidRequest, NotFound, PermissionDenied, SlipstreamError
from slipstream.protocol import openai_replies as replies
from slipstream.protocol.openai_batch import (
    GENERATIVE_ENDPOINTS,
    BatchLine,
    Conflict,
    CreateBatchRequest,
    batch_object,
    check_batch_input,
    is_object_id,
    new_batch_id,
    output_line,
    unanswered_line,
)
from slipstream.server.httpd import HttpRequest, HttpResponse, StreamingResponse
from slipstream.server.openai_files import FilesDirectory, FileStore, Viewer, write_json

logger = logging.getLogger(__name__)

Handler = Callable[[HttpRequest], Awaitable[HttpResponse | StreamingResponse]]

# OpenAI's only completion window.
WINDOW_S = 24 * 3600
# How long one request is tried again while it is answered 429 or 503.
_RETRY_FOR_S = 600.0
_RETRY_MAX_WAIT_S = 5.0
_UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
_SERVER_ERROR = {"error": {"message": "internal server error; see the server log",
                           "type": "server_error", "param": None, "code": None}}  # fmt: skip


class TokenBudget:
    """An API key's tokens per minute, as the live generative routes spend them: a
    request waits while the key's budget is in debt, and its usage is charged after."""

    async def wait(self, owner: str) -> None:  # pragma: no cover - the contract
        """Return once ``owner``'s key may start a generative request."""

    async def charge(self, owner: str, tokens: int) -> None:  # pragma: no cover
        """Count ``tokens`` against ``owner``'s key."""


@dataclass(slots=True)
class StoredBatch:
    """One batch's record: its OpenAI object and what the server keeps beside it."""

    object: dict[str, Any]
    owner: str
    # The models the owner's key may use (None: every model): each request is checked.
    models: frozenset[str] | None
    created_ns: int
    # Indices of the requests answered (from the journal).
    answered: set[int] = field(default_factory=set)


class BatchStore:
    """The batches of one :class:`FilesDirectory`, and the tasks running them."""

    def __init__(
        self,
        directory: FilesDirectory,
        files: FileStore,
        handler: Handler,
        concurrency: int,
        budget: TokenBudget | None = None,
    ) -> None:
        self._directory = directory
        self._files = files
        self._handler = handler
        self._slots = asyncio.Semaphore(concurrency)
        self._budget = budget
        self._batches: dict[str, StoredBatch] | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}

    @property
    def _dir(self) -> Path:
        return self._directory.root / "batches"

    # -- the API's operations -----------------------------------------------------------

    async def create(self, request: CreateBatchRequest, viewer: Viewer,
                     models: frozenset[str] | None) -> dict[str, Any]:  # fmt: skip
        batches = self._index()
        source = self._files.get(request.input_file_id, viewer)
        if source.object["purpose"] != "batch":
            purpose = source.object["purpose"]
            raise InvalidRequest(f"input_file_id: {request.input_file_id!r} has purpose "
                                 f"{purpose!r}; upload it with purpose batch")  # fmt: skip
        batch_id = new_batch_id()
        created_ns = time.time_ns()
        record = StoredBatch(batch_object(batch_id, request, created_ns // 10**9, 0, WINDOW_S),
                             viewer.name, models, created_ns)  # fmt: skip
        self._save(record)
        batches[batch_id] = record
        self._start(record)
        return record.object

    def get(self, batch_id: str, viewer: Viewer) -> dict[str, Any]:
        return self._get(batch_id, viewer).object

    def listed(self, viewer: Viewer) -> list[dict[str, Any]]:
        """The batches ``viewer`` sees, newest first (OpenAI's order)."""
        return [record.object for record in reversed(self._index().values())
                if viewer.sees(record.owner)]  # fmt: skip

    def cancel(self, batch_id: str, viewer: Viewer) -> dict[str, Any]:
        record = self._get(batch_id, viewer)
        status = record.object["status"]
        if status in ("cancelling", "cancelled"):
            return record.object
        if status not in ("validating", "in_progress"):
            raise Conflict(f"batch_id: batch {batch_id!r} is {status}; only a validating or "
                           "in_progress batch can be cancelled")  # fmt: skip
        self._move(record, "cancelling")
        return record.object

    def resume(self) -> None:
        """Run the unfinished batches of a directory used before (a restart)."""
        if not (self._directory.root / "batches").is_dir():
            return  # never used: opened on first use
        for record in self._index().values():
            obj = record.object
            if obj["status"] in _UNFINISHED:
                logger.info("resuming batch %s (%s, %d requests answered before)",
                            obj["id"], obj["status"], len(record.answered))  # fmt: skip
                self._start(record)

    async def stop(self) -> None:
        """Cancel the running batches (they resume at the next start)."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- records ------------------------------------------------------------------------

    def _index(self) -> dict[str, StoredBatch]:
        if self._batches is None:
            self._directory.open()
            batches = []
            for meta in self._dir.glob("*.json"):
                try:
                    doc = orjson.loads(meta.read_bytes())
                    models = doc["models"]
                    record = StoredBatch(doc["object"], doc["owner"],
                                         None if models is None else frozenset(models),
                                         doc["created_ns"])  # fmt: skip
                except (OSError, orjson.JSONDecodeError, KeyError, TypeError):
                    logger.warning("batch record %s cannot be read; it is left out", meta)
                    continue
                record.answered = {index for index, _ in self._journal(meta.stem)}
                batches.append(record)
            batches.sort(key=lambda record: record.created_ns)
            self._batches = {record.object["id"]: record for record in batches}
        return self._batches

    def _get(self, batch_id: str, viewer: Viewer) -> StoredBatch:
        record = self._index().get(batch_id) if is_object_id(batch_id) else None
        if record is None or not viewer.sees(record.owner):
            raise NotFound(f"batch_id: no batch {batch_id!r} here")
        return record

    def _save(self, record: StoredBatch) -> None:
        models = None if record.models is None else sorted(record.models)
        write_json(self._dir / f"{record.object['id']}.json",
                   {"object": record.object, "owner": record.owner, "models": models,
                    "created_ns": record.created_ns})  # fmt: skip

    def _move(self, record: StoredBatch, status: str, **fields: Any) -> None:
        record.object.update(status=status, **fields)
        record.object[f"{status}_at"] = replies.now()
        self._save(record)

    def _journal(self, batch_id: str) -> list[tuple[int, dict[str, Any]]]:
        """(index, answer) of each request answered; a line cut by a crash is skipped."""
        answers = []
        try:
            raw = (self._dir / f"{batch_id}.answers").read_bytes()
        except FileNotFoundError:
            return []
        for line in raw.splitlines():
            try:
                entry = orjson.loads(line)
                answers.append((int(entry["i"]), entry))
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
        return answers

    # -- running ------------------------------------------------------------------------

    def _start(self, record: StoredBatch) -> None:
        batch_id = record.object["id"]
        task = asyncio.create_task(self._run(record), name=f"batch {batch_id}")
        self._tasks[batch_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(batch_id, None))

    async def _run(self, record: StoredBatch) -> None:
        try:
            lines = await self._validate(record)
            if lines is not None:
                if record.object["status"] != "finalizing":  # (stopped while finalizing)
                    await self._run_lines(record, lines)
                await self._finalize(record, lines)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("batch %s failed", record.object["id"])
            self._move(record, "failed", errors={"object": "list", "data": [
                {"code": "server_error", "message": "the batch failed; see the server log",
                 "param": None, "line": None}]})  # fmt: skip

    async def _validate(self, record: StoredBatch) -> list[BatchLine] | None:
        """The input file's requests (None: the batch failed or was cancelled)."""
        obj = record.object
        owner = Viewer(record.owner, admin=True)  # checked when the batch was created
        try:
            data = await self._files.content(obj["input_file_id"], owner)
            lines = check_batch_input(data, obj["endpoint"])
        except SlipstreamError as exc:
            line = exc.message.split(": ", 2)[1] if exc.message.startswith("file: line ") else ""
            number = int(line.removeprefix("line ")) if line.startswith("line ") else None
            self._move(record, "failed", errors={"object": "list", "data": [
                {"code": "invalid_request", "message": exc.message, "param": "input_file_id",
                 "line": number}]})  # fmt: skip
            return None
        obj["request_counts"] = {"total": len(lines), "completed": 0, "failed": 0}
        for index, answer in self._journal(obj["id"]):
            obj["request_counts"]["completed" if answer["ok"] else "failed"] += 1
            record.answered.add(index)
        if obj["status"] == "validating":
            self._move(record, "in_progress")
        return lines

    async def _run_lines(self, record: StoredBatch, lines: list[BatchLine]) -> None:
        """Every request not answered yet, at most the store's concurrency at once over
        all batches; stops starting them once the batch is cancelling or expired."""
        running: set[asyncio.Task[None]] = set()
        fd = os.open(self._dir / f"{record.object['id']}.answers",
                     os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)  # fmt: skip
        try:
            for line in lines:
                if line.index in record.answered:
                    continue
                await self._slots.acquire()
                if self._stopping(record):
                    self._slots.release()
                    break
                task = asyncio.create_task(self._answer(record, line, fd))
                running.add(task)
                task.add_done_callback(running.discard)
            await asyncio.gather(*running)
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            os.close(fd)

    def _stopping(self, record: StoredBatch) -> bool:
        expires_at: int = record.object["expires_at"]
        return record.object["status"] == "cancelling" or time.time() >= expires_at

    async def _answer(self, record: StoredBatch, line: BatchLine, fd: int) -> None:
        try:
            status, rid, body = await self._request(record, line)
        except Exception:
            logger.exception("batch %s: request %r failed", record.object["id"], line.custom_id)
            status, rid = 500, ""
            body = _SERVER_ERROR
        finally:
            self._slots.release()
        entry = {"i": line.index, "ok": status == 200,
                 "line": output_line(line.custom_id, status, rid, body)}  # fmt: skip
        os.write(fd, orjson.dumps(entry) + b"\n")  # one write: a line whole, or cut
        record.answered.add(line.index)
        record.object["request_counts"]["completed" if status == 200 else "failed"] += 1

    async def _request(self, record: StoredBatch, line: BatchLine) -> tuple[int, str, Any]:
        """The live route's answer to one request: (status, request id, JSON body)."""
        rid = f"req_{uuid.uuid4().hex}"
        model = line.body.get("model")
        if record.models is not None and model not in record.models:
            allowed = sorted(record.models)
            exc = PermissionDenied(f"model: the batch's API key {record.owner!r} may not use "
                                   f"model {model!r}; it may use {allowed}")  # fmt: skip
            return exc.http_status, rid, orjson.loads(replies.error(exc))
        body = orjson.dumps(line.body)
        generative = line.url in GENERATIVE_ENDPOINTS and self._budget is not None
        started = time.monotonic()
        while True:
            if generative and self._budget is not None:
                await self._budget.wait(record.owner)
            request = HttpRequest("POST", line.url, [(b"content-type", b"application/json"),
                                  (b"x-request-id", rid.encode())], body,
                                  models=record.models, owner=record.owner)  # fmt: skip
            reply = await self._handler(request)
            if isinstance(reply, StreamingResponse):  # refused at validation; never here
                await reply.chunks.aclose()  # type: ignore[attr-defined]
                return 500, rid, _SERVER_ERROR
            wait_s = _retry_after(reply)
            if wait_s is None or time.monotonic() - started > _RETRY_FOR_S:
                break
            if self._stopping(record):
                break
            await asyncio.sleep(wait_s)
        answer = _json(reply.body)
        if generative and reply.status == 200 and self._budget is not None:
            usage = answer.get("usage") if isinstance(answer, dict) else None
            tokens = usage.get("total_tokens") if isinstance(usage, dict) else None
            if isinstance(tokens, int):
                await self._budget.charge(record.owner, tokens)
        return reply.status, rid, answer

    async def _finalize(self, record: StoredBatch, lines: list[BatchLine]) -> None:
        obj = record.object
        cancelled = obj["cancelling_at"] is not None
        expired = not cancelled and len(record.answered) < len(lines)
        self._move(record, "finalizing")
        answers = dict(self._journal(obj["id"]))
        outputs, errors = bytearray(), bytearray()
        for line in lines:
            entry = answers.get(line.index)
            if entry is not None:
                target = outputs if entry["ok"] else errors
                target += orjson.dumps(entry["line"]) + b"\n"
            elif expired:
                errors += orjson.dumps(unanswered_line(
                    line.custom_id, "batch_expired",
                    "This request could not be executed before the completion window expired.",
                )) + b"\n"  # fmt: skip
                obj["request_counts"]["failed"] += 1
        batch_id = obj["id"]
        ids: dict[str, Any] = {}
        for name, data in (("output_file_id", outputs), ("error_file_id", errors)):
            if data:
                kind = "output" if name == "output_file_id" else "error"
                stored = await self._files.create(bytes(data), f"{batch_id}_{kind}.jsonl",
                                                  "batch_output", record.owner)  # fmt: skip
                ids[name] = stored.object["id"]
        status = "cancelled" if cancelled else "expired" if expired else "completed"
        self._move(record, status, **ids)
        counts = obj["request_counts"]
        logger.info("batch %s %s: %d succeeded, %d failed", batch_id, status,
                    counts["completed"], counts["failed"])  # fmt: skip


def _retry_after(reply: HttpResponse) -> float | None:
    """Seconds to wait before asking again (None: the answer is final)."""
    if reply.status not in (429, 503):
        return None
    for name, value in reply.headers:
        if name == b"retry-after" and value.strip().isdigit():
            return min(float(value), _RETRY_MAX_WAIT_S)
    return 1.0


def _json(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return body.decode("utf-8", "replace")
