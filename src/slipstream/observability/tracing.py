"""Request tracing with OpenTelemetry, configured as Triton configures its own
(``--trace-config``), exported over OTLP/HTTP to a collector (Jaeger, Tempo, the
OpenTelemetry Collector...).

    slipstream serve --model-repository ./models \\
        --trace-config mode=opentelemetry \\
        --trace-config opentelemetry,url=http://collector:4318/v1/traces \\
        --trace-config level=TIMESTAMPS --trace-config rate=1

Which requests are traced follows Triton's trace settings, global and per model, which
clients read and change at ``/v2[/models/<m>]/trace/setting`` (gRPC ``TraceSetting``):
``trace_level`` OFF or TIMESTAMPS, one request in ``trace_rate``, and ``trace_count``
traces before stopping (-1: no limit). A traced V2 inference is a span ``InferRequest``
(Triton's name) with ``triton.model_name``/``triton.model_version``, the request id and
the protocol, its outcome as the span's status, and under it Triton's TIMESTAMPS as
Triton's OpenTelemetry mode lays them out (:meth:`Tracing.add_timestamps`): a span named
after the model with the events ``REQUEST_START``, ``QUEUE_START`` and ``REQUEST_END``,
and its child span ``compute`` with ``COMPUTE_START``, ``COMPUTE_INPUT_END``,
``COMPUTE_OUTPUT_START`` and ``COMPUTE_END`` (an ensemble's or cascade's model span holds
one such model span per step), recorded by the serving core where it runs the request
(:mod:`slipstream.observability.timestamps`); an OpenAI route's request is a span
``POST /v1/chat/completions`` with the model and, when answered, the token usage. A
request that carries W3C trace context (``traceparent``, as OpenTelemetry-instrumented
clients send it, in HTTP headers or gRPC metadata) gets its span as a child of the
caller's, so a trace runs from the client through the server.

The front ends put each request's incoming headers in :data:`INCOMING` (for the task
that serves it); :class:`Tracing` decides and makes the spans. With no
``--trace-config`` nothing of this runs: no middleware, no wrapper, no exporter.
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from slipstream.config.tracing import TraceConfig
from slipstream.observability.timestamps import RequestTimes, RunTimes

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Incoming:
    """How the request being served came in."""

    # "http" or "grpc".
    protocol: str
    # Its W3C trace-context headers (traceparent, tracestate); None if it sent none.
    headers: Mapping[str, str] | None


# The request being served, set by the front ends for the task that serves it.
INCOMING: contextvars.ContextVar[Incoming | None] = contextvars.ContextVar(
    "slipstream_trace_incoming", default=None
)
# The header names the W3C propagator reads (lower case, as HTTP/2 and our parser give).
CONTEXT_HEADERS = ("traceparent", "tracestate")

# A model's trace settings as Triton's trace extension keeps them ("" the global ones).
SettingsView = Callable[[str], Mapping[str, list[str]]]


class Tracing:
    """The process's tracer: which requests to trace (:meth:`sampled`) and their spans
    (:meth:`span`). ``settings`` reads the live trace settings of a model."""

    def __init__(self, config: TraceConfig, settings: SettingsView, exporter: Any = None) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=config.url)
        self.config = config
        self._settings = settings
        resource = Resource.create({"service.name": "slipstream", **config.resource})
        self._provider = TracerProvider(resource=resource)
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("slipstream")
        # Per scope (a model with settings of its own, or ""): requests seen, traces made.
        self._seen: dict[str, Iterator[int]] = {}
        self._made: dict[str, int] = {}
        self._lock = threading.Lock()

    def sampled(self, model: str) -> bool:
        """Whether this request of ``model`` is traced: its level is not OFF, it is one in
        ``trace_rate`` (counted per model with a rate of its own), and ``trace_count``
        traces have not been made yet."""
        view = self._settings(model)
        if view.get("trace_level", ["OFF"]) in (["OFF"], []):
            return False
        own = self._settings("") != view  # a model with settings of its own counts apart
        scope = model if own else ""
        rate = int(view.get("trace_rate", ["1000"])[0])
        count = int(view.get("trace_count", ["-1"])[0])
        with self._lock:
            seen = next(self._seen.setdefault(scope, itertools.count()))
            if rate == 0 or seen % rate:
                return False
            if count >= 0 and self._made.get(scope, 0) >= count:
                return False
            self._made[scope] = self._made.get(scope, 0) + 1
        return True

    def start(self, name: str, attributes: Mapping[str, Any]) -> Any:
        """A started server span (end it with :meth:`end`), child of the incoming W3C
        context where the request carried one. Never made the current span: it may end
        in another task (a stream's writer)."""
        from opentelemetry.propagate import extract
        from opentelemetry.trace import SpanKind

        incoming = INCOMING.get()
        parent = extract(dict(incoming.headers)) if incoming and incoming.headers else None
        return self._tracer.start_span(
            name, context=parent, kind=SpanKind.SERVER, attributes=dict(attributes)
        )

    @staticmethod
    def end(span: Any, error: BaseException | None = None) -> None:
        """End ``span``; ``error``: it failed with it (the span's status says so)."""
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, _message(error)))
            span.set_attribute("error.type", type(error).__name__)
        span.end()

    @contextmanager
    def span(self, name: str, attributes: Mapping[str, Any]) -> Iterator[Any]:
        """:meth:`start` to :meth:`end` around a block; an exception out of it marks the
        span failed (and goes on)."""
        span = self.start(name, attributes)
        try:
            yield span
        except BaseException as exc:
            self.end(span, exc)
            raise
        self.end(span)

    def add_timestamps(
        self, span: Any, times: RequestTimes, model_name: str, model_version: str, ok: bool
    ) -> None:
        """Triton's TIMESTAMPS of a traced inference under its request ``span``, in
        Triton's shape: a span named after the model (events ``REQUEST_START``,
        ``QUEUE_START``, ``REQUEST_END``) with a child span ``compute``
        (``COMPUTE_START``, ``COMPUTE_INPUT_END``, ``COMPUTE_OUTPUT_START``,
        ``COMPUTE_END``); an ensemble's or a cascade's model span holds such a model span
        per step instead. ``ok``: the request was answered (a failed one that ran no
        model gets none). A fault here is logged, never the request's."""
        try:
            self._add_timestamps(span, times, model_name, model_version, ok)
        except Exception:
            logger.exception("request tracing: the timestamps of a request were not traced")

    def _add_timestamps(
        self, span: Any, times: RequestTimes, model_name: str, model_version: str, ok: bool
    ) -> None:
        runs = times.runs
        if not runs and not ok:
            return
        alone = len(runs) == 1 and runs[0].model_name == model_name
        version = model_version or (runs[0].model_version if alone else "")
        queue_start_ns = runs[0].queue_start_ns if alone else 0
        end_ns = times.request_end_ns
        top = self._model_span(
            span, model_name, version, times.request_start_ns, queue_start_ns, end_ns
        )
        for run in runs:
            if alone:
                self._compute_span(top, run, end_ns)
                continue
            step_end_ns = run.request_end_ns or end_ns
            step = self._model_span(
                top, run.model_name, run.model_version, run.request_start_ns,
                run.queue_start_ns, step_end_ns,
            )  # fmt: skip
            self._compute_span(step, run, step_end_ns)

    def _model_span(
        self,
        parent: Any,
        name: str,
        version: str,
        start_ns: int,
        queue_start_ns: int,
        end_ns: int,
    ) -> Any:
        """Triton's model span: one model's part of the request (ended; its context
        still parents the spans made after it)."""
        attributes = {"triton.model_name": name, "triton.model_version": version}
        span = self._past_span(name, parent, start_ns, attributes)
        _events(span, ("REQUEST_START", start_ns), ("QUEUE_START", queue_start_ns),
                ("REQUEST_END", end_ns))  # fmt: skip
        span.end(end_time=end_ns)
        return span

    def _compute_span(self, parent: Any, run: RunTimes, end_ns: int) -> None:
        """Triton's compute span: the run's batch on its instance (none where it never
        started; ending with ``end_ns`` where its end is not known, a decoupled model's
        run still going when its final answer was sent)."""
        if not run.compute_start_ns:
            return
        span = self._past_span("compute", parent, run.compute_start_ns)
        _events(span, ("COMPUTE_START", run.compute_start_ns),
                ("COMPUTE_INPUT_END", run.compute_input_end_ns),
                ("COMPUTE_OUTPUT_START", run.compute_output_start_ns),
                ("COMPUTE_END", run.compute_end_ns))  # fmt: skip
        span.end(end_time=run.compute_end_ns or end_ns)

    def _past_span(
        self, name: str, parent: Any, start_ns: int, attributes: Mapping[str, Any] | None = None
    ) -> Any:
        from opentelemetry.trace import SpanKind, set_span_in_context

        return self._tracer.start_span(
            name, context=set_span_in_context(parent), kind=SpanKind.INTERNAL,
            attributes=attributes, start_time=start_ns,
        )  # fmt: skip

    def shutdown(self) -> None:
        """Export what is buffered, then stop (at the server's stop)."""
        self._provider.shutdown()


def _events(span: Any, *events: tuple[str, int]) -> None:
    """``events`` on ``span`` at their times, those that happened (0: did not)."""
    for name, ns in events:
        if ns:
            span.add_event(name, timestamp=ns)


def _message(exc: BaseException) -> str:
    message = getattr(exc, "message", None)
    return str(message if isinstance(message, str) else exc)[:500]


def incoming_headers(pairs: Iterable[tuple[Any, Any]]) -> dict[str, str] | None:
    """The trace-context headers among ``pairs`` (bytes or str, any case); None if none."""
    found: dict[str, str] = {}
    for key, value in pairs:
        name = (key.decode("latin-1") if isinstance(key, bytes) else str(key)).lower()
        if name in CONTEXT_HEADERS:
            found[name] = value.decode("latin-1") if isinstance(value, bytes) else str(value)
    return found or None
