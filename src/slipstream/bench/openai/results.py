"""Figures of an OpenAI-mode run: per request, and per load level as vLLM reports them.

Definitions follow vLLM's ``benchmark_serving.py``, so the numbers compare:

- TTFT, time to first token: from the request's arrival to its first content chunk.
  In open loop the arrival is the scheduled time (a request sent late still counts
  its wait, as in the V2 modes); in closed loop it is the send.
- TPOT, time per output token: ``(e2e - ttft) / (output_tokens - 1)``, for requests
  of more than one output token.
- ITL, inter-token latency: every gap between two content chunks of a request.
- E2E: from arrival to the response's last byte.
- Goodput: successful requests per second that meet every SLO given (a request of one
  output token meets any TPOT limit, as in vLLM).

Throughputs divide by the level's duration: from its first arrival to its last
response.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from slipstream.bench.core.errors import error_summary, reconnects_warning
from slipstream.bench.core.histogram import LatencyHistogram
from slipstream.bench.core.levels import LoadLevel
from slipstream.bench.core.schedule import LATE_SEND_SHARE, SATURATED_CPU_PCT


@dataclass
class RequestResult:
    """One request of a level, as the client saw it."""

    # Position in the run's request list.
    index: int
    # Arrival (scheduled send in open loop), seconds after the level's start.
    arrival_s: float
    # How late the send was after its scheduled arrival (0 in closed loop).
    send_lag_s: float
    # max_tokens asked.
    max_tokens: int
    # Error key ("http 503", "timeout", "stream error", ...); None on success.
    error: str | None = None
    # From the usage chunk; output_tokens falls back to the content chunks counted
    # when the server sent no usage.
    prompt_tokens: int | None = None
    output_tokens: int = 0
    # Whether output_tokens came from the server's usage chunk.
    usage_reported: bool = False
    # None when the request failed (or, for TTFT, produced no content).
    ttft_s: float | None = None
    e2e_s: float | None = None
    # Gaps between consecutive content chunks.
    itl_s: list[float] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        return tpot_s(self.e2e_s, self.ttft_s, self.output_tokens)


def tpot_s(e2e_s: float | None, ttft_s: float | None, output_tokens: int) -> float | None:
    """vLLM's time per output token, excluding the first; None for fewer than 2 tokens.

    >>> tpot_s(e2e_s=1.1, ttft_s=0.1, output_tokens=11)
    0.1
    """
    if e2e_s is None or ttft_s is None or output_tokens < 2:
        return None
    return (e2e_s - ttft_s) / (output_tokens - 1)


def meets_slos(request: RequestResult, slos_ms: Mapping[str, float]) -> bool:
    """Whether a successful request meets every SLO (ms by metric: ttft, tpot, e2el).

    A request with no content chunk is held to the TTFT limit with its E2E (it waited
    that long for its whole, empty answer); one of a single token has TPOT 0, as vLLM
    counts it.
    """
    if request.error is not None or request.e2e_s is None:
        return False
    values_s = {
        "ttft": request.ttft_s if request.ttft_s is not None else request.e2e_s,
        "tpot": request.tpot_s or 0.0,
        "e2el": request.e2e_s,
    }
    return all(values_s[name] * 1000 <= limit_ms for name, limit_ms in slos_ms.items())


@dataclass
class LatencySummary:
    """Mean and percentiles of one metric, in ms; None when no request had it."""

    count: int
    mean_ms: float | None
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    max_ms: float | None

    @classmethod
    def of(cls, values_s: Sequence[float]) -> LatencySummary:
        """From raw values in seconds, through the bench's histogram (nearest rank,
        within 0.5%; the mean and max are exact)."""
        hist = LatencyHistogram.from_latencies(np.asarray(values_s, dtype=np.float64))
        return cls(hist.count, hist.ms(), hist.ms(50), hist.ms(90), hist.ms(99), hist.ms(100))


@dataclass
class OpenAILevelResult:
    """Every figure of one load level; per-request detail in ``request_results``."""

    concurrency: int | None
    request_rate: float | None
    # From the first arrival to the last response.
    duration_s: float
    # Successful requests, and failed ones by error key with an example message each.
    requests: int
    errors: int
    errors_by_code: dict[str, int]
    error_examples: dict[str, str]
    request_throughput_per_s: float
    # Output (and prompt + output) tokens of successful requests per second.
    output_throughput_tok_per_s: float
    total_token_throughput_tok_per_s: float
    prompt_tokens: int
    output_tokens: int
    # Requests per second meeting every --goodput SLO; None without SLOs.
    goodput_req_per_s: float | None
    good_requests: int | None
    ttft: LatencySummary
    tpot: LatencySummary
    itl: LatencySummary
    e2e: LatencySummary
    # Most requests outstanding at once.
    peak_inflight: int
    # Open loop: arrivals per second actually sent, and those over 10 ms late.
    send_rate_per_s: float | None
    late_sends: int
    max_send_lag_ms: float | None
    # CPU of this client in percent of one core over the level.
    client_cpu_pct: float
    # Requests sent again on a fresh connection after the server closed a pooled one
    # before answering (keep-alive timeouts): not errors.
    reconnects: int = 0
    warnings: list[str] = field(default_factory=list)
    request_results: list[RequestResult] = field(default_factory=list)

    @property
    def label(self) -> str:
        return LoadLevel(self.concurrency, self.request_rate).label


@dataclass
class OpenAIBenchResult:
    """A whole OpenAI-mode run: what was measured and one result per load level."""

    url: str
    model: str
    protocol: str
    # Open loop's arrival distribution; None in closed loop.
    distribution: str | None
    num_requests: int
    ignore_eos: bool
    # The --goodput SLOs in ms by metric.
    goodput_slos_ms: dict[str, float]
    levels: list[OpenAILevelResult]
    warnings: list[str] = field(default_factory=list)
    # The warm-up request's time to first token (its prompt alone on the server, before
    # the first level); None when it produced no content. Not in any level's figures.
    probe_ttft_ms: float | None = None
    # The settings as given, for the JSON record.
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LevelMeasurement:
    """What the runner measured for one level, turned into a result here."""

    level: LoadLevel
    requests: list[RequestResult]
    duration_s: float
    error_examples: dict[str, str]
    peak_inflight: int
    late_sends: int
    client_cpu_s: float
    slos_ms: Mapping[str, float]
    ignore_eos: bool
    # Open loop: the --max-inflight cap.
    max_inflight: int
    # Requests sent again on a fresh connection (see OpenAILevelResult.reconnects).
    reconnects: int = 0


def level_result(measured: LevelMeasurement) -> OpenAILevelResult:
    ok = [r for r in measured.requests if r.error is None]
    errors: dict[str, int] = {}
    for request in measured.requests:
        if request.error is not None:
            errors[request.error] = errors.get(request.error, 0) + 1
    duration_s = measured.duration_s
    per_s = 1 / duration_s if duration_s > 0 else 0.0
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    good = None
    if measured.slos_ms:
        good = sum(meets_slos(r, measured.slos_ms) for r in ok)
    lags = [r.send_lag_s for r in measured.requests]
    open_loop = measured.level.request_rate is not None
    result = OpenAILevelResult(
        concurrency=measured.level.concurrency,
        request_rate=measured.level.request_rate,
        duration_s=duration_s,
        requests=len(ok),
        errors=sum(errors.values()),
        errors_by_code=dict(sorted(errors.items())),
        error_examples={k: measured.error_examples.get(k, "") for k in sorted(errors)},
        request_throughput_per_s=len(ok) * per_s,
        output_throughput_tok_per_s=output_tokens * per_s,
        total_token_throughput_tok_per_s=(prompt_tokens + output_tokens) * per_s,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        goodput_req_per_s=None if good is None else good * per_s,
        good_requests=good,
        ttft=LatencySummary.of([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot=LatencySummary.of([t for r in ok if (t := r.tpot_s) is not None]),
        itl=LatencySummary.of([gap for r in ok for gap in r.itl_s]),
        e2e=LatencySummary.of([r.e2e_s for r in ok if r.e2e_s is not None]),
        peak_inflight=measured.peak_inflight,
        send_rate_per_s=_send_rate(measured.requests) if open_loop else None,
        late_sends=measured.late_sends,
        max_send_lag_ms=max(lags) * 1000 if open_loop and lags else None,
        client_cpu_pct=100 * measured.client_cpu_s / duration_s if duration_s > 0 else 0.0,
        reconnects=measured.reconnects,
        request_results=measured.requests,
    )
    result.warnings = _warnings(result, ok, measured)
    return result


def _send_rate(requests: list[RequestResult]) -> float | None:
    """Arrivals per second over the span of arrivals (n - 1 gaps)."""
    if len(requests) < 2:
        return None
    span_s = max(r.arrival_s + r.send_lag_s for r in requests)
    return (len(requests) - 1) / span_s if span_s > 0 else None


def _warnings(
    result: OpenAILevelResult, ok: list[RequestResult], measured: LevelMeasurement
) -> list[str]:
    warnings = []
    max_inflight = measured.max_inflight
    if not ok:
        warnings.append("no request succeeded: " + error_summary(result))
    if result.client_cpu_pct >= SATURATED_CPU_PCT:
        warnings.append(
            f"the client used {result.client_cpu_pct:.0f}% of a core: its own delays are in "
            "the latencies; run it on another machine or lower the load"
        )
    sent = len(result.request_results)
    if sent and result.late_sends > LATE_SEND_SHARE * sent:
        cause = (
            "the in-flight cap (--max-inflight) held them"
            if result.peak_inflight >= max_inflight
            else "the client was busy or short of CPU"
        )
        warnings.append(
            f"open loop: {100 * result.late_sends / sent:.1f}% of requests were sent over "
            f"10 ms late (worst {result.max_send_lag_ms or 0:.1f} ms): {cause}; their "
            "latencies count from the scheduled arrival"
        )
    warnings += reconnects_warning(result.reconnects)
    unreported = sum(not r.usage_reported for r in ok)
    if unreported:
        warnings.append(
            f"{unreported} responses carried no usage chunk (stream_options.include_usage): "
            "their output tokens are counted as content chunks, which can be fewer"
        )
    if measured.ignore_eos:
        short = sum(r.usage_reported and r.output_tokens < r.max_tokens for r in ok)
        if short:
            warnings.append(
                f"{short} responses stopped before max_tokens despite ignore_eos: the server "
                "ignores the extension, or a stop sequence or the context length ended them"
            )
    return warnings
