"""The routes whose answer under ``serve --ray`` differs from one server's.

Under Ray a request reaches one replica of one application, so the routes that speak
for the whole server are answered here from what every replica reports to the board
(:mod:`slipstream.rayserve.metrics`), and the routes Ray Serve owns say so:

- ``POST /v2/repository/index``: each model as its replicas report it (READY, version);
  a model none of whose replicas runs (scaled to zero, or still starting) is
  UNAVAILABLE with the reason.
- ``GET /v2/models/stats``: every replica's statistics, summed per model version; a
  model's own ``.../stats`` route adds the other replicas' figures to its replica's own.
- ``POST /v2/repository/models/<model>/load|unload``: 400. Ray Serve runs every model of
  the repository as an application: what runs, and on how many replicas, is the
  repository and each model's ``ray_serve:`` config, read at start. ``GET /v2`` lists
  no ``model_repository(unload_dependents)``.
- ``POST /v2/systemsharedmemory/.../register`` (and CUDA's): 400. A model's replicas run
  in processes of their own, on any Ray node; status and unregister answer (none is
  registered), so a client's clean-up works. ``GET /v2`` lists neither extension.
- ``POST /v2/logging`` and ``.../trace/setting`` with changes, ``POST
  /v2/models/<model>/rollout``: 400. Each replica is a process of its own, with its own
  settings and rollout controller, and the request would change one of them (no request
  is traced either: --trace-config is refused under Ray). Reading them answers, as the
  plain server (without --trace-config) does: :func:`refuse_per_process_changes`, every
  replica's middleware.
- ``GET /v2/models/<model>/drift``: the answering replica's monitor, as the plain
  server's, naming that replica, with the reports the model's other replicas last sent
  (each replica tests the windows of the requests it answers): :class:`ReplicaDrift`.
- ``/v1/embeddings``, vLLM's scoring routes (``/v1/score``, ``/v1/rerank``, ``/rerank``,
  ``/v2/rerank``) and ``/classify``: 404 naming why: their model is a V2 application of
  its own (:func:`no_embeddings_or_scoring`).
- OpenAI's files and batches (``/v1/files``, ``/v1/batches``): 404 naming why: one
  server process keeps them and runs their requests (:func:`no_files_or_batches`).
- A request body over ``--max-request-bytes``: 413, as the plain server answers it.

    root = RootRoutes(service, board, fallback=v2_app.handle)
    router = Router(fallback=v2_app.handle, routes=[("/v2/", root.handle)])
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import orjson

from slipstream.config import ConfigError
from slipstream.errors import InvalidRequest, NotFound, SlipstreamError
from slipstream.monitor.registry import DriftMonitors
from slipstream.protocol import openai_replies, v2, v2_meta, v2_shm
from slipstream.repository.layout import list_models, read_config
from slipstream.server.http_messages import BodyRefused, decode_body, error_reply
from slipstream.server.httpd import HttpRequest, HttpResponse, StreamingResponse
from slipstream.server.openai_rest import RERANK_ROUTES
from slipstream.server.router import no_route
from slipstream.serving.core import ModelServer
from slipstream.types import MemoryUsage, total_memory

Reply = HttpResponse | StreamingResponse
Handler = Callable[[HttpRequest], Awaitable[Reply]]

MODEL_CONTROL_UNDER_RAY = (
    "model {action} is not available under serve --ray: Ray Serve runs every model of "
    "the repository as an application of its own, deployed at start; to change what "
    "runs, change the model repository (and its config.yaml's ray_serve: section for the "
    "replicas) and restart slipstream serve --ray"
)
SHARED_MEMORY_UNDER_RAY = (
    "shared memory is not served under serve --ray: a model's replicas run in Ray worker "
    "processes of their own, on any node of the cluster, where a client's region is not; "
    "send the tensors in the request (binary tensors cost no JSON), or use slipstream "
    "serve without --ray for shared memory"
)
LOGGING_UNDER_RAY = (
    "changing the log settings is not served under serve --ray: each replica logs in a "
    "Ray worker process of its own and this request reaches one of them; start slipstream "
    "serve --ray with the --log-level wanted (Ray keeps the replicas' logs in its session "
    "logs directory)"
)
TRACE_UNDER_RAY = (
    "changing the trace settings is not served under serve --ray: no request is traced "
    "there (--trace-config is not served under --ray), and each replica would keep its "
    "own; trace requests with slipstream serve without --ray"
)
ROLLOUT_UNDER_RAY = (
    "progressive rollouts are not served under serve --ray: each replica of a model runs "
    "its own rollout controller, so one replica would route by the rollout and the others "
    "not; give the versions static weights in the model's config.yaml rollout: section "
    "(every replica follows it), or run the rollout on slipstream serve without --ray"
)
EMBEDDINGS_UNDER_RAY = (
    "/v1/embeddings is not served under serve --ray: each embedding model is a V2 "
    "application of its own (POST /v2/models/<model>/infer takes its token ids); serve "
    "it with slipstream serve, without --ray, for /v1/embeddings"
)
SCORING_UNDER_RAY = (
    "{route} is not served under serve --ray: each cross-encoder, classifier or embedding "
    "model is a V2 application of its own (POST /v2/models/<model>/infer takes its token "
    "ids); serve it with slipstream serve, without --ray, for /v1/score, /v1/rerank and "
    "/classify"
)
BATCHES_UNDER_RAY = (
    "{route} is not served under serve --ray: OpenAI's files and batches are kept by one "
    "server process, which runs each batch's requests and resumes them after a restart, "
    "where Ray spreads the models over replicas on any node; run batches on slipstream "
    "serve without --ray (--frontends N too)"
)
# OpenAI's Files and Batch APIs: any request under them -> 404 why.
FILES_AND_BATCHES = ("/v1/files", "/v1/batches")
# The OpenAI routes whose model would be a V2 application of its own: POST -> 404 why.
NOT_ON_RAY_ROUTES = ("/v1/embeddings", "/v1/score", *sorted(RERANK_ROUTES), "/classify")
_INFER_STATS = ("success", "fail", "queue", "compute_input", "compute_infer",
                "compute_output", "cache_hit", "cache_miss")  # fmt: skip
_BATCH_STATS = ("compute_input", "compute_infer", "compute_output")
_RESPONSE_STATS = ("compute_infer", "compute_output", "success", "fail", "empty_response",
                   "cancel")  # fmt: skip
_SHARED_MEMORY = ("systemsharedmemory", "cudasharedmemory")
# GET /v2 extensions whose routes Ray answers 400 (see the module doc).
_REFUSED_EXTENSIONS = (v2_shm.EXTENSION, v2_shm.CUDA_EXTENSION,
                       "model_repository(unload_dependents)")  # fmt: skip


async def read_body(request: Any, headers: list[tuple[bytes, bytes]], limit: int) -> bytes:
    """The body of a Starlette ``request``, decoded from its Content-Encoding, refused
    (:class:`BodyRefused` 413, worded as the plain server words it) once it is past
    ``limit``: by its Content-Length before a byte is read, else as it streams in."""
    for name, value in headers:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            raise BodyRefused(
                413, f"request body of {int(value)} bytes exceeds the limit of {limit} "
                "bytes (--max-request-bytes)"
            )  # fmt: skip
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyRefused(
                413, f"request body exceeds the limit of {limit} bytes (--max-request-bytes)"
            )
        chunks.append(chunk)
    return decode_body(headers, b"".join(chunks), limit)


async def refuse_per_process_changes(request: HttpRequest, call_next: Handler) -> Reply:
    """Middleware of every replica: a change that would reach one replica's process of
    many (log or trace settings, a rollout) is refused, naming why; a read, or a body
    that is not JSON, goes on to its route."""
    refusal = _refusal(request)
    if refusal is None:
        return await call_next(request)
    exc = InvalidRequest(refusal)
    return error_reply(exc, v2.encode_error(exc.message))


def _refusal(request: HttpRequest) -> str | None:
    parts = request.path.strip("/").split("/")
    if request.method != "POST" or parts[0] != "v2":
        return None
    model_route = parts[3:] if len(parts) >= 4 and parts[1] == "models" else []
    if model_route == ["rollout"]:
        return ROLLOUT_UNDER_RAY
    if parts[1:] == ["logging"]:
        refusal = LOGGING_UNDER_RAY
    elif parts[1:] == ["trace", "setting"] or model_route == ["trace", "setting"]:
        refusal = TRACE_UNDER_RAY
    else:
        return None
    try:
        changes = v2.load_json_object(request.body) if request.body else {}
    except InvalidRequest:  # the route's own answer names the problem
        return None
    return refusal if changes else None


class ReplicaDrift:
    """A replica's ``GET /v2/models/<model>[/versions/<v>]/drift``: its own monitor's
    report (404 as the plain server's without one), with ``replica`` naming it and
    ``other_replicas`` holding each other replica's report of the same version, as last
    sent to the board (up to ``PUSH_INTERVAL_S`` old)."""

    def __init__(self, monitors: DriftMonitors, replica_id: str, board: Any) -> None:
        self._monitors = monitors
        self._replica_id = replica_id
        self._board = board

    async def report(self, model: str, version: str) -> dict[str, Any]:
        own = self._monitors.report(model, version)
        reports = await self._board.reports.remote()
        others = {
            replica: entry
            for replica, report in sorted(reports.items())
            if replica != self._replica_id
            for entry in report.drift
            if (entry["model"], entry["version"]) == (own["model"], own["version"])
        }
        return {**own, "replica": self._replica_id, "other_replicas": others}


async def no_embeddings_or_scoring(request: HttpRequest) -> Reply:
    """``/v1/embeddings`` and the scoring routes (:data:`NOT_ON_RAY_ROUTES`) under Ray:
    a POST is 404 in the OpenAI error format, naming why; another method or path is
    answered as the plain server's OpenAI routes answer it (405, 404)."""
    route = request.path.rstrip("/")
    exc: SlipstreamError
    if request.method != "POST" or route not in NOT_ON_RAY_ROUTES:
        exc = no_route(request.method, request.path)
    elif route == "/v1/embeddings":
        exc = NotFound(EMBEDDINGS_UNDER_RAY)
    else:
        exc = NotFound(SCORING_UNDER_RAY.format(route=route))
    return error_reply(exc, openai_replies.error(exc))


async def no_files_or_batches(request: HttpRequest) -> Reply:
    """OpenAI's files and batches (:data:`FILES_AND_BATCHES`) under Ray: 404 in the OpenAI
    error format, naming why (another path sharing the prefix: as the plain server)."""
    route = request.path.rstrip("/")
    kind = next((p for p in FILES_AND_BATCHES if route == p or route.startswith(p + "/")), "")
    exc = NotFound(BATCHES_UNDER_RAY.format(route=kind)) if kind else no_route(
        request.method, request.path)  # fmt: skip
    return error_reply(exc, openai_replies.error(exc))


def merge_stats(stats: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """V2 statistics entries (``model_stats`` items) of several replicas, summed per
    model version: counts and times add up (per batch size and per response index too),
    as does ``memory_usage`` per kind and device (what every replica holds);
    ``last_inference`` is the latest."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for entry in stats:
        key = (entry["name"], entry["version"])
        total = merged.get(key)
        if total is None:
            merged[key] = orjson.loads(orjson.dumps(entry))  # a copy to add into
            continue
        total["last_inference"] = max(total["last_inference"], entry["last_inference"])
        for field in ("inference_count", "execution_count"):
            total[field] += entry[field]
        _add_durations(total["inference_stats"], entry["inference_stats"], _INFER_STATS)
        batches = {batch["batch_size"]: batch for batch in total["batch_stats"]}
        for batch in entry["batch_stats"]:
            if batch["batch_size"] in batches:
                _add_durations(batches[batch["batch_size"]], batch, _BATCH_STATS)
            else:
                total["batch_stats"].append(orjson.loads(orjson.dumps(batch)))
        total["batch_stats"].sort(key=lambda batch: batch["batch_size"])
        responses = total.setdefault("response_stats", {})
        for index, figures in entry.get("response_stats", {}).items():
            _add_durations(responses.setdefault(index, {}), figures, _RESPONSE_STATS)
        usages = [*total.get("memory_usage", []), *entry.get("memory_usage", [])]
        total["memory_usage"] = [
            {"type": m.type, "id": m.id, "byte_size": m.byte_size}
            for m in total_memory(MemoryUsage(u["type"], u["id"], u["byte_size"]) for u in usages)
        ]
    return [merged[key] for key in sorted(merged)]


def _add_durations(total: dict[str, Any], more: dict[str, Any], names: Iterable[str]) -> None:
    for name in names:
        if name in more:
            into = total.setdefault(name, {"count": 0, "ns": 0})
            into["count"] += more[name]["count"]
            into["ns"] += more[name]["ns"]


def merged_index(
    reported: Iterable[dict[str, str]], known: list[dict[str, str]], repository: Path,
    ready_only: bool,
) -> list[dict[str, str]]:  # fmt: skip
    """The repository index: each model as its replicas report it (``reported``); one
    in the repository (``known``) that no replica reports is UNAVAILABLE, saying why."""
    entries = {tuple(sorted(entry.items())): entry for entry in reported}
    listed = {entry["name"] for entry in entries.values()}
    out = [entry for entry in entries.values() if not ready_only or entry["state"] == "READY"]
    if not ready_only:
        idle = _scaled_to_zero(repository)
        for entry in known:
            if entry["name"] in listed:
                continue
            reason = "no replica of its Ray Serve application is running" + (
                " (ray_serve: min_replicas 0; a request starts one)"
                if entry["name"] in idle
                else " yet"
            )
            out.append({"name": entry["name"], "state": "UNAVAILABLE", "reason": reason})
    return sorted(out, key=lambda entry: (entry["name"], entry.get("version", "")))


def _scaled_to_zero(repository: Path) -> set[str]:
    names = set()
    for name, directory in list_models(repository).items():
        try:
            if read_config(directory).ray_serve.min_replicas == 0:
                names.add(name)
        except (ConfigError, OSError):  # its own application's load reports it
            continue
    return names


class RootRoutes:
    """The root application's server routes that span the applications (see the module
    doc); every other request goes to ``fallback``, the V2 routes of its empty core."""

    def __init__(self, service: ModelServer, board: Any, fallback: Handler) -> None:
        """``board``: the Ray actor every replica reports to."""
        self._service = service
        self._board = board
        self._fallback = fallback

    async def handle(self, request: HttpRequest) -> Reply:
        try:
            return await self._dispatch(request)
        except SlipstreamError as exc:
            return error_reply(exc, v2.encode_error(exc.message))

    async def _dispatch(self, request: HttpRequest) -> Reply:
        parts = request.path.strip("/").split("/")
        reads = request.method in ("GET", "HEAD")
        if reads and parts == ["v2", "models", "stats"]:
            reports = await self._board.reports.remote()
            stats = merge_stats(s for report in reports.values() for s in report.model_stats)
            return HttpResponse(200, orjson.dumps({"model_stats": stats}))
        if reads and parts == ["v2"]:
            metadata = v2_meta.server_metadata_json(await self._service.server_metadata())
            metadata["extensions"] = [extension for extension in metadata["extensions"]
                                      if extension not in _REFUSED_EXTENSIONS]  # fmt: skip
            return HttpResponse(200, orjson.dumps(metadata))
        if request.method != "POST":
            return await self._fallback(request)
        if len(parts) >= 3 and parts[1] in _SHARED_MEMORY and parts[-1] == "register":
            raise InvalidRequest(SHARED_MEMORY_UNDER_RAY)
        if parts[:2] != ["v2", "repository"]:
            return await self._fallback(request)
        if parts[2:] == ["index"]:
            options = v2.load_json_object(request.body) if request.body else {}
            ready_only = options.get("ready", False)
            if type(ready_only) is not bool:
                raise InvalidRequest(f"ready: expected true or false, got {ready_only!r}")
            reports = await self._board.reports.remote()
            known = v2_meta.repository_index_json(await self._service.repository_index())
            repository = self._service.settings.model_repository
            index = await asyncio.to_thread(
                merged_index, (e for report in reports.values() for e in report.index),
                known, repository, ready_only,
            )  # fmt: skip
            return HttpResponse(200, orjson.dumps(index))
        if len(parts) >= 5 and parts[2] == "models" and parts[-1] in ("load", "unload"):
            raise InvalidRequest(MODEL_CONTROL_UNDER_RAY.format(action=parts[-1]))
        return await self._fallback(request)


class ModelStatsRoute:
    """A model replica's ``.../stats`` routes: its own figures (as fresh as can be) plus
    those the model's other replicas last reported."""

    def __init__(self, model: str, replica_id: str, board: Any, handler: Handler) -> None:
        self._model = model
        self._replica_id = replica_id
        self._board = board
        self._handler = handler

    async def handle(self, request: HttpRequest) -> Reply:
        reply = await self._handler(request)
        parts = request.path.strip("/").split("/")[3:]  # after v2/models/<model>
        version = parts[1] if len(parts) == 3 and parts[0] == "versions" else ""
        stats_route = parts == ["stats"] or (bool(version) and parts[2] == "stats")
        if request.method not in ("GET", "HEAD") or not stats_route or reply.status != 200:
            return reply
        assert isinstance(reply, HttpResponse)
        own = orjson.loads(reply.body)["model_stats"]
        reports = await self._board.reports.remote()
        others = [
            entry
            for replica, report in reports.items()
            if replica != self._replica_id
            for entry in report.model_stats
            if entry["name"] == self._model and version in ("", entry["version"])
        ]
        stats = merge_stats([*own, *others])
        return HttpResponse(200, orjson.dumps({"model_stats": stats}), reply.content_type)
