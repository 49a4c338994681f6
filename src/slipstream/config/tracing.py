"""``--trace-config``, as Triton spells it: which requests are traced and where spans go
(:mod:`slipstream.observability.tracing` does the tracing)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

LEVELS = ("OFF", "TIMESTAMPS")
_DEFAULT_URL = "http://localhost:4318/v1/traces"  # Triton's default, with its scheme


class TraceConfigError(ValueError):
    """A ``--trace-config`` entry that cannot be used; the message names it."""


@dataclass(frozen=True, slots=True)
class TraceConfig:
    """What ``--trace-config`` entries say (Triton's keys)."""

    # Whether tracing is on at all: mode=opentelemetry was given.
    enabled: bool = False
    # The OTLP/HTTP endpoint spans are exported to.
    url: str = _DEFAULT_URL
    # The starting trace settings (clients may change them at /v2/trace/setting).
    level: str = "TIMESTAMPS"
    rate: int = 1000
    count: int = -1
    # OpenTelemetry resource attributes (service.name defaults to "slipstream").
    resource: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, entries: Iterable[str]) -> TraceConfig:
        """From ``--trace-config`` values: ``mode=opentelemetry``, ``level=...``,
        ``rate=N``, ``count=N``, ``opentelemetry,url=...``, ``opentelemetry,resource=k=v``.

        >>> TraceConfig.parse(["mode=opentelemetry", "opentelemetry,url=otel:4318/v1/traces"]).url
        'http://otel:4318/v1/traces'
        """
        values: dict[str, Any] = {}
        resource: dict[str, str] = {}
        for entry in entries:
            head, comma, tail = entry.partition(",")
            section, setting = (head, tail) if comma and "=" not in head else ("", entry)
            key, sep, value = setting.partition("=")
            if not sep:
                raise TraceConfigError(f"--trace-config {entry!r}: expected key=value")
            if section not in ("", "opentelemetry"):
                raise TraceConfigError(
                    f"--trace-config {entry!r}: only the opentelemetry section is served"
                )
            values.update(_entry(entry, section, key, value, resource))
        if "enabled" not in values and values:
            raise TraceConfigError(
                "--trace-config: add mode=opentelemetry (Triton's own trace files are not "
                "written: spans are exported over OTLP)"
            )
        return cls(resource=resource, **values)


def _entry(
    entry: str, section: str, key: str, value: str, resource: dict[str, str]
) -> dict[str, Any]:
    if section == "opentelemetry":
        if key == "url":
            return {"url": value if "://" in value else f"http://{value}"}
        if key == "resource":
            name, sep, attribute = value.partition("=")
            if not sep or not name:
                raise TraceConfigError(f"--trace-config {entry!r}: expected resource=key=value")
            resource[name] = attribute
            return {}
        raise TraceConfigError(f"--trace-config {entry!r}: opentelemetry takes url or resource")
    if key == "mode":
        if value != "opentelemetry":
            raise TraceConfigError(
                f"--trace-config {entry!r}: only mode=opentelemetry is served (spans over OTLP)"
            )
        return {"enabled": True}
    if key == "level":
        level = value.upper()
        if level not in LEVELS:
            raise TraceConfigError(f"--trace-config {entry!r}: level is one of {', '.join(LEVELS)}")
        return {"level": level}
    if key in ("rate", "count"):
        try:
            number = int(value)
        except ValueError:
            number = -2
        if number < (0 if key == "rate" else -1):
            raise TraceConfigError(f"--trace-config {entry!r}: {key} takes an integer")
        return {key: number}
    raise TraceConfigError(
        f"--trace-config {entry!r}: unknown key {key!r} (mode, level, rate, count, "
        "opentelemetry,url, opentelemetry,resource)"
    )
