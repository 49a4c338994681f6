"""One loaded model version: its completed config, instances, batcher and request checks."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from slipstream.config import ConfigError, ModelConfig, TensorConfig, WarmupSample
from slipstream.datatypes import V2_TO_NUMPY, numpy_dtype, v2_datatype
from slipstream.errors import Decoupled, InvalidRequest
from slipstream.observability.metrics import ModelMetrics
from slipstream.observability.stats import ModelStatsRecorder
from slipstream.protocol.v2_meta import model_config_json
from slipstream.repository.autocomplete import complete_config
from slipstream.runtime import backend_for_file, get_backend
from slipstream.runtime.base import (
    Backend,
    LocalInfer,
    RequestContext,
    Respond,
    instance_places,
)
from slipstream.runtime.pickles import check_pickle_trust
from slipstream.scheduling.batcher import Batcher
from slipstream.serving.classification import load_labels
from slipstream.serving.reshaping import reshaping
from slipstream.serving.sequences import Sequences
from slipstream.serving.taps import ResponseTap
from slipstream.types import InferRequest, ModelMetadata, TensorMetadata

logger = logging.getLogger(__name__)

ShapeKey = tuple[tuple[int, ...], ...]

# Output datatypes that have no classes to rank (Triton's classification refuses them).
_NOT_CLASSES = frozenset({"BYTES", "BOOL", "BF16"})
# How long a readiness query waits for a model's is_ready(): a probe's usual timeout is
# 1 s (Kubernetes'), and a model whose check takes longer is not ready to answer either.
READY_TIMEOUT_S = 1.0
# Request parameters that are a sequence's controls: a Python model reads them as its
# request's correlation_id() and flags(), not among its parameters(), as in Triton.
_SEQUENCE_KEYS = frozenset({"sequence_id", "sequence_start", "sequence_end"})


@dataclass(slots=True)
class PreparedRequest:
    """A request checked against the model: ready for the batcher."""

    # Inputs in the model's declared order, with the model's dtypes.
    inputs: dict[str, np.ndarray]
    rows: int
    shape_key: ShapeKey
    # Output names to return, in response order.
    output_names: list[str]


class ModelVersion:
    """A loaded, warmed-up model version; build one with :meth:`load`."""

    def __init__(
        self,
        name: str,
        version: int,
        config: ModelConfig,
        instances: list[Backend],
        metrics: ModelMetrics,
    ) -> None:
        self.name = name
        self.version = version
        self.version_str = str(version)
        self.config = config
        self.metrics = metrics
        self.stats = ModelStatsRecorder(name, self.version_str)
        self._inputs = {t.name: t for t in config.input}
        self._input_dtypes = {t.name: V2_TO_NUMPY[t.data_type] for t in config.input}
        # The full shape a request's input must have, batch dim excluded, where no dim is
        # variable: checked with one tuple comparison (the general check below cost ~7%
        # of an engine process's event loop at 10k requests/s).
        self._fixed_dims = {
            t.name: tuple(t.dims) if -1 not in t.dims else None for t in config.input
        }
        self._required = [t.name for t in config.input if not t.optional]
        self._output_names = [t.name for t in config.output]
        self._output_types = {t.name: t.data_type for t in config.output}
        self._batching = bool(config.max_batch_size)
        # A stateful model's live sequences; its batches also return the states' outputs.
        self.sequences: Sequences | None = None
        run_outputs = self._output_names
        if config.sequence_batching is not None:
            self.sequences = Sequences(name, config.sequence_batching, self._batching)
            run_outputs = run_outputs + config.sequence_batching.model_outputs()
        self.batcher = Batcher(config, instances, run_outputs, metrics, self.stats)
        self._instances = instances
        # Its backend is handed each request with its context (a Python model).
        self.takes_requests = any(instance.takes_requests for instance in instances)
        self.decoupled = config.model_transaction_policy.decoupled
        if any(instance.cpu_threads is not None for instance in instances):
            metrics.cpu_threads = lambda: sum(instance.cpu_threads or 0 for instance in instances)
        # Watches served requests (drift); set by the manager once the version is kept.
        self.tap: ResponseTap | None = None
        # What the response cache keys this version's answers by beside its number (see
        # :func:`files_identity`); set by :meth:`load`.
        self.cache_identity = self.version_str
        # Output name -> its class labels (label_filename), for classification requests.
        self.labels: dict[str, list[str]] = {}
        # The model's is_ready() being asked (see is_ready), and whether it was too slow.
        self._ready_asked: asyncio.Future[bool] | None = None
        self._ready_late = False

    @classmethod
    async def load(
        cls,
        name: str,
        version: int,
        path: Path,
        config: ModelConfig,
        metrics: ModelMetrics,
        infer: LocalInfer | None = None,
    ) -> ModelVersion:
        """Load every instance off the event loop, complete the config, warm up.
        ``infer``: the server's inference call, for models that call other models."""
        backend_name = config.backend or backend_for_file(path)
        config = _placed(config, backend_name)
        backend_cls = get_backend(backend_name)
        check_pickle_trust(name, path, backend_cls, config.trust_pickle)
        if config.model_transaction_policy.decoupled and (
            not backend_cls.takes_requests or config.sequence_batching is not None
        ):
            raise ConfigError(
                "model_transaction_policy.decoupled: only a Python model (backend: python) "
                "without sequence_batching sends its answers itself"
            )
        count = config.instance_count

        def load_instances() -> list[Backend]:
            loaded: list[Backend] = []
            try:
                for _ in range(count):
                    loaded.append(backend_cls.load(path, config.parameters, count))
            except BaseException:
                # A later instance failed (out of memory, say): free the ones that loaded.
                for instance in loaded:
                    instance.close()
                raise
            return loaded

        started = time.perf_counter()
        instances = await asyncio.to_thread(load_instances)
        try:
            completed = complete_config(config, instances[0].signature(), backend_name)
            if infer is not None:
                loop = asyncio.get_running_loop()
                for instance in instances:
                    instance.attach(infer, loop)
            await asyncio.to_thread(_configure, instances, completed)
            labels = await asyncio.to_thread(load_labels, path.parent.parent, completed)
            model = cls(name, version, completed, reshaping(instances, completed), metrics)
            model.labels = labels
            model.stats.set_memory_usage(
                usage for instance in instances for usage in instance.memory_usage()
            )
            model.cache_identity = await asyncio.to_thread(files_identity, path, completed)
            warm_up_started = time.perf_counter()
            await asyncio.to_thread(model._warm_up)
            metrics.warmup_duration_s = time.perf_counter() - warm_up_started
        except BaseException:
            for instance in instances:
                instance.close()
            raise
        metrics.model_load_duration_s = time.perf_counter() - started
        return model

    # -- requests ----------------------------------------------------------------------

    def prepare(self, request: InferRequest) -> PreparedRequest:
        """Check names, dtypes and shapes against the config; InvalidRequest says what is wrong."""
        inputs: dict[str, np.ndarray] = {}
        rows = 1
        key: list[tuple[int, ...]] = []
        for name, array in request.inputs.items():
            tensor = self._inputs.get(name)
            if tensor is None:
                known = ", ".join(self._inputs)
                raise InvalidRequest(
                    f"input {name!r}: model {self.name!r} has no such input (inputs: {known})"
                )
            array = self._check_dtype(tensor, array)
            rows = self._check_shape(tensor, array, rows, first=not inputs)
            inputs[name] = array
        for name in self._required:
            if name not in inputs:
                raise InvalidRequest(f"input {name!r}: missing; model {self.name!r} requires it")
        # Model order, so every request of a batch builds the same key.
        ordered = {t: inputs[t] for t in self._inputs if t in inputs}
        for array in ordered.values():
            key.append(array.shape[1:] if self._batching else array.shape)
        return PreparedRequest(ordered, rows, tuple(key), self._requested_outputs(request))

    def _check_dtype(self, tensor: TensorConfig, array: np.ndarray) -> np.ndarray:
        expected = self._input_dtypes[tensor.name]
        if array.dtype == expected:
            return array
        if tensor.data_type == "BYTES" and array.dtype.kind in "OSU":
            return array.astype(object)
        try:
            got = v2_datatype(array.dtype)
        except ValueError:
            got = str(array.dtype)
        raise InvalidRequest(
            f"input {tensor.name!r}: datatype {got} but the model expects {tensor.data_type}"
        )

    def _check_shape(self, tensor: TensorConfig, array: np.ndarray, rows: int, first: bool) -> int:
        shape = array.shape
        fixed = self._fixed_dims[tensor.name]
        if fixed is not None:  # the common case, answered without building lists
            if not self._batching:
                if shape == fixed:
                    return 1
            elif len(shape) == len(fixed) + 1 and shape[1:] == fixed:
                batch = int(shape[0])
                if 1 <= batch <= (self.config.max_batch_size or 0) and (first or batch == rows):
                    return batch
        dims = tensor.dims
        expected = ([-1] if self._batching else []) + dims
        if len(shape) != len(expected) or any(
            d != -1 and s != d for s, d in zip(shape, expected, strict=False)
        ):
            raise InvalidRequest(
                f"input {tensor.name!r}: shape {list(shape)} does not match the model's "
                f"{expected} (-1 = any size"
                + (", first dim is the batch" if self._batching else "")
                + ")"
            )
        if not self._batching:
            return 1
        batch = int(shape[0])
        if not 1 <= batch <= (self.config.max_batch_size or 0):
            raise InvalidRequest(
                f"input {tensor.name!r}: batch size {batch} outside 1..{self.config.max_batch_size}"
                " (max_batch_size)"
            )
        if not first and batch != rows:
            raise InvalidRequest(
                f"input {tensor.name!r}: batch size {batch} differs from the other inputs' {rows}"
            )
        return batch

    def _requested_outputs(self, request: InferRequest) -> list[str]:
        if not request.outputs:
            return self._output_names
        names = []
        for output in request.outputs:
            if output.name not in self._output_names:
                known = ", ".join(self._output_names)
                raise InvalidRequest(
                    f"output {output.name!r}: model {self.name!r} has no such output "
                    f"(outputs: {known})"
                )
            if output.classification and self._output_types[output.name] in _NOT_CLASSES:
                raise InvalidRequest(
                    f"output {output.name!r}: classification needs a numeric output; this "
                    f"one is {self._output_types[output.name]}"
                )
            names.append(output.name)
        return names

    # -- metadata ------------------------------------------------------------------------

    def tensor_metadata(self) -> tuple[list[TensorMetadata], list[TensorMetadata]]:
        lead = [-1] if self._batching else []
        return (
            [TensorMetadata(t.name, t.data_type, lead + t.dims) for t in self.config.input],
            [TensorMetadata(t.name, t.data_type, lead + t.dims) for t in self.config.output],
        )

    def context(
        self,
        request: InferRequest,
        respond: Respond | None = None,
        cancelled: Callable[[], bool] | None = None,
        started: Callable[[], None] | None = None,
    ) -> RequestContext | None:
        """What a backend that takes requests sees of ``request`` besides its tensors;
        None for the others (nothing is built on their path). A decoupled model's
        requests come with ``respond`` and ``started`` (:mod:`.decoupled`); one asked for
        one answer is refused."""
        if not self.takes_requests:
            return None
        if self.decoupled and respond is None:
            raise Decoupled(
                f"model {self.name!r} is decoupled (it may answer a request any number of "
                "times, Triton's model_transaction_policy): send its requests on gRPC "
                "ModelStreamInfer (tritonclient.grpc's start_stream and async_stream_infer)"
            )
        parameters = {k: v for k, v in request.parameters.items() if k not in _SEQUENCE_KEYS}
        sequence = request.parameters
        return RequestContext(
            id=request.id,
            parameters=parameters,
            outputs=tuple(o.name for o in request.outputs) if request.outputs else None,
            correlation_id=sequence.get("sequence_id", 0),
            sequence_start=sequence.get("sequence_start") is True,
            sequence_end=sequence.get("sequence_end") is True,
            respond=respond,
            cancelled=cancelled,
            started=started,
        )

    async def is_ready(self) -> bool:
        """Whether every instance says it can serve (a Python model's ``is_ready``),
        asked off the event loop: the model's code may take its time. One question is
        in flight at a time, shared by every readiness query meanwhile (probes never
        pile threads up behind a model that hangs), and one unanswered within
        :data:`READY_TIMEOUT_S` means not ready (logged once until it answers)."""
        if not any(type(i).is_ready is not Backend.is_ready for i in self._instances):
            return True  # the backend's own answer is always yes: no thread hand-off
        if self._ready_asked is None or self._ready_asked.done():
            question = asyncio.to_thread(lambda: all(i.is_ready() for i in self._instances))
            self._ready_asked = asyncio.ensure_future(question)
        try:
            answer = await asyncio.wait_for(asyncio.shield(self._ready_asked), READY_TIMEOUT_S)
        except TimeoutError:
            if not self._ready_late:
                logger.warning("model %s: is_ready has not answered in %g s; not ready "
                               "until it does", self.name, READY_TIMEOUT_S)  # fmt: skip
            self._ready_late = True
            return False
        self._ready_late = False
        return answer

    def metadata(self, versions: list[str]) -> ModelMetadata:
        inputs, outputs = self.tensor_metadata()
        return ModelMetadata(self.name, versions, self.config.platform, inputs, outputs)

    # -- warm-up -------------------------------------------------------------------------

    def _warm_up(self) -> None:
        """Run the configured warm-up samples (or one zero sample) on every instance.

        A configured sample that fails fails the load. The default sample is a guess: a
        model may refuse zero-filled inputs as data (a 400, :class:`InvalidRequest`) and
        still serve real requests, so that only skips it; so does any failure where the
        guess had to make up a size (a variable dim run as 1, an empty string) or the
        model's run is user code (a Python model). Any other failure is one every request
        would meet (a 500 each), so it fails the load too, and the model never goes READY.
        """
        samples = self.config.model_warmup
        configured = bool(samples)
        fatal = self._instances[0].warm_up_faults_are_fatal if self._instances else False
        fatal = fatal and not any(
            -1 in tensor.dims or tensor.data_type == "BYTES" for tensor in self.config.input
        )
        if not samples:
            samples = [WarmupSample(name="default", batch_size=1)]
        for instance in self._instances:
            for sample in samples:
                inputs = self._warmup_inputs(sample)
                try:
                    for _ in range(sample.count):
                        instance.run(inputs, self._output_names)
                except Exception as exc:
                    if configured:
                        raise ConfigError(
                            f"model_warmup {sample.name!r}: the model failed on it: {exc}"
                        ) from None
                    if fatal and not isinstance(exc, InvalidRequest):
                        raise ConfigError(
                            "default warm-up: the model failed on a zero-filled request of "
                            f"batch size {sample.batch_size}, as it would on requests: {exc}; "
                            "fix the model or its config, or list model_warmup samples it takes"
                        ) from None
                    logger.warning("%s: default warm-up skipped (%s)", self.name, exc)
                    return

    def _warmup_inputs(self, sample: WarmupSample) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(0)
        lead = [sample.batch_size] if self._batching else []
        inputs = {}
        for tensor in self.config.input:
            given = sample.inputs.get(tensor.name)
            dims = given.dims if given else [max(d, 1) for d in tensor.dims]
            dtype = numpy_dtype(given.data_type if given else tensor.data_type)
            shape = lead + dims
            if dtype == np.object_:
                inputs[tensor.name] = np.full(shape, b"", dtype=object)
            elif given and given.random_data:
                inputs[tensor.name] = rng.random(shape).astype(dtype)
            else:
                inputs[tensor.name] = np.zeros(shape, dtype=dtype)
        unknown = set(sample.inputs) - set(self._inputs)
        if unknown:
            raise ConfigError(f"model_warmup {sample.name!r}: unknown inputs {sorted(unknown)}")
        if self.sequences is not None:
            inputs.update(self.sequences.warmup_inputs(sample.batch_size))
        return inputs


def _placed(config: ModelConfig, backend: str) -> ModelConfig:
    """``config`` with its instances where ``instance_group`` puts them: Triton's KIND_GPU
    means a GPU, which only the torch backend runs here (``parameters.device``); elsewhere
    it is refused rather than run on the CPU without a word."""
    if not any(group.kind == "KIND_GPU" for group in config.instance_group):
        return config
    device = config.parameters.get("device", "")
    if backend == "torch" and not device:
        return config.model_copy(update={"parameters": {**config.parameters, "device": "cuda"}})
    if backend == "torch" and device.strip().lower().startswith("cuda"):
        return config
    where = f"parameters.device {device!r}" if backend == "torch" else f"the {backend} backend"
    raise ConfigError(
        f"instance_group kind KIND_GPU: {where} runs on the CPU here; use KIND_CPU (or "
        "KIND_AUTO), or serve the model with the torch backend on a GPU"
    )


def _configure(instances: list[Backend], config: ModelConfig) -> None:
    """Hand every instance the completed config (Triton's JSON form)."""
    triton_json = model_config_json(config)
    for instance, place in zip(instances, instance_places(triton_json), strict=True):
        instance.place(place)
        instance.configure(triton_json)


def files_identity(model_file: Path, config: ModelConfig) -> str:
    """The version's number, and a digest of its directory's files (names, sizes and
    modification times) and its completed config: new weights under the same version
    number (a reload, a wake-up after the files changed, a restart beside a shared Redis
    cache) change it, so the response cache never answers from the old ones."""
    version_dir = model_file.parent
    digest = hashlib.blake2b(digest_size=12)
    digest.update(config.model_dump_json().encode())
    for path in sorted(version_dir.rglob("*")):
        if path.is_file():
            info = path.stat()
            digest.update(f"{path.relative_to(version_dir)}\0{info.st_size}\0".encode())
            digest.update(f"{info.st_mtime_ns}\0".encode())
    return f"{version_dir.name}:{digest.hexdigest()}"
