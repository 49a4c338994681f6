"""Where rollouts persist their state: a file in each model's directory (the default), or
a Redis hash (``--rollout-store redis://host:port[/db]``) for servers whose repository is
read-only (a Kubernetes volume, KServe's storage initializer) or lost with the pod.

Writes are rare (a rollout's transitions) and synchronous: a state a server acted on is
on disk or in Redis before the next request routes by it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Protocol

STATE_FILE = "rollout.json"
# The Redis hash: model name -> its rollout state as JSON.
REDIS_KEY = "slipstream:rollouts"
_REDIS_TIMEOUT_S = 2.0


class StoreError(Exception):
    """The state could not be read or written; the message says where and why."""


class RolloutStore(Protocol):
    def load_all(self) -> dict[str, Any]:
        """Every model's persisted state document (unreadable ones raise StoreError)."""

    def save(self, name: str, document: dict[str, Any]) -> None:
        """Persist ``name``'s state; StoreError when it cannot."""


class FileStore:
    """``REPO/<model>/rollout.json``, written atomically (a crash leaves the old or new)."""

    def __init__(self, repository: Path) -> None:
        self._repository = repository

    def load_all(self) -> dict[str, Any]:
        found = {}
        for path in sorted(self._repository.glob(f"*/{STATE_FILE}")):
            try:
                found[path.parent.name] = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise StoreError(f"{path} cannot be read: {exc}") from None
        return found

    def save(self, name: str, document: dict[str, Any]) -> None:
        path = self._repository / name / STATE_FILE
        temporary = path.with_name(f".{STATE_FILE}.tmp")
        try:
            with temporary.open("w") as file:
                json.dump(document, file, indent=1)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, path)
        except OSError as exc:
            raise StoreError(f"cannot write {path}: {exc}; a read-only repository wants "
                             "--rollout-store redis://...") from None  # fmt: skip


class RedisStore:
    """One hash in Redis, which every server sharing that Redis reads at start."""

    def __init__(self, url: str) -> None:
        from redis import Redis

        self._url = url.split("@")[-1]  # no password in messages
        self._client = Redis.from_url(url, socket_timeout=_REDIS_TIMEOUT_S,
                                      socket_connect_timeout=_REDIS_TIMEOUT_S)  # fmt: skip

    def load_all(self) -> dict[str, Any]:
        from redis.exceptions import RedisError

        try:
            raw = self._client.hgetall(REDIS_KEY)
        except RedisError as exc:
            raise StoreError(f"Redis at {self._url} cannot be read: {exc}") from None
        found = {}
        for field, text in sorted(raw.items()):
            name = field.decode() if isinstance(field, bytes) else str(field)
            try:
                found[name] = json.loads(text)
            except ValueError as exc:
                raise StoreError(f"{REDIS_KEY}[{name!r}] is not JSON: {exc}") from None
        return found

    def save(self, name: str, document: dict[str, Any]) -> None:
        from redis.exceptions import RedisError

        try:
            self._client.hset(REDIS_KEY, name, json.dumps(document))
        except RedisError as exc:
            raise StoreError(f"Redis at {self._url} cannot be written: {exc}") from None


def rollout_store(spec: str, repository: Path) -> RolloutStore:
    """The store ``--rollout-store`` names ("" : the repository's files)."""
    if spec.startswith(("redis://", "rediss://")):
        return RedisStore(spec)
    return FileStore(repository)
