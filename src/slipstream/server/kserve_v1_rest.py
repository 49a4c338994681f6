"""KServe's V1 REST routes under ``/v1/models``, beside the OpenAI routes that share it.

- ``POST /v1/models/<model>[/versions/<v>]:predict``: decoded by
  :mod:`slipstream.protocol.kserve_v1` into the very request a V2 ``infer`` makes, and run
  by the same service (batcher, statistics, metrics, tracing), so V1 and V2 requests to
  one model batch together. Errors in KServe's shape, ``{"error": "..."}``.
- ``GET /v1/models/<model>``: OpenAI's model object, with KServe's ``name`` and
  ``ready`` added, for a model the OpenAI routes serve; KServe's ``{"name", "ready"}``
  for any other model; 503 with ``"ready": false`` for a model of the repository that is
  not ready (KServe's readiness probe), 404 (OpenAI's error) for no such model.
- ``GET /v1/models``: OpenAI's list (``data``) with KServe's ``models``, the names of
  every model served.

Everything else under ``/v1/models`` is the OpenAI app's. In the split layout the OpenAI
handler is the front end's forwarder and the service the engine link, so a prediction is
decoded in the front end and batched in the engine like a V2 request.

    v1 = KServeV1App(service, openai_app.handle)
    router = Router(v2_app.handle, [("/v1/models", v1.handle), ("/v1/", openai_app.handle)])
"""

from __future__ import annotations

import asyncio
import logging
import time

import orjson

from slipstream.errors import MethodNotAllowed, NotFound, SlipstreamError
from slipstream.names import path_model_name
from slipstream.protocol import kserve_v1, v2
from slipstream.protocol import openai_replies as replies
from slipstream.server.httpd import HttpRequest, HttpResponse, encode_body, error_reply
from slipstream.server.router import Handler, Reply, no_route
from slipstream.serving.service import InferenceService
from slipstream.types import ModelMetadata

logger = logging.getLogger(__name__)

_PREFIX = "/v1/models"
_ROUTE_KEY = b"x-slipstream-route-key"
# A prediction needs its model's input datatypes. Kept this long, a model's metadata is
# read once a second rather than per request: in the split layout each read is a round
# trip to the engine. A reload that changes the inputs is seen within this time; until
# then the engine's own check refuses what no longer fits (400).
_METADATA_TTL_S = 1.0
_MAX_CACHED = 1024


class KServeV1App:
    """See the module docstring; ``openai`` answers what is not KServe's."""

    def __init__(self, service: InferenceService, openai: Handler) -> None:
        self._service = service
        self._openai = openai
        # (model, version) -> (when it expires, its metadata).
        self._metadata: dict[tuple[str, str], tuple[float, ModelMetadata]] = {}

    async def handle(self, request: HttpRequest) -> Reply:
        route = request.path.rstrip("/")
        tail = route[len(_PREFIX) :]
        if tail and not tail.startswith("/"):  # /v1/modelsX: no route of KServe's
            return await self._openai(request)
        if ":" in tail.rpartition("/")[2]:
            return await self._verb(request, tail.removeprefix("/"))
        if request.method in ("GET", "HEAD") and (tail == "" or tail.count("/") == 1):
            try:
                if tail == "":
                    return await self._models(request)
                return await self._model_ready(request, tail[1:])
            except SlipstreamError as exc:  # as the OpenAI app answers these routes
                return error_reply(exc, replies.error(exc))
        return await self._openai(request)

    async def _verb(self, request: HttpRequest, target: str) -> HttpResponse:
        """``<model>[/versions/<v>]:<verb>``, answered in KServe's error shape."""
        try:
            target, _, verb = target.rpartition(":")
            if verb != "predict":
                raise NotFound(f"{request.path}: :{verb} is not served here; use :predict")
            if request.method != "POST":
                raise MethodNotAllowed(
                    f"{request.method} is not allowed on {request.path}; use POST", ["POST"]
                )
            parts = target.split("/")
            if len(parts) == 3 and parts[1] == "versions" and parts[2]:
                return await self._predict(path_model_name(parts[0]), parts[2], request)
            if len(parts) != 1:
                raise no_route(request.method, request.path)
            return await self._predict(path_model_name(parts[0]), "", request)
        except SlipstreamError as exc:
            return error_reply(exc, v2.encode_error(exc.message))
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("unhandled error on %s %s", request.method, request.path)
            return HttpResponse(500, v2.encode_error("internal server error; see the server log"))

    async def _predict(self, name: str, version: str, http: HttpRequest) -> HttpResponse:
        metadata = await self._model_metadata(name, version)
        predict = kserve_v1.decode_predict(http.body, metadata, name, version)
        request = predict.request
        route_key = http.header(_ROUTE_KEY)
        if route_key:
            request.route_key = route_key.decode("latin-1")
        request.owner = http.owner
        # A client that disconnects cancels this task, which drops its queued work.
        response = await self._service.infer(request)
        payload = kserve_v1.encode_predict(response, predict.columnar)
        headers: list[tuple[bytes, bytes]] = []
        accept = http.header(b"accept-encoding")
        if accept is not None:
            payload = encode_body(accept, payload, headers)
        return HttpResponse(200, payload, headers=headers)

    async def _model_metadata(self, name: str, version: str) -> ModelMetadata:
        key = (name, version)
        now = time.monotonic()
        cached = self._metadata.get(key)
        if cached is not None and cached[0] > now:
            return cached[1]
        metadata = await self._service.model_metadata(name, version)
        if len(self._metadata) >= _MAX_CACHED:
            self._metadata.clear()
        self._metadata[key] = (now + _METADATA_TTL_S, metadata)
        return metadata

    async def _models(self, request: HttpRequest) -> Reply:
        """OpenAI's list, with KServe's ``models``: the OpenAI routes' models and every
        model of the repository that is ready or asleep (its next request loads it)."""
        reply = await self._openai(request)
        if not isinstance(reply, HttpResponse) or reply.status != 200:
            return reply
        listing = orjson.loads(reply.body)
        names = {str(card.get("id")) for card in listing.get("data", [])}
        for entry in await self._service.repository_index():
            if entry.state == "READY" or (entry.state, entry.reason) == ("UNAVAILABLE", "idle"):
                names.add(entry.name)
        if request.models is not None:  # only what the caller's key may use
            names &= request.models
        listing["models"] = sorted(names)
        return HttpResponse(200, orjson.dumps(listing))

    async def _model_ready(self, request: HttpRequest, segment: str) -> Reply:
        reply = await self._openai(request)
        if not isinstance(reply, HttpResponse) or reply.status not in (200, 404):
            return reply  # a bad name (400), an engine away (503): as the OpenAI app says
        name = path_model_name(segment)  # valid: the OpenAI app checked it
        if reply.status == 200:  # served on the OpenAI routes (an idle one wakes to a request)
            card = orjson.loads(reply.body)
            card |= {"name": name, "ready": True}
            return HttpResponse(200, orjson.dumps(card))
        if await self._service.model_ready(name):
            return HttpResponse(200, orjson.dumps({"name": name, "ready": True}))
        if not any(entry.name == name for entry in await self._service.repository_index()):
            return reply
        message = f"model {name!r} is not ready; its state is in /v2/repository/index"
        body = {"name": name, "ready": False, "error": message}
        return HttpResponse(503, orjson.dumps(body))
