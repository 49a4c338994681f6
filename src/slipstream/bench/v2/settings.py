"""What one ``slipstream bench`` run measures: validated settings and the load levels.

The field descriptions are the CLI's ``--help`` text, so the two never drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from slipstream.bench.v2.messages import Distribution, Protocol


class BenchSettings(BaseModel):
    """Every option of ``slipstream bench``; defaults follow perf_analyzer's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(
        description="Server address: http://host:port for http and http-binary, host:port for grpc."
    )
    model: str = Field(min_length=1, description="Model name.")
    model_version: str = Field("", description="Model version; empty = the server's choice.")
    protocol: Protocol = Field(
        "http",
        description="http: V2 JSON tensors; http-binary: Triton's binary tensor extension; "
        "grpc: V2 gRPC with raw contents.",
    )
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
    batch_size: int = Field(1, ge=1, description="Batch size of generated requests.")
    shapes: dict[str, list[int]] = Field(
        default_factory=dict,
        description="Dims for variable-size inputs, name:d1,d2 (repeatable); without the "
        "batch dim for a batching model, as perf_analyzer's --shape.",
    )
    input_data: Path | None = Field(
        None,
        description="Inputs from a file instead of random data: .npz arrays named like the "
        "inputs, or .json holding one V2 request or a list of them (sent in turn).",
    )
    warmup_s: float = Field(1.0, ge=0, description="Warm-up per load level, not measured.")
    window_s: float = Field(2.0, gt=0, description="Length of one measurement window.")
    stability_pct: float = Field(
        10.0,
        gt=0,
        description="A level is stable when throughput and mean latency of the last 3 "
        "windows are each within this percentage of their average.",
    )
    max_windows: int = Field(
        10, ge=3, description="Windows per level before giving up on stability."
    )
    duration_s: float | None = Field(
        None,
        gt=0,
        description="Measure each level for exactly this many seconds instead of until stable.",
    )
    workers: int = Field(
        0,
        ge=0,
        description="Client processes; 0 = auto: start with one and add more while a "
        "worker's CPU is saturated and cores are free.",
    )
    max_inflight: int = Field(
        256,
        ge=1,
        description="Open loop: most requests outstanding at once; beyond it sends wait "
        "(and their wait counts in their latency).",
    )
    timeout_s: float = Field(30.0, gt=0, description="Per-request timeout.")
    seed: int = Field(0, description="Seed of generated input data and Poisson gaps.")
    server_pid: int | None = Field(
        None, description="Sample this process's (and its children's) CPU and RSS."
    )
    price_per_hour: float | None = Field(
        None, gt=0, description="Machine price per hour: reports the cost per 1M inferences."
    )
    json_path: Path | None = Field(None, description="Write the results as JSON.")
    csv_path: Path | None = Field(None, description="Write one CSV row per load level.")
    report_path: Path | None = Field(
        None, description="Write charts: .html (PNGs embedded) or .png."
    )

    @model_validator(mode="after")
    def _check(self) -> BenchSettings:
        check_load(self.concurrency, self.request_rate)
        suffix = self.report_path.suffix.lower() if self.report_path else ".html"
        if suffix not in (".html", ".png"):
            raise ValueError(f"--report must end in .html or .png, got {self.report_path}")
        return self

    def load_levels(self) -> list[LoadLevel]:
        """The sweep in the order given; concurrency 1 when nothing was asked for."""
        return load_levels(self.concurrency, self.request_rate)


@dataclass(frozen=True)
class LoadLevel:
    """One point of the sweep: exactly one of the two fields is set."""

    # Closed loop: requests always outstanding.
    concurrency: int | None = None
    # Open loop: requests scheduled per second.
    request_rate: float | None = None

    @property
    def label(self) -> str:
        if self.concurrency is not None:
            return f"concurrency {self.concurrency}"
        return f"{self.request_rate:g} req/s"


def check_load(concurrency: list[int], request_rate: list[float]) -> None:
    """ValueError unless the sweep is one kind of load with valid values."""
    if concurrency and request_rate:
        raise ValueError("give either --concurrency or --request-rate, not both")
    if any(c < 1 for c in concurrency):
        raise ValueError(f"--concurrency values must be >= 1, got {concurrency}")
    if any(r <= 0 for r in request_rate):
        raise ValueError(f"--request-rate values must be > 0, got {request_rate}")


def load_levels(concurrency: list[int], request_rate: list[float]) -> list[LoadLevel]:
    """The sweep in the order given; concurrency 1 when nothing was asked for."""
    if request_rate:
        return [LoadLevel(request_rate=rate) for rate in request_rate]
    return [LoadLevel(concurrency=c) for c in (concurrency or [1])]
