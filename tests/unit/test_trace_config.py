"""``--trace-config`` entries as Triton spells them, read into a TraceConfig; bad ones
refused naming the entry."""

from __future__ import annotations

import doctest

import pytest

from slipstream.config import tracing as config_tracing
from slipstream.config.tracing import TraceConfig, TraceConfigError
from slipstream.observability.tracing import incoming_headers


def test_triton_s_entries_are_read() -> None:
    config = TraceConfig.parse([
        "mode=opentelemetry", "opentelemetry,url=https://otel.example:4318/v1/traces",
        "level=timestamps", "rate=10", "count=-1", "opentelemetry,resource=service.name=api",
        "opentelemetry,resource=team=ml",
    ])  # fmt: skip
    assert config.enabled and config.url == "https://otel.example:4318/v1/traces"
    assert (config.level, config.rate, config.count) == ("TIMESTAMPS", 10, -1)
    assert config.resource == {"service.name": "api", "team": "ml"}
    assert not TraceConfig.parse([]).enabled


@pytest.mark.parametrize(
    ("entries", "fragment"),
    [
        (["level=TIMESTAMPS"], "add mode=opentelemetry"),
        (["mode=triton"], "only mode=opentelemetry"),
        (["mode=opentelemetry", "file=/tmp/t.json"], "unknown key 'file'"),
        (["mode=opentelemetry", "count=-2"], "count takes an integer"),
        (["mode=opentelemetry", "triton,file=x"], "only the opentelemetry section"),
        (["mode=opentelemetry", "opentelemetry,resource=novalue"], "resource=key=value"),
        (["mode=opentelemetry", "opentelemetry,bsp_max_queue_size=4"], "url or resource"),
        (["mode"], "expected key=value"),
    ],
)
def test_bad_entries_are_refused_naming_them(entries: list[str], fragment: str) -> None:
    with pytest.raises(TraceConfigError, match=fragment):
        TraceConfig.parse(entries)


def test_only_the_trace_context_headers_are_taken() -> None:
    pairs = [(b"traceparent", b"00-ab-cd-01"), (b"authorization", b"secret"),
             ("TraceState", "k=v")]  # fmt: skip
    assert incoming_headers(pairs) == {"traceparent": "00-ab-cd-01", "tracestate": "k=v"}
    assert incoming_headers([(b"host", b"x")]) is None


def test_the_module_examples_hold() -> None:
    assert doctest.testmod(config_tracing).failed == 0
