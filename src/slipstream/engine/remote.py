"""The serving core as a front-end process sees it: every call answered by the engine.

:class:`RemoteInferenceService` implements the same contract as the in-process
:class:`~slipstream.serving.core.ModelServer` (``serving/service.py``), so the V2 REST
and gRPC front ends run unchanged on top of it; each method is one call to the engine
process, which runs it on its ``ModelServer`` and answers with the result or the error
(a 404 stays a 404), but ``infer``: the requests of one turn of the event loop go
together (:mod:`slipstream.engine.groups`). Requests carry their tensors as out-of-band frames
(:mod:`slipstream.engine.wire`); shared-memory inputs travel as their region and offset,
and the engine reads the client's region itself, since it holds the registrations.
"""

from __future__ import annotations

import asyncio
from typing import Any

from slipstream.config import ModelConfig
from slipstream.engine.client import EngineClient
from slipstream.engine.groups import Group, answer_gathered, answer_group, answer_groups
from slipstream.engine.host import Call, Gatherer
from slipstream.engine.wire import request_fields, request_from, response_fields
from slipstream.observability.stats import ModelStats
from slipstream.serving.service import InferenceService
from slipstream.types import (
    InferRequest,
    InferResponse,
    ModelMetadata,
    RepositoryEntry,
    ServerMetadata,
    SharedMemoryRegionStatus,
)


class RemoteInferenceService(InferenceService):
    """:class:`InferenceService` over an :class:`EngineClient`; see the module docstring."""

    def __init__(self, client: EngineClient) -> None:
        self._client = client
        self._stopping = False
        # The requests of this turn of the event loop, sent at its end.
        self._group: Group | None = None

    def is_live(self) -> bool:
        """This front end is up (the engine may be restarting: then not ready)."""
        return not self._stopping

    def stop(self) -> None:
        self._stopping = True

    async def is_ready(self) -> bool:
        if self._stopping or not self._client.connected:
            return False
        ready: bool = await self._client.call("is_ready")
        return ready

    async def server_metadata(self) -> ServerMetadata:
        metadata: ServerMetadata = await self._client.call("server_metadata")
        return metadata

    async def model_ready(self, name: str, version: str = "") -> bool:
        ready: bool = await self._client.call("model_ready", name, version)
        return ready

    async def model_metadata(self, name: str, version: str = "") -> ModelMetadata:
        metadata: ModelMetadata = await self._client.call("model_metadata", name, version)
        return metadata

    async def model_config(self, name: str, version: str = "") -> ModelConfig:
        config: ModelConfig = await self._client.call("model_config", name, version)
        return config

    async def infer(self, request: InferRequest) -> InferResponse:
        """Sent with the other requests of this turn of the loop as one group
        (:class:`~slipstream.engine.groups.Group`); answered as the engine's ``infer``
        answers it alone."""
        group = self._group
        if group is None:
            group = self._group = Group(self._client)
            asyncio.get_running_loop().call_soon(self._send_group)
        answer = group.add(request)
        try:
            return Group.response(await answer)
        except asyncio.CancelledError:
            group.left(answer)
            raise

    def _send_group(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            group.send()

    async def check(self, request: InferRequest) -> None:
        await self._client.call("check", request_fields(request))

    async def model_statistics(self, name: str = "", version: str = "") -> list[ModelStats]:
        stats: list[ModelStats] = await self._client.call("model_statistics", name, version)
        return stats

    async def repository_index(self, ready_only: bool = False) -> list[RepositoryEntry]:
        entries: list[RepositoryEntry] = await self._client.call("repository_index", ready_only)
        return entries

    async def load_model(self, name: str) -> None:
        await self._client.call("load_model", name)

    async def unload_model(self, name: str) -> None:
        await self._client.call("unload_model", name)

    async def rollout(self, name: str, body: dict[str, Any] | None) -> dict[str, Any]:
        status: dict[str, Any] = await self._client.call("rollout", name, body)
        return status

    async def region_status(
        self, name: str = "", owner: str = ""
    ) -> list[SharedMemoryRegionStatus]:
        regions: list[SharedMemoryRegionStatus] = await self._client.call(
            "region_status", name, owner
        )
        return regions

    async def register_region(
        self, name: str, key: str, offset: int, byte_size: int, owner: str = ""
    ) -> None:
        await self._client.call("register_region", name, key, offset, byte_size, owner)

    async def unregister_region(self, name: str = "", owner: str = "") -> None:
        await self._client.call("unregister_region", name, owner)


def engine_calls(service: InferenceService) -> dict[str, Call]:
    """What the engine answers for :class:`RemoteInferenceService`: each method of the
    contract, run on the engine's own ``service`` (its ModelServer)."""
    calls: dict[str, Call] = {
        name: getattr(service, name)
        for name in ("is_ready", "server_metadata", "model_ready", "model_metadata",
                     "model_config", "model_statistics", "repository_index", "load_model",
                     "unload_model", "rollout", "region_status", "register_region",
                     "unregister_region")
    }  # fmt: skip

    async def infer(fields: tuple[Any, ...]) -> tuple[Any, ...]:
        return response_fields(await service.infer(request_from(fields)))

    async def check(fields: tuple[Any, ...]) -> None:
        await service.check(request_from(fields))

    calls.update(infer=infer, infer_group=answer_group(service), check=check)
    return calls


def engine_gathered(service: InferenceService) -> dict[str, Gatherer]:
    """The calls the engine answers together when several reach it in one turn of its
    loop (:class:`~slipstream.engine.host.EngineHost`'s ``gathered``): lone ``infer``
    calls, from one front end or several, served as a group; ``infer_group`` calls from
    several front ends, alike entries merged into one stack."""
    return {"infer": answer_gathered(service), "infer_group": answer_groups(service)}
