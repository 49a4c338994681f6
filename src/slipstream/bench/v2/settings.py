"""What one ``slipstream bench`` run measures: validated settings and the load levels.

The field descriptions are the CLI's ``--help`` text, so the two never drift apart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from slipstream.bench.core.settings import LoadSettings
from slipstream.bench.v2.messages import Protocol


class BenchSettings(LoadSettings):
    """Every option of ``slipstream bench`` for V2 protocols; defaults follow perf_analyzer's."""

    model_version: str = Field("", description="Model version; empty = the server's choice.")
    protocol: Protocol = Field(
        "http",
        description="http: V2 JSON tensors; http-binary: Triton's binary tensor extension; "
        "grpc: V2 gRPC with raw contents.",
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
    sequence_length: int = Field(
        20,
        ge=1,
        description="Stateful models (sequence_batching in the model's config): requests "
        "per sequence. Each concurrent user runs its own sequences, sequence_start on the "
        "first request and sequence_end on the last, as perf_analyzer's --sequence-length.",
    )
    sequence_ids: Literal["auto", "int", "string"] = Field(
        "auto",
        description="Stateful models: the type of the sequence ids sent; auto: strings where "
        "the model's CORRID control is TYPE_STRING, else integers.",
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
    server_pid: int | None = Field(
        None,
        description="Sample this process's (and its children's) CPU and RSS, and where "
        "this machine has a GPU, its utilization and memory (NVML, the gpu extra).",
    )
    price_per_hour: float | None = Field(
        None, gt=0, description="Machine price per hour: reports the cost per 1M inferences."
    )
    report_path: Path | None = Field(
        None, description="Write charts: .html (PNGs embedded) or .png."
    )

    @model_validator(mode="after")
    def _check(self) -> BenchSettings:
        suffix = self.report_path.suffix.lower() if self.report_path else ".html"
        if suffix not in (".html", ".png"):
            raise ValueError(f"--report must end in .html or .png, got {self.report_path}")
        return self
