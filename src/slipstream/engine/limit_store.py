"""The front ends' rate limits kept in the engine process: with ``--frontends N`` and
``--rate-limit-store memory`` (the default), every front end's checks go to the first
engine (:func:`limit_calls` answers them there with a
:class:`~slipstream.security.shared_store.LocalBackend`), so a key's budget and its
requests in flight are one for the whole server, as in one process, not one per front
end. Checks travel together and fast keys take leases, as with Redis
(:mod:`slipstream.security.shared_store`). While the engine is away (restarting) the
limiter fails open or closed as it does for an unreachable Redis; a restarted engine
starts with full budgets.
"""

from __future__ import annotations

from slipstream.engine.client import EngineClient
from slipstream.engine.host import Call
from slipstream.security.shared_store import (
    GONE_S,
    Backend,
    Entry,
    LocalBackend,
    RateCheck,
    SharedStore,
)


class EngineBackend(Backend):
    """The budgets of the engine ``client`` talks to."""

    def __init__(self, client: EngineClient) -> None:
        self._client = client

    async def admit(self, checks: list[RateCheck]) -> list[tuple[int, int]]:
        answers: list[tuple[int, int]] = await self._client.call("limits_admit", checks)
        return answers

    async def enter(self, process: str, gone_ms: int, entries: list[Entry]) -> list[int]:
        entered: list[int] = await self._client.call("limits_enter", process, gone_ms, entries)
        return entered

    async def hold(self, process: str, changes: dict[str, int]) -> None:
        await self._client.call("limits_hold", process, changes)


def engine_limit_store(client: EngineClient, gone_after_s: float = GONE_S) -> SharedStore:
    """A front end's store: the budgets in the engine ``client`` talks to (a front end
    silent for ``gone_after_s`` no longer holds requests in flight there)."""
    return SharedStore(EngineBackend(client), "the engine", gone_after_s)


def limit_calls(backend: LocalBackend | None = None) -> dict[str, Call]:
    """What the engine answers for :class:`EngineBackend` (from every front end)."""
    held = backend if backend is not None else LocalBackend()
    return {"limits_admit": held.admit, "limits_enter": held.enter, "limits_hold": held.hold}
