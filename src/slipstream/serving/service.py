"""What the HTTP and gRPC front ends ask of the serving core.

Both front ends are thin: they decode the wire format, call one method of an
:class:`InferenceService`, and encode the result or the :class:`SlipstreamError` it
raised. Unknown models raise ModelNotFound; a model that is loading or failed to load
raises Unavailable from ``infer``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from slipstream.config import ModelConfig
from slipstream.errors import ModelNotFound
from slipstream.observability.stats import ModelStats
from slipstream.types import (
    CudaRegionStatus,
    InferRequest,
    InferResponse,
    ModelMetadata,
    RepositoryEntry,
    ServerMetadata,
    SharedMemoryRegionStatus,
)

# One answer of :meth:`InferenceService.infer_stream`: the response (None: a final flag
# alone), the error message sent instead of a response ("" for none), and whether it is
# the request's last.
StreamItem = tuple[InferResponse | None, str, bool]


class ModelLane(Protocol):
    """Models served beside the V2 ones by another part (the LLM lane, llm/api.py).

    The serving core starts a lane with the V2 models, is ready only when every lane is,
    and stops it at shutdown; the lane's own routes do the rest. Structural, so a lane
    never imports the serving core, nor the core the lane.
    """

    async def load_all(self, only: set[str] | None = None) -> None: ...

    def is_ready(self) -> bool: ...

    async def close(self) -> None: ...

    # The repository API (index, load, unload) for the models the lane serves.
    def handles(self, name: str) -> bool:
        """Whether the repository's model ``name`` is one of this lane's."""
        ...

    def index(self, ready_only: bool = False) -> list[RepositoryEntry]: ...

    async def load(self, name: str) -> None:
        """(Re)load ``name``; InvalidRequest naming the error when it fails."""
        ...

    async def unload(self, name: str) -> None: ...


class InferenceService(ABC):
    """The serving core as the front ends see it.

    Every method but ``is_live`` is a coroutine: the core may run in this process
    (:class:`slipstream.serving.core.ModelServer`) or in an engine process behind
    a Unix socket (:class:`slipstream.engine.remote.RemoteInferenceService`), and the front
    ends cannot tell which.
    """

    @abstractmethod
    def is_live(self) -> bool:
        """The process is up and serving requests (V2 health/live)."""

    @abstractmethod
    async def is_ready(self) -> bool:
        """Every model that should be loaded is READY (V2 health/ready)."""

    @abstractmethod
    async def server_metadata(self) -> ServerMetadata: ...

    @abstractmethod
    async def model_ready(self, name: str, version: str = "") -> bool:
        """False for unknown models as well as not-yet-ready ones."""

    @abstractmethod
    async def model_metadata(self, name: str, version: str = "") -> ModelMetadata: ...

    @abstractmethod
    async def model_config(self, name: str, version: str = "") -> ModelConfig:
        """The completed config the model version runs with."""

    @abstractmethod
    async def infer(self, request: InferRequest) -> InferResponse:
        """Validate, queue, batch and run one request; raise SlipstreamError on failure."""

    async def infer_stream(self, request: InferRequest) -> AsyncIterator[StreamItem]:
        """A request's answers as they come: one for most models, any number for a
        decoupled one (:mod:`slipstream.serving.decoupled`), the last flagged final.
        The default answers with :meth:`infer`."""
        yield await self.infer(request), "", True

    async def infer_group(
        self, requests: Sequence[InferRequest]
    ) -> list[InferResponse | Exception]:
        """Requests that arrived together, each answered (or its error given) as
        :meth:`infer` would, in order. The default runs them one by one, concurrently;
        the serving core stacks those on one model into one batcher submission."""

        async def one(request: InferRequest) -> InferResponse | Exception:
            try:
                return await self.infer(request)
            except Exception as exc:
                return exc

        return list(await asyncio.gather(*map(one, requests)))

    async def infer_stack(
        self, stacked: InferRequest, parts: Sequence[InferRequest], rows: Sequence[int]
    ) -> InferResponse | list[InferResponse | Exception]:
        """Requests a front end stacked (:mod:`slipstream.engine.groups`): ``parts``, their
        inputs consecutive ``rows`` of ``stacked``'s. Answers ``stacked``'s response,
        outputs stacked alike, or one answer per part. The default runs the parts one by
        one (:meth:`infer_group`); the serving core queues a stack as one request."""
        return await self.infer_group(unstack(stacked, parts, rows))

    async def check(self, request: InferRequest) -> None:
        """Raise the ClientError (or Unavailable) ``infer`` would raise before running
        ``request``, without running it: an asynchronous job is checked when submitted.
        The default checks nothing (the job fails when run instead)."""
        return None

    @abstractmethod
    async def model_statistics(self, name: str = "", version: str = "") -> list[ModelStats]:
        """Statistics of one model version, every version of a model, or every model."""

    @abstractmethod
    async def repository_index(self, ready_only: bool = False) -> list[RepositoryEntry]: ...

    @abstractmethod
    async def load_model(self, name: str, config: str | None = None) -> None:
        """Load (or reload) a model from the repository; ModelNotFound if absent.
        ``config``: a config override in Triton's JSON form (see ModelServer)."""

    @abstractmethod
    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        """Unload every version of a model; ModelNotFound if it is not in the repository.
        ``unload_dependents`` (Triton's): an ensemble's or cascade's models too, those no
        other one still runs."""

    async def rollout(self, name: str, body: dict[str, Any] | None) -> dict[str, Any]:
        """A model's rollout: its status (``body`` None), or an action on it
        (``{"action": "start", "candidate": "2", ...}``, pause, resume, promote, abort)."""
        raise ModelNotFound("rollouts are not served by this server")

    # -- the client shared-memory regions (Triton's systemsharedmemory and
    # cudasharedmemory extensions; one table of names for both kinds) ---------------
    # ``infer`` reads inputs from them and writes outputs into them. Each region belongs
    # to its ``owner``, the name of the API key that registered it ("" without keys):
    # these calls, and ``infer`` (``InferRequest.owner``), see that owner's regions only.

    @abstractmethod
    async def region_status(
        self, name: str = "", owner: str = ""
    ) -> list[SharedMemoryRegionStatus]:
        """One of ``owner``'s regions (RegionNotFound when absent), or every one
        (``name`` empty)."""

    @abstractmethod
    async def register_region(
        self, name: str, key: str, offset: int, byte_size: int, owner: str = ""
    ) -> None:
        """Register ``byte_size`` bytes at ``offset`` of the POSIX shared-memory object
        ``key`` as ``owner``'s region ``name``; InvalidRequest naming the cause when it
        cannot be."""

    @abstractmethod
    async def unregister_region(self, name: str = "", owner: str = "") -> None:
        """Forget ``owner``'s region ``name`` (every region of ``owner`` when empty)."""

    @abstractmethod
    async def cuda_region_status(self, name: str = "", owner: str = "") -> list[CudaRegionStatus]:
        """:meth:`region_status` of CUDA regions."""

    @abstractmethod
    async def register_cuda_region(
        self, name: str, raw_handle: bytes, device_id: int, byte_size: int, owner: str = ""
    ) -> None:
        """Register the device memory the CUDA IPC handle ``raw_handle`` exports (on GPU
        ``device_id``, ``byte_size`` bytes) as ``owner``'s region ``name``;
        InvalidRequest naming the cause when it cannot be."""

    @abstractmethod
    async def unregister_cuda_region(self, name: str = "", owner: str = "") -> None:
        """:meth:`unregister_region` of CUDA regions."""


def unstack(
    stacked: InferRequest, parts: Sequence[InferRequest], rows: Sequence[int]
) -> list[InferRequest]:
    """Each part of a stack as the request it was, its inputs views of its rows."""
    alone = []
    start = 0
    for part, count in zip(parts, rows, strict=True):
        stop = start + count
        inputs = {name: array[start:stop] for name, array in stacked.inputs.items()}
        alone.append(dataclasses.replace(part, inputs=inputs))
        start = stop
    return alone


def cut(stacked: InferResponse, ids: Sequence[str], rows: Sequence[int]) -> list[InferResponse]:
    """A stack's response as each part's (``ids``, ``rows`` each), its outputs views of
    the part's rows."""
    answers = []
    start = 0
    for request_id, count in zip(ids, rows, strict=True):
        stop = start + count
        outputs = {name: array[start:stop] for name, array in stacked.outputs.items()}
        answers.append(
            InferResponse(stacked.model_name, stacked.model_version, outputs, id=request_id)
        )
        start = stop
    return answers
