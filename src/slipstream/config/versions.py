"""The sections of a model's config.yaml about its versions: which directories are
served (``version_policy``) and what runs before one is READY (``model_warmup``)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from slipstream.config.base import Strict as _Strict
from slipstream.datatypes import from_config_datatype


class VersionPolicy(_Strict):
    """Which version directories to serve: exactly one of latest / all / specific."""

    latest: dict[str, int] | None = None
    all: dict[str, Any] | None = None
    specific: dict[str, list[int]] | None = None

    @model_validator(mode="after")
    def _one_policy(self) -> VersionPolicy:
        chosen = [k for k in ("latest", "all", "specific") if getattr(self, k) is not None]
        if len(chosen) > 1:
            raise ValueError(f"set only one of latest / all / specific, got {chosen}")
        if self.latest is not None:
            n = self.latest.get("num_versions", 1)
            if set(self.latest) - {"num_versions"} or n < 1:
                raise ValueError("latest takes {num_versions: N} with N >= 1")
        if self.specific is not None and set(self.specific) != {"versions"}:
            raise ValueError("specific takes {versions: [1, 2, ...]}")
        return self

    def select(self, available: list[int]) -> list[int]:
        """Versions to serve among the available ones, ascending."""
        ordered = sorted(available)
        if self.all is not None:
            return ordered
        if self.specific is not None:
            wanted = set(self.specific["versions"])
            return [v for v in ordered if v in wanted]
        n = (self.latest or {}).get("num_versions", 1)
        return ordered[-n:]


class WarmupInput(_Strict):
    data_type: str
    dims: list[int]
    zero_data: bool = False
    random_data: bool = False

    @field_validator("data_type")
    @classmethod
    def _normalise_datatype(cls, value: str) -> str:
        return from_config_datatype(value)


class WarmupSample(_Strict):
    """One synthetic request run before the model is declared READY."""

    name: str = "warmup"
    batch_size: int = Field(1, ge=1)
    inputs: dict[str, WarmupInput] = Field(default_factory=dict)
    count: int = Field(1, ge=1, le=1000)
