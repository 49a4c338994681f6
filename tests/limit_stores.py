"""The stores that share rate limits between processes, as the tests make them: Redis
(a real ``redis-server``) and the engine's (a real engine host on a Unix socket, each
store with an engine client of its own, as each front end has)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import redis as redis_client

from slipstream.engine.client import EngineClient
from slipstream.engine.host import EngineHost
from slipstream.engine.limit_store import engine_limit_store, limit_calls
from slipstream.errors import TooManyRequests
from slipstream.security.redis_store import RedisStore
from slipstream.security.shared_store import GONE_S, Entry, LocalBackend, RateCheck, SharedStore
from tests.redis_server import RedisServer


class Stores:
    """Makes stores sharing one backend (one per process of a server); ``calls``: the
    backend's calls so far."""

    async def make(self, gone_after_s: float = GONE_S) -> SharedStore:
        raise NotImplementedError

    def calls(self) -> int:
        raise NotImplementedError

    async def close(self) -> None:
        """Closes what :meth:`make` made."""


class RedisStores(Stores):
    def __init__(self, redis: RedisServer) -> None:
        self._redis = redis
        self._stats = redis_client.Redis(port=redis.port)

    async def make(self, gone_after_s: float = GONE_S) -> SharedStore:
        return RedisStore(self._redis.url, gone_after_s)

    def calls(self) -> int:
        stats = self._stats.info("commandstats").get("cmdstat_evalsha", {})
        return int(stats.get("calls", 0))

    async def close(self) -> None:
        self._stats.close()


class _Counted(LocalBackend):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    async def admit(self, checks: list[RateCheck]) -> list[tuple[int, int]]:
        self.calls += 1
        return await super().admit(checks)

    async def enter(self, process: str, gone_ms: int, entries: list[Entry]) -> list[int]:
        self.calls += 1
        return await super().enter(process, gone_ms, entries)

    async def hold(self, process: str, changes: dict[str, int]) -> None:
        self.calls += 1
        await super().hold(process, changes)


class EngineStores(Stores):
    """An engine host answering the limits' calls, in this process, on a socket in
    ``directory``; each store talks to it through an engine client of its own."""

    def __init__(self, directory: Path) -> None:
        self._path = str(directory / "engine")
        self._backend = _Counted()
        self._host = EngineHost(self._path, limit_calls(self._backend))
        self._clients: list[EngineClient] = []

    async def start(self) -> None:
        await self._host.start()

    async def make(self, gone_after_s: float = GONE_S) -> SharedStore:
        client = EngineClient(self._path)
        client.start()
        assert await client.wait_connected(10), "no engine connection"
        self._clients.append(client)
        return engine_limit_store(client, gone_after_s)

    def calls(self) -> int:
        return self._backend.calls

    async def close(self) -> None:
        await asyncio.gather(*(client.close() for client in self._clients))
        await self._host.close()


async def wait_for(admit: Callable[[], Awaitable[bool]], timeout_s: float) -> bool:
    """``admit()`` retried while it is refused with 429, up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await admit()
        except TooManyRequests:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.02)
