"""Plain data passed between the parts of the request path.

Protocol decoders build an :class:`InferRequest`; the scheduler and the runtime turn it
into an :class:`InferResponse`; protocol encoders write that back to the wire. Tensors
are numpy arrays throughout (BYTES tensors are ``dtype=object`` arrays of ``bytes``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np


@dataclass(frozen=True, slots=True)
class SharedMemoryRef:
    """Where a tensor lies in a client's registered shared-memory region (Triton's
    shared_memory_region, shared_memory_offset and shared_memory_byte_size)."""

    # The name the region was registered under.
    region: str
    # Bytes from the start of the region to the tensor's data.
    offset: int
    # Bytes of the tensor's data (inputs), or room for it (outputs).
    byte_size: int


@dataclass(frozen=True, slots=True)
class SharedMemoryInput:
    """An input whose data the server reads from a shared-memory region."""

    datatype: str
    shape: list[int]
    ref: SharedMemoryRef


@dataclass(slots=True)
class RequestedOutput:
    """One output the client asked for."""

    name: str
    # True/False: the client asked for binary / JSON encoding of this output;
    # None: follow the request-level default.
    binary_data: bool | None = None
    # Write the output into this region instead of the response.
    shared_memory: SharedMemoryRef | None = None
    # > 0: return the output's top classes instead (Triton's classification extension).
    classification: int = 0


@dataclass(slots=True)
class InferRequest:
    """One inference request, decoded from any wire protocol."""

    model_name: str
    # "" means "let the router pick" (the latest ready version).
    model_version: str
    # Input name -> array; the first dim is the batch dim when the model batches.
    inputs: dict[str, np.ndarray]
    # Client-chosen id, echoed in the response ("" when none was given).
    id: str = ""
    # None means every output of the model, JSON-encoded unless binary_data_output.
    outputs: list[RequestedOutput] | None = None
    # 0 means the model's default priority level; 1 is the highest.
    priority: int = 0
    # 0 means the model's default timeout; otherwise a queue deadline in microseconds.
    timeout_us: int = 0
    # HTTP only: encode every output as binary unless the output says otherwise.
    binary_data_output: bool = False
    # Any other request parameters, passed through untouched.
    parameters: dict[str, Any] = field(default_factory=dict)
    # Inputs to read from shared-memory regions (not yet in ``inputs``): the serving
    # core reads them in before the request is checked against the model.
    shared_memory_inputs: dict[str, SharedMemoryInput] = field(default_factory=dict)
    # Sticky routing (rollouts): requests with one key go to one version. From the
    # X-Slipstream-Route-Key header, the gRPC metadata of that name, or OpenAI's `user`.
    route_key: str = ""
    # The name of the caller's API key ("" on a server without keys): whose
    # shared-memory regions the request may read and write.
    owner: str = ""


@dataclass(slots=True)
class InferResponse:
    """The result of one :class:`InferRequest`."""

    model_name: str
    model_version: str
    # Output name -> array, in the order the outputs should be written.
    outputs: dict[str, np.ndarray]
    id: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    # Outputs already written into the client's shared-memory regions: the response
    # carries their name, datatype and shape only.
    in_shared_memory: frozenset[str] = frozenset()


# -- metadata: what the front ends report about the server and its models ------------


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


@dataclass(frozen=True, slots=True)
class SharedMemoryRegionStatus:
    """A registered system shared-memory region, as the status request lists it."""

    name: str
    # The POSIX shared-memory object holding the region.
    key: str
    # Where the region starts in that object, and its size, in bytes.
    offset: int
    byte_size: int
    # The name of the API key that registered it ("" on a server without keys): only
    # requests with that key see, use or unregister it.
    owner: str = ""


@dataclass(frozen=True, slots=True)
class CudaRegionStatus:
    """A registered CUDA shared-memory region (Triton's cudasharedmemory): device memory
    a client allocated and exported as a CUDA IPC handle."""

    name: str
    # The GPU the memory is on, and its size in bytes.
    device_id: int
    byte_size: int
    # The API key's name that registered it, as for system regions.
    owner: str = ""
    # The handle's 64 bytes (cudaIpcGetMemHandle), kept so that an engine started again
    # can open the memory again; never listed to clients.
    raw_handle: bytes = b""


# -- generation ---------------------------------------------------------------------

# What a constraint holds: a JSON schema (as JSON text), nothing (any JSON object), the
# allowed strings, a regular expression, or a grammar in llama.cpp's GBNF.
ConstraintKind = Literal["json_schema", "json_object", "choice", "regex", "gbnf"]


@dataclass(frozen=True, slots=True)
class Constraint:
    """Decoding limited to texts of a language: every token keeps the text in it."""

    kind: ConstraintKind
    # The schema's JSON text (json_schema), the regex, the grammar's text (gbnf), or ""
    # (json_object, choice).
    source: str = ""
    # The allowed texts (choice).
    choices: tuple[str, ...] = ()
    # json_schema: OpenAI's strict mode (no properties beyond those an object lists).
    strict: bool = False


# Triton's memory kinds (TRITONSERVER_MemoryTypeString), in Triton's order.
MEMORY_TYPES = ("CPU", "CPU_PINNED", "GPU")


@dataclass(frozen=True, slots=True)
class MemoryUsage:
    """Memory of one kind on one device that a model version's instances hold."""

    # "CPU", "CPU_PINNED" or "GPU" (Triton's names).
    type: str
    # The device: 0 for host memory, the GPU's index.
    id: int
    byte_size: int


def total_memory(usages: Iterable[MemoryUsage]) -> list[MemoryUsage]:
    """``usages`` summed per kind and device, in Triton's order (kind, then device)."""
    totals: dict[tuple[str, int], int] = {}
    for usage in usages:
        totals[usage.type, usage.id] = totals.get((usage.type, usage.id), 0) + usage.byte_size
    order = sorted(totals, key=lambda key: (MEMORY_TYPES.index(key[0]), key[1]))
    return [MemoryUsage(kind, device, totals[kind, device]) for kind, device in order]
