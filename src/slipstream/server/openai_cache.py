"""The response cache on the generative routes: a non-streamed completion or chat whose
answer is determined by its request (``temperature: 0``, or a fixed ``seed``), of a model
whose config.yaml says ``response_cache: {enable: true}``, is answered from the server's
``--cache`` when the same request (byte for byte, once its JSON is put in key order) came
before to the same load of that model. The answer is the earlier one, its id included.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import orjson

from slipstream.config import ConfigError
from slipstream.llm.api import GenerationService
from slipstream.llm.engine import GREEDY_BELOW
from slipstream.repository.layout import ModelDirectory, read_config
from slipstream.server.httpd import HttpRequest, HttpResponse, StreamingResponse
from slipstream.serving.cache import ResponseCache

Reply = HttpResponse | StreamingResponse


class GenerationCache:
    """See the module docstring; one per OpenAI app, when the server has a cache."""

    def __init__(self, cache: ResponseCache, llm: GenerationService, repository: Path) -> None:
        self._cache = cache
        self._llm = llm
        self._repository = repository
        # (model, load time) -> whether its config enables the cache.
        self._enabled: dict[tuple[str, int], bool] = {}

    async def answer(
        self, route: str, request: HttpRequest, compute: Callable[[HttpRequest], Awaitable[Reply]]
    ) -> Reply:
        """The cached answer to ``request``, or ``compute``'s (stored when it is a 200)."""
        key = self._key(route, request.body)
        if key is None:
            return await compute(request)
        stored = await self._cache.get(key)
        if stored is not None and "body" in stored:
            return HttpResponse(200, stored["body"].tobytes())
        reply = await compute(request)
        if isinstance(reply, HttpResponse) and reply.status == 200:
            await self._cache.put(key, {"body": np.frombuffer(reply.body, dtype=np.uint8)})
        return reply

    def _key(self, route: str, body: bytes) -> bytes | None:
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
        if loaded is None or not self._model_enabled(model, loaded):
            return None
        digest = hashlib.blake2b(digest_size=20)
        digest.update(f"openai\0{route}\0{model}\0{loaded}\0".encode())
        digest.update(orjson.dumps(data, option=orjson.OPT_SORT_KEYS))
        return digest.digest()

    def _model_enabled(self, model: str, loaded: int) -> bool:
        enabled = self._enabled.get((model, loaded))
        if enabled is None:
            directory = ModelDirectory(name=model, path=self._repository / model, versions=())
            try:
                enabled = read_config(directory).response_cache.enable
            except (ConfigError, OSError):
                enabled = False
            self._enabled[model, loaded] = enabled
        return enabled
