"""A finished request in its version's statistics and metrics, however it was served."""

from __future__ import annotations

from slipstream.errors import ClientError, Decoupled, NotFound, SlipstreamError, Unavailable
from slipstream.observability.metrics import ModelMetrics
from slipstream.serving.model import ModelVersion


def record_success(model: ModelVersion, elapsed_ns: int, count: int = 1) -> None:
    """``count`` requests served, each in ``elapsed_ns`` (a stack's parts: one call)."""
    model.stats.record_request(ok=True, total_ns=elapsed_ns, count=count)
    model.metrics.request_success += count
    model.metrics.request_duration.observe(elapsed_ns / 1e9, count)


def record_failure(model: ModelVersion, exc: SlipstreamError, elapsed_ns: int) -> None:
    if isinstance(exc, Decoupled):
        # One answer asked of a decoupled model: refused before it ran, as Triton's front
        # ends refuse it (gRPC's ModelStreamInfer asks so first, then streams the answers).
        return
    model.stats.record_request(ok=False, total_ns=elapsed_ns)
    count_failure(model.metrics, exc)


def count_failure(metrics: ModelMetrics, exc: SlipstreamError) -> None:
    if isinstance(exc, Unavailable):
        return  # queue-full and timeout are counted by the batcher, where they happen
    if isinstance(exc, NotFound):
        reason = "not_found"
    elif isinstance(exc, ClientError):
        reason = "bad_request"
    else:
        reason = "internal"
    metrics.count_failure(reason)
