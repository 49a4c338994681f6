"""The load levels of a sweep, as both bench modes take them.

Light on purpose (no pydantic, no numpy): the V2 mode's worker processes and the CLI
import it first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# Open loop: gaps between scheduled sends, constant or exponential (a Poisson process).
Distribution = Literal["constant", "poisson"]


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
