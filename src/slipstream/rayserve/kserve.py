"""KServe's V1 routes under ``serve --ray``, answered as the plain server answers them
(:mod:`slipstream.server.kserve_v1_rest`).

Ray's HTTP proxy routes ``/v1/...`` to the generative application where there is one,
else to the root: to a front replica, which holds no tensor model. There:

- ``POST /v1/models/<model>[/versions/<v>]:predict`` of a tensor model is relayed, as it
  came, over a Ray Serve handle to a replica of the model's own application
  (:func:`slipstream.rayserve.relay.relay`), whose ``/v1/models`` route is the plain
  server's :class:`~slipstream.server.kserve_v1_rest.KServeV1App` on its serving core:
  a prediction runs in the same batcher as the V2 requests that Ray's proxy hands that
  replica, and they batch together. Any other model's is answered by the front's own
  KServe V1 routes (the generative application's models; 404 for no such model).
- ``GET /v1/models``: OpenAI's list with KServe's ``models``, the models some replica
  reports READY to the board (:mod:`slipstream.rayserve.metrics`) and those scaled to
  zero (a request starts a replica), as the plain server lists the asleep ones.
- ``GET /v1/models/<model>``: ``{"name", "ready": true}`` while some replica of the
  model reports it READY; 503 with ``"ready": false`` while none does; the OpenAI model
  object with both added for a model of the OpenAI routes; 404 for no such model.

    front = KServeFront(applications, board, open_handle, local=v1.handle, openai=openai)
    router = Router(fallback, routes=[("/v1/models", front.handle), ("/v1/", openai)])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from slipstream.errors import InvalidRequest, SlipstreamError
from slipstream.names import path_model_name
from slipstream.protocol import openai_replies
from slipstream.rayserve.relay import relay, relay_handle
from slipstream.server.http_messages import error_reply
from slipstream.server.httpd import HttpRequest, HttpResponse
from slipstream.server.router import Handler, Reply, no_route

_PREFIX = "/v1/models"


@dataclass(frozen=True, slots=True)
class TensorApplications:
    """The tensor models as a front replica knows them (from the repository at start)."""

    # Each one a Ray Serve application of its own, named as the model, at
    # /v2/models/<model>.
    models: frozenset[str] = field(default_factory=frozenset)
    # Those whose ray_serve: min_replicas is 0: no replica while idle, a request starts one.
    scaled_to_zero: frozenset[str] = field(default_factory=frozenset)


class KServeFront:
    """A front replica's ``/v1/models`` routes; see the module doc."""

    def __init__(
        self,
        applications: TensorApplications,
        board: Any,
        open_handle: Callable[[str], Any],
        local: Handler,
        openai: Handler,
    ) -> None:
        """``board``: the Ray actor every replica reports to; ``open_handle``: a model's
        application's Ray Serve DeploymentHandle; ``local``: this replica's KServe V1
        routes; ``openai``: its OpenAI routes."""
        self._applications = applications
        self._board = board
        self._open_handle = open_handle
        self._handles: dict[str, Any] = {}
        self._local = local
        self._openai = openai

    async def handle(self, request: HttpRequest) -> Reply:
        tail = request.path.rstrip("/")[len(_PREFIX) :]
        if tail and not tail.startswith("/"):  # /v1/modelsX: no route of KServe's
            return await self._openai(request)
        if ":" in tail.rpartition("/")[2]:
            model = self._relayed_model(tail[1:])
            if model is None:
                return await self._local(request)
            handle = self._handles.get(model)
            if handle is None:
                handle = self._handles[model] = relay_handle(self._open_handle(model))
            return await relay(handle, request, f"model {model}'s")
        if request.method in ("GET", "HEAD") and (tail == "" or tail.count("/") == 1):
            try:
                if tail == "":
                    return await self._models(request)
                return await self._model_ready(request, tail[1:])
            except SlipstreamError as exc:  # as the OpenAI routes answer these
                return error_reply(exc, openai_replies.error(exc))
        return await self._openai(request)

    def _relayed_model(self, target: str) -> str | None:
        """The tensor model that ``<model>[/versions/<v>]:<verb>`` names, else None."""
        segment = target.rpartition(":")[0].split("/", 1)[0]
        try:
            name = path_model_name(segment)
        except InvalidRequest:  # the local routes answer it, naming the problem
            return None
        return name if name in self._applications.models else None

    async def _ready_models(self) -> set[str]:
        reports = await self._board.reports.remote()
        return {
            entry["name"]
            for report in reports.values()
            for entry in report.index
            if entry.get("state") == "READY"
        }

    async def _models(self, request: HttpRequest) -> Reply:
        reply = await self._openai(request)
        if not isinstance(reply, HttpResponse) or reply.status != 200:
            return reply
        listing = orjson.loads(reply.body)
        names = {str(card.get("id")) for card in listing.get("data", [])}
        names |= await self._ready_models() | self._applications.scaled_to_zero
        listing["models"] = sorted(names)
        return HttpResponse(200, orjson.dumps(listing))

    async def _model_ready(self, request: HttpRequest, segment: str) -> Reply:
        reply = await self._openai(request)
        if not isinstance(reply, HttpResponse) or reply.status not in (200, 404):
            return reply  # a bad name (400): as the OpenAI routes say
        name = path_model_name(segment)  # valid: the OpenAI routes checked it
        if reply.status == 200:
            card = orjson.loads(reply.body) | {"name": name, "ready": True}
            return HttpResponse(200, orjson.dumps(card))
        if name in await self._ready_models():
            return HttpResponse(200, orjson.dumps({"name": name, "ready": True}))
        if name not in self._applications.models:
            return reply
        message = f"model {name!r} is not ready; its state is in /v2/repository/index"
        body = {"name": name, "ready": False, "error": message}
        return HttpResponse(503, orjson.dumps(body))


async def predictions_only(request: HttpRequest) -> Reply:
    """What a model replica's KServe V1 routes hand on: the front relays only
    ``:predict`` to them, so anything else is no route there."""
    exc = no_route(request.method, request.path)
    return error_reply(exc, openai_replies.error(exc))
