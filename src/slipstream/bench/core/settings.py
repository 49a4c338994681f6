"""The settings both bench modes share: where to send, the load sweep, and the client's
limits. Each mode's settings class extends :class:`LoadSettings` with its own fields
and defaults; the field descriptions are the CLI's ``--help`` text.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from slipstream.bench.core.levels import Distribution, LoadLevel


class LoadSettings(BaseModel):
    """The options of ``slipstream bench`` common to every protocol."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(
        description="Server address: http://host:port for http and http-binary, host:port for grpc."
    )
    model: str = Field(min_length=1, description="Model name.")
    concurrency: list[int] = Field(
        default_factory=list,
        description="Closed loop: requests kept outstanding, a comma-separated sweep "
        "(e.g. 1,8,64). Default 1 when no --request-rate is given.",
    )
    request_rate: list[float] = Field(
        default_factory=list,
        description="Open loop: requests sent per second, a comma-separated sweep "
        "(e.g. 100,500); latency counts from each request's scheduled send time.",
    )
    distribution: Distribution = Field(
        "constant", description="Open loop: gaps between sends, constant or poisson."
    )
    max_inflight: int = Field(
        256,
        ge=1,
        description="Open loop: most requests outstanding at once; beyond it sends wait "
        "(and their wait counts in their latency).",
    )
    timeout_s: float = Field(30.0, gt=0, description="Per-request timeout.")
    seed: int = Field(0, description="Seed of generated input data and Poisson gaps.")
    json_path: Path | None = Field(None, description="Write the results as JSON.")
    csv_path: Path | None = Field(None, description="Write one CSV row per load level.")

    @model_validator(mode="after")
    def _check_load(self) -> LoadSettings:
        """One kind of load, with valid values."""
        if self.concurrency and self.request_rate:
            raise ValueError("give either --concurrency or --request-rate, not both")
        if any(c < 1 for c in self.concurrency):
            raise ValueError(f"--concurrency values must be >= 1, got {self.concurrency}")
        if any(r <= 0 for r in self.request_rate):
            raise ValueError(f"--request-rate values must be > 0, got {self.request_rate}")
        return self

    def load_levels(self) -> list[LoadLevel]:
        """The sweep in the order given; concurrency 1 when nothing was asked for."""
        if self.request_rate:
            return [LoadLevel(request_rate=rate) for rate in self.request_rate]
        return [LoadLevel(concurrency=c) for c in (self.concurrency or [1])]
