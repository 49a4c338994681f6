"""Which model versions are loaded: loading, reloading, unloading, version routing."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path

from slipstream.config import ConfigError, ModelConfig
from slipstream.errors import InvalidRequest, ModelNotFound, Unavailable
from slipstream.observability.metrics import ServerMetrics
from slipstream.repository.layout import (
    ModelDirectory,
    is_generative,
    list_models,
    model_file,
    model_path,
    read_config,
    read_model_directory,
)
from slipstream.repository.names import validate_model_name
from slipstream.runtime.base import BackendUnavailable
from slipstream.serving.model import ModelVersion
from slipstream.serving.service import RepositoryEntry

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelState:
    """Everything known about one model of the repository."""

    name: str
    # Loaded, ready versions by number.
    versions: dict[int, ModelVersion] = field(default_factory=dict)
    # Why a version (or, under key 0, the whole model) failed to load.
    failures: dict[int, str] = field(default_factory=dict)
    # LOADING / UNLOADING while a change is in progress, else "".
    transition: str = ""
    # The directory as it was last loaded, to notice changes when polling.
    loaded_from: ModelDirectory | None = None


class ModelManager:
    """The repository's models and their loaded versions."""

    def __init__(self, repository: Path, metrics: ServerMetrics, unload_timeout_s: float) -> None:
        self.repository = repository
        self._metrics = metrics
        self._unload_timeout_s = unload_timeout_s
        self._models: dict[str, ModelState] = {}
        # One change at a time per model: a second load waits for the first.
        self._locks: dict[str, asyncio.Lock] = {}

    # -- routing -------------------------------------------------------------------------

    def resolve(self, name: str, version: str = "") -> ModelVersion:
        """The version a request should run on: the given one, or the newest ready one."""
        validate_model_name(name)
        state = self._models.get(name)
        if state is None:
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
            if int(version) in state.failures or state.transition:
                raise self._not_ready(state, f"{name} version {version}")
            loaded = ", ".join(map(str, sorted(state.versions))) or "none"
            raise ModelNotFound(
                f"model {name!r} has no version {version} loaded (loaded: {loaded})"
            )
        return model

    def _not_ready(self, state: ModelState, what: str) -> Unavailable:
        if state.transition:
            return Unavailable(f"model {what!r} is {state.transition.lower()}", retry_after_s=1)
        if not state.failures:
            return Unavailable(_not_loaded(state.name))
        return Unavailable(f"model {what!r} is not ready: {'; '.join(state.failures.values())}")

    def loaded_versions(self, name: str) -> list[str]:
        state = self._models.get(name)
        return [str(v) for v in sorted(state.versions)] if state else []

    def all_loaded(self) -> list[ModelVersion]:
        return [m for state in self._models.values() for m in state.versions.values()]

    def pending_work(self) -> bool:
        """True while some model is loading or unloading."""
        return any(state.transition for state in self._models.values())

    def failures(self, name: str) -> str:
        """Why a model (or some of its versions) failed to load; "" when none did."""
        state = self._models.get(name)
        return "; ".join(state.failures.values()) if state else ""

    def has_failures(self) -> bool:
        return any(state.failures for state in self._models.values())

    # -- repository index ----------------------------------------------------------------

    def index(self, ready_only: bool = False) -> list[RepositoryEntry]:
        try:
            on_disk = self._tensor_models()
        except FileNotFoundError:
            on_disk = {}
        entries = []
        for name in sorted(set(on_disk) | set(self._models)):
            state = self._models.get(name)
            if state is None or not (state.versions or state.failures or state.transition):
                if not ready_only:
                    entries.append(RepositoryEntry(name, "", "", ""))
                continue
            for number, _ in sorted(state.versions.items()):
                entries.append(RepositoryEntry(name, str(number), "READY", ""))
            if ready_only:
                continue
            for number, reason in sorted(state.failures.items()):
                entries.append(RepositoryEntry(name, str(number or ""), "UNAVAILABLE", reason))
            if state.transition and not state.versions:
                entries.append(RepositoryEntry(name, "", state.transition, ""))
        return entries

    # -- loading and unloading ---------------------------------------------------------

    def _tensor_models(self) -> dict[str, ModelDirectory]:
        """The repository's models minus the generative ones (slipstream.llm serves those)."""
        found = list_models(self.repository)
        return {name: d for name, d in found.items() if not is_generative(d)}

    async def load_all(self) -> None:
        names = list(self._tensor_models())
        await asyncio.gather(*(self.load(name) for name in names))

    async def load(self, name: str) -> None:
        """Load (or reload) a model: new versions come up before old ones go away."""
        validate_model_name(name)
        lock = self._locks.setdefault(name, asyncio.Lock())
        async with lock:
            path = model_path(self.repository, name)
            if not path.is_dir():
                raise ModelNotFound(f"model {name!r} is not in the repository {self.repository}")
            if is_generative(read_model_directory(path)):
                raise InvalidRequest(
                    f"model {name!r} is generative: it is served by the OpenAI routes (/v1/...) "
                    "and loaded at start-up"
                )
            state = self._models.setdefault(name, ModelState(name))
            state.transition = "LOADING"
            try:
                await self._load_versions(state, read_model_directory(path))
            finally:
                state.transition = ""

    async def _load_versions(self, state: ModelState, directory: ModelDirectory) -> None:
        name = state.name
        state.failures = {}
        state.loaded_from = directory
        try:
            config = read_config(directory)
            wanted = config.version_policy.select(list(directory.versions))
            if not wanted:
                raise ConfigError(
                    f"{name}: no version directory to serve (found {list(directory.versions)}, "
                    "version_policy selects none); add REPO/<model>/1/model.onnx"
                )
        except (ConfigError, OSError) as exc:
            state.failures[0] = str(exc)
            logger.error("model %s failed to load: %s", name, exc)
            await self._retire(state, list(state.versions))
            return
        results = await asyncio.gather(
            *(self._load_version(name, v, directory.path / str(v), config) for v in wanted)
        )
        old = dict(state.versions)
        retire = [v for v in old if v not in wanted]
        for version, outcome in zip(wanted, results, strict=True):
            if isinstance(outcome, ModelVersion):
                if version in old:
                    retire.append(version)
                state.versions[version] = outcome
            else:
                state.failures[version] = outcome
                # A failed reload leaves nothing of that version serving stale weights.
                if version in old:
                    retire.append(version)
                    del state.versions[version]
        for version in retire:
            if state.versions.get(version) is old.get(version):
                state.versions.pop(version, None)
        await asyncio.gather(*(self._close(old[v]) for v in retire if v in old))

    async def _load_version(
        self, name: str, version: int, path: Path, config: ModelConfig
    ) -> ModelVersion | str:
        metrics = self._metrics.for_model(name, str(version))
        try:
            model = await ModelVersion.load(
                name, version, model_file(path, config), config, metrics
            )
        except (ConfigError, BackendUnavailable, ValueError, OSError) as exc:
            logger.error("model %s version %d failed to load: %s", name, version, exc)
            return str(exc)
        except Exception as exc:
            logger.exception("model %s version %d failed to load", name, version)
            return f"{type(exc).__name__}: {exc}"
        logger.info("model %s version %d is READY", name, version)
        return model

    async def unload(self, name: str) -> None:
        validate_model_name(name)
        lock = self._locks.setdefault(name, asyncio.Lock())
        async with lock:
            state = self._models.get(name)
            if state is None:
                if (self.repository / name).is_dir():
                    return
                raise ModelNotFound(f"model {name!r} is not in the repository")
            state.transition = "UNLOADING"
            try:
                await self._retire(state, list(state.versions))
                state.failures = {}
                state.loaded_from = None
            finally:
                state.transition = ""

    async def _retire(self, state: ModelState, versions: list[int]) -> None:
        models = [state.versions.pop(v) for v in versions if v in state.versions]
        await asyncio.gather(*(self._close(m) for m in models))

    async def _close(self, model: ModelVersion) -> None:
        await model.batcher.close(self._unload_timeout_s)
        self._metrics.remove_model(model.name, model.version_str)
        logger.info("model %s version %s unloaded", model.name, model.version_str)

    async def close(self) -> None:
        for state in self._models.values():
            await self._retire(state, list(state.versions))

    # -- polling -------------------------------------------------------------------------

    async def poll_once(self) -> None:
        """Load new or changed models, unload removed ones."""
        on_disk = self._tensor_models()
        for name, directory in on_disk.items():
            state = self._models.get(name)
            if (
                state is None
                or state.loaded_from is None
                or state.loaded_from.fingerprint != directory.fingerprint
                or (state.loaded_from.versions != directory.versions)
            ):
                await self.load(name)
        for name in list(self._models):
            if name not in on_disk:
                await self.unload(name)
                self._models.pop(name, None)


def _not_loaded(name: str) -> str:
    return (
        f"model {name!r} is in the repository but not loaded; load it with "
        f"POST /v2/repository/models/{name}/load (--model-control-mode explicit)"
    )
