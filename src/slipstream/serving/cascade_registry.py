"""Which cascades serve: building them from their config, checking their stages, reloads.

A cascade is built once its stages can answer: each local stage's model is loaded (in
explicit mode, loading the cascade loads them, as Triton loads an ensemble's models),
each remote stage's metadata is read. Every stage must take the first stage's inputs
and give the outputs the cascade serves (those every stage has, with one datatype),
and batch. A cascade that cannot be built is UNAVAILABLE in the repository index with
the cause; a reload that fails leaves the cascade serving as it was.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from slipstream.config import CascadeStage, ConfigError, ModelConfig, TensorConfig
from slipstream.errors import InvalidRequest, ModelNotFound, SlipstreamError
from slipstream.observability.cascade_metrics import CascadeMetrics
from slipstream.observability.metrics import ModelMetrics, ServerMetrics
from slipstream.repository.layout import (
    Share,
    is_cascade,
    list_models,
    model_path,
    read_config,
    read_model_directory,
)
from slipstream.serving.cascade import Cascade, Stage
from slipstream.serving.classification import load_labels
from slipstream.serving.ensemble import Ensemble
from slipstream.serving.manager import ModelAsleep, ModelManager
from slipstream.types import ModelMetadata, RepositoryEntry, TensorMetadata

logger = logging.getLogger(__name__)

Signature = tuple[list[TensorMetadata], list[TensorMetadata]]
# A model made of other models: what this registry builds and serves.
Composed = Cascade | Ensemble


@dataclass(slots=True)
class _CascadeState:
    """One cascade of the repository: what serves, and why the last build failed."""

    serving: Composed | None = None
    failure: str = ""
    # The config.yaml text the last build attempt read (poll mode rebuilds on a change).
    attempted: str | None = None
    # Unloaded by a request (listed UNAVAILABLE, "unloaded", as Triton lists one).
    unloaded: bool = False


@dataclass(slots=True)
class Cascades:
    """The repository's cascades, beside the model manager's models."""

    repository: Path
    models: ModelManager
    metrics: ServerMetrics
    # The repository's models this process serves (repository/placement.py); None: all.
    share: Share | None = None
    counts: CascadeMetrics = field(default_factory=CascadeMetrics)
    _states: dict[str, _CascadeState] = field(default_factory=dict)
    # name -> the cascade serving it: the one lookup every request pays.
    _serving: dict[str, Composed] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.metrics.registry.register(self.counts.collector())

    def get(self, name: str) -> Composed | None:
        return self._serving.get(name)

    def serving(self) -> list[Composed]:
        return list(self._serving.values())

    def handles(self, name: str) -> bool:
        """Whether ``name`` is a cascade (loaded, or one in the repository)."""
        if name in self._states:
            return True
        path = self.repository / name
        return path.is_dir() and is_cascade(read_model_directory(path))

    def has_failures(self) -> bool:
        return any(s.failure and s.serving is None for s in self._states.values())

    def index(self, ready_only: bool = False) -> list[RepositoryEntry]:
        entries = []
        asleep = self.models.asleep()
        for name, state in sorted(self._states.items()):
            missing = [
                model
                for model in (state.serving.models() if state.serving is not None else [])
                if not self.models.serving(model) and model not in asleep
            ]
            if state.serving is not None and missing:
                if not ready_only:
                    reason = f"model {missing[0]!r}, which it runs, is not loaded"
                    entries.append(RepositoryEntry(name, "1", "UNAVAILABLE", reason))
            elif state.serving is not None:
                reason = (
                    f"serving as before; reloading failed: {state.failure}"
                    if (state.failure)
                    else ""
                )
                entries.append(RepositoryEntry(name, "1", "READY", reason))
            elif state.unloaded and not ready_only:
                entries.append(RepositoryEntry(name, "1", "UNAVAILABLE", "unloaded"))
            elif not ready_only:
                entries.append(
                    RepositoryEntry(
                        name,
                        "1" if state.failure else "",
                        "UNAVAILABLE" if state.failure else "",
                        state.failure,
                    )
                )
        return entries

    # -- loading -------------------------------------------------------------------------

    async def load_all(self) -> None:
        """Build every cascade of the repository (after the models: they are stages)."""
        try:
            found = list_models(self.repository, self.share)
        except FileNotFoundError:
            return
        for name, directory in found.items():
            if is_cascade(directory):
                await self.load(name, quiet=True)

    async def poll(self) -> None:
        """Rebuild cascades whose config changed or failed; drop removed ones."""
        found = list_models(self.repository, self.share)
        names = [name for name, directory in found.items() if is_cascade(directory)]
        for name in list(self._states):
            if name not in names:
                await self.unload(name)
                self._states.pop(name, None)
        for name in names:
            state = self._states.get(name)
            if (
                state is None
                or state.failure
                or state.attempted != _config_text(self.repository / name)
            ):
                await self.load(name, quiet=True)

    async def load(self, name: str, quiet: bool = False) -> None:
        """(Re)build ``name``; a failure is logged and recorded, and raised as an
        InvalidRequest naming the cause unless ``quiet`` (start-up, polling)."""
        state = self._states.setdefault(name, _CascadeState())
        path = model_path(self.repository, name)
        state.attempted = _config_text(path)
        try:
            cascade = await self._build(name, path)
        except (ConfigError, SlipstreamError, OSError) as exc:
            state.failure = exc.message if isinstance(exc, SlipstreamError) else str(exc)
            kept = " (the cascade loaded before keeps serving)" if state.serving else ""
            logger.error("cascade %s failed to load: %s%s", name, state.failure, kept)
            if not quiet:
                raise InvalidRequest(f"failed to load cascade {name!r}: {state.failure}") from None
            return
        old, state.serving, state.failure, state.unloaded = state.serving, cascade, "", False
        self._serving[name] = cascade
        self.metrics.add(cascade.metrics)
        if old is not None:
            await old.close()
        logger.info("%s %s is READY: %s", cascade.kind, name, cascade.describe())

    async def unload(self, name: str, unload_dependents: bool = False) -> None:
        """Unload ``name``; with ``unload_dependents`` (Triton's), the models it runs
        too, but those another loaded ensemble or cascade still runs."""
        state = self._states.get(name)
        if state is None:
            if not self.handles(name):
                raise ModelNotFound(f"model {name!r} is not in the repository")
            return
        cascade, state.serving, state.failure, state.unloaded = state.serving, None, "", True
        self._serving.pop(name, None)
        if cascade is None:
            return
        self.metrics.remove(cascade.metrics)
        self.counts.remove(name)
        await cascade.close()
        logger.info("%s %s unloaded", cascade.kind, name)
        if unload_dependents:
            still_run = {model for other in self._serving.values() for model in other.models()}
            for model in cascade.models():
                if model not in still_run and self.models.serving(model):
                    await self.models.unload(model)

    async def close(self) -> None:
        for name in list(self._states):
            await self.unload(name)

    # -- building ------------------------------------------------------------------------

    async def _build(self, name: str, path: Path) -> Composed:
        config = read_config(read_model_directory(path))
        if config.ensemble is not None:
            ensemble = await self._build_ensemble(name, config)
            ensemble.labels = load_labels(path, config)
            return ensemble
        if config.cascade is None:
            raise ConfigError(f"{name}/config.yaml: no cascade: section")
        stages: list[Stage] = []
        signatures: list[Signature] = []
        batch_sizes: list[int] = []
        try:
            for index, spec in enumerate(config.cascade.stages):
                stage, signature, max_batch_size = await self._stage(name, index, spec)
                stages.append(stage)
                signatures.append(signature)
                batch_sizes.append(max_batch_size)
            metadata = _cascade_metadata(name, config, signatures)
        except BaseException:
            for stage in stages:
                if stage.remote is not None:
                    await stage.remote.close()
            raise
        counts = self.counts.for_cascade(name, [stage.spec.name for stage in stages])
        # Every row of a request goes to the first stage: its limit is the cascade's
        # (1 where a remote one does not say).
        completed = _completed_config(config, metadata, batch_sizes[0] or 1)
        return Cascade(name, completed, metadata, stages, counts, ModelMetrics(name, "1"))

    async def _build_ensemble(self, name: str, config: ModelConfig) -> Ensemble:
        """An ensemble whose steps' models serve, each step's tensors of one datatype
        with the ensemble's, and (where the ensemble batches) each model batching."""
        assert config.ensemble is not None
        datatypes = {t.name: t.data_type for t in (*config.input, *config.output)}
        for index, step in enumerate(config.ensemble.steps):
            where = f"steps[{index}] ({step.name})"
            model_config = await self._local_model(name, where, step.model, step.version)
            batch = config.max_batch_size or 0
            if batch and (model_config.max_batch_size or 0) < batch:
                raise ConfigError(
                    f"{where}: model {step.model!r} takes batches of up to "
                    f"{model_config.max_batch_size or 0} rows (max_batch_size), fewer than "
                    f"the ensemble's {batch}"
                )
            for kind, tensors, mapping in (
                ("input", model_config.input, step.input_map),
                ("output", model_config.output, step.output_map),
            ):
                declared = {t.name: t.data_type for t in tensors}
                for model_name, tensor in mapping.items():
                    if model_name not in declared:
                        raise ConfigError(
                            f"{where}: model {step.model!r} has no {kind} {model_name!r} "
                            f"({kind}s: {', '.join(declared)})"
                        )
                    known = datatypes.setdefault(tensor, declared[model_name])
                    if known != declared[model_name]:
                        raise ConfigError(
                            f"{where}: tensor {tensor!r} is {known} but model "
                            f"{step.model!r}'s {kind} {model_name!r} is {declared[model_name]}"
                        )
        completed = config.model_copy(update={"platform": "ensemble"})
        metadata = ModelMetadata(name, ["1"], "ensemble", *_signature(completed))
        return Ensemble(name, completed, metadata, ModelMetrics(name, "1"))

    async def _local_model(
        self, composed: str, where: str, model: str, version: str
    ) -> ModelConfig:
        """The completed config of a local model a cascade or ensemble runs; loaded first
        in explicit mode (as Triton loads an ensemble's models); ConfigError when it cannot
        serve."""
        if model == composed or self.handles(model):
            raise ConfigError(f"{where}: {model!r} is made of other models; name a model")
        if not (self.repository / model).is_dir():
            raise ConfigError(
                f"{where}: model {model!r} is not in the repository {self.repository}"
            )
        if not self.models.serving(model):
            await self.models.load(model)
        try:
            return self.models.resolve(model, version).config
        except ModelAsleep:
            return self.models.sleeping_version(model, version)[1]
        except SlipstreamError as exc:
            failures = self.models.failures(model)
            raise ConfigError(
                f"{where}: model {model!r} cannot serve: {failures or exc.message}"
            ) from None

    async def _stage(
        self, cascade: str, index: int, spec: CascadeStage
    ) -> tuple[Stage, Signature, int]:
        """A stage ready to run, its signature and its max_batch_size (0: unknown)."""
        where = f"stages[{index}] ({spec.name})"
        if spec.remote:
            from slipstream.serving.cascade_remote import RemoteStage  # imports httpx

            remote = RemoteStage(spec)
            try:
                signature = await remote.signature()
                max_batch_size = await remote.max_batch_size()
            except BaseException:
                await remote.close()
                raise
            _check_batching(where, signature)
            return Stage(spec, remote), signature, max_batch_size
        config = await self._local_model(cascade, where, spec.model, spec.version)
        signature, max_batch_size = _signature(config), config.max_batch_size or 0
        if not max_batch_size:
            raise ConfigError(
                f"{where}: model {spec.model!r} does not batch (max_batch_size 0); a "
                "cascade sends each stage a subset of a request's rows, so its stages batch"
            )
        return Stage(spec, None), signature, max_batch_size


def _signature(config: ModelConfig) -> Signature:
    """A model's inputs and outputs as its completed config says (the batch dim first,
    -1, when it batches)."""
    lead = [-1] if config.max_batch_size else []

    def tensors(found: list[TensorConfig]) -> list[TensorMetadata]:
        return [TensorMetadata(t.name, t.data_type, lead + t.dims) for t in found]

    return tensors(config.input), tensors(config.output)


def _check_batching(where: str, signature: Signature) -> None:
    for tensor in signature[0] + signature[1]:
        if not tensor.shape or tensor.shape[0] != -1:
            raise ConfigError(
                f"{where}: {tensor.name!r} has shape {tensor.shape}, with no batch dim "
                "first (-1); a cascade's stages batch"
            )


def _cascade_metadata(name: str, config: ModelConfig, signatures: list[Signature]) -> ModelMetadata:
    """The first stage's inputs and the outputs every stage gives; ConfigError when a
    stage cannot stand in for the first."""
    assert config.cascade is not None
    specs = config.cascade.stages
    inputs, first_outputs = signatures[0]
    outputs = list(first_outputs)
    for spec, (stage_inputs, stage_outputs) in zip(specs[1:], signatures[1:], strict=True):
        accepted = {t.name: t.datatype for t in stage_inputs}
        for tensor in inputs:
            if accepted.get(tensor.name) != tensor.datatype:
                raise ConfigError(
                    f"stage {spec.name}: takes no input {tensor.name!r} {tensor.datatype} "
                    f"(its inputs: {_tensors(stage_inputs)}); every stage takes the first "
                    "stage's inputs"
                )
        given = {t.name: t.datatype for t in stage_outputs}
        for tensor in list(outputs):
            if tensor.name in given and given[tensor.name] != tensor.datatype:
                raise ConfigError(
                    f"stage {spec.name}: output {tensor.name!r} is "
                    f"{given[tensor.name]}, the first stage's is {tensor.datatype}"
                )
            if tensor.name not in given:
                outputs.remove(tensor)
    for spec, (_, stage_outputs) in zip(specs, signatures, strict=True):
        rule = spec.confidence
        if rule is not None and rule.output not in {t.name for t in stage_outputs}:
            raise ConfigError(
                f"stage {spec.name}: confidence.output {rule.output!r} is not one "
                f"of its outputs ({_tensors(stage_outputs)})"
            )
    if not outputs:
        raise ConfigError("the stages have no output in common (name and datatype)")
    dropped = [t.name for t in first_outputs if t not in outputs]
    if dropped:
        logger.info(
            "cascade %s: outputs %s are not served (not every stage has them)", name, dropped
        )
    return ModelMetadata(name, ["1"], "cascade", list(inputs), outputs)


def _completed_config(
    config: ModelConfig, metadata: ModelMetadata, max_batch_size: int
) -> ModelConfig:
    """The cascade's config with its signature filled in, for /config: a batching
    model's, as its metadata says (dims without the batch dim)."""

    def tensors(found: list[TensorMetadata]) -> list[TensorConfig]:
        return [TensorConfig(name=t.name, data_type=t.datatype, dims=t.shape[1:]) for t in found]

    return config.model_copy(
        update={
            "platform": "cascade",
            "max_batch_size": max_batch_size,
            "input": tensors(metadata.inputs),
            "output": tensors(metadata.outputs),
        }
    )


def _tensors(found: list[TensorMetadata]) -> str:
    return ", ".join(f"{t.name} {t.datatype}" for t in found) or "none"


def _config_text(path: Path) -> str:
    for filename in ("config.yaml", "config.yml"):
        try:
            return (path / filename).read_text(errors="replace")
        except OSError:
            continue
    return ""
