"""The front door's counters, exposed on /metrics (labels carry key names, never keys)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector


class FrontDoorMetrics(Collector):
    """Counts updated on the event loop; turned into metric families at scrape time."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        # reason: missing_key, unknown_key, wrong_role, wrong_model. The known labels
        # start at 0, so their series exist (and rate() works) before the first event.
        self.refused: Counter[str] = Counter(
            dict.fromkeys(("missing_key", "unknown_key", "wrong_role", "wrong_model"), 0)
        )
        # (key name, limit): requests, concurrency, tokens.
        self.limited: Counter[tuple[str, str]] = Counter()
        # Rate-limit store calls that failed (Redis unreachable), by what was done.
        self.store_errors: Counter[str] = Counter(dict.fromkeys(("admitted", "refused"), 0))
        if registry is not None:
            registry.register(self)

    def collect(self) -> Iterator[Metric]:
        refused = CounterMetricFamily(
            "slipstream_auth_refused",
            "Requests refused by the API-key check (401/403), by reason.",
            labels=["reason"],
        )
        for reason, count in sorted(self.refused.items()):
            refused.add_metric([reason], count)
        limited = CounterMetricFamily(
            "slipstream_rate_limited",
            "Requests refused with 429, by key name and the limit that refused them.",
            labels=["key", "limit"],
        )
        for (key, limit), count in sorted(self.limited.items()):
            limited.add_metric([key, limit], count)
        errors = CounterMetricFamily(
            "slipstream_rate_limit_store_errors",
            "Rate-limit checks the store (Redis) could not answer, by outcome "
            "(admitted: fail open, refused: fail closed).",
            labels=["outcome"],
        )
        for outcome, count in sorted(self.store_errors.items()):
            errors.add_metric([outcome], count)
        yield from (refused, limited, errors)
