"""Which engine process serves which model under ``slipstream serve --engines per-device``.

Each model runs on the device its config names: a torch model's ``parameters.device``, a
generative model's ``generation.device`` (``cuda`` is ``cuda:0``); every other model, and
any config that does not parse (its engine reports why), on the CPU. The split layout
starts one engine process per device the repository's models use, so that an 8-GPU host
feeds each GPU from a process of its own (one GIL each) and a CPU model never waits for
the GIL behind a GPU model's kernel launches.

    REPO/mlp          (ONNX)                           -> engine "cpu"
    REPO/encoder      parameters: {device: cuda}        -> engine "cuda:0"
    REPO/llm          generation: {device: cuda:1}      -> engine "cuda:1"
    REPO/triage       cascade: [mlp, encoder]           -> engine "cuda:0", with mlp

A cascade runs its stages in the engine that holds it, so a cascade and the local models
it names are placed together, on the first GPU any of them uses (the CPU when none does).
A model whose device has no engine (one added, or moved to another GPU, after the server
started) is served by the first engine; restart the server to give it its own.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from slipstream.config import ModelConfig
from slipstream.repository.layout import ConfigMemo, ModelDirectory, list_models

CPU = "cpu"
_CUDA = re.compile(r"cuda(?::([0-9]+))?")


def device_of(config: ModelConfig) -> str:
    """The device ``config`` runs its model on: ``cpu`` or ``cuda:N``.

    >>> device_of(ModelConfig(backend="torch", parameters={"device": "cuda"}))
    'cuda:0'
    >>> device_of(ModelConfig())
    'cpu'
    """
    named = config.generation.device if config.generative else config.parameters.get("device", "")
    if not named and any(group.kind == "KIND_GPU" for group in config.instance_group):
        named = "cuda"  # Triton's KIND_GPU: what a torch model's load makes of it
    named = named or CPU
    match = _CUDA.fullmatch(named.strip().lower())
    if match is None:
        return CPU  # cpu, or a value the backend refuses when it loads
    return f"cuda:{int(match.group(1) or 0)}"


def _order(device: str) -> tuple[int, int]:
    """CPU first, then the GPUs by index."""
    return (0, 0) if device == CPU else (1, int(device.partition(":")[2]))


def _preference(device: str) -> tuple[int, int]:
    """Where a group of linked models goes: its first GPU, the CPU only when none."""
    return (1, 0) if device == CPU else (0, int(device.partition(":")[2]))


def placements(models: dict[str, ModelDirectory]) -> dict[str, str]:
    """Each model's device, a cascade and its local stages on one (module docstring)."""
    devices: dict[str, str] = {}
    # Union-find over the cascades' links: a model -> one model of its group.
    parent = {name: name for name in models}

    def root(name: str) -> str:
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    for name, directory in models.items():
        devices[name], stages = _read(directory)
        for stage in stages:
            if stage in parent:
                parent[root(stage)] = root(name)
    groups: dict[str, str] = {}
    for name, device in devices.items():
        group = root(name)
        groups[group] = min(groups.get(group, device), device, key=_preference)
    return {name: groups[root(name)] for name in models}


def _placement(config: ModelConfig) -> tuple[str, tuple[str, ...]]:
    """A model's device and the local models its cascade or ensemble runs (none if it
    is neither): they are placed on one engine."""
    cascade = config.cascade.stages if config.cascade is not None else []
    linked = [stage.model for stage in cascade if not stage.url]
    if config.ensemble is not None:
        linked += [step.model for step in config.ensemble.steps]
    return device_of(config), tuple(linked)


# A front end reads the placement every 2 s and each engine at every listing: a front
# end's refresh of 500 models took 328 ms parsing every config, 41 ms (the listing,
# mostly) with the stamps.
_PLACEMENTS = ConfigMemo(_placement)


def _read(directory: ModelDirectory) -> tuple[str, tuple[str, ...]]:
    """:func:`_placement` of a model; the CPU, linking nothing, for a config that does
    not parse (its engine reports why)."""
    return _PLACEMENTS.get(directory) or (CPU, ())


def engine_devices(models: dict[str, ModelDirectory]) -> list[str]:
    """One engine per device the models are placed on, CPU first (the CPU alone for an
    empty repository)."""
    return sorted(set(placements(models).values()) or {CPU}, key=_order)


@dataclass(frozen=True, slots=True)
class Share:
    """The models one engine process serves: those placed on ``device``, and where
    ``device`` is the first of ``devices``, those placed on a device with no engine."""

    # This engine's device ("cpu", "cuda:0", ...).
    device: str
    # Every engine's device, in the order the engines were started.
    devices: tuple[str, ...]

    def engine_for(self, device: str) -> str:
        """The engine that serves a model placed on ``device``."""
        return device if device in self.devices else self.devices[0]

    def select(self, models: dict[str, ModelDirectory]) -> dict[str, ModelDirectory]:
        """The part of ``models`` this engine serves."""
        placed = placements(models)
        return {
            name: directory
            for name, directory in models.items()
            if self.engine_for(placed[name]) == self.device
        }


class Routing:
    """A front end's view of which engine serves each model: :meth:`engine_of` answers
    from the last :meth:`refresh` (no I/O), the first engine for a name it does not know
    (which answers 404 for a model that is nowhere)."""

    def __init__(self, repository: Path, devices: Sequence[str]) -> None:
        self._repository = repository
        self._share = Share(devices[0], tuple(devices))
        self._engines: dict[str, int] = {}
        self.refresh()

    def engine_of(self, name: str) -> int:
        return self._engines.get(name, 0)

    def refresh(self) -> None:
        """Read the repository again (blocking: a front end runs it in a thread)."""
        try:
            placed = placements(list_models(self._repository))
        except FileNotFoundError:
            placed = {}
        devices = self._share.devices
        self._engines = {
            name: devices.index(self._share.engine_for(device)) for name, device in placed.items()
        }
