"""Options of ``slipstream worker``; each field's description is its --help text."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


def _default_consumer() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class WorkerSettings(BaseModel):
    """What one worker process reads, runs and how it retries."""

    model_config = ConfigDict(extra="forbid")

    redis: str = Field(description="The job stream's Redis: redis://host:port[/db].")
    model_repository: Path = Field(description="Directory laid out as <model>/<version>/model.*")
    consumer: str = Field(
        default_factory=_default_consumer,
        description="This worker's name in the consumer group; default: <host>-<pid>. "
        "Unique per live worker.",
    )
    prefetch: int = Field(
        64, ge=1, le=10_000, description="Jobs one read takes from the stream (a round)."
    )
    rounds: int = Field(
        2, ge=1, le=16,
        description="Rounds in flight at once: one reads and decodes while another runs.",
    )  # fmt: skip
    max_attempts: int = Field(
        3, ge=1,
        description="Starts of a job (faults and crashed workers) before it goes to the "
        "dead-letter stream as failed.",
    )  # fmt: skip
    reclaim_after_s: float = Field(
        60.0, gt=0,
        description="A job whose worker died, or whose run faulted, is taken over by "
        "another worker after this long. A live worker keeps the jobs it holds (running "
        "or waiting in its batcher) from going idle, however long they take.",
    )  # fmt: skip
    result_ttl_s: int = Field(3600, ge=1, description="How long a finished job's result is kept.")
    trust_pickle: bool = Field(
        False,
        description="Load pickle-based model files (as slipstream serve --trust-pickle): "
        "only for a repository you trust like code.",
    )
    metrics_port: int = Field(
        0, ge=0, le=65535, description="Serve /metrics (Prometheus) on this port; 0: off."
    )
    shutdown_timeout_s: float = Field(
        30.0, ge=0,
        description="On SIGTERM, how long the rounds under way may take to finish; jobs "
        "left unfinished are reclaimed by other workers.",
    )  # fmt: skip
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Logging level."
    )

    @field_validator("redis")
    @classmethod
    def _check_redis(cls, value: str) -> str:
        if not value.startswith(("redis://", "rediss://")):
            raise ValueError(f"expected redis://host:port[/db], got {value!r}")
        return value
