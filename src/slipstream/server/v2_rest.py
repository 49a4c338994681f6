"""The V2 REST front end: routes an :class:`HttpRequest` to the serving core.

It sits on :mod:`slipstream.server.httpd` rather than a web framework because
the inference route is the hot path: a framework's routing, request objects and
middleware cost more per request than the decode-batch-encode path of a small model.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from slipstream import __version__
from slipstream.errors import InvalidRequest, MethodNotAllowed, ModelNotFound, SlipstreamError
from slipstream.jobs.queue import JobQueue
from slipstream.names import path_model_name
from slipstream.observability.metrics import ServerMetrics
from slipstream.protocol import v2, v2_meta, v2_shm
from slipstream.protocol.openapi import openapi_document
from slipstream.server import dashboard
from slipstream.server.httpd import (
    HttpRequest,
    HttpResponse,
    StreamingResponse,
    encode_body,
    error_reply,
)
from slipstream.server.jobs_rest import JobRoutes, prefers_async
from slipstream.server.router import no_route
from slipstream.server.triton_settings import log_settings_json, trace_settings_json
from slipstream.server.v2_generate import generate
from slipstream.serving.cascade import FAILED_STAGE_PARAMETER, STAGE_PARAMETER
from slipstream.serving.service import InferenceService
from slipstream.serving.shared_memory import check_region_name

logger = logging.getLogger(__name__)

_BINARY = b"application/octet-stream"
_SHARED_MEMORY = ("systemsharedmemory", "cudasharedmemory")
_SHARED_MEMORY_ACTIONS = ("status", "register", "unregister")
_HEADER_LENGTH = b"inference-header-content-length"
# Sticky routing during rollouts: requests with one key run on one version.
_ROUTE_KEY = b"x-slipstream-route-key"
# Which stage of a cascade answered (serving/cascade.py), and the stage that failed when
# an earlier one's answer stands in for it.
_CASCADE_STAGE = b"x-slipstream-cascade-stage"
_CASCADE_FALLBACK = b"x-slipstream-cascade-fallback"


def _json(value: Any) -> HttpResponse:
    return HttpResponse(200, orjson.dumps(value))


def _empty(status: int) -> HttpResponse:
    return HttpResponse(status, b"", b"text/plain")


class V2RestApp:
    """The V2 REST API, Triton's extensions and /metrics, as one request handler."""

    def __init__(
        self,
        service: InferenceService,
        metrics: ServerMetrics,
        drift: Callable[[str, str], Awaitable[dict[str, Any]]] | None = None,
        jobs: JobQueue | None = None,
        metrics_text: Callable[[], Awaitable[bytes]] | None = None,
    ) -> None:
        """``drift``: a version's drift report by (model, version), when monitoring runs;
        ``jobs``: the asynchronous job stream (--jobs-redis), when there is one;
        ``metrics_text``: what /metrics answers (default: ``metrics``' registry; the
        split layout's front ends gather every process's)."""
        self._service = service
        self._jobs = JobRoutes(service, jobs)
        self._metrics = metrics
        self._drift = drift
        self._openapi: bytes | None = None  # built at the first GET /openapi.json
        self._metrics_text = metrics_text or self._local_metrics

    async def _local_metrics(self) -> bytes:
        return generate_latest(self._metrics.registry)

    async def handle(self, request: HttpRequest) -> HttpResponse | StreamingResponse:
        """Answer one request; a SlipstreamError becomes its status and {"error": ...}."""
        try:
            return await self._dispatch(request)
        except SlipstreamError as exc:
            return _error_reply(exc)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("unhandled error on %s %s", request.method, request.path)
            return HttpResponse(500, v2.encode_error("internal server error; see the server log"))

    async def _dispatch(self, request: HttpRequest) -> HttpResponse | StreamingResponse:
        method = request.method
        parts = request.path.strip("/").split("/")
        if "." in parts or ".." in parts:
            raise InvalidRequest(
                f"path {request.path!r}: '.' and '..' segments are not allowed; "
                "name the resource directly, e.g. /v2/models/<model>/ready"
            )
        if parts[0] == "v2":
            if len(parts) >= 3 and parts[1] == "models" and parts[2] != "stats":
                return await self._model_route(method, parts[2:], request)
            if parts[1:2] == ["jobs"]:
                return await self._jobs_route(method, parts[2:], request)
            if len(parts) >= 3 and parts[1] in _SHARED_MEMORY:
                return await self._shared_memory_route(method, parts[1:], request)
            return await self._server_route(method, parts[1:], request)
        if parts == ["health"] and method in ("GET", "HEAD"):
            # vLLM's and llama-server's probe, which tools made for them (guidellm) ask
            # first: readiness, as /v2/health/ready.
            if await self._service.is_ready():
                return HttpResponse(200, b'{"status":"ok"}')
            return HttpResponse(503, b'{"status":"not ready"}')
        if parts[0] == "dashboard" and len(parts) <= 2 and method in ("GET", "HEAD"):
            found = dashboard.asset(parts[1] if len(parts) == 2 else "index.html")
            if found is None:
                raise ModelNotFound(
                    f"{request.path}: no such dashboard file ({', '.join(dashboard.FILES)})"
                )
            return HttpResponse(200, found[0], found[1])
        if parts == ["metrics"] and method in ("GET", "HEAD"):
            body = await self._metrics_text()
            return HttpResponse(200, body, CONTENT_TYPE_LATEST.encode())
        if parts == ["openapi.json"] and method in ("GET", "HEAD"):
            if self._openapi is None:
                self._openapi = orjson.dumps(openapi_document(__version__))
            return HttpResponse(200, self._openapi)
        raise no_route(method, request.path)

    async def _server_route(
        self, method: str, parts: list[str], request: HttpRequest
    ) -> HttpResponse:
        service = self._service
        route = "/".join(parts)
        if route == "logging":
            return HttpResponse(200, log_settings_json(_settings_body(method, request)))
        if route == "trace/setting":
            return HttpResponse(200, trace_settings_json(_settings_body(method, request)))
        if method in ("GET", "HEAD"):
            if route == "":
                return _json(v2_meta.server_metadata_json(await service.server_metadata()))
            if route == "health/live":
                return _empty(200 if service.is_live() else 503)
            if route == "health/ready":
                return _empty(200 if await service.is_ready() else 503)
            if route == "models/stats":
                stats = await service.model_statistics()
                if request.models is not None:  # only what the caller's key may use
                    stats = [entry for entry in stats if entry.name in request.models]
                return _json(v2_meta.model_stats_json(stats))
        if method == "POST" and parts[:1] == ["repository"]:
            return await self._repository_route(parts[1:], request.body, request.models)
        raise no_route(method, f"/v2/{route}")

    async def _repository_route(
        self, parts: list[str], body: bytes, visible: frozenset[str] | None
    ) -> HttpResponse:
        service = self._service
        options = v2.load_json_object(body) if body else {}
        if parts == ["index"]:
            ready_only = options.get("ready", False)
            if type(ready_only) is not bool:
                raise InvalidRequest(f"ready: expected true or false, got {ready_only!r}")
            entries = await service.repository_index(ready_only)
            if visible is not None:  # only what the caller's key may use
                entries = [entry for entry in entries if entry.name in visible]
            return _json(v2_meta.repository_index_json(entries))
        if len(parts) >= 3 and parts[0] == "models" and parts[-1] in ("load", "unload"):
            # Extra segments are a name with '/' in it: refused by name, not "no route".
            name = path_model_name("/".join(parts[1:-1]))
            if parts[-1] == "load":
                parameters = options.get("parameters", {})
                if not isinstance(parameters, dict):
                    raise InvalidRequest(
                        f"parameters: expected an object, got {type(parameters).__name__}"
                    )
                # Triton's load may carry a config override (its JSON form, as a string)
                # and model files ("file:..."); files come from the repository only, and
                # ignoring them would load a model other than the one asked for.
                config = parameters.pop("config", None)
                if config is not None and not isinstance(config, str):
                    raise InvalidRequest(
                        "parameters.config: expected the model config as a JSON string, got "
                        f"{type(config).__name__}"
                    )
                if parameters:
                    names = ", ".join(sorted(parameters))
                    raise InvalidRequest(
                        f"parameters: {names} not supported in a load; put the model's "
                        "files in the model repository and load again"
                    )
                await service.load_model(name, config)
            else:
                parameters = options.get("parameters", {})
                dependents = (
                    parameters.get("unload_dependents", False)
                    if isinstance(parameters, dict)
                    else parameters
                )
                if type(dependents) is not bool:
                    raise InvalidRequest(
                        f"parameters.unload_dependents: expected true or false, got {dependents!r}"
                    )
                await service.unload_model(name, dependents)
            return _empty(200)
        raise no_route("POST", f"/v2/repository/{'/'.join(parts)}")

    async def _jobs_route(
        self, method: str, parts: list[str], request: HttpRequest
    ) -> HttpResponse:
        if not parts and method == "POST":
            return await self._jobs.submit_named(request)
        if len(parts) == 1 and method in ("GET", "HEAD"):
            return await self._jobs.status(unquote(parts[0], errors="replace"))
        raise no_route(method, request.path)

    async def _shared_memory_route(
        self, method: str, parts: list[str], request: HttpRequest
    ) -> HttpResponse:
        # parts: <kind>sharedmemory [region <name>] status|register|unregister
        action = parts[-1]
        # Percent-decoded once, as model names are (tritonclient quotes the name it sends).
        region = (
            unquote(parts[2], errors="replace") if len(parts) == 4 and parts[1] == "region" else ""
        )
        wanted = "GET" if action == "status" else "POST"
        if (
            (len(parts) != 2 and not region)
            or action not in _SHARED_MEMORY_ACTIONS
            or (method != wanted and not (wanted == "GET" and method == "HEAD"))
            or (action == "register" and not region)
        ):
            raise no_route(method, request.path)
        if region:
            check_region_name(region)
        service, owner = self._service, request.owner
        if parts[0] == "cudasharedmemory":
            return await _cuda_shared_memory(service, action, region, request)
        if action == "status":
            regions = await service.region_status(region, owner)
            return HttpResponse(200, v2_shm.status_json(regions))
        if action == "register":
            register = v2_shm.decode_register_json(request.body)
            await service.register_region(
                region, register.key, register.offset, register.byte_size, owner
            )
        else:
            await service.unregister_region(region, owner)
        return _empty(200)

    async def _model_route(
        self, method: str, parts: list[str], request: HttpRequest
    ) -> HttpResponse | StreamingResponse:
        # parts: <model> [versions <v>] [ready|infer|config|stats]
        name, version, rest = path_model_name(parts[0]), "", parts[1:]
        if len(rest) >= 2 and rest[0] == "versions":
            version, rest = rest[1], rest[2:]
        action = rest[0] if len(rest) == 1 else ("" if not rest else "?")
        service = self._service
        if method == "POST" and action == "infer":
            return await self._infer(name, version, request)
        if method == "POST" and action in ("generate", "generate_stream"):
            stream = action == "generate_stream"
            return await generate(service, name, version, request.body, request.owner, stream)
        if rest == ["trace", "setting"] and not version:
            changes = _settings_body(method, request)
            await service.model_metadata(name)  # 404 for a model not served
            return HttpResponse(200, trace_settings_json(changes, name))
        if action == "rollout" and not version and method in ("GET", "HEAD", "POST"):
            body = v2.load_json_object(request.body) if method == "POST" else None
            return _json(await service.rollout(name, body))
        if method in ("GET", "HEAD"):
            if action == "":
                return _json(
                    v2_meta.model_metadata_json(await service.model_metadata(name, version))
                )
            if action == "ready":
                return _empty(200 if await service.model_ready(name, version) else 400)
            if action == "config":
                return _json(v2_meta.model_config_json(await service.model_config(name, version)))
            if action == "stats":
                stats = await service.model_statistics(name, version)
                return _json(v2_meta.model_stats_json(stats))
            if action == "drift":
                await service.model_metadata(name, version)  # 404 / 400 for an unknown one
                if self._drift is None:
                    raise ModelNotFound("drift monitoring is not running in this server")
                return _json(await self._drift(name, version))
        raise no_route(method, request.path)

    async def _infer(self, name: str, version: str, http: HttpRequest) -> HttpResponse:
        if self._jobs.enabled and prefers_async(http):
            return await self._jobs.submit(name, version, http)
        header = http.header(_HEADER_LENGTH)
        header_length = (
            None if header is None else _int_header(header, "Inference-Header-Content-Length")
        )
        request = v2.decode_infer_request(http.body, header_length, name, version)
        route_key = http.header(_ROUTE_KEY)
        if route_key:
            request.route_key = route_key.decode("latin-1")
        request.owner = http.owner
        # A client that disconnects cancels this task, which drops its queued work.
        response = await self._service.infer(request)
        payload, json_length = v2.encode_infer_response(response, request)
        headers = _cascade_headers(response.parameters) if response.parameters else []
        accept = http.header(b"accept-encoding")
        if accept is not None:  # Inference-Header-Content-Length counts the JSON as made
            payload = encode_body(accept, payload, headers)
        if json_length is None:
            return HttpResponse(200, payload, headers=headers)
        headers.append((_HEADER_LENGTH, str(json_length).encode()))
        return HttpResponse(200, payload, _BINARY, headers)


def _cascade_headers(parameters: dict[str, Any]) -> list[tuple[bytes, bytes]]:
    """The X-Slipstream-Cascade-* headers of a cascade's response (none for a model's)."""
    headers = []
    stage = parameters.get(STAGE_PARAMETER)
    if isinstance(stage, str):
        headers.append((_CASCADE_STAGE, stage.encode("latin-1", errors="replace")))
    failed = parameters.get(FAILED_STAGE_PARAMETER)
    if isinstance(failed, str):
        headers.append((_CASCADE_FALLBACK, failed.encode("latin-1", errors="replace")))
    return headers


async def _cuda_shared_memory(
    service: InferenceService, action: str, region: str, request: HttpRequest
) -> HttpResponse:
    """The cudasharedmemory routes (``region`` "" where the path names none)."""
    owner = request.owner
    if action == "status":
        regions = await service.cuda_region_status(region, owner)
        return HttpResponse(200, v2_shm.cuda_status_json(regions))
    if action == "register":
        register = v2_shm.decode_cuda_register_json(request.body)
        await service.register_cuda_region(
            region, register.raw_handle, register.device_id, register.byte_size, owner
        )
    else:
        await service.unregister_cuda_region(region, owner)
    return _empty(200)


def _settings_body(method: str, request: HttpRequest) -> bytes | None:
    """The changes of a POST to the logging or trace settings (b"" for none), None for a
    read; 405 for another method."""
    if method in ("GET", "HEAD"):
        return None
    if method == "POST":
        return request.body
    raise MethodNotAllowed(
        f"{method} is not allowed on {request.path}; use GET or POST", ["GET", "POST"]
    )


def _error_reply(exc: SlipstreamError) -> HttpResponse:
    return error_reply(exc, v2.encode_error(exc.message))


def _int_header(value: bytes, name: str) -> int:
    if not value.strip().isdigit():
        raise InvalidRequest(
            f"header {name}: {value.decode('latin-1')!r} is not a non-negative integer"
        )
    return int(value)
