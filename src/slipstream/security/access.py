"""Which role each route needs, and which model it touches.

Roles nest: ``admin`` may do everything ``infer`` may. ``open`` routes (health probes,
the OpenAPI document) need no key; ``metrics`` needs one only with --metrics-need-key.
Every route of the HTTP API (the OpenAPI document the router answers 405s from) and
every gRPC method must be in these tables: tests/integration/test_front_door.py
enumerates them from the router and the gRPC front end, so a new route without a rule
fails there. At run time a path no rule matches exactly is answered 404 by the front
door: the routes read paths more loosely (extra '/'), and such a path must not reach
one past its rule.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from typing import Literal

from slipstream.names import path_model_name
from slipstream.protocol.openapi import openapi_document

Need = Literal["open", "metrics", "key", "infer", "admin"]

# Route template (as in /openapi.json) -> the role it needs.
HTTP_ROUTES: dict[str, Need] = {
    "/v2/health/live": "open",
    "/v2/health/ready": "open",
    "/v2/models/{model}/ready": "open",
    "/v2/models/{model}/versions/{version}/ready": "open",
    "/openapi.json": "open",
    "/metrics": "metrics",
    "/v2": "infer",
    "/v2/models/{model}": "infer",
    "/v2/models/{model}/versions/{version}": "infer",
    "/v2/models/{model}/infer": "infer",
    "/v2/models/{model}/versions/{version}/infer": "infer",
    # Triton's generate extension (server/v2_generate.py).
    "/v2/models/{model}/generate": "infer",
    "/v2/models/{model}/generate_stream": "infer",
    "/v2/models/{model}/versions/{version}/generate": "infer",
    "/v2/models/{model}/versions/{version}/generate_stream": "infer",
    "/v1/models": "infer",
    "/v1/models/{model}": "infer",
    # KServe's V1 protocol (server/kserve_v1_rest.py): inference, as V2's infer.
    "/v1/models/{model}:predict": "infer",
    "/v1/models/{model}/versions/{version}:predict": "infer",
    "/v1/completions": "infer",
    "/v1/chat/completions": "infer",
    "/v1/responses": "infer",
    "/v1/embeddings": "infer",
    # vLLM's scoring routes (rerank at all three of its paths).
    "/v1/score": "infer",
    "/v1/rerank": "infer",
    "/rerank": "infer",
    "/v2/rerank": "infer",
    # vLLM's classification route (outside /v1/, as vLLM answers it).
    "/classify": "infer",
    # OpenAI's files and batches: each key sees and uses its own (an admin key all); a
    # batch's requests are checked against its key's models as they run.
    "/v1/files": "infer",
    "/v1/files/{file_id}": "infer",
    "/v1/files/{file_id}/content": "infer",
    "/v1/batches": "infer",
    "/v1/batches/{batch_id}": "infer",
    "/v1/batches/{batch_id}/cancel": "infer",
    # Asynchronous jobs: submitting one is inference; its status is its result. A job
    # names no model in its path: a key limited to some models may read any job whose
    # id it knows (the server's ids are 128 random bits).
    "/v2/jobs": "infer",
    "/v2/jobs/{job}": "infer",
    "/v2/models/stats": "admin",
    "/v2/models/{model}/stats": "admin",
    "/v2/models/{model}/versions/{version}/stats": "admin",
    "/v2/models/{model}/config": "admin",
    "/v2/models/{model}/versions/{version}/config": "admin",
    "/v2/repository/index": "admin",
    "/v2/repository/models/{model}/load": "admin",
    "/v2/repository/models/{model}/unload": "admin",
    # vLLM's and llama-server's readiness probe.
    "/health": "open",
    # The built-in dashboard shows /metrics: the same rule.
    "/dashboard": "metrics",
    "/dashboard/{file}": "metrics",
    # A version's drift report, like its statistics.
    "/v2/models/{model}/drift": "admin",
    "/v2/models/{model}/versions/{version}/drift": "admin",
    # Rollouts change which version serves: as the repository's load and unload.
    "/v2/models/{model}/rollout": "admin",
    # Shared-memory regions are how co-located clients send inference tensors. Each key
    # has regions of its own (serving/shared_memory.py): a key sees, uses and
    # unregisters only the regions it registered.
    "/v2/systemsharedmemory/status": "infer",
    "/v2/systemsharedmemory/unregister": "infer",
    "/v2/systemsharedmemory/region/{region}/status": "infer",
    "/v2/systemsharedmemory/region/{region}/unregister": "infer",
    "/v2/systemsharedmemory/region/{region}/register": "infer",
    "/v2/cudasharedmemory/status": "infer",
    "/v2/cudasharedmemory/unregister": "infer",
    "/v2/cudasharedmemory/region/{region}/status": "infer",
    "/v2/cudasharedmemory/region/{region}/unregister": "infer",
    "/v2/cudasharedmemory/region/{region}/register": "infer",
    # Triton's logging and trace settings change how the whole server logs: as its
    # configuration (admin), reading them included.
    "/v2/logging": "admin",
    "/v2/trace/setting": "admin",
    "/v2/models/{model}/trace/setting": "admin",
}
# The generative routes: their tokens count against a key's tokens per minute.
GENERATIVE = frozenset(("/v1/completions", "/v1/chat/completions", "/v1/responses"))
# OpenAI routes whose model is the body's "model" field.
MODEL_IN_BODY = frozenset((
    "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/v2/jobs",
    "/v1/score", "/v1/rerank", "/rerank", "/v2/rerank", "/classify",
))  # fmt: skip

# gRPC method of inference.GRPCInferenceService -> (role, the request field naming the
# model, or "" when it names none).
GRPC_METHODS: dict[str, tuple[Need, str]] = {
    "ServerLive": ("open", ""),
    "ServerReady": ("open", ""),
    "ModelReady": ("open", "name"),
    "ServerMetadata": ("infer", ""),
    "ModelMetadata": ("infer", "name"),
    "ModelInfer": ("infer", "model_name"),
    "ModelStreamInfer": ("infer", "model_name"),
    "ModelConfig": ("admin", "name"),
    "ModelStatistics": ("admin", "name"),
    "RepositoryIndex": ("admin", ""),
    "RepositoryModelLoad": ("admin", "model_name"),
    "RepositoryModelUnload": ("admin", "model_name"),
    "SystemSharedMemoryStatus": ("infer", ""),
    "SystemSharedMemoryRegister": ("infer", ""),
    "SystemSharedMemoryUnregister": ("infer", ""),
    "CudaSharedMemoryStatus": ("infer", ""),
    "CudaSharedMemoryRegister": ("infer", ""),
    "CudaSharedMemoryUnregister": ("infer", ""),
    "LogSettings": ("admin", ""),
    "TraceSetting": ("admin", "model_name"),
}


@dataclass(frozen=True, slots=True)
class RouteAccess:
    """What one request path needs."""

    need: Need
    # The route template, "" for a path no route matches.
    template: str = ""
    # The model the path names ("" when none, or when it is in the body).
    model: str = ""
    version: str = ""
    # Whether the route is generative (in GENERATIVE).
    generative: bool = False

    @property
    def model_in_body(self) -> bool:
        return self.template in MODEL_IN_BODY


# A path no rule matches (the front door answers it 404): the strictest role, should
# anything else ever ask.
_UNKNOWN = RouteAccess("admin")
# Paths seen recently -> their access; bounded, cleared when full (paths repeat).
_MAX_CACHED = 4096


@cache
def _patterns() -> tuple[tuple[re.Pattern[str], str], ...]:
    templates = list(openapi_document("")["paths"])
    # Literal templates first: /v2/models/stats is not the model "stats"; then those with
    # a verb: /v1/models/m:predict is not the model "m:predict".
    templates.sort(key=lambda t: ("{" in t, ":" not in t))
    compiled = []
    for template in templates:
        pattern = re.sub(r"\\\{([a-z_]+)\\\}", r"(?P<\1>[^/]+)", re.escape(template))
        compiled.append((re.compile(pattern + "/?"), template))
    return tuple(compiled)


class HttpAccess:
    """Classifies request paths, caching the answers of paths seen before."""

    def __init__(self) -> None:
        # Paths seen -> their access: ``seen.get(path) or classify(path)`` is the lookup
        # of a hot path without a call.
        self.seen: dict[str, RouteAccess] = {}
        missing = [t for _, t in _patterns() if t not in HTTP_ROUTES]
        if missing:
            raise RuntimeError(f"routes without an access rule in security/access.py: {missing}")

    def classify(self, path: str) -> RouteAccess:
        """The access ``path`` needs; InvalidRequest when its model name breaks the rule."""
        access = self.seen.get(path)
        if access is None:
            access = _classify(path)
            if len(self.seen) >= _MAX_CACHED:
                self.seen.clear()
            self.seen[path] = access
        return access


def _classify(path: str) -> RouteAccess:
    for pattern, template in _patterns():
        match = pattern.fullmatch(path)
        if match is not None:
            groups = match.groupdict()
            model = path_model_name(groups["model"]) if "model" in groups else ""
            return RouteAccess(HTTP_ROUTES[template], template, model, groups.get("version", ""),
                               template in GENERATIVE)  # fmt: skip
    return _UNKNOWN
