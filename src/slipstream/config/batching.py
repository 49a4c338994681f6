"""``dynamic_batching``: a model version's queue and batching policy (Triton's keys)."""

from __future__ import annotations

from pydantic import Field, model_validator

from slipstream.config.base import Strict


class QueuePolicy(Strict):
    """One priority level's queue policy (``priority_queue_policy``): as the default's
    keys, for that level's requests."""

    max_queue_size: int = Field(
        0, ge=0, description="Requests of this level queued beyond this are refused (0: no bound)"
    )
    default_timeout_microseconds: int = Field(
        0, ge=0, description="Queue timeout of this level's requests that set none; 0: none"
    )
    allow_timeout_override: bool = Field(
        True, description="A request's own timeout applies (shorter than the default only)"
    )


class DynamicBatching(Strict):
    """Queue and batching policy of one model version."""

    max_queue_delay_microseconds: int = Field(
        0,
        ge=0,
        description="How long the oldest request may wait for a fuller batch; 0 never waits.",
    )
    preferred_batch_size: list[int] = Field(
        default_factory=list, description="Batch sizes worth waiting for (with a delay)."
    )
    max_queue_size: int = Field(
        1024, ge=1, description="Requests queued beyond this are refused with 503."
    )
    default_timeout_microseconds: int = Field(
        0, ge=0, description="Queue timeout of requests that set none; 0 means no timeout."
    )
    allow_timeout_override: bool = Field(
        True,
        description="A request's own timeout applies: shorter than the default only (a "
        "config.pbtxt's default, as Triton's, is false: requests' timeouts are ignored)",
    )
    priority_levels: int = Field(0, ge=0, description="Number of priority levels; 0 = off.")
    inline_execution_max_microseconds: int = Field(
        300,
        ge=0,
        description="Slipstream: a lone batch of a model whose recent runs took less than "
        "this runs on the event loop instead of its instance thread (saves the hand-off "
        "latency); 0 always uses the thread.",
    )
    default_priority_level: int = Field(0, ge=0)
    priority_queue_policy: dict[int, QueuePolicy] = Field(
        default_factory=dict,
        description="A priority level's own queue policy (Triton's): its requests' "
        "default timeout and override, and a bound on that level's queue",
    )

    @model_validator(mode="after")
    def _check_priorities(self) -> DynamicBatching:
        if self.priority_levels and not 1 <= self.default_priority_level <= self.priority_levels:
            if self.default_priority_level == 0:
                self.default_priority_level = (self.priority_levels + 1) // 2
            else:
                raise ValueError(f"default_priority_level must be within 1..{self.priority_levels}")
        outside = [
            level for level in self.priority_queue_policy if not 1 <= level <= self.priority_levels
        ]
        if outside:
            raise ValueError(
                f"priority_queue_policy: level {outside[0]} is not one of the model's "
                f"priority levels (1..{self.priority_levels}; priority_levels sets them)"
            )
        return self
