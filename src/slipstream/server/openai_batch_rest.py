"""The routes of OpenAI's Files and Batch APIs, in front of the OpenAI app:

    POST   /v1/files                  multipart: file (JSON Lines), purpose=batch
    GET    /v1/files                  ?purpose, limit, after, order
    GET    /v1/files/{id}             the file object
    GET    /v1/files/{id}/content     its bytes
    DELETE /v1/files/{id}
    POST   /v1/batches                {input_file_id, endpoint, completion_window, metadata}
    GET    /v1/batches                ?after, limit (newest first)
    GET    /v1/batches/{id}
    POST   /v1/batches/{id}/cancel

Every other request goes on to the OpenAI app, whose handler also runs each batch's
requests. One process owns the files and batches: the server's (--frontends 0), else the
(first) engine's, where the front ends forward the OpenAI routes whole. With
--auth-file each file and batch belongs to the key that made it (``request.owner``,
set by the front door); an admin key sees all.

    routes = BatchRoutes(openai_app.handle, BatchSettings(Path("files")), auth_file=None)
    router = Router(v2_app.handle, [("/v1/", routes.handle)])
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs

import orjson
from prometheus_client import CollectorRegistry

from slipstream.errors import InvalidRequest, SlipstreamError, Unavailable
from slipstream.protocol import openai_replies as replies
from slipstream.protocol.openai_batch import (
    PURPOSES,
    CreateBatchRequest,
    check_batch_input,
    list_limit,
    page,
    upload_parts,
)
from slipstream.security.keys import ApiKey, KeyRing, KeysFileError, file_state
from slipstream.security.limits import Limiter
from slipstream.security.metrics import FrontDoorMetrics
from slipstream.security.shared_store import LocalBackend, SharedStore
from slipstream.server.httpd import HttpRequest, HttpResponse, error_reply
from slipstream.server.openai_batches import BatchStore, Handler, TokenBudget
from slipstream.server.openai_files import FilesDirectory, FileStore, Viewer, check_filename
from slipstream.server.router import Reply, no_route

logger = logging.getLogger(__name__)

_PREFIXES = ("/v1/files", "/v1/batches")
# How often the keys file is looked at again (a key's role and limits may change).
_KEYS_CHECK_S = 1.0


@dataclass(frozen=True, slots=True)
class BatchSettings:
    """Where files and batches live and how hard batches may run."""

    files_dir: Path
    # Requests of all batches in flight at once.
    concurrency: int = 4


class KeyView:
    """The keys file as this process last read it (looked at again every second): a
    key's role (an admin sees every owner's files and batches) and its limits."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._ring: KeyRing | None = None
        self._checked = 0.0

    def find(self, name: str) -> ApiKey | None:
        now = time.monotonic()
        if self._ring is None or now - self._checked >= _KEYS_CHECK_S:
            self._checked = now
            if self._ring is None or file_state(self._path) != self._ring.file_state:
                try:
                    self._ring = KeyRing.load(self._path)
                except KeysFileError as exc:
                    logger.error("batches: %s; the keys read before stay in use", exc)
        ring = self._ring
        return next((key for key in ring.keys if key.name == name), None) if ring else None


class LimiterBudget(TokenBudget):
    """A key's tokens per minute in the server's limiter (see :class:`TokenBudget`)."""

    def __init__(self, limiter: Limiter, keys: KeyView) -> None:
        self._limiter = limiter
        self._keys = keys

    async def wait(self, owner: str) -> None:
        while True:
            key = self._keys.find(owner)
            if key is None:
                return
            wait_s = await self._limiter.tokens_wait_s(key)
            if wait_s <= 0:
                return
            await asyncio.sleep(min(wait_s, 5.0))

    async def charge(self, owner: str, tokens: int) -> None:
        key = self._keys.find(owner)
        if key is not None:
            await self._limiter.charge_tokens(key, tokens)


def engine_limiter(auth_file: Path | None, store_url: str, backend: LocalBackend) -> Limiter | None:
    """The limiter an engine process charges batches' tokens to (--frontends N): the
    front ends' budgets, in ``backend`` (this engine's, which they ask) or in Redis."""
    if auth_file is None:
        return None
    if store_url.startswith(("redis://", "rediss://")):
        from slipstream.security.redis_store import RedisStore

        return Limiter(RedisStore(store_url), FrontDoorMetrics(CollectorRegistry()))
    return Limiter(SharedStore(backend, "the engine"), FrontDoorMetrics(CollectorRegistry()))


class BatchRoutes:
    """See the module docstring; :meth:`start` once the models are ready (unfinished
    batches resume), :meth:`stop` at shutdown."""

    def __init__(
        self,
        openai: Handler,
        settings: BatchSettings,
        auth_file: Path | None,
        limiter: Limiter | None = None,
    ) -> None:
        self._openai = openai
        self._directory = FilesDirectory(settings.files_dir)
        self._keys = KeyView(auth_file) if auth_file is not None else None
        budget = LimiterBudget(limiter, self._keys) if limiter and self._keys else None
        self.files = FileStore(self._directory)
        self.batches = BatchStore(self._directory, self.files, openai, settings.concurrency,
                                  budget)  # fmt: skip

    async def handle(self, request: HttpRequest) -> Reply:
        route = request.path.rstrip("/")
        if not route.startswith(_PREFIXES):
            return await self._openai(request)
        try:
            return await self._dispatch(request, route)
        except SlipstreamError as exc:
            return error_reply(exc, replies.error(exc))

    def start(self) -> None:
        try:
            self.batches.resume()
        except Unavailable as exc:
            logger.error("batches cannot resume: %s", exc.message)

    async def stop(self) -> None:
        await self.batches.stop()
        self._directory.close()

    def _viewer(self, request: HttpRequest) -> Viewer:
        if self._keys is None:
            return Viewer(request.owner, admin=True)  # no keys: no owners to keep apart
        key = self._keys.find(request.owner)
        return Viewer(request.owner, admin=key is not None and key.role == "admin")

    async def _dispatch(self, request: HttpRequest, route: str) -> Reply:
        viewer = self._viewer(request)
        method = "GET" if request.method == "HEAD" else request.method
        parts = route.split("/")[2:]  # ["files", id, "content"]
        kind, rest = parts[0], parts[1:]
        if kind == "files":
            if not rest and method == "POST":
                return _ok(await self._upload(request, viewer))
            if not rest and method == "GET":
                return self._list_files(request, viewer)
            if len(rest) == 1 and method == "GET":
                return _ok(self.files.get(rest[0], viewer).object)
            if len(rest) == 1 and method == "DELETE":
                await self.files.delete(rest[0], viewer)
                return _ok({"id": rest[0], "object": "file", "deleted": True})
            if rest[1:] == ["content"] and method == "GET":
                data = await self.files.content(rest[0], viewer)
                return HttpResponse(200, data, b"application/octet-stream")
        elif kind == "batches":
            if not rest and method == "POST":
                body = CreateBatchRequest.parse(request.body)
                return _ok(await self.batches.create(body, viewer, request.models))
            if not rest and method == "GET":
                query = _query(request)
                listed = self.batches.listed(viewer)
                return HttpResponse(200, page(listed, query.get("after"),
                                              list_limit(query, 20, 100)))  # fmt: skip
            if len(rest) == 1 and method == "GET":
                return _ok(self.batches.get(rest[0], viewer))
            if rest[1:] == ["cancel"] and method == "POST":
                return _ok(self.batches.cancel(rest[0], viewer))
        raise no_route(request.method, request.path)

    async def _upload(self, request: HttpRequest, viewer: Viewer) -> dict[str, object]:
        file, purpose = upload_parts(request.header(b"content-type"), request.body)
        name = check_filename(file.filename)
        check_batch_input(file.data)  # 400 naming the line, as OpenAI checks at upload
        stored = await self.files.create(file.data, name, purpose, viewer.name)
        return stored.object

    def _list_files(self, request: HttpRequest, viewer: Viewer) -> HttpResponse:
        query = _query(request)
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise InvalidRequest(f"order: expected 'asc' or 'desc', got {order!r}")
        purpose = query.get("purpose")
        if purpose is not None and purpose not in PURPOSES:
            raise InvalidRequest(f"purpose: expected one of {list(PURPOSES)}, got {purpose!r}")
        listed = self.files.listed(viewer, purpose)
        if order == "desc":
            listed.reverse()
        return HttpResponse(
            200, page(listed, query.get("after"), list_limit(query, 10_000, 10_000))
        )


def _query(request: HttpRequest) -> dict[str, str]:
    return {name: values[-1] for name, values in
            parse_qs(request.query.decode("latin-1"), keep_blank_values=True).items()}  # fmt: skip


def _ok(obj: object) -> HttpResponse:
    return HttpResponse(200, orjson.dumps(obj))


def default_files_dir() -> Path:
    """$XDG_STATE_HOME/slipstream/files, else ~/.local/state/slipstream/files."""
    import os

    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "slipstream" / "files"


def batch_routes(
    openai: Handler,
    files_dir: Path | None,
    concurrency: int,
    auth_file: Path | None,
    limiter: Limiter | None,
) -> BatchRoutes:
    """The server's files and batches routes in front of ``openai`` (see the settings'
    --files-dir, --batch-concurrency, --auth-file)."""
    settings = BatchSettings(files_dir or default_files_dir(), concurrency)
    return BatchRoutes(openai, settings, auth_file, limiter)
