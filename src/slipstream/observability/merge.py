"""One ``/metrics`` answer for several processes: snapshots of their registries, merged.

A process that does not answer the scrape itself (a Ray replica, a front-end or engine
process of the split layout) sends :func:`snapshot` of its registry as plain, picklable
data; the process that answers merges them with :func:`merged_text`, each series
labelled with where it came from (``replica="..."``, ``frontend="0"``, ``engine="cuda:0"``).

    text = merged_text([({}, engine_families), ({"frontend": "0"}, mine),
                        ({"frontend": "1"}, other_frontend)])
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Metric, generate_latest

# One metric family as plain data: name, type, help, samples of (sample name, labels,
# value).
Family = tuple[str, str, str, list[tuple[str, dict[str, str], float]]]


def snapshot(registry: CollectorRegistry) -> list[Family]:
    """Every family of ``registry`` now, as plain data."""
    return [
        (family.name, family.type, family.documentation,
         [(s.name, dict(s.labels), float(s.value)) for s in family.samples])
        for family in registry.collect()
    ]  # fmt: skip


# A snapshot and the labels that say where it came from.
Report = tuple[dict[str, str], list[Family]]


def merged_text(reports: Iterable[Report]) -> bytes:
    """The Prometheus text of every snapshot in ``reports``, each of its series given
    the snapshot's labels."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(list(reports)))
    return generate_latest(registry)


class _Merged:
    def __init__(self, reports: list[Report]) -> None:
        self._reports = reports

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for extra, report in self._reports:
            for name, kind, documentation, samples in report:
                family = families.get(name)
                if family is None:
                    family = families[name] = Metric(name, documentation, kind)
                for sample, labels, value in samples:
                    family.add_sample(sample, {**labels, **extra}, value)
        yield from families.values()
