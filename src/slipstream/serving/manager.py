"""Which model versions are loaded: loading, reloading, unloading, version routing."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from pathlib import Path

from slipstream.config import ConfigError, ModelConfig
from slipstream.errors import InvalidRequest, ModelNotFound, Unavailable
from slipstream.names import validate_model_name
from slipstream.observability.lifecycle import LifecycleMetrics
from slipstream.observability.metrics import ModelMetrics, ServerMetrics
from slipstream.observability.startup import TRACE
from slipstream.repository.changes import (
    ModelFingerprint,
    changed_versions,
    fingerprint,
    settled_changes,
    with_override,
)
from slipstream.repository.layout import (
    ModelDirectory,
    Share,
    is_generative,
    model_file,
    model_path,
    read_config,
    read_model_directory,
    tensor_models,
)
from slipstream.runtime import heap
from slipstream.runtime.base import BackendUnavailable, LocalInfer
from slipstream.serving.model import ModelVersion
from slipstream.serving.model_state import ModelAsleep as ModelAsleep  # core.py imports it here
from slipstream.serving.model_state import ModelState, files_unchanged, index_entries
from slipstream.serving.model_state import signature_change as signature_change  # for tests
from slipstream.serving.taps import TapFactory
from slipstream.types import ModelMetadata, RepositoryEntry

logger = logging.getLogger(__name__)

# Longest wait between on-demand loads of a model whose wake-ups keep failing.
_MAX_BACKOFF_S = 60.0

# What serving() answers for a model never loaded.
_NOTHING: dict[int, ModelVersion] = {}


class ModelManager:
    """The repository's models and their loaded versions."""

    def __init__(
        self,
        repository: Path,
        metrics: ServerMetrics,
        unload_timeout_s: float,
        tap_factory: TapFactory | None = None,
        lifecycle: LifecycleMetrics | None = None,
        share: Share | None = None,
    ) -> None:
        """``lifecycle``: load and unload counts shared with the LLM lane (made here if None);
        ``share``: the models this process serves (repository/placement.py), all if None."""
        self.repository = repository
        self._share = share
        self._metrics = metrics
        self._unload_timeout_s = unload_timeout_s
        self._tap_factory = tap_factory
        if lifecycle is None:
            lifecycle = LifecycleMetrics()
            metrics.registry.register(lifecycle)
        self.lifecycle = lifecycle
        self._models: dict[str, ModelState] = {}
        # Wake-up loads in progress: the requests that find a model asleep share one.
        self._waking: dict[str, asyncio.Task[None]] = {}
        # One change at a time per model: a second load waits for the first.
        self._locks: dict[str, asyncio.Lock] = {}
        # What the previous poll found: files must look the same twice to be loaded.
        self._last_poll: dict[str, ModelFingerprint] = {}
        # What the engine before this one kept serving after a failed reload (fallback()).
        self._fallbacks: dict[str, list[int]] = {}
        # The server's inference call, for models that call others (a Python model's
        # BLS); set by the serving core.
        self.local_infer: LocalInfer | None = None

    # -- routing -------------------------------------------------------------------------

    def resolve(self, name: str, version: str = "") -> ModelVersion:
        """The version a request should run on: the given one, or the newest ready one."""
        state = self._models.get(name)
        if state is None:
            # Only a name that is not loaded reaches the disk: check it there. The front
            # ends checked it on arrival already, so a served request pays nothing twice.
            validate_model_name(name)
            if (self.repository / name).is_dir():
                raise Unavailable(_not_loaded(name))
            raise ModelNotFound(f"model {name!r} is not in the repository")
        if not version:
            if state.versions:
                return state.versions[max(state.versions)]
            raise self._not_ready(state, name)
        if not version.isdigit():
            raise ModelNotFound(f"model {name!r}: version {version!r} is not a positive integer")
        model = state.versions.get(int(version))
        if model is None:
            if state.asleep and int(version) in state.sleeping:
                raise self._not_ready(state, f"{name} version {version}")
            if int(version) in state.failures or state.transition:
                raise self._not_ready(state, f"{name} version {version}")
            loaded = ", ".join(map(str, sorted(state.versions))) or "none"
            raise ModelNotFound(
                f"model {name!r} has no version {version} loaded (loaded: {loaded})"
            )
        return model

    def _not_ready(self, state: ModelState, what: str) -> Unavailable:
        if state.asleep:
            wait = state.retry_at - time.monotonic()
            if state.transition or not state.failures or wait <= 0:
                return ModelAsleep(state.name)
            return Unavailable(
                f"model {what!r} failed to load on demand: {self.failures(state.name)}; "
                f"the next attempt is in {math.ceil(wait)} s",
                retry_after_s=math.ceil(wait),
            )
        if state.transition:
            return Unavailable(f"model {what!r} is {state.transition.lower()}", retry_after_s=1)
        if not state.failures:
            return Unavailable(_not_loaded(state.name))
        return Unavailable(f"model {what!r} is not ready: {'; '.join(state.failures.values())}")

    def serving(self, name: str) -> dict[int, ModelVersion]:
        """The versions serving ``name`` now; a reload replaces the dict (never mutates it),
        so a caller can tell a change by identity."""
        state = self._models.get(name)
        return state.versions if state is not None else _NOTHING

    def loaded_versions(self, name: str) -> list[str]:
        state = self._models.get(name)
        return [str(v) for v in sorted(state.versions)] if state else []

    def all_loaded(self) -> list[ModelVersion]:
        return [m for state in self._models.values() for m in state.versions.values()]

    def pending_work(self) -> bool:
        """True while some model with nothing serving is loading or unloading.

        A model reloading beside its serving versions keeps the server ready: a load
        balancer that took the server out for a reload would fail the requests it serves.
        """
        return any(
            state.transition and not state.versions and not state.asleep
            for state in self._models.values()
        )

    def failures(self, name: str) -> str:
        """Why a model (or some of its versions) failed to load; "" when none did."""
        state = self._models.get(name)
        if state is None or not state.failures:
            return ""
        reasons = "; ".join(
            f"version {version}: {reason}" if version else reason
            for version, reason in sorted(state.failures.items())
        )
        if state.kept_previous:
            serving = ", ".join(map(str, sorted(state.versions)))
            return f"{reasons} (the loaded version(s) {serving} keep serving, unchanged)"
        return reasons

    def has_failures(self) -> bool:
        """Whether a model failed to load and nothing of it serves (strict readiness).
        Neither a failed reload that left the previous versions serving counts (the index
        says why the new files were refused), nor an idle model that failed to wake (it
        answers 503 naming why; the server out of its load balancer would fail the rest)."""
        states = self._models.values()
        return any(s.failures and not (s.kept_previous or s.asleep) for s in states)

    # -- repository index ----------------------------------------------------------------

    def index(self, ready_only: bool = False) -> list[RepositoryEntry]:
        try:
            on_disk = self._tensor_models()
        except FileNotFoundError:
            on_disk = {}
        entries: list[RepositoryEntry] = []
        for name in sorted(set(on_disk) | set(self._models)):
            state = self._models.get(name)
            if state is None:
                if not ready_only:
                    entries.append(RepositoryEntry(name, "", "", ""))
                continue
            entries.extend(index_entries(state, self.failures(name), ready_only))
        return entries

    # -- loading and unloading ---------------------------------------------------------

    def _tensor_models(self) -> dict[str, ModelDirectory]:
        return tensor_models(self.repository, self._share)

    async def load_all(self) -> None:
        """Load every model but those restored asleep (restore_asleep): they stay so."""
        asleep = self.asleep()
        names = [name for name in self._tensor_models() if name not in asleep]
        await asyncio.gather(*(self.load(name) for name in names))

    async def load(
        self, name: str, override: ModelConfig | None = None, request: bool = False
    ) -> None:
        """Load (or reload) a model; see :meth:`_load`. ``request``: a load request's,
        which sets the config to load with from now on: ``override`` instead of the
        repository's (kept for reloads and wake-ups until a request without one); else
        (start-up) the config in use, an override restored from the journal included."""
        validate_model_name(name)
        await self._load(name, expected=None, override=(override,) if request else None)

    def restore_override(self, name: str, override: ModelConfig) -> None:
        """Take ``override`` as the config ``name`` was loaded with (by the engine before
        this one), before it is loaded."""
        self._models.setdefault(name, ModelState(name)).override = override

    async def _load(
        self,
        name: str,
        expected: ModelFingerprint | None,
        override: tuple[ModelConfig | None] | None = None,
    ) -> None:
        """Load new files beside the serving versions; swap only when all are ready.

        Calls for one model run one at a time (other models are not held up). A call
        that waited for another load of the same files does not load them again, nor
        does a load of files already loaded without failures. ``expected`` (polling):
        the files a poll saw settle; when they changed since, the next poll decides.
        ``override`` (a load request's): the config to use from now on, in a 1-tuple;
        None keeps the one in use.
        """
        lock = self._locks.setdefault(name, asyncio.Lock())
        before = self._models.get(name)
        attempts_seen = before.attempts if before else 0
        if lock.locked():
            logger.info("model %s: waiting for the load or unload in progress", name)
        async with lock:
            path = model_path(self.repository, name)
            if not path.is_dir():
                raise ModelNotFound(f"model {name!r} is not in the repository {self.repository}")
            directory = read_model_directory(path)
            if is_generative(directory):
                raise InvalidRequest(
                    f"model {name!r} is generative: it is served by the OpenAI routes (/v1/...) "
                    "and loaded at start-up"
                )
            state = self._models.setdefault(name, ModelState(name))
            if override is not None:
                state.override = override[0]
            found = fingerprint(path)
            if expected is not None and found != expected:
                return
            if state.override is not None:  # a changed override is a changed config
                found = with_override(found, state.override)
            if state.attempted == found and (
                state.attempts != attempts_seen or (state.versions and not state.failures)
            ):
                logger.info("model %s: files unchanged since they were loaded; not reloading", name)
                return
            state.transition = "LOADING"
            try:
                await self._reload(state, directory, found)
            finally:
                state.transition = ""
                state.attempted = found
                state.attempts += 1

    async def _reload(
        self, state: ModelState, directory: ModelDirectory, found: ModelFingerprint
    ) -> None:
        """Load what changed beside what serves, then swap, or keep serving on failure."""
        name = state.name
        fallback = self._fallbacks.pop(name, [])
        if not directory.versions:
            # The version directories were removed: there is nothing left to keep serving.
            await self._swap(state, {}, None)
            self._fail(state, {0: _no_version(name, directory)}, kept_previous=False)
            return
        try:
            config = state.override or read_config(directory)
            wanted = config.version_policy.select(list(directory.versions))
            if not wanted:
                raise ConfigError(_no_version(name, directory))
        except (ConfigError, OSError) as exc:
            self._fail(state, {0: str(exc)}, kept_previous=bool(state.versions))
            return
        reused = {
            v: model
            for v, model in state.versions.items()
            if v in wanted and files_unchanged(state.loaded, found, v)
        }
        fresh = [v for v in wanted if v not in reused]
        results = await asyncio.gather(
            *(self._load_version(state, v, directory.path / str(v), config) for v in fresh)
        )
        loaded = {v: r for v, r in zip(fresh, results, strict=True) if isinstance(r, ModelVersion)}
        failures = {v: r for v, r in zip(fresh, results, strict=True) if isinstance(r, str)}
        if failures and state.versions:
            # Triton's rule: a reload that fails for any reason leaves the loaded model
            # as it was; the versions that did load are dropped unused.
            await asyncio.gather(*(_discard(model) for model in loaded.values()))
            self._fail(state, failures, kept_previous=True)
            return
        kept = await self._fall_back(state, directory, config, fallback) if failures else None
        if kept is not None:
            # The versions loaded beside the failed ones give way to the fallback's.
            await asyncio.gather(*(_discard(model) for model in loaded.values()))
            await self._swap(state, kept, found)
            self._fail(state, failures, kept_previous=True)
            return
        await self._swap(state, {**reused, **loaded}, found)
        # A first load serves the versions that loaded, beside the failed ones.
        self._fail(state, failures, kept_previous=False)

    async def _fall_back(
        self, state: ModelState, directory: ModelDirectory, config: ModelConfig, versions: list[int]
    ) -> dict[int, ModelVersion] | None:
        """``versions`` (see :meth:`fallback`) loaded, or None when they fail too (so the
        model fails as it would have without them)."""
        if not versions or not set(versions) <= set(directory.versions):
            return None
        results = await asyncio.gather(
            *(self._load_version(state, v, directory.path / str(v), config) for v in versions)
        )
        loaded = {
            v: r for v, r in zip(versions, results, strict=True) if isinstance(r, ModelVersion)
        }
        if len(loaded) < len(versions):
            await asyncio.gather(*(_discard(model) for model in loaded.values()))
            return None
        logger.warning("model %s: serving versions %s, as before the engine restarted",
                       state.name, ", ".join(map(str, versions)))  # fmt: skip
        return loaded

    def _fail(self, state: ModelState, failures: dict[int, str], kept_previous: bool) -> None:
        """Record (and log, once) the outcome of a load attempt."""
        state.failures = failures
        state.kept_previous = kept_previous and bool(failures)
        for version, reason in failures.items():
            what = f"version {version}" if version else "model"
            logger.error("model %s: %s failed to load: %s", state.name, what, reason)
        if state.kept_previous:
            logger.warning("model %s: versions %s keep serving, unchanged", state.name,
                           ", ".join(map(str, sorted(state.versions))))  # fmt: skip

    async def _load_version(
        self, state: ModelState, version: int, path: Path, config: ModelConfig
    ) -> ModelVersion | str:
        """A loaded, warmed-up version, or why it could not be (already logged by the caller)."""
        name = state.name
        # Counted apart until the swap: the serving version's series stay exposed meanwhile.
        metrics = ModelMetrics(name, str(version))
        started = time.perf_counter()
        try:
            model = await ModelVersion.load(
                name, version, model_file(path, config), config, metrics, self.local_infer
            )
        except (ConfigError, BackendUnavailable, ValueError, OSError) as exc:
            self.lifecycle.loaded(name, time.perf_counter() - started, ok=False)
            return str(exc)
        except Exception as exc:
            # Not one of the expected failures: keep the traceback for a bug report.
            logger.debug("model %s version %d: load raised", name, version, exc_info=True)
            self.lifecycle.loaded(name, time.perf_counter() - started, ok=False)
            return f"{type(exc).__name__}: {exc}"
        self.lifecycle.loaded(name, time.perf_counter() - started, ok=True)
        warmup_s = metrics.warmup_duration_s
        TRACE.model_loaded(f"{name}/{version}", metrics.model_load_duration_s - warmup_s, warmup_s)
        serving = state.versions.get(max(state.versions, default=0))
        if serving is not None:
            change = signature_change(serving.config, model.config)
            if change:
                await _discard(model)
                return (
                    f"version {version} changes the signature of the serving version "
                    f"{serving.version}: {change}; its clients would break. To serve it, "
                    f"unload the model first (POST /v2/repository/models/{name}/unload, or "
                    "in poll mode move its directory out of the repository), then load it"
                )
        if self._tap_factory is not None:
            try:
                model.tap = self._tap_factory(name, str(version), model.config, path)
            except (ValueError, OSError) as exc:  # e.g. an unreadable drift reference
                await _discard(model)
                return str(exc)
        logger.info("model %s version %d is READY", name, version)
        return model

    async def _swap(
        self, state: ModelState, versions: dict[int, ModelVersion], found: ModelFingerprint | None
    ) -> None:
        """Route to ``versions`` from now on; drain and unload the versions they replace."""
        for model in versions.values():
            self._metrics.add(model.metrics)
        old = state.versions
        state.versions = versions  # the one step routing sees
        state.loaded = found if versions else None
        if versions:  # loaded again (on demand, or by a load request): awake
            state.asleep, state.sleeping, state.failed_wakes = False, {}, 0
        retired = [model for v, model in old.items() if versions.get(v) is not model]
        state.unloaded = (state.unloaded | set(old)) - set(versions)
        # Requests already routed to a retired version were queued on it in the same
        # event-loop step: its batcher lets them finish before it closes.
        await asyncio.gather(*(self._close(model) for model in retired))

    async def unload(self, name: str, reason: str = "request") -> None:
        """Unload every version (``reason``: request or removed, as the metric says)."""
        validate_model_name(name)
        lock = self._locks.setdefault(name, asyncio.Lock())
        if lock.locked():
            logger.info("model %s: waiting for the load or unload in progress", name)
        async with lock:
            state = self._models.get(name)
            if state is None:
                if (self.repository / name).is_dir():
                    return
                raise ModelNotFound(f"model {name!r} is not in the repository")
            state.transition = "UNLOADING"
            self.lifecycle.unloads[name, reason] += len(state.versions)
            try:
                await self._swap(state, {}, None)
                state.failures = {}
                state.kept_previous = False
                state.attempted = None
                state.asleep, state.sleeping = False, {}  # unloaded on purpose: stays so
                state.override = None  # a later load reads the repository's config
            finally:
                state.transition = ""

    def idle_candidates(self) -> list[tuple[str, list[ModelVersion]]]:
        """Each model serving now, with its versions: what the idle check looks at."""
        return [
            (name, list(state.versions.values()))
            for name, state in self._models.items()
            if state.versions and not state.transition
        ]

    async def sleep(self, name: str) -> bool:
        """Unload ``name`` for being idle, so that its next request loads it again
        (:meth:`wake`); False when a change of the model is under way or nothing serves."""
        lock = self._locks.setdefault(name, asyncio.Lock())
        state = self._models.get(name)
        if lock.locked() or state is None or not state.versions or state.transition:
            return False
        async with lock:
            loaded = sorted(state.versions)
            state.sleeping = {
                v: (model.metadata([str(n) for n in loaded]), model.config)
                for v, model in state.versions.items()
            }
            # Asleep before the swap: a request arriving meanwhile waits for the wake-up,
            # which waits for this lock.
            state.asleep = True
            state.transition = "UNLOADING"
            self.lifecycle.unloads[name, "idle"] += len(loaded)
            try:
                # The files stay the ones attempted: polling does not see a change.
                await self._swap(state, {}, None)
            finally:
                state.transition = ""
        logger.info("model %s: unloaded after being idle; its next request loads it again", name)
        return True

    # -- what an engine restarted after it died takes over (server/journal.py) -------------

    def restore_asleep(
        self, name: str, sleeping: dict[int, tuple[ModelMetadata, ModelConfig]]
    ) -> None:
        """Take ``name`` as unloaded for being idle (by the engine before this one): a
        scale to zero outlives the restart; its next request loads it, as before."""
        path = model_path(self.repository, name)
        # Only while on disk and still this engine's (--engines per-device: its share).
        if sleeping and name not in self._models and name in self._tensor_models():
            # Its files as attempted: a poll sees no change to load.
            self._models[name] = ModelState(name, asleep=True, sleeping=sleeping,
                                            attempted=fingerprint(path))  # fmt: skip

    def fallback(self, name: str, versions: list[int]) -> None:
        """``versions`` of ``name`` kept serving after a failed reload (in the engine before
        this one): when its first load fails with nothing serving, they load instead."""
        self._fallbacks[name] = versions

    def asleep(self) -> dict[str, dict[int, tuple[ModelMetadata, ModelConfig]]]:
        """The models unloaded for being idle, with their versions' metadata and config."""
        return {name: state.sleeping for name, state in self._models.items()
                if state.asleep and state.sleeping and not state.versions}  # fmt: skip

    def kept_previous(self) -> dict[str, list[int]]:
        """The models whose failed reload left their earlier versions serving: those."""
        return {name: sorted(state.versions) for name, state in self._models.items()
                if state.kept_previous and state.versions}  # fmt: skip

    def sleeping_version(self, name: str, version: str) -> tuple[ModelMetadata, ModelConfig]:
        """Metadata and config of an asleep model's version (the newest when ``version``
        is empty), as loaded before; ModelNotFound when it is not asleep."""
        state = self._models.get(name)
        if state is None or not state.asleep or not state.sleeping:
            raise ModelNotFound(f"model {name!r} is not asleep")
        number = int(version) if version.isdigit() else max(state.sleeping)
        if number not in state.sleeping:
            raise ModelNotFound(f"model {name!r} has no version {version} loaded")
        return state.sleeping[number]

    async def wake(self, name: str, wait_s: float) -> None:
        """Load an asleep model again, waiting up to ``wait_s`` (503 past it; the load
        goes on). Requests arriving together share one load."""
        task = self._waking.get(name)
        if task is None:
            task = self._waking[name] = asyncio.create_task(self._wake(name))
            task.add_done_callback(lambda _: self._waking.pop(name, None))
        self.lifecycle.load_waits[name] += 1
        try:
            await asyncio.wait_for(asyncio.shield(task), wait_s)
        except TimeoutError:
            raise Unavailable(
                f"model {name!r} is still loading after being idle ({wait_s:g} s, "
                "--load-wait-s or the request's timeout); retry shortly",
                retry_after_s=1,
            ) from None
        state = self._models[name]
        if state.asleep and not state.versions:  # the load failed: say why
            wait = max(1, math.ceil(state.retry_at - time.monotonic()))
            raise Unavailable(
                f"model {name!r} failed to load on demand: {self.failures(name)}; the next "
                f"attempt is in {wait} s",
                retry_after_s=wait,
            )

    async def _wake(self, name: str) -> None:
        state = self._models[name]
        logger.info("model %s: a request arrived; loading it again after being idle", name)
        try:
            await self._load(name, expected=None)
        except Exception as exc:  # the directory went away, say: recorded like a failed load
            self._fail(state, {0: str(exc)}, kept_previous=False)
        if not state.versions and state.asleep:
            state.retry_at = time.monotonic() + min(_MAX_BACKOFF_S, 2.0**state.failed_wakes)
            state.failed_wakes += 1

    async def _close(self, model: ModelVersion) -> None:
        await model.batcher.close(self._unload_timeout_s)
        if model.tap is not None:
            model.tap.close()
        self._metrics.remove(model.metrics)
        heap.reclaim_soon()
        logger.info("model %s version %s unloaded", model.name, model.version_str)

    async def close(self) -> None:
        await asyncio.gather(*(self._swap(state, {}, None) for state in self._models.values()))

    # -- polling -------------------------------------------------------------------------

    async def poll_once(self) -> None:
        """Load models whose changed files have settled (see repository/changes.py),
        unload removed ones; models are handled side by side."""
        on_disk = self._tensor_models()
        found = {name: fingerprint(directory.path) for name, directory in on_disk.items()}
        attempted = {name: state.attempted for name, state in self._models.items()}
        decision = settled_changes(self._last_poll, found, attempted)
        for name in decision.noticed:
            state = self._models.get(name)
            changed = changed_versions(state.attempted if state else None, found[name])
            logger.info("model %s: files changed (%s); loading them once unchanged for a poll",
                        name, ", ".join(changed))  # fmt: skip
        self._last_poll = found
        removed = [name for name in self._models if name not in on_disk]
        outcomes = await asyncio.gather(
            *(self._load(name, found[name]) for name in decision.load),
            *(self._remove(name) for name in removed),
            return_exceptions=True,
        )
        for outcome in outcomes:
            if isinstance(outcome, Exception):
                logger.error("repository poll: %s", outcome)

    async def _remove(self, name: str) -> None:
        await self.unload(name, reason="removed")
        self._models.pop(name, None)
        self._last_poll.pop(name, None)


async def _discard(model: ModelVersion) -> None:
    """Free a version that loaded but will not serve (it never took a request)."""
    await model.batcher.close(0.0)


def _no_version(name: str, directory: ModelDirectory) -> str:
    return (f"{name}: no version directory to serve (found {list(directory.versions)}, "
            "version_policy selects none); add REPO/<model>/1/model.onnx")  # fmt: skip


def _not_loaded(name: str) -> str:
    return (f"model {name!r} is in the repository but not loaded; load it with "
            f"POST /v2/repository/models/{name}/load (--model-control-mode explicit)")  # fmt: skip
