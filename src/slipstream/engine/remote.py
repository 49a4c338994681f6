"""The serving core as a front-end process sees it: every call answered by the engine.

:class:`RemoteInferenceService` implements the same contract as the in-process
:class:`~slipstream.serving.core.ModelServer` (``serving/service.py``), so the V2 REST
and gRPC front ends run unchanged on top of it; each method is one call to the engine
process, which runs it on its ``ModelServer`` and answers with the result or the error
(a 404 stays a 404), but ``infer``: the requests of one turn of the event loop go
together (:mod:`slipstream.engine.groups`), and a turn's lone request may wait a
moment for others when more are due (:mod:`slipstream.engine.company`). With several
engines (one per device), a model's calls go to the engine that serves it (a
:class:`ModelRouting` says which); what concerns the whole server (readiness, the
repository index, every model's statistics, shared-memory registrations) is asked of, or
made in, every engine.
Requests carry their tensors as out-of-band frames (:mod:`slipstream.engine.wire`);
shared-memory inputs travel as their region and offset, and the engine reads the
client's region itself, since it holds the registrations.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, Protocol

from slipstream.config import ModelConfig
from slipstream.engine.client import EngineClient
from slipstream.engine.company import Company
from slipstream.engine.groups import Group, answer_gathered, answer_group, answer_groups
from slipstream.engine.host import Call, Gatherer, Stream
from slipstream.engine.traced import (
    infer_stream_traced,
    infer_traced,
    traced_calls,
    traced_streams,
)
from slipstream.engine.wire import request_fields, request_from, response_fields, response_from
from slipstream.errors import SlipstreamError
from slipstream.observability.stats import ModelStats
from slipstream.observability.timestamps import RECORDING
from slipstream.serving.service import InferenceService, StreamItem
from slipstream.types import (
    CudaRegionStatus,
    InferRequest,
    InferResponse,
    ModelMetadata,
    RepositoryEntry,
    ServerMetadata,
    SharedMemoryRegionStatus,
)


class ModelRouting(Protocol):
    """Which of several engines serves a model (server/split.py's, from the repository's
    placement: repository/placement.py)."""

    def engine_of(self, name: str) -> int:
        """The index of the engine serving ``name`` as last read (no I/O: on the hot path);
        the first engine for a name it does not know."""
        ...

    def refresh(self) -> None:
        """Read the repository again (blocking: run it in a thread)."""
        ...


class RemoteInferenceService(InferenceService):
    """:class:`InferenceService` over the front end's :class:`EngineClient` of each engine
    (one but for ``--engines per-device``); see the module docstring."""

    def __init__(
        self,
        clients: list[EngineClient],
        routing: ModelRouting | None = None,
        company: Company | None = None,
    ) -> None:
        if len(clients) > 1 and routing is None:
            raise ValueError("several engines need a routing")
        self._clients = clients
        self._routing = routing
        self._stopping = False
        # The requests of this turn of the event loop for each engine, sent at its end
        # (or, for a lone request waiting for company, when it comes or _held fires).
        self._groups: dict[int, Group] = {}
        # When a lone request waits for others (the default hold unless given).
        self._company = company if company is not None else Company()
        self._held: asyncio.TimerHandle | None = None

    def is_live(self) -> bool:
        """This front end is up (an engine may be restarting: then not ready)."""
        return not self._stopping

    def stop(self) -> None:
        self._stopping = True

    def engine_for(self, name: str) -> EngineClient:
        """The client of the engine serving model ``name``."""
        routing = self._routing
        return self._clients[0 if routing is None else routing.engine_of(name)]

    async def _engine_for_change(self, name: str) -> EngineClient:
        """:meth:`engine_for` as the repository is now: a model to load may be new."""
        if self._routing is not None:
            await asyncio.to_thread(self._routing.refresh)
        return self.engine_for(name)

    async def _each(self, method: str, *args: Any) -> list[Any]:
        """``method`` answered by every engine, in order."""
        return await asyncio.gather(*(client.call(method, *args) for client in self._clients))

    async def is_ready(self) -> bool:
        if self._stopping or not all(client.connected for client in self._clients):
            return False
        return all(await self._each("is_ready"))

    async def server_metadata(self) -> ServerMetadata:
        metadata: ServerMetadata = await self._clients[0].call("server_metadata")
        return metadata

    async def model_ready(self, name: str, version: str = "") -> bool:
        ready: bool = await self.engine_for(name).call("model_ready", name, version)
        return ready

    async def model_metadata(self, name: str, version: str = "") -> ModelMetadata:
        client = self.engine_for(name)
        metadata: ModelMetadata = await client.call("model_metadata", name, version)
        return metadata

    async def model_config(self, name: str, version: str = "") -> ModelConfig:
        config: ModelConfig = await self.engine_for(name).call("model_config", name, version)
        return config

    async def infer(self, request: InferRequest) -> InferResponse:
        """Sent with the other requests of this turn of the loop for the same engine as
        one group (:class:`~slipstream.engine.groups.Group`); answered as the engine's
        ``infer`` answers it alone. A turn's lone request may wait for company: see
        :mod:`slipstream.engine.company`. A traced request goes alone, to bring its
        timestamps back (:mod:`slipstream.engine.traced`)."""
        recording = RECORDING.get()
        if recording is not None:
            return await infer_traced(self.engine_for(request.model_name), request, recording)
        index = 0 if self._routing is None else self._routing.engine_of(request.model_name)
        loop = asyncio.get_running_loop()
        company = self._company
        company.arrived(loop.time())
        try:
            group = self._groups.get(index)
            if group is None:
                group = self._groups[index] = Group(self._clients[index])
                if len(self._groups) == 1 and self._held is None:  # the turn's first
                    loop.call_soon(self._end_turn)
            if self._held is not None and not company.expecting():  # the company came
                self._held.cancel()
                self._held = None
                loop.call_soon(self._send_groups, True)
            answer = group.add(request)
            try:
                return Group.response(await answer)
            except asyncio.CancelledError:
                group.left(answer)
                raise
        finally:
            company.done()

    async def infer_stream(self, request: InferRequest) -> AsyncIterator[StreamItem]:
        """The engine's ``infer_stream``, item by item (a decoupled model's answers)."""
        client = self.engine_for(request.model_name)
        recording = RECORDING.get()
        if recording is not None:
            async with contextlib.aclosing(
                infer_stream_traced(client, request, recording)
            ) as traced:
                async for item in traced:
                    yield item
            return
        answers = client.stream("infer_stream", request_fields(request))
        async for fields, message, final in answers:
            yield (None if fields is None else response_from(fields)), message, final

    def _end_turn(self) -> None:
        """The turn's groups leave now, but a lone request that waits for company."""
        groups = self._groups
        if len(groups) == 1:
            (group,) = groups.values()
            if group.size == 1 and self._company.should_hold():
                loop = asyncio.get_running_loop()
                self._held = loop.call_later(self._company.most_s, self._send_groups, True)
                return
        self._send_groups()

    def _send_groups(self, held: bool = False) -> None:
        """Sends this turn's groups; ``held``: they end a lone request's wait."""
        self._held = None
        groups, self._groups = self._groups, {}
        if held:
            self._company.held(sum(group.size for group in groups.values()) > 1)
        for group in groups.values():
            group.send()

    async def check(self, request: InferRequest) -> None:
        await self.engine_for(request.model_name).call("check", request_fields(request))

    async def model_statistics(self, name: str = "", version: str = "") -> list[ModelStats]:
        if name:
            stats: list[ModelStats] = await self.engine_for(name).call(
                "model_statistics", name, version
            )
            return stats
        return [entry for each in await self._each("model_statistics", "", version)
                for entry in each]  # fmt: skip

    async def repository_index(self, ready_only: bool = False) -> list[RepositoryEntry]:
        entries = [entry for each in await self._each("repository_index", ready_only)
                   for entry in each]  # fmt: skip
        return sorted(entries, key=lambda entry: entry.name)  # stable: versions stay in order

    async def load_model(self, name: str, config: str | None = None) -> None:
        engine = await self._engine_for_change(name)
        await engine.call("load_model", name, config)
        await self._unload_elsewhere(name, engine)

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        engine = await self._engine_for_change(name)
        await engine.call("unload_model", name, unload_dependents)
        await self._unload_elsewhere(name, engine)

    async def _unload_elsewhere(self, name: str, engine: EngineClient) -> None:
        """Unload ``name`` from the engines but ``engine``: a model whose config moved it
        to another device stays loaded where it was (no poll unloads it in explicit
        mode), and requests no longer reach it there."""
        for client in self._clients:
            if client is not engine and await client.call("model_ready", name, ""):
                await client.call("unload_model", name)

    async def rollout(self, name: str, body: dict[str, Any] | None) -> dict[str, Any]:
        status: dict[str, Any] = await self.engine_for(name).call("rollout", name, body)
        return status

    async def region_status(
        self, name: str = "", owner: str = ""
    ) -> list[SharedMemoryRegionStatus]:
        # Every engine holds the same registrations: each reads requests' inputs itself.
        regions: list[SharedMemoryRegionStatus] = await self._clients[0].call(
            "region_status", name, owner
        )
        return regions

    async def register_region(
        self, name: str, key: str, offset: int, byte_size: int, owner: str = ""
    ) -> None:
        await self._register_everywhere(
            "register_region", "unregister_region", name, (key, offset, byte_size), owner
        )

    async def unregister_region(self, name: str = "", owner: str = "") -> None:
        await self._everywhere("unregister_region", name, owner)

    async def cuda_region_status(self, name: str = "", owner: str = "") -> list[CudaRegionStatus]:
        regions: list[CudaRegionStatus] = await self._clients[0].call(
            "cuda_region_status", name, owner
        )
        return regions

    async def register_cuda_region(
        self, name: str, raw_handle: bytes, device_id: int, byte_size: int, owner: str = ""
    ) -> None:
        await self._register_everywhere(
            "register_cuda_region", "unregister_cuda_region", name,
            (raw_handle, device_id, byte_size), owner,
        )  # fmt: skip

    async def unregister_cuda_region(self, name: str = "", owner: str = "") -> None:
        await self._everywhere("unregister_cuda_region", name, owner)

    async def _register_everywhere(
        self, register: str, unregister: str, name: str, args: tuple[Any, ...], owner: str
    ) -> None:
        """Registered in every engine, one after the other; one that refuses (the first
        checks the client's input) undoes the registrations made before it."""
        for index, client in enumerate(self._clients):
            try:
                await client.call(register, name, *args, owner)
            except Exception:
                for before in self._clients[:index]:
                    with contextlib.suppress(SlipstreamError):
                        await before.call(unregister, name, owner)
                raise

    async def _everywhere(self, method: str, *args: Any) -> None:
        outcomes = await asyncio.gather(
            *(client.call(method, *args) for client in self._clients),
            return_exceptions=True,
        )
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome


def engine_calls(service: InferenceService) -> dict[str, Call]:
    """What the engine answers for :class:`RemoteInferenceService`: each method of the
    contract, run on the engine's own ``service`` (its ModelServer)."""
    calls: dict[str, Call] = {
        name: getattr(service, name)
        for name in ("is_ready", "server_metadata", "model_ready", "model_metadata",
                     "model_config", "model_statistics", "repository_index", "load_model",
                     "unload_model", "rollout", "region_status", "register_region",
                     "unregister_region", "cuda_region_status", "register_cuda_region",
                     "unregister_cuda_region")
    }  # fmt: skip

    async def infer(fields: tuple[Any, ...]) -> tuple[Any, ...]:
        return response_fields(await service.infer(request_from(fields)))

    async def check(fields: tuple[Any, ...]) -> None:
        await service.check(request_from(fields))

    calls.update(infer=infer, infer_group=answer_group(service), check=check)
    calls.update(traced_calls(service))
    return calls


def engine_streams(service: InferenceService) -> dict[str, Stream]:
    """The streams the engine answers for :class:`RemoteInferenceService`."""

    async def infer_stream(fields: tuple[Any, ...]) -> AsyncIterator[tuple[Any, ...]]:
        async for response, message, final in service.infer_stream(request_from(fields)):
            yield (None if response is None else response_fields(response)), message, final

    return {"infer_stream": infer_stream, **traced_streams(service)}


def engine_gathered(service: InferenceService) -> dict[str, Gatherer]:
    """The calls the engine answers together when several reach it in one turn of its
    loop (:class:`~slipstream.engine.host.EngineHost`'s ``gathered``): lone ``infer``
    calls, from one front end or several, served as a group; ``infer_group`` calls from
    several front ends, alike entries merged into one stack."""
    return {"infer": answer_gathered(service), "infer_group": answer_groups(service)}
