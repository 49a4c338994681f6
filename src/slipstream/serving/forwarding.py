"""An :class:`InferenceService` that hands every call to another: the base of the
services that wrap the serving core for the front ends and change a few calls (the
generative models on the V2 routes, request tracing), so that each states only what it
changes and a method added to the contract is forwarded by all of them at once.

    class Counting(ForwardingService):
        async def infer(self, request):
            self.count += 1
            return await self._inner.infer(request)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from slipstream.config import ModelConfig
from slipstream.observability.stats import ModelStats
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


class ForwardingService(InferenceService):
    """Every call answered by ``inner``; see the module docstring."""

    def __init__(self, inner: InferenceService) -> None:
        self._inner = inner

    def is_live(self) -> bool:
        return self._inner.is_live()

    async def is_ready(self) -> bool:
        return await self._inner.is_ready()

    async def server_metadata(self) -> ServerMetadata:
        return await self._inner.server_metadata()

    async def model_ready(self, name: str, version: str = "") -> bool:
        return await self._inner.model_ready(name, version)

    async def model_metadata(self, name: str, version: str = "") -> ModelMetadata:
        return await self._inner.model_metadata(name, version)

    async def model_config(self, name: str, version: str = "") -> ModelConfig:
        return await self._inner.model_config(name, version)

    async def infer(self, request: InferRequest) -> InferResponse:
        return await self._inner.infer(request)

    async def infer_stream(self, request: InferRequest) -> AsyncIterator[StreamItem]:
        answers = self._inner.infer_stream(request)
        try:
            async for item in answers:
                yield item
        finally:
            aclose = getattr(answers, "aclose", None)
            if aclose is not None:
                await aclose()

    async def infer_group(
        self, requests: Sequence[InferRequest]
    ) -> list[InferResponse | Exception]:
        return await self._inner.infer_group(requests)

    async def infer_stack(
        self, stacked: InferRequest, parts: Sequence[InferRequest], rows: Sequence[int]
    ) -> InferResponse | list[InferResponse | Exception]:
        return await self._inner.infer_stack(stacked, parts, rows)

    async def check(self, request: InferRequest) -> None:
        await self._inner.check(request)

    async def model_statistics(self, name: str = "", version: str = "") -> list[ModelStats]:
        return await self._inner.model_statistics(name, version)

    async def repository_index(self, ready_only: bool = False) -> list[RepositoryEntry]:
        return await self._inner.repository_index(ready_only)

    async def load_model(self, name: str, config: str | None = None) -> None:
        await self._inner.load_model(name, config)

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        await self._inner.unload_model(name, unload_dependents)

    async def rollout(self, name: str, body: dict[str, Any] | None) -> dict[str, Any]:
        return await self._inner.rollout(name, body)

    async def region_status(
        self, name: str = "", owner: str = ""
    ) -> list[SharedMemoryRegionStatus]:
        return await self._inner.region_status(name, owner)

    async def register_region(
        self, name: str, key: str, offset: int, byte_size: int, owner: str = ""
    ) -> None:
        await self._inner.register_region(name, key, offset, byte_size, owner)

    async def unregister_region(self, name: str = "", owner: str = "") -> None:
        await self._inner.unregister_region(name, owner)

    async def cuda_region_status(self, name: str = "", owner: str = "") -> list[CudaRegionStatus]:
        return await self._inner.cuda_region_status(name, owner)

    async def register_cuda_region(
        self, name: str, raw_handle: bytes, device_id: int, byte_size: int, owner: str = ""
    ) -> None:
        await self._inner.register_cuda_region(name, raw_handle, device_id, byte_size, owner)

    async def unregister_cuda_region(self, name: str = "", owner: str = "") -> None:
        await self._inner.unregister_cuda_region(name, owner)
