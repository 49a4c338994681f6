"""The OpenAI mode's runner: a fixed set of streamed requests per load level.

A level reads as its steps: send the run's requests (open loop: at Poisson or constant
arrival times, whatever the responses do; closed loop: ``concurrency`` users, each
sending its next request when its last one ends), read every stream to its end, and
turn the per-request timings into a :class:`OpenAILevelResult`. Before the first level
one short request checks the URL and model and warms the server up; it is not measured.

Unlike the V2 modes there are no worker processes and no stability windows: a streamed
generation lasts tens of milliseconds to seconds and costs the client a few
microseconds per chunk, so one event loop keeps up with hundreds of streams (the
client's CPU is reported, with a warning if it saturates); and a run is a fixed
number of requests, as in vLLM's ``benchmark_serving.py``, so levels compare
request for request.

Example::

    from slipstream.bench.openai.runner import run_openai_benchmark

    result = run_openai_benchmark("http://localhost:8000", "smollm2", request_rate=[2.0],
                                  num_requests=50, output_tokens=64, ignore_eos=True)
    level = result.levels[0]
    print(level.output_throughput_tok_per_s, level.ttft.p99_ms, level.tpot.mean_ms)
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Awaitable, Mapping, Sequence

import numpy as np

from slipstream.bench.core.endpoint import parse_endpoint
from slipstream.bench.core.errors import BenchError, ServerUnreachable
from slipstream.bench.core.levels import Distribution, LoadLevel
from slipstream.bench.core.schedule import (
    LoadDriver,
    arrival_gaps_s,
    corrected_latency_s,
    run_event_loop,
)
from slipstream.bench.openai.client import OpenAIClient, StreamState
from slipstream.bench.openai.requests import GenerationRequest, build_requests, request_body
from slipstream.bench.openai.results import (
    LevelMeasurement,
    OpenAIBenchResult,
    OpenAILevelResult,
    RequestResult,
    level_result,
)
from slipstream.bench.openai.settings import OpenAIBenchSettings, OpenAIProtocol, TokenRange

# What the CLI adds when no request of any level succeeded.
ALL_FAILED_HINT = "an overloaded server, or prompts plus max_tokens beyond the model's context"
# The warm-up request asks for this many tokens at most.
_PROBE_MAX_TOKENS = 4
# A send later than this after its scheduled arrival counts as late: under 1% of a
# streamed generation's latency (the V2 modes' 1 ms would flag mere scheduler noise).
LATE_SEND_S = 0.01


class ProgressListener:
    """Told about the run as it goes: the CLI's live progress overrides these no-ops
    (``slipstream.bench.openai.report.RichProgress``); the API passes nothing."""

    def level_started(self, level: LoadLevel, total: int) -> None:
        pass

    def request_done(self, request: RequestResult) -> None:
        pass

    def level_done(self, result: OpenAILevelResult) -> None:
        pass


def run_openai_benchmark(
    url: str,
    model: str,
    *,
    protocol: OpenAIProtocol = "openai-chat",
    request_rate: Sequence[float] = (),
    concurrency: Sequence[int] = (),
    num_requests: int = 100,
    prompt_tokens: int | str | TokenRange = 256,
    output_tokens: int | str | TokenRange = 128,
    prompts: Sequence[str | list[int]] | None = None,
    ignore_eos: bool = False,
    goodput_ms: Mapping[str, float] | None = None,
    distribution: Distribution = "poisson",
    max_inflight: int = 256,
    timeout_s: float = 300.0,
    seed: int = 0,
) -> OpenAIBenchResult:
    """Benchmark a generative model behind an OpenAI-compatible server, level by level.

    One level per ``request_rate`` (open loop) or ``concurrency`` (closed loop; 1 when
    neither is given), each sending the same ``num_requests`` streamed requests.
    Lengths are ``MEAN`` or ``"MEAN,SPREAD"`` tokens (or a :class:`TokenRange`);
    ``prompts`` replaces the synthetic prompts (texts, or token-id lists for
    ``openai-completions``; used in turn); ``goodput_ms`` holds
    SLOs like ``{"ttft": 500, "tpot": 50}``. Raises ``pydantic.ValidationError`` for a
    bad argument and :class:`BenchError` when the server cannot be benchmarked (the
    warm-up request failed). Runs its own event loop: from async code, use
    :func:`run_bench_async`.

    >>> result = run_openai_benchmark("http://localhost:8000", "smollm2",
    ...     request_rate=[1, 2], num_requests=20, output_tokens="64,16",
    ...     goodput_ms={"ttft": 1000})  # doctest: +SKIP
    >>> [(lvl.request_rate, lvl.goodput_req_per_s) for lvl in result.levels]  # doctest: +SKIP
    """
    settings = OpenAIBenchSettings(
        url=url,
        model=model,
        protocol=protocol,
        request_rate=list(request_rate),
        concurrency=list(concurrency),
        num_requests=num_requests,
        prompt_tokens=TokenRange.of(prompt_tokens),
        output_tokens=TokenRange.of(output_tokens),
        ignore_eos=ignore_eos,
        goodput=dict(goodput_ms or {}),
        distribution=distribution,
        max_inflight=max_inflight,
        timeout_s=timeout_s,
        seed=seed,
    )
    return run_bench(settings, prompts=prompts)


def run_bench(
    settings: OpenAIBenchSettings,
    progress: ProgressListener | None = None,
    prompts: Sequence[str | list[int]] | None = None,
) -> OpenAIBenchResult:
    """:func:`run_bench_async` on a fresh event loop (uvloop where installed)."""
    return run_event_loop(run_bench_async(settings, progress, prompts))


async def run_bench_async(
    settings: OpenAIBenchSettings,
    progress: ProgressListener | None = None,
    prompts: Sequence[str | list[int]] | None = None,
) -> OpenAIBenchResult:
    """Measure every load level of ``settings``; BenchError when it cannot run."""
    listener = progress or ProgressListener()
    try:
        endpoint = parse_endpoint(settings.url, "http")
        requests = build_requests(settings, prompts)
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    client = OpenAIClient(endpoint, settings.path, settings.timeout_s)
    try:
        probe_ttft_s = await _probe(client, settings, requests[0])
        levels = []
        for level in settings.load_levels():
            listener.level_started(level, len(requests))
            measured = await LevelRun(client, settings, requests, level, listener).run()
            result = level_result(measured)
            listener.level_done(result)
            levels.append(result)
    finally:
        await client.close()
    return OpenAIBenchResult(
        url=settings.url,
        model=settings.model,
        protocol=settings.protocol,
        distribution=settings.distribution if settings.request_rate else None,
        num_requests=settings.num_requests,
        ignore_eos=settings.ignore_eos,
        goodput_slos_ms=dict(settings.goodput),
        levels=levels,
        probe_ttft_ms=None if probe_ttft_s is None else probe_ttft_s * 1000,
        settings=settings.model_dump(mode="json"),
    )


async def _probe(
    client: OpenAIClient, settings: OpenAIBenchSettings, request: GenerationRequest
) -> float | None:
    """One short request, not in any level: fails fast on a wrong URL or model, and
    returns its time to first token (None when it produced no content).

    Its prompt is the first request's reversed: as long, so it warms the same shapes,
    but no prefix of any request's, so a server's prefix cache cannot serve the first
    measured request from the probe."""
    started_s = time.monotonic()
    body = request_body(
        settings.protocol,
        settings.model,
        request.prompt[::-1],
        min(request.max_tokens, _PROBE_MAX_TOKENS),
        settings.ignore_eos,
    )
    stream = await client.send(client.encode(body))
    if stream.error is None:
        first = stream.first_content_s
        return None if first is None else first - started_s
    message = f"the warm-up request to {settings.url}{settings.path} failed: {stream.error}"
    if stream.error_message:
        message += f" ({stream.error_message[:300]})"
    if stream.error.startswith("connect"):
        raise ServerUnreachable(message + "; is the server running at that address?")
    if stream.error in ("http 404", "http 405"):
        raise BenchError(message + "; check --model, the URL and --protocol")
    if stream.error.startswith("http 4"):
        raise BenchError(message + "; the server refused the request as the run sends it")
    raise BenchError(message + "; see the server's log")


class LevelRun:
    """Sends one level's requests and times their streams."""

    def __init__(
        self,
        client: OpenAIClient,
        settings: OpenAIBenchSettings,
        requests: list[GenerationRequest],
        level: LoadLevel,
        progress: ProgressListener,
    ) -> None:
        self._client = client
        self._settings = settings
        self._requests = requests
        self._payloads = [client.encode(r.body) for r in requests]
        self._level = level
        self._progress = progress
        self._results: list[RequestResult] = []
        self._start_s = 0.0

    async def run(self) -> LevelMeasurement:
        settings = self._settings
        driver = LoadDriver(
            self._send,
            self._record,
            requests=len(self._requests),
            late_send_s=LATE_SEND_S,
            max_inflight=settings.max_inflight,
            total=len(self._requests),
        )
        cpu_start_s = time.process_time()
        reconnects_before = self._client.reconnects
        self._start_s = time.monotonic()
        if self._level.concurrency is not None:
            await driver.closed_loop(self._level.concurrency)
        else:
            rng = np.random.default_rng(settings.seed)
            gaps = arrival_gaps_s(self._level.request_rate or 1.0, settings.distribution, rng)
            await driver.open_loop(gaps, self._start_s)
        duration_s = time.monotonic() - self._start_s
        return LevelMeasurement(
            level=self._level,
            requests=sorted(self._results, key=lambda r: r.index),
            duration_s=duration_s,
            error_examples=dict(self._client.error_examples),
            peak_inflight=driver.stats.peak_inflight,
            late_sends=driver.stats.late_sends,
            client_cpu_s=time.process_time() - cpu_start_s,
            slos_ms=settings.goodput,
            ignore_eos=settings.ignore_eos,
            max_inflight=settings.max_inflight,
            reconnects=self._client.reconnects - reconnects_before,
        )

    def _send(self, number: int) -> Awaitable[StreamState]:
        return self._client.send(self._payloads[self._requests[number].index])

    def _record(
        self, number: int, scheduled_s: float, sent_s: float, done_s: float, stream: StreamState
    ) -> None:
        request = self._requests[number]
        result = request_result(request, stream, self._start_s, scheduled_s, sent_s)
        self._results.append(result)
        self._progress.request_done(result)


def request_result(
    request: GenerationRequest,
    stream: StreamState,
    level_start_s: float,
    scheduled_s: float,
    sent_s: float,
) -> RequestResult:
    result = RequestResult(
        index=request.index,
        arrival_s=scheduled_s - level_start_s,
        send_lag_s=max(0.0, sent_s - scheduled_s),
        max_tokens=request.max_tokens,
        error=stream.error,
    )
    if stream.error is not None:
        return result
    times_s = stream.chunk_times_s
    result.prompt_tokens = stream.prompt_tokens
    result.usage_reported = stream.output_tokens is not None
    result.output_tokens = (
        stream.output_tokens if stream.output_tokens is not None else len(times_s)
    )
    result.e2e_s = corrected_latency_s(scheduled_s, sent_s, stream.done_s)
    if times_s:
        result.ttft_s = corrected_latency_s(scheduled_s, sent_s, times_s[0])
        result.itl_s = [later - earlier for earlier, later in itertools.pairwise(times_s)]
    return result
