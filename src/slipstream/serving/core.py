"""The serving core: the InferenceService both front ends call."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any

import numpy as np

from slipstream import __version__
from slipstream.config import ModelConfig, ServerSettings
from slipstream.errors import (
    GenerativeModel,
    InvalidRequest,
    ModelNotFound,
    SlipstreamError,
    Unavailable,
)
from slipstream.names import validate_model_name
from slipstream.observability.lifecycle import LifecycleMetrics
from slipstream.observability.metrics import ServerMetrics
from slipstream.observability.rollout_metrics import RolloutMetrics
from slipstream.observability.stats import ModelStats
from slipstream.protocol import v2_shm
from slipstream.repository.layout import Share, load_override
from slipstream.runtime import python_metrics
from slipstream.runtime.base import RequestContext
from slipstream.runtime.pickles import trust_pickles_server_wide
from slipstream.serving import classification, decoupled, together
from slipstream.serving.cache import CacheEntry, ResponseCache, build_cache, request_key
from slipstream.serving.cascade_registry import Cascades, Composed
from slipstream.serving.idle import IdleWatcher
from slipstream.serving.manager import ModelAsleep, ModelManager
from slipstream.serving.model import ModelVersion, PreparedRequest
from slipstream.serving.outcomes import record_failure, record_success
from slipstream.serving.rollout import Rollouts, Route
from slipstream.serving.rollout_analysis import counts_against_version
from slipstream.serving.rollout_store import rollout_store
from slipstream.serving.sequences import Sequences
from slipstream.serving.service import InferenceService, ModelLane, StreamItem
from slipstream.serving.shadow import run_copies
from slipstream.serving.shared_memory import RegionCalls, SystemSharedMemory
from slipstream.serving.taps import TapFactory
from slipstream.types import (
    InferRequest,
    InferResponse,
    ModelMetadata,
    RepositoryEntry,
    ServerMetadata,
)

logger = logging.getLogger(__name__)

EXTENSIONS = [
    "binary_tensor_data", "model_configuration", "model_repository", "statistics",
    "schedule_policy", "classification", "sequence", "logging", "generate", v2_shm.EXTENSION,
    "model_repository(unload_dependents)",
]  # fmt: skip


class ModelServer(RegionCalls, InferenceService):
    """Routes requests to loaded model versions; owns the model manager."""

    def __init__(
        self,
        settings: ServerSettings,
        metrics: ServerMetrics | None = None,
        lanes: Sequence[ModelLane] = (),
        tap_factory: TapFactory | None = None,
        lifecycle: LifecycleMetrics | None = None,
        share: Share | None = None,
    ) -> None:
        """``lanes``: other sets of models served beside the V2 ones (the LLM lane), which
        this core starts, stops and waits for before it is ready, and nothing else.
        ``tap_factory``: makes each loaded version's response tap (drift monitoring).
        ``lifecycle``: load and unload counts shared with the lanes. ``share``: the
        repository's models this core serves (one engine of several), all if None."""
        self.settings = settings
        self.metrics = metrics or ServerMetrics()
        trust_pickles_server_wide(settings.trust_pickle)
        self.models = ModelManager(
            settings.model_repository,
            self.metrics,
            settings.shutdown_timeout_s,
            tap_factory,
            lifecycle,
            share,
        )
        self.models.local_infer = self.infer  # for Python models' exec()
        self.metrics.registry.register(python_metrics.COLLECTOR)  # their MetricFamily
        self.rollout_metrics = RolloutMetrics()
        self.metrics.registry.register(self.rollout_metrics.collector())
        # Version choice for requests that name none: weighted splits, rollouts, shadows.
        self.rollouts = Rollouts(
            settings.model_repository, self.models, self.rollout_metrics,
            functools.partial(run_copies, self.models),
            rollout_store(settings.rollout_store, settings.model_repository),
        )  # fmt: skip
        # Models that are chains of other models (serving/cascade.py).
        self.cascades = Cascades(settings.model_repository, self.models, self.metrics, share)
        self._lanes = list(lanes)
        self.shared_memory = SystemSharedMemory(settings.allow_client_shm)
        # --cache: answers for the models whose config enables response_cache.
        self._cache = build_cache(settings.cache)
        self.metrics.cache_enabled = self._cache is not None
        self._started = False
        self._stopping = False
        self._poll_task: asyncio.Task[None] | None = None
        # Unloads models idle past their idle_unload_seconds (scale to zero).
        self._idle = IdleWatcher(self.models, settings.idle_unload_seconds)
        self._idle_task: asyncio.Task[None] | None = None

    @property
    def response_cache(self) -> ResponseCache | None:
        """The server's --cache (None without one), shared with the generative routes."""
        return self._cache

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Load the models the control mode asks for; start polling in poll mode."""
        mode = self.settings.model_control_mode
        if mode == "explicit" and "*" in self.settings.load_models:
            mode = "none"  # Triton's --load-model=*: every model, then explicit control
        only = set(self.settings.load_models) if mode == "explicit" else None
        others = asyncio.gather(*(lane.load_all(only) for lane in self._lanes))
        if mode == "explicit":
            names = [validate_model_name(name) for name in self.settings.load_models]
            cascades = [name for name in names if self.cascades.handles(name)]
            # Side by side, as poll mode loads them; the cascades after, their stages ready.
            loads = await asyncio.gather(
                *(self.models.load(name) for name in names
                  if name not in cascades and self._lane_of(name) is None),
                return_exceptions=True,
            )  # fmt: skip
            for outcome in loads:
                if isinstance(outcome, BaseException):
                    raise outcome
            for name in cascades:
                await self.cascades.load(name, quiet=True)
        else:
            await self.models.load_all()
            await self.cascades.load_all()  # after the models: they are its stages
        await others
        await self.rollouts.start()
        if mode == "poll":
            self._poll_task = asyncio.create_task(self._poll_forever())
        self._idle_task = asyncio.create_task(self._idle.run())
        self._started = True

    async def stop(self) -> None:
        """Refuse new work, let queued and running requests finish, unload everything."""
        self._stopping = True
        for task in (self._poll_task, self._idle_task):
            if task is not None:
                task.cancel()
        await self.rollouts.close()
        await self.cascades.close()
        await asyncio.gather(self.models.close(), *(lane.close() for lane in self._lanes))
        self.shared_memory.close()
        if self._cache is not None:
            await self._cache.close()

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.repository_poll_secs)
            try:
                await self.models.poll_once()
                await self.cascades.poll()
            except Exception:
                logger.exception("repository poll failed")

    # -- health and metadata -------------------------------------------------------------

    def is_live(self) -> bool:
        return not self._stopping

    async def is_ready(self) -> bool:
        if not self._started or self._stopping or self.models.pending_work():
            return False
        if not all(lane.is_ready() for lane in self._lanes):
            return False
        failures = self.models.has_failures() or self.cascades.has_failures()
        return not (self.settings.strict_readiness and failures)

    async def server_metadata(self) -> ServerMetadata:
        extensions = list(EXTENSIONS)
        # Listed where a client's CUDA memory can be opened: the bindings, a driver and a
        # device are here (asked once, off the loop: the import takes ~70 ms).
        if await asyncio.to_thread(self.shared_memory.cuda.device_count):
            extensions.append(v2_shm.CUDA_EXTENSION)
        return ServerMetadata("slipstream", __version__, extensions)

    async def model_ready(self, name: str, version: str = "") -> bool:
        """Loaded, or asleep (idle-unloaded) and able to load for its next request."""
        validate_model_name(name)  # a bad name is a 400, not "not ready"
        if (composed := self.cascades.get(name)) is not None:
            # Ready while every model it runs here is (or sleeps, able to wake).
            asleep = self.models.asleep()
            return version in ("", "1") and all(
                self.models.serving(model) or model in asleep for model in composed.models()
            )
        if (lane := self._lane_of(name)) is not None:  # generative: asleep and idle too
            return any(
                entry.name == name
                and version in ("", entry.version)
                and (
                    entry.state == "READY" or (entry.state, entry.reason) == ("UNAVAILABLE", "idle")
                )
                for entry in lane.index()
            )
        try:
            model = self.models.resolve(name, version)
        except ModelAsleep:
            return True
        except SlipstreamError:
            return False
        return await model.is_ready()

    async def model_metadata(self, name: str, version: str = "") -> ModelMetadata:
        if (cascade := self._cascade_for_metadata(name, version)) is not None:
            return cascade.metadata
        model = self._resolve_for_metadata(name, version)
        if isinstance(model, ModelVersion):
            return model.metadata(self.models.loaded_versions(name))
        return model[0]

    async def model_config(self, name: str, version: str = "") -> ModelConfig:
        if (cascade := self._cascade_for_metadata(name, version)) is not None:
            return cascade.config
        model = self._resolve_for_metadata(name, version)
        return model.config if isinstance(model, ModelVersion) else model[1]

    def _cascade_for_metadata(self, name: str, version: str) -> Composed | None:
        cascade = self.cascades.get(name)
        if cascade is not None and version not in ("", "1"):
            raise ModelNotFound(f"model {name!r} is a {cascade.kind}; its one version is 1")
        if cascade is None and self.cascades.handles(name):
            raise ModelNotFound(f"model {name!r} is not loaded: {self._cascade_failure(name)}")
        return cascade

    def _cascade_failure(self, name: str) -> str:
        entry = next((e for e in self.cascades.index() if e.name == name), None)
        return entry.reason if entry is not None and entry.reason else "not loaded yet"

    def _resolve_for_metadata(
        self, name: str, version: str
    ) -> ModelVersion | tuple[ModelMetadata, ModelConfig]:
        """The loaded version, or an asleep one's metadata and config as last loaded."""
        try:
            return self.models.resolve(name, version)
        except ModelAsleep:
            return self.models.sleeping_version(name, version)
        except Unavailable as exc:
            self._refuse_generative(name)
            # Metadata of a model that is not loaded is unknown: answer as Triton does.
            raise ModelNotFound(exc.message) from None

    async def model_statistics(self, name: str = "", version: str = "") -> list[ModelStats]:
        if name and (cascade := self._cascade_for_metadata(name, version)) is not None:
            return [cascade.stats.snapshot()]
        if name:
            if version:
                model = self._resolve_for_metadata(name, version)
                return [model.stats.snapshot()] if isinstance(model, ModelVersion) else []
            models = [m for m in self.models.all_loaded() if m.name == name]
            if not models:
                self._resolve_for_metadata(name, version)  # 404 unless asleep
        else:
            models = self.models.all_loaded()
        found = [(m.name, m.version_str, m.stats) for m in models]
        if not name:
            found += [(c.name, "1", c.stats) for c in self.cascades.serving()]
        return [stats.snapshot() for _, _, stats in sorted(found, key=lambda f: (f[0], f[1]))]

    # -- inference -----------------------------------------------------------------------

    async def infer(self, request: InferRequest) -> InferResponse:
        if self._stopping:
            raise Unavailable("server is shutting down", retry_after_s=1)
        cascade = self.cascades.get(request.model_name)
        if cascade is not None:
            response = await self._infer_cascade(cascade, request)
        else:
            response = await self._infer_model(request)
        if classification.wanted(request):
            # After everything that compares or keeps raw outputs (cache, shadow, taps).
            return self._classified(request, response, cascade)
        return response

    def _classified(
        self, request: InferRequest, response: InferResponse, cascade: Composed | None
    ) -> InferResponse:
        if cascade is not None:
            batching, labels = bool(cascade.config.max_batch_size), cascade.labels
        else:
            model = self.models.resolve(response.model_name, response.model_version)
            batching, labels = bool(model.config.max_batch_size), model.labels
        return classification.classify_response(request, response, batching, labels)

    async def _infer_model(self, request: InferRequest) -> InferResponse:
        """A request on a model (not a cascade): the version its route or name picks."""
        route = None if request.model_version else self.rollouts.route(request.model_name)
        if route is not None:
            return await self._infer_routed(route, request)
        try:
            model = await self._resolve(request, request.model_version)
        except Unavailable:
            self._refuse_generative(request.model_name)
            if self.cascades.handles(request.model_name):
                why = f"model {request.model_name!r} is not loaded: "
                raise Unavailable(why + self._cascade_failure(request.model_name)) from None
            raise
        return await self._serve(model, request)

    async def _infer_cascade(self, cascade: Composed, request: InferRequest) -> InferResponse:
        """Shared-memory inputs are read and outputs written here, around the stages."""
        if request.shared_memory_inputs:
            self.shared_memory.read_inputs(request)
        targets = self.shared_memory.output_targets(request) if request.outputs else None
        response = await cascade.infer(request, self._infer_model)
        if targets:
            self.shared_memory.write_outputs(targets, response, request.owner)
        return response

    async def _serve(self, model: ModelVersion, request: InferRequest) -> InferResponse:
        if self._cache is not None and model.config.response_cache.enable:
            return await self._infer_cached(model, request, self._cache)
        return await self._run(model, request)

    async def _resolve(self, request: InferRequest, version: str) -> ModelVersion:
        """The loaded ``version`` of the request's model ("" : the default one). A model
        unloaded for being idle is loaded again first, the request waiting up to
        --load-wait-s (or its own timeout, when shorter)."""
        try:
            return self.models.resolve(request.model_name, version)
        except ModelAsleep:
            wait_s = min(self.settings.load_wait_s, request.timeout_us / 1e6 or float("inf"))
            await self.models.wake(request.model_name, wait_s)
            return self.models.resolve(request.model_name, version)

    async def check(self, request: InferRequest) -> None:
        if self._stopping:
            raise Unavailable("server is shutting down", retry_after_s=1)
        if self.cascades.get(request.model_name) is not None:
            return  # its stages check the request when it runs
        try:
            model = self.models.resolve(request.model_name, request.model_version)
        except ModelAsleep:
            return  # idle-unloaded here: the worker that runs the job checks it
        except Unavailable:
            self._refuse_generative(request.model_name)
            raise
        model.prepare(request)

    async def _infer_routed(self, route: Route, request: InferRequest) -> InferResponse:
        """Run on the version the model's route picks; record the outcome in a running
        rollout's window; offer the answer to the route's shadow."""
        model = await self._resolve(request, route.choose(request))
        window = route.window
        started_ns = time.perf_counter_ns()
        try:
            response = await self._serve(model, request)
        except SlipstreamError as exc:
            if window is not None and counts_against_version(exc):
                window.version(model.version_str).record(False, 0.0)
            raise
        if window is not None:
            seconds = (time.perf_counter_ns() - started_ns) / 1e9
            window.version(model.version_str).record(True, seconds)
        shadow = route.shadow
        # A stateful model's copies would run outside their sequences: none are made.
        if shadow is not None and shadow.version != model.version_str and model.sequences is None:
            shadow.offer(request, response)
        return response

    def infer_stream(self, request: InferRequest) -> AsyncIterator[StreamItem]:
        return decoupled.stream(self.infer, self._resolve, request)

    async def infer_group(
        self, requests: Sequence[InferRequest]
    ) -> list[InferResponse | Exception]:
        return await together.infer_group(self, requests)

    async def infer_stack(
        self, stacked: InferRequest, parts: Sequence[InferRequest], rows: Sequence[int]
    ) -> InferResponse | list[InferResponse | Exception]:
        return await together.infer_stack(self, stacked, parts, rows)

    def plain_model(self, request: InferRequest) -> ModelVersion | None:
        """The loaded version ``request`` runs on, when nothing but its batcher stands
        between them (no cascade, rollout route, response cache or shared memory); None
        when :meth:`infer` must take it (and answer any error)."""
        if (
            self._stopping
            or request.shared_memory_inputs
            or self.cascades.get(request.model_name) is not None
        ):
            return None
        if not request.model_version and self.rollouts.route(request.model_name) is not None:
            return None
        if request.outputs and any(o.shared_memory or o.classification for o in request.outputs):
            return None
        try:
            model = self.models.resolve(request.model_name, request.model_version)
        except (ModelAsleep, SlipstreamError):
            return None
        if (
            model.sequences is not None
            or model.takes_requests
            or (self._cache is not None and model.config.response_cache.enable)
        ):
            return None
        return model

    async def rollout(self, name: str, body: dict[str, Any] | None) -> dict[str, Any]:
        validate_model_name(name)
        self._refuse_generative(name)
        if body is None:
            return self.rollouts.status(name)
        return await self.rollouts.act(name, body)

    async def _infer_cached(
        self, model: ModelVersion, request: InferRequest, cache: ResponseCache
    ) -> InferResponse:
        """A hit answers from the cache without entering the batcher; a miss runs the
        request and stores its outputs. Durations are Triton's: lookup for a hit, lookup
        plus insertion for a miss (not the model's run)."""
        started_ns = time.perf_counter_ns()
        key = request_key(model.name, model.cache_identity, request)
        entry = await cache.get(key) if key is not None else None
        metrics = model.metrics
        if entry is not None:
            elapsed_ns = time.perf_counter_ns() - started_ns
            metrics.cache_hits += 1
            metrics.cache_hit_us += elapsed_ns / 1e3
            metrics.request_success += 1
            metrics.request_duration.observe(elapsed_ns / 1e9)
            model.stats.record_cache(hit=True, ns=elapsed_ns)
            model.stats.record_request(ok=True, total_ns=elapsed_ns)
            return InferResponse(model.name, model.version_str, dict(entry.outputs),
                                 id=request.id, parameters=dict(entry.parameters))  # fmt: skip
        lookup_ns = time.perf_counter_ns() - started_ns
        response = await self._run(model, request)
        insert_started_ns = time.perf_counter_ns()
        if key is not None:
            await cache.put(key, CacheEntry(response.outputs, response.parameters))
        miss_ns = lookup_ns + time.perf_counter_ns() - insert_started_ns
        metrics.cache_misses += 1
        metrics.cache_miss_us += miss_ns / 1e3
        model.stats.record_cache(hit=False, ns=miss_ns)
        return response

    async def _run(self, model: ModelVersion, request: InferRequest) -> InferResponse:
        started_ns = time.perf_counter_ns()
        targets = None
        try:
            if request.shared_memory_inputs:
                self.shared_memory.read_inputs(request)
            if request.outputs:
                targets = self.shared_memory.output_targets(request)
            prepared = model.prepare(request)
            context = model.context(request)
            if model.sequences is not None:
                outputs = await self._run_in_sequence(
                    model, model.sequences, request, prepared, context
                )
            else:
                outputs = await model.batcher.submit(
                    prepared.inputs,
                    prepared.rows,
                    prepared.shape_key,
                    request.priority,
                    request.timeout_us,
                    context=context,
                )
            response = InferResponse(
                model_name=model.name,
                model_version=model.version_str,
                outputs={name: outputs[name] for name in prepared.output_names},
                id=request.id,  # and the parameters a (Python) model's response carries:
                parameters=dict(context.response_parameters) if context is not None else {},
            )
            if targets:
                self.shared_memory.write_outputs(targets, response, request.owner)
        except asyncio.CancelledError:
            model.stats.record_request(ok=False, total_ns=time.perf_counter_ns() - started_ns)
            raise
        except SlipstreamError as exc:
            record_failure(model, exc, time.perf_counter_ns() - started_ns)
            raise
        elapsed_ns = time.perf_counter_ns() - started_ns
        record_success(model, elapsed_ns)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "request id=%r model=%s version=%s rows=%d took %.3f ms",
                request.id, model.name, model.version_str, prepared.rows, elapsed_ns / 1e6,
            )  # fmt: skip
        if model.tap is not None:
            inputs = prepared.inputs
            if request.shared_memory_inputs:
                # Views of a client's region: the tap keeps its rows past this request,
                # when the client may have rewritten or unregistered the region.
                inputs = {name: array.copy() for name, array in inputs.items()}
            model.tap.offer(inputs, response.outputs)
        return response

    @staticmethod
    async def _run_in_sequence(
        model: ModelVersion,
        sequences: Sequences,
        request: InferRequest,
        prepared: PreparedRequest,
        context: RequestContext | None,
    ) -> dict[str, np.ndarray]:
        """A stateful model's request, after its sequence's earlier ones, with its
        controls and state (:mod:`slipstream.serving.sequences`)."""

        def submit(
            inputs: dict[str, np.ndarray], shapes: tuple[Any, ...]
        ) -> Awaitable[dict[str, np.ndarray]]:
            key = (*prepared.shape_key, *shapes)
            priority, timeout_us = request.priority, request.timeout_us
            return model.batcher.submit(
                inputs, prepared.rows, key, priority, timeout_us, 1, context
            )

        return await sequences.run(request, prepared.inputs, prepared.rows, submit)

    # -- repository ----------------------------------------------------------------------

    async def repository_index(self, ready_only: bool = False) -> list[RepositoryEntry]:
        return self.index_now(ready_only)

    def index_now(self, ready_only: bool = False) -> list[RepositoryEntry]:
        """``repository_index`` without a coroutine (scrape-time collectors)."""
        entries = self.models.index(ready_only) + self.cascades.index(ready_only)
        for lane in self._lanes:
            entries.extend(lane.index(ready_only))
        return sorted(entries, key=lambda entry: (entry.name, entry.version))

    def _refuse_generative(self, name: str) -> None:
        """A generative model is served on the OpenAI routes only: to V2 it is no model
        (404), not one to wait for (503) or to load."""
        if self._lane_of(name) is not None:
            raise GenerativeModel(
                f"model {name!r} is a generative model, served on the OpenAI routes "
                "(/v1/completions, /v1/chat/completions), not by V2"
            )

    def _lane_of(self, name: str) -> ModelLane | None:
        validate_model_name(name)
        return next((lane for lane in self._lanes if lane.handles(name)), None)

    async def load_model(self, name: str, config: str | None = None) -> None:
        """``config``: Triton's load with a config override (its JSON form), used in
        place of the repository's config.yaml or config.pbtxt."""
        self._check_explicit("load")
        override = None
        if config is not None:
            override = load_override(self.models.repository, name, config)
        cascade, lane = self.cascades.handles(name), self._lane_of(name)
        if override is not None and (cascade or lane is not None):
            raise InvalidRequest(
                f"parameters.config: model {name!r} is a cascade, an ensemble or a generative "
                "model; a config override loads tensor models only"
            )
        if cascade:
            await self.cascades.load(name)
            return
        if lane is not None:
            await lane.load(name)
            return
        await self.models.load(name, override, request=True)
        failures = self.models.failures(name)
        if failures:
            raise InvalidRequest(f"failed to load model {name!r}: {failures}")

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        self._check_explicit("unload")
        if self.cascades.handles(name):
            await self.cascades.unload(name, unload_dependents)
            return
        lane = self._lane_of(name)
        if lane is not None:
            await lane.unload(name)
            return
        await self.models.unload(name)

    def _check_explicit(self, action: str) -> None:
        if self.settings.model_control_mode != "explicit":
            raise InvalidRequest(
                f"explicit model {action} is not allowed in model control mode "
                f"{self.settings.model_control_mode!r}; start the server with "
                "--model-control-mode explicit"
            )
