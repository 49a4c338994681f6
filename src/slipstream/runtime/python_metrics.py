"""Custom metrics of Python models (Triton's ``pb_utils.MetricFamily``), on ``/metrics``.

A model.py declares a family and its labelled metrics, and counts what it likes::

    family = pb_utils.MetricFamily(name="tokens_seen", description="...",
                                   kind=pb_utils.MetricFamily.COUNTER)
    seen = family.Metric(labels={"model": "tokenize"})
    seen.increment(len(tokens))

Kinds: ``COUNTER`` (increments of zero or more), ``GAUGE`` (set, increment by any
amount), ``HISTOGRAM`` (a metric made with ``buckets=[...]``, then ``observe``). The
server exposes them beside its own series (the serving core registers
:data:`COLLECTOR`), under the names the model chose, as Triton does. A family declared
again with the same kind and description is the same family (a model loaded again, or
several instances); with another kind it is refused. A name the server's own series use
is refused when the model declares it.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
# Prefixes of the server's own series: a model's family may not take them.
_RESERVED = ("slipstream_", "nv_", "process_", "python_")


class MetricError(Exception):
    """A family or metric declared or used against the rules above."""


class _Metric:
    """One labelled series of a family."""

    def __init__(
        self, family: _Family, labels: Mapping[str, str], buckets: Sequence[float]
    ) -> None:
        self._family = family
        self._lock = threading.Lock()
        self.labels = dict(labels)
        self._value = 0.0
        self._buckets = tuple(buckets)
        self._counts = [0] * (len(self._buckets) + 1)
        self._sum = 0.0

    def increment(self, value: float) -> None:
        kind = self._family.kind
        if kind == MetricFamily.HISTOGRAM:
            raise MetricError(f"{self._family.name}: a histogram is observed, not incremented")
        if kind == MetricFamily.COUNTER and value < 0:
            raise MetricError(f"{self._family.name}: a counter only goes up, got {value}")
        with self._lock:
            self._value += float(value)

    def set(self, value: float) -> None:
        if self._family.kind != MetricFamily.GAUGE:
            raise MetricError(f"{self._family.name}: only a gauge is set")
        with self._lock:
            self._value = float(value)

    def observe(self, value: float) -> None:
        if self._family.kind != MetricFamily.HISTOGRAM:
            raise MetricError(f"{self._family.name}: only a histogram observes")
        with self._lock:
            self._sum += float(value)
            index = next((i for i, bound in enumerate(self._buckets) if value <= bound), -1)
            self._counts[index] += 1

    def value(self) -> float:
        if self._family.kind == MetricFamily.HISTOGRAM:
            raise MetricError(f"{self._family.name}: a histogram has no single value")
        return self._value

    def samples(self) -> Iterator[tuple[str, dict[str, str], float]]:
        name = self._family.name
        with self._lock:
            if self._family.kind != MetricFamily.HISTOGRAM:
                yield name, self.labels, self._value
                return
            total = 0
            for bound, count in zip(self._buckets, self._counts, strict=False):
                total += count
                yield f"{name}_bucket", {**self.labels, "le": _float(bound)}, total
            total += self._counts[-1]
            yield f"{name}_bucket", {**self.labels, "le": "+Inf"}, total
            yield f"{name}_count", self.labels, total
            yield f"{name}_sum", self.labels, self._sum


class _Family:
    def __init__(self, name: str, description: str, kind: int) -> None:
        self.name, self.description, self.kind = name, description, kind
        self.metrics: dict[tuple[tuple[str, str], ...], _Metric] = {}
        self.lock = threading.Lock()


class MetricFamily:
    """Triton's ``pb_utils.MetricFamily``: a named metric and its labelled series."""

    COUNTER = 0
    GAUGE = 1
    HISTOGRAM = 2

    def __init__(self, name: str, description: str, kind: int) -> None:
        if not isinstance(name, str) or not _NAME.match(name):
            raise MetricError(f"MetricFamily name {name!r}: letters, digits, _ and : only")
        if name.startswith(_RESERVED):
            raise MetricError(f"MetricFamily name {name!r}: {_RESERVED} are the server's own")
        if kind not in (self.COUNTER, self.GAUGE, self.HISTOGRAM):
            raise MetricError(f"MetricFamily {name!r}: kind must be COUNTER, GAUGE or HISTOGRAM")
        self._family = COLLECTOR.family(name, str(description), kind)

    def Metric(
        self, labels: Mapping[str, str] | None = None, buckets: Iterable[float] | None = None
    ) -> _Metric:
        family = self._family
        labels = {str(k): str(v) for k, v in (labels or {}).items()}
        bad = [key for key in labels if not _LABEL.match(key) or key == "le"]
        if bad:
            raise MetricError(f"{family.name}: label name {bad[0]!r} is not allowed")
        bounds = sorted(float(b) for b in buckets or ())
        if family.kind == self.HISTOGRAM and not bounds:
            raise MetricError(f"{family.name}: a histogram metric needs buckets=[...]")
        key = tuple(sorted(labels.items()))
        with family.lock:
            metric = family.metrics.get(key)
            if metric is None:
                metric = family.metrics[key] = _Metric(family, labels, bounds)
        return metric


class _Collector(Collector):
    """Every Python model's families, for the server's registry."""

    def __init__(self) -> None:
        self._families: dict[str, _Family] = {}
        self._lock = threading.Lock()

    def family(self, name: str, description: str, kind: int) -> _Family:
        with self._lock:
            family = self._families.get(name)
            if family is None:
                family = self._families[name] = _Family(name, description, kind)
            elif family.kind != kind:
                raise MetricError(f"MetricFamily {name!r} is already declared of another kind")
            return family

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            families = list(self._families.values())
        for family in families:
            # A counter typed gauge, as the server's nv_* series: written under the
            # model's own name, which a counter family would suffix with _total.
            kind = "histogram" if family.kind == MetricFamily.HISTOGRAM else "gauge"
            metric = Metric(family.name, family.description, kind)
            with family.lock:
                series = list(family.metrics.values())
            for one in series:
                for name, labels, value in one.samples():
                    metric.add_sample(name, labels, value)
            yield metric

    def describe(self) -> Iterator[Any]:
        return iter(())  # families come and go with models: never checked at registration


def _float(bound: float) -> str:
    return repr(float(bound))


# The process's families: the serving core registers it in its registry.
COLLECTOR = _Collector()
