"""The contract every runtime backend fulfils.

A :class:`Backend` is one loaded copy (an *instance*) of a model file. The scheduler owns
several instances of a model version and hands each one batch at a time:

* ``signature()`` tells what the file itself declares: input and output names, V2
  datatypes and full shapes (batch dim included, -1 for variable dims). The repository
  completes a missing ``config.yaml`` from it, as Triton's auto-complete does.
* ``run(inputs, output_names)`` executes one batch. ``inputs`` maps every input name to
  an array whose first dim is the batch when the model batches; the result maps each
  requested output name to an array with the same leading batch dim. ``run`` is called
  from one thread at a time per instance, never from the event loop when
  ``releases_gil`` is True (ONNX Runtime, torch): those get a dedicated thread each, so
  the event loop keeps accepting requests while a batch computes.
* ``close()`` frees what the instance holds.
* A backend with ``takes_requests`` (Triton's Python backend) is handed a batch as its
  requests instead, each with its own tensors and :class:`RequestContext` (id,
  parameters, requested outputs, sequence), through ``run_requests``; ``run`` serves the
  warm-up and ``slipstream profile``. ``attach`` gives it the server's own inference
  call, for models that call other models.

Backends raise :class:`slipstream.errors.InvalidRequest` for inputs the model refuses
(wrong rank, out-of-range values the runtime rejects: :mod:`slipstream.runtime.data_errors`
tells those apart from faults); any other exception fails the batch as an internal error.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from slipstream.types import MemoryUsage

if TYPE_CHECKING:
    import asyncio

    from slipstream.types import InferRequest, InferResponse

# The server's own inference call (routing, batching, statistics), for backends whose
# models call other models.
LocalInfer = Callable[["InferRequest"], Awaitable["InferResponse"]]


# A decoupled model's answer: its outputs (None: no response), an error instead, whether
# it is the last, and the parameters the response carries (a Python model's).
Respond = Callable[[dict[str, np.ndarray] | None, Exception | None, bool, Mapping[str, Any]], None]


@dataclass(frozen=True, slots=True)
class RequestContext:
    """What a backend that takes requests one by one sees of a client request besides
    its tensors (``Backend.takes_requests``)."""

    # The client's request id ("" where none was given).
    id: str = ""
    # The request's own parameters (a sequence's controls excluded).
    parameters: Mapping[str, Any] = field(default_factory=dict)
    # The outputs the client asked for; None: every output.
    outputs: tuple[str, ...] | None = None
    # A stateful model's sequence id (0: none), and whether this request starts or
    # ends its sequence.
    correlation_id: int | str = 0
    sequence_start: bool = False
    sequence_end: bool = False
    # A decoupled model's way to answer, from any thread, any number of times: the
    # outputs (None: no response), an error instead, and whether it is the last.
    respond: Respond | None = None
    # Whether the client has gone before the last answer (a decoupled request's stream
    # closed): the model may stop making answers nobody reads. None: never.
    cancelled: Callable[[], bool] | None = None
    # Written by the backend as it answers: the parameters its response carries (a
    # Python model's InferenceResponse(parameters=...)), sent to the client.
    response_parameters: dict[str, Any] = field(default_factory=dict)
    # Called on the instance's thread as execute takes a decoupled request: its first
    # response is timed from here (Triton's response statistics). None: not asked.
    started: Callable[[], None] | None = None


@dataclass(frozen=True, slots=True)
class InstancePlace:
    """Which instance of its model a loaded instance is, as Triton names it."""

    # Triton's instance name: its group's name (by default ``<model>_<group index>``),
    # ``_`` and its index in the group.
    name: str
    # Triton's instance kind: "CPU" or "GPU".
    kind: str
    # The device the instance runs on (0 for the CPU).
    device_id: int


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor as the model file declares it."""

    name: str
    # V2 datatype name: FP32, INT64, BYTES, ...
    datatype: str
    # Full shape including the batch dim; -1 marks a variable dim.
    shape: tuple[int, ...]
    # Other datatypes a config may declare for it, the backend converting (a bfloat16
    # tensor of a torch program is FP32 by default, BF16 where the config says so).
    also: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ModelSignature:
    """Inputs and outputs of a model file, in declaration order."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    # The most rows one run of the file takes along its batch dim (a torch.export
    # ``Dim("batch", max=N)``); None where the file sets no bound. The backend splits a
    # larger batch into runs of at most this many rows.
    max_batch_size: int | None = None
    # The file asks for dynamic batching (a Python model's auto_complete_config calls
    # set_dynamic_batching): its requests share runs even where the config has none.
    dynamic_batching: bool = False

    @property
    def batch_dim_is_dynamic(self) -> bool:
        """True when every input and output has a variable first dim (a batch axis)."""
        specs = self.inputs + self.outputs
        return bool(specs) and all(s.shape and s.shape[0] == -1 for s in specs)


class Backend(ABC):
    """One loaded instance of a model; see the module docstring for the contract."""

    # Backend name as written in config.yaml's ``backend:``.
    name: ClassVar[str]
    # Model file extensions this backend is the default for.
    file_extensions: ClassVar[tuple[str, ...]] = ()
    # True when run() releases the GIL, so it gets a dedicated thread per instance.
    releases_gil: ClassVar[bool] = True
    # For pickle-based files (see loads_pickle): how to save the model without pickle.
    pickle_free_format: ClassVar[str] = "export the model to ONNX (model.onnx)"
    # Whether a fault on the default warm-up's zero-filled request is one every request
    # would meet (it then fails the load); False where run() is the user's own code,
    # which may fault on zeros and serve real data.
    warm_up_faults_are_fatal: ClassVar[bool] = True
    # Whether the scheduler hands it each batch as its requests (run_requests), never
    # merged, and never on the event loop's own thread.
    takes_requests: ClassVar[bool] = False

    @classmethod
    def loads_pickle(cls, path: Path) -> bool:
        """Whether loading ``path`` unpickles it (runs code from the file).

        Such files load only when the model opts in (``trust_pickle``); see
        :mod:`slipstream.runtime.pickles`.
        """
        return False

    @classmethod
    @abstractmethod
    def load(cls, path: Path, parameters: dict[str, str], instance_count: int) -> Backend:
        """Load one instance from ``path`` with backend options from config ``parameters``.

        ``instance_count`` is how many instances of this model will run side by side,
        so thread pools can be sized to share the cores between them.
        """

    @abstractmethod
    def signature(self) -> ModelSignature:
        """Inputs and outputs declared by the model file."""

    @abstractmethod
    def run(
        self, inputs: dict[str, np.ndarray], output_names: Sequence[str]
    ) -> dict[str, np.ndarray]:
        """Execute one batch and return the requested outputs."""

    def run_requests(
        self,
        requests: Sequence[tuple[dict[str, np.ndarray], RequestContext]],
        output_names: Sequence[str],
    ) -> list[dict[str, np.ndarray] | BaseException]:
        """Where ``takes_requests``: execute one batch given as its requests; per request,
        its outputs or what failed it."""
        raise NotImplementedError(f"the {self.name} backend runs batches (run)")

    def attach(self, infer: LocalInfer, loop: asyncio.AbstractEventLoop) -> None:  # noqa: B027
        """Called at load with the server's inference call and the event loop it runs on
        (a Python model's ``InferenceRequest.exec``); most backends need neither."""

    def place(self, place: InstancePlace) -> None:  # noqa: B027 - most need nothing
        """Called before :meth:`configure` with which instance of its model this is."""

    def is_ready(self) -> bool:
        """Whether this loaded instance can serve now, asked (off the event loop) on each
        model-readiness query; a Python model's own ``is_ready``. Most always can."""
        return True

    def configure(self, config: dict[str, Any]) -> None:  # noqa: B027 - most need nothing
        """Called once the model's config is completed, before warm-up, with it in
        Triton's JSON form (a Python model's ``initialize`` reads it)."""

    def close(self) -> None:  # noqa: B027 - most backends hold nothing to free explicitly
        """Free what this instance holds."""

    def memory_usage(self) -> list[MemoryUsage]:
        """What this loaded instance holds, where the backend can say (Triton's
        ``memory_usage`` statistics): ONNX Runtime its model's initializers, torch its
        module's parameters and buffers. Empty where nothing honest can be said."""
        return []

    @property
    def cpu_threads(self) -> int | None:
        """The CPU threads this instance's next run uses, where the backend follows the
        host's load (``slipstream_model_cpu_threads``); None where it does not say."""
        return None


def instance_places(config: Mapping[str, Any]) -> list[InstancePlace]:
    """Each instance's place, in load order, from a completed config in Triton's JSON form
    (its ``instance_group``: groups named, kinds as Slipstream runs them)."""
    device = str((config.get("parameters") or {}).get("device", {}).get("string_value", ""))
    _, _, number = device.partition(":")  # "cuda:1": the GPU a torch model runs on
    places: list[InstancePlace] = []
    for group in config.get("instance_group", []):
        gpu = group.get("kind") == "KIND_GPU"
        places.extend(
            InstancePlace(
                f"{group['name']}_{index}",
                "GPU" if gpu else "CPU",
                int(number) if gpu and number.isdigit() else 0,
            )
            for index in range(int(group.get("count", 1)))
        )
    return places


class BackendUnavailable(RuntimeError):
    """The backend's optional dependency is not installed; the message names the extra."""


def check_cpu_device(backend: str, parameters: Mapping[str, str]) -> None:
    """Refuse a ``parameters.device`` other than ``cpu`` for a backend that runs on the CPU
    only: the key is read for every model (where its engine runs), and ``cuda`` would
    otherwise run on the CPU without a word."""
    device = parameters.get("device")
    if device is not None and device.strip().lower() != "cpu":
        raise ValueError(
            f"parameters.device: {device!r}; the {backend} backend runs on the CPU here, so "
            'it takes "cpu" only (serve the model with backend: torch to run it on a GPU)'
        )


def usable_cpu_count() -> int:
    """Cores this process may run on: its affinity (taskset, cpusets), capped by its
    cgroup's CPU quota (a container's ``cpu.max``, a Kubernetes CPU limit), rounded up."""
    import math
    import os

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    quota = cgroup_file("cpu.max")
    if quota is not None:
        try:
            limit, period = quota.read_text().split()
            if limit != "max":
                cores = min(cores, max(1, math.ceil(int(limit) / int(period))))
        except (OSError, ValueError):
            pass
    return cores


def cgroup_file(name: str) -> Path | None:
    """``name`` in this process's cgroup v2 directory, where there is one."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                path = Path("/sys/fs/cgroup") / line[3:].lstrip("/") / name
                return path if path.is_file() else None
    except OSError:
        pass
    return None
