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
