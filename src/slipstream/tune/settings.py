"""What the user asks of ``slipstream tune``: the SLO, the hardware catalogue, the space.

Each parser raises :class:`TuneInputError` with a message that names the option or the
catalogue entry and the fix; the CLI shows it as a usage error.

Example::

    slo = parse_slo("p99_ms=50", min_throughput=None)
    profiles = load_catalogue(Path("examples/tune/catalogue.yaml"))
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

# Latency figures an SLO may bound: bench's level fields, in milliseconds.
SLO_FIGURES = ("avg_ms", "p50_ms", "p90_ms", "p95_ms", "p99_ms")


class TuneInputError(ValueError):
    """A bad --slo, catalogue or option; the message names the fix."""


@dataclass(frozen=True)
class Slo:
    """The latency bounds every measured load level must meet, and a throughput floor."""

    # Bench figure name (p99_ms, ...) -> its upper bound in milliseconds.
    latency_ms: dict[str, float]
    # Inferences per second the configuration must serve within the bounds; None: any.
    min_throughput: float | None = None

    def describe(self) -> str:
        parts = [f"{name}<={bound:g}" for name, bound in self.latency_ms.items()]
        if self.min_throughput is not None:
            parts.append(f"throughput>={self.min_throughput:g}/s")
        return ", ".join(parts)


def parse_slo(text: str, min_throughput: float | None) -> Slo:
    """``p99_ms=50`` or ``p50_ms=10,p99_ms=50`` (bench's figure names, milliseconds)."""
    bounds: dict[str, float] = {}
    for item in (part.strip() for part in text.split(",")):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in SLO_FIGURES:
            raise TuneInputError(
                f"--slo {text!r}: expected FIGURE=MS with FIGURE one of "
                f"{', '.join(SLO_FIGURES)}, e.g. --slo p99_ms=50"
            )
        try:
            bound = float(value)
        except ValueError:
            bound = float("nan")
        if not bound > 0:
            raise TuneInputError(f"--slo {item!r}: the bound must be a positive number of ms")
        bounds[name] = bound
    if min_throughput is not None and min_throughput <= 0:
        raise TuneInputError(f"--min-throughput {min_throughput:g}: must be > 0 inferences/s")
    return Slo(latency_ms=bounds, min_throughput=min_throughput)


class HardwareProfile(BaseModel):
    """One catalogue entry: the cores (and GPU) a trial server gets, and their price."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, description="Shown in the leaderboard, e.g. c7i.large.")
    cores: int | None = Field(
        None, ge=1, description="How many cores the server is pinned to (the first usable ones)."
    )
    cpus: list[int] | None = Field(
        None, min_length=1, description="Exactly which CPU ids the server is pinned to."
    )
    gpu: str | None = Field(
        None, description="GPU the server may use (CUDA_VISIBLE_DEVICES value); none: CPU only."
    )
    price_per_hour: float = Field(
        ge=0, description="What the machine costs per hour, in your currency."
    )

    @model_validator(mode="after")
    def _one_core_spec(self) -> HardwareProfile:
        if (self.cores is None) == (self.cpus is None):
            raise ValueError("give exactly one of cores: N or cpus: [ids]")
        return self

    def cpu_set(self, usable: list[int]) -> list[int] | None:
        """The CPU ids to pin to on this machine, or None when they are not all here."""
        if self.cpus is not None:
            return sorted(self.cpus) if set(self.cpus) <= set(usable) else None
        assert self.cores is not None
        return usable[: self.cores] if self.cores <= len(usable) else None


class Catalogue(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Free text: where the prices come from and when they were read.
    source: str = ""
    profiles: list[HardwareProfile] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_names(self) -> Catalogue:
        names = [p.name for p in self.profiles]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"profile names must be unique; repeated: {', '.join(twice)}")
        return self


def load_catalogue(path: Path) -> Catalogue:
    try:
        data: Any = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise TuneInputError(f"--profiles {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise TuneInputError(f"--profiles {path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise TuneInputError(f"--profiles {path}: expected a mapping with a 'profiles:' list")
    try:
        return Catalogue.model_validate(data)
    except ValidationError as exc:
        problems = []
        for problem in exc.errors():
            key = ".".join(str(part) for part in problem["loc"]) or "(top level)"
            problems.append(f"{key}: {str(problem['msg']).removeprefix('Value error, ')}")
        raise TuneInputError(f"--profiles {path}: " + "; ".join(problems)) from None


def this_machine(price_per_hour: float | None) -> Catalogue:
    """The catalogue when none is given: every usable core at the given price (or 0)."""
    return Catalogue(
        source="this machine (no --profiles given)",
        profiles=[
            HardwareProfile(
                name="this-machine", cores=len(usable_cpus()), price_per_hour=price_per_hour or 0.0
            )
        ],
    )


def usable_cpus() -> list[int]:
    """CPU ids this process may run on (respects taskset / cgroup affinity)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return list(range(os.cpu_count() or 1))


def int_list(text: str, option: str, *, minimum: int = 0) -> tuple[int, ...]:
    """``1,4,16`` -> (1, 4, 16), distinct and ascending; TuneInputError names ``option``."""
    try:
        values = sorted({int(item) for item in text.split(",") if item.strip()})
    except ValueError:
        values = []
    if not values or values[0] < minimum:
        raise TuneInputError(f"{option} {text!r}: expected integers >= {minimum} like 1,4,16")
    return tuple(values)
