"""The response cache on the generative routes: a non-streamed completion or chat whose
answer is determined by its request (``temperature: 0``, or a fixed ``seed``), of a model
whose config.yaml says ``response_cache: {enable: true}``, is answered from the server's
``--cache`` when the same request (byte for byte, once its JSON is put in key order) came
before to the same load of that model. The answer is the earlier one, its id included.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import orjson

from slipstream.config import ConfigError
from slipstream.llm.api import GenerationService
from slipstream.llm.engine import GREEDY_BELOW
from slipstream.observability.metrics import CacheCounts, ServerMetrics
from slipstream.repository.layout import read_config, read_model_directory
from slipstream.server.httpd import HttpRequest, HttpResponse, StreamingResponse
from slipstream.serving.cache import CacheEntry, ResponseCache

Reply = HttpResponse | StreamingResponse


class GenerationCache:
    """See the module docstring; one per OpenAI app, when the server has a cache."""

    def __init__(
        self,
        cache: ResponseCache,
        llm: GenerationService,
        repository: Path,
        metrics: ServerMetrics | None = None,
    ) -> None:
        """``metrics``: where hits and misses are counted (Triton's nv_cache_* series)."""
        self._cache = cache
        self._llm = llm
        self._repository = repository
        self._metrics = metrics
        # (model, load time) -> whether its config enables the cache, and its counts.
        self._enabled: dict[tuple[str, int], tuple[bool, CacheCounts | None]] = {}

    async def answer(
        self, route: str, request: HttpRequest, compute: Callable[[HttpRequest], Awaitable[Reply]]
    ) -> Reply:
        """The cached answer to ``request``, or ``compute``'s (stored when it is a 200).
        Durations are Triton's: the lookup for a hit, lookup plus insertion for a miss
        (not the generation)."""
        keyed = self._key(route, request.body)
        if keyed is None:
            return await compute(request)
        key, counts = keyed
        started_ns = time.perf_counter_ns()
        stored = await self._cache.get(key)
        looked_up_ns = time.perf_counter_ns() - started_ns
        if stored is not None and "body" in stored.outputs:
            if counts is not None:
                counts.cache_hits += 1
                counts.cache_hit_us += looked_up_ns / 1e3
            return HttpResponse(200, stored.outputs["body"].tobytes())
        reply = await compute(request)
        stored_ns = 0
        if isinstance(reply, HttpResponse) and reply.status == 200:
            started_ns = time.perf_counter_ns()
            body = np.frombuffer(reply.body, dtype=np.uint8)
            await self._cache.put(key, CacheEntry({"body": body}))
            stored_ns = time.perf_counter_ns() - started_ns
        if counts is not None:
            counts.cache_misses += 1
            counts.cache_miss_us += (looked_up_ns + stored_ns) / 1e3
        return reply

    def _key(self, route: str, body: bytes) -> tuple[bytes, CacheCounts | None] | None:
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None  # the route answers the 400
        if not isinstance(data, dict) or data.get("stream"):
            return None
        seed, temperature = data.get("seed"), data.get("temperature")
        # Greedy (as SamplingParams.greedy) or seeded: the same request, the same answer.
        greedy = isinstance(temperature, int | float) and 0 <= temperature < GREEDY_BELOW
        deterministic = type(seed) is int or greedy
        model = data.get("model")
        if not deterministic or not isinstance(model, str):
            return None
        # Served models only (so the name is a checked one), at their current load.
        loaded = dict(self._llm.models()).get(model)
        if loaded is None:
            return None
        enabled, counts = self._model_enabled(model, loaded)
        if not enabled:
            return None
        digest = hashlib.blake2b(digest_size=20)
        digest.update(f"openai\0{route}\0{model}\0{loaded}\0".encode())
        digest.update(orjson.dumps(data, option=orjson.OPT_SORT_KEYS))
        return digest.digest(), counts

    def _model_enabled(self, model: str, loaded: int) -> tuple[bool, CacheCounts | None]:
        known = self._enabled.get((model, loaded))
        if known is None:
            enabled, version = False, ""
            try:
                directory = read_model_directory(self._repository / model)
                config = read_config(directory)
                enabled = config.response_cache.enable
                # The version the lane serves: the newest its policy selects (llm/service.py).
                version = str(
                    max(config.version_policy.select(list(directory.versions)), default="")
                )
            except (ConfigError, OSError):
                pass
            counts = None
            if enabled and self._metrics is not None:
                counts = self._metrics.generative_cache(model, version)
            known = self._enabled[model, loaded] = (enabled, counts)
        return known
