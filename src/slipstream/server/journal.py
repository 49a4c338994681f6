"""The split layout's engine journal: what an engine restarted after it died needs from
the one before it (server/split.py runs the engines)."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
from pathlib import Path
from typing import Any

import orjson

from slipstream.config import ModelConfig
from slipstream.errors import SlipstreamError
from slipstream.repository.layout import load_override
from slipstream.serving.manager import ModelManager
from slipstream.serving.shared_memory import SystemSharedMemory
from slipstream.types import ModelMetadata, TensorMetadata

logger = logging.getLogger(__name__)

# How often the engine looks for a change of its models' states to save.
_WATCH_S = 0.5


class EngineJournal:
    """What an engine was asked to change at run time, written to the split layout's
    private directory on every change, so that an engine started again after it died
    serves as the one before it did: the client shared-memory regions (the clients'
    objects outlive the engine, and their requests go on naming the regions) and, in
    explicit model-control mode, the models loaded and unloaded through the repository
    API; and the model states a restart must not undo (see :meth:`watch`)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self.regions: list[dict[str, Any]] = []
        # CUDA regions: as CudaRegionStatus's fields, the handle in base64.
        self.cuda_regions: list[dict[str, Any]] = []
        # None: no change yet (the models of --load-model).
        self.models: list[str] | None = None
        # Models unloaded for being idle: name -> version -> {"metadata": ModelMetadata's
        # fields, "config": ModelConfig's}, as ModelManager.asleep() holds them.
        self.asleep: dict[str, dict[str, dict[str, Any]]] = {}
        # Models whose failed reload left earlier versions serving: name -> those versions.
        self.kept: dict[str, list[int]] = {}
        # Models loaded with a config override (Triton's JSON form): name -> its text.
        self.overrides: dict[str, str] = {}
        try:
            saved = orjson.loads(path.read_bytes())
        except FileNotFoundError:
            return
        except (OSError, orjson.JSONDecodeError) as exc:
            logger.error("cannot read the engine's state from %s: %s", path, exc)
            return
        self.regions, self.models = saved["regions"], saved["models"]
        self.cuda_regions = saved.get("cuda_regions", [])
        self.asleep, self.kept = saved.get("asleep", {}), saved.get("kept", {})
        self.overrides = saved.get("overrides", {})

    def restore_regions(self, regions: SystemSharedMemory) -> None:
        for region in self.regions:
            try:
                regions.register(
                    region["name"], region["key"], region["offset"], region["byte_size"],
                    region.get("owner", ""),
                )  # fmt: skip
            except SlipstreamError as exc:
                logger.warning("region %r is not registered again: %s", region["name"], exc)
        for region in self.cuda_regions:
            try:
                regions.register_cuda(
                    region["name"], base64.b64decode(region["raw_handle"]),
                    region["device_id"], region["byte_size"], region["owner"],
                )  # fmt: skip
            except SlipstreamError as exc:
                logger.warning("CUDA region %r is not registered again: %s", region["name"], exc)
        if self.regions or self.cuda_regions:
            logger.info("registered %d shared-memory regions again",
                        len(self.regions) + len(self.cuda_regions))  # fmt: skip

    def save(self, regions: SystemSharedMemory | None = None) -> None:
        if regions is not None:
            self.regions = [dataclasses.asdict(status) for status in regions.registered()]
            self.cuda_regions = [
                {**dataclasses.asdict(status), "raw_handle": _base64(status.raw_handle)}
                for status in regions.registered_cuda()
            ]
        temporary = self._path.with_suffix(".tmp")
        state = {"regions": self.regions, "cuda_regions": self.cuda_regions,
                 "models": self.models, "asleep": self.asleep, "kept": self.kept,
                 "overrides": self.overrides}  # fmt: skip
        temporary.write_bytes(orjson.dumps(state))
        temporary.replace(self._path)

    def set_override(self, name: str, config: str | None) -> None:
        """Record the config override ``name`` was loaded with (None: the repository's)."""
        if config is None:
            self.overrides.pop(name, None)
        else:
            self.overrides[name] = config

    def restore_models(self, models: ModelManager) -> set[str]:
        """Tell a new engine's manager, before it loads anything, what the engine before it
        had asleep, what it kept serving after a failed reload and the configs it loaded
        models with; the models restored asleep (not to be loaded at start)."""
        for name, versions in self.kept.items():
            models.fallback(name, versions)
        for name, text in self.overrides.items():
            try:
                models.restore_override(name, load_override(models.repository, name, text))
            except SlipstreamError as exc:  # e.g. a journal of another release
                logger.warning("model %s: loading it with its own config: %s", name, exc)
        for name, saved in self.asleep.items():
            try:
                models.restore_asleep(name, {int(v): _sleeper(s) for v, s in saved.items()})
            except (KeyError, TypeError, ValueError) as exc:  # e.g. a journal of another release
                logger.warning("model %s: loading it, its idle state is unreadable: %s", name, exc)
        return set(models.asleep())

    async def watch(self, models: ModelManager, started: asyncio.Task[None]) -> None:
        """Save the journal when the models asleep or kept serving change. Polled, since
        they change inside the manager (the idle check, polls, wake-ups); from when the
        engine has ``started``: until then its states are the journal's, half restored."""
        await asyncio.wait({started})
        seen = (set(self.asleep), self.kept)
        while True:
            asleep, kept = models.asleep(), models.kept_previous()
            if (set(asleep), kept) != seen:
                seen = (set(asleep), kept)
                self.asleep = {name: {str(v): {"metadata": dataclasses.asdict(meta),
                                               "config": config.model_dump(mode="json")}
                                      for v, (meta, config) in versions.items()}
                               for name, versions in asleep.items()}  # fmt: skip
                self.kept = kept
                self.save()
            await asyncio.sleep(_WATCH_S)


def _sleeper(saved: dict[str, Any]) -> tuple[ModelMetadata, ModelConfig]:
    meta = saved["metadata"]
    tensors = {kind: [TensorMetadata(**t) for t in meta[kind]] for kind in ("inputs", "outputs")}
    return ModelMetadata(**{**meta, **tensors}), ModelConfig.model_validate(saved["config"])


def _base64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
