"""What the HTTP and gRPC front ends ask of the serving core.

Both front ends are thin: they decode the wire format, call one method of an
:class:`InferenceService`, and encode the result or the :class:`SlipstreamError` it
raised. Unknown models raise ModelNotFound; a model that is loading or failed to load
raises Unavailable from ``infer``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from slipstream.config import ModelConfig
from slipstream.observability.stats import ModelStats
from slipstream.types import InferRequest, InferResponse


@dataclass(frozen=True, slots=True)
class TensorMetadata:
    """A tensor as clients see it in model metadata."""

    name: str
    datatype: str
    # Shape with the batch dim as -1 when the model batches; -1 for other variable dims.
    shape: list[int]


@dataclass(frozen=True, slots=True)
class ModelMetadata:
    name: str
    # Versions currently loaded, ascending, as strings.
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


@dataclass(frozen=True, slots=True)
class ServerMetadata:
    name: str
    version: str
    extensions: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class RepositoryEntry:
    """One model version in the repository index."""

    name: str
    # "" when the model has no loaded or failed version yet.
    version: str
    # READY, LOADING, UNLOADING, UNAVAILABLE, or "" (never loaded).
    state: str
    # Why a version is UNAVAILABLE (its load error), else "".
    reason: str


class InferenceService(ABC):
    """The serving core as the front ends see it."""

    @abstractmethod
    def is_live(self) -> bool:
        """The process is up and serving requests (V2 health/live)."""

    @abstractmethod
    def is_ready(self) -> bool:
        """Every model that should be loaded is READY (V2 health/ready)."""

    @abstractmethod
    def server_metadata(self) -> ServerMetadata: ...

    @abstractmethod
    def model_ready(self, name: str, version: str = "") -> bool:
        """False for unknown models as well as not-yet-ready ones."""

    @abstractmethod
    def model_metadata(self, name: str, version: str = "") -> ModelMetadata: ...

    @abstractmethod
    def model_config(self, name: str, version: str = "") -> ModelConfig:
        """The completed config the model version runs with."""

    @abstractmethod
    async def infer(self, request: InferRequest) -> InferResponse:
        """Validate, queue, batch and run one request; raise SlipstreamError on failure."""

    @abstractmethod
    def model_statistics(self, name: str = "", version: str = "") -> list[ModelStats]:
        """Statistics of one model version, every version of a model, or every model."""

    @abstractmethod
    def repository_index(self, ready_only: bool = False) -> list[RepositoryEntry]: ...

    @abstractmethod
    async def load_model(self, name: str) -> None:
        """Load (or reload) a model from the repository; ModelNotFound if absent."""

    @abstractmethod
    async def unload_model(self, name: str) -> None:
        """Unload every version of a model; ModelNotFound if it is not in the repository."""
