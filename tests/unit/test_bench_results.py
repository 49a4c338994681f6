"""A level's figures from its windows: server breakdown deltas, resource use, cost, and
the warnings that keep a reader from trusting figures the client limited."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
from rich.console import Console

from slipstream.bench.core.histogram import LatencyHistogram
from slipstream.bench.core.levels import LoadLevel
from slipstream.bench.core.schedule import SendStats
from slipstream.bench.v2.report import print_tables
from slipstream.bench.v2.results import (
    BenchResult,
    LevelInputs,
    LevelResult,
    WindowTotals,
    level_result,
)
from slipstream.bench.v2.server_stats import (
    ProcessSample,
    ProcessSampler,
    StatsSnapshot,
    process_usage,
    snapshot_from_json,
)
from slipstream.observability.gpu import Gpus
from tests.fake_nvml import FakeGpu, FakeNvml


def _window(
    index: int,
    ok: int,
    latency_s: float = 0.002,
    cpu_s: float = 0.1,
    errors: dict[str, int] | None = None,
    **open_loop: float,
) -> WindowTotals:
    return WindowTotals(
        index=index,
        duration_s=1.0,
        ok_requests=ok,
        ok_inferences=4 * ok,
        latency=LatencyHistogram.from_latencies(np.full(ok, latency_s)),
        errors=errors or {},
        error_examples={key: "why" for key in errors or {}},
        cpu_s_by_worker={0: cpu_s},
        sends=SendStats(
            sent=int(open_loop.get("sent", 0)),
            late_sends=int(open_loop.get("late_sends", 0)),
            max_send_lag_s=open_loop.get("max_send_lag_s", 0.0),
            inflight_cap_waits=int(open_loop.get("cap_waits", 0)),
        ),
    )


def _result(
    windows: list[WindowTotals], level: LoadLevel | None = None, **extra: object
) -> LevelResult:
    fields: dict[str, object] = {
        "level": level or LoadLevel(concurrency=8),
        "workers": 1,
        "windows": windows,
        "windows_measured": len(windows),
        "stable": True,
        "stability_required": True,
        "stability_pct": 10.0,
        "server": None,
        "server_process": None,
        "price_per_hour": None,
        "workers_capped": False,
    }
    fields.update(extra)
    return level_result(LevelInputs(**fields))  # type: ignore[arg-type]


def test_figures_add_up_over_the_reported_windows() -> None:
    result = _result(
        [_window(0, 1000), _window(1, 1000, errors={"http 503": 5}), _window(2, 1000, 0.004)]
    )
    assert result.requests == 3000 and result.inferences == 12000
    assert result.throughput_req_per_s == pytest.approx(1000)
    assert result.throughput_infer_per_s == pytest.approx(4000)
    assert result.errors == 5 and result.errors_by_code == {"http 503": 5}
    assert result.p50_ms == pytest.approx(2.0, rel=0.01)
    assert result.max_ms == pytest.approx(4.0)
    assert result.avg_ms == pytest.approx(8 / 3)
    assert result.client_cpu_pct == pytest.approx(10.0)
    assert result.warnings == []


def test_server_breakdown_and_overhead_come_from_the_statistics_delta() -> None:
    before = StatsSnapshot(
        success_count=100, success_ns=10**8, execution_count=50, inference_count=100
    )
    after = StatsSnapshot(
        success_count=1100,
        success_ns=10**8 + 1000 * 1_500_000,
        queue_count=1000,
        queue_ns=1000 * 200_000,
        compute_input_count=1000,
        compute_input_ns=1000 * 10_000,
        compute_infer_count=1000,
        compute_infer_ns=1000 * 700_000,
        compute_output_count=1000,
        compute_output_ns=1000 * 90_000,
        execution_count=300,
        inference_count=4100,
    )
    result = _result([_window(0, 1000, 0.002)], server=after.since(before))
    assert result.server_queue_ms == pytest.approx(0.2)
    assert result.server_compute_infer_ms == pytest.approx(0.7)
    assert result.server_request_ms == pytest.approx(1.5)
    assert result.server_avg_batch_size == pytest.approx(16.0)
    # The client saw 2 ms; queue + compute account for 1 ms of it.
    assert result.server_overhead_ms == pytest.approx(1.0)


def test_statistics_of_the_http_extension_sum_versions_unless_one_is_asked_for() -> None:
    def version(name: str, count: int) -> dict[str, object]:
        return {
            "version": name,
            "inference_count": count,
            "execution_count": count,
            "inference_stats": {"queue": {"count": count, "ns": count * 1000}},
        }

    doc = {"model_stats": [version("1", 10), version("2", 5)]}
    assert snapshot_from_json(doc, "").queue_count == 15
    assert snapshot_from_json(doc, "2").queue_ns == 5000


def test_resource_use_and_cost() -> None:
    samples = [ProcessSample(0.0, 1.0, 100 * 2**20), ProcessSample(2.0, 2.5, 120 * 2**20)]
    usage = process_usage(samples)
    assert usage is not None
    assert (usage.cpu_pct, usage.rss_mb) == (pytest.approx(75.0), pytest.approx(120.0))
    assert process_usage(samples[:1]) is None
    result = _result([_window(0, 1000)], server_process=usage, price_per_hour=0.36)
    # 4000 inferences/s = 14.4M per hour for $0.36: $0.025 per million.
    assert result.cost_per_1m_infer == pytest.approx(0.025)
    assert result.server_cpu_pct == pytest.approx(75.0)


def test_gpu_use_beside_cpu_and_rss() -> None:
    mib = 2**20
    samples = [
        ProcessSample(0.0, 1.0, 100 * mib, gpu_utilization=0.0, gpu_memory_used_bytes=500 * mib),
        ProcessSample(1.0, 1.5, 100 * mib, gpu_utilization=0.8, gpu_memory_used_bytes=900 * mib),
        ProcessSample(2.0, 2.0, 100 * mib, gpu_utilization=0.6, gpu_memory_used_bytes=700 * mib),
    ]
    usage = process_usage(samples)
    # The first reading covers the moments before the stretch: the mean is of the others.
    assert usage is not None and usage.gpu_util_pct == pytest.approx(70.0)
    assert usage.gpu_memory_mb == pytest.approx(900.0)
    gpu = _result([_window(0, 1000)], server_process=usage)
    assert (gpu.server_gpu_util_pct, gpu.server_gpu_memory_mb) == (usage.gpu_util_pct, 900.0)
    cpu_only = _result([_window(0, 1000)], server_process=process_usage(
        [ProcessSample(0.0, 1.0, 100 * mib), ProcessSample(2.0, 2.5, 120 * mib)]))  # fmt: skip
    assert cpu_only.server_gpu_util_pct is None and cpu_only.server_gpu_memory_mb is None

    def table(level: LevelResult) -> str:
        out = io.StringIO()
        result = BenchResult("http://h:1", "m", "", "http", 1, None, [level])
        print_tables(result, Console(file=out, width=250, force_terminal=False))
        return out.getvalue()

    assert "GPU%" in table(gpu) and "GPU mem MB" in table(gpu)
    assert "GPU" not in table(cpu_only)  # no GPU columns where there is no GPU


def test_bench_samples_the_gpus_beside_the_server_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # both fakes visible
    nvml = FakeNvml([FakeGpu("GPU-a", utilization_pct=60), FakeGpu("GPU-b", utilization_pct=30)])
    sampler = ProcessSampler(os.getpid(), Gpus.open(nvml))
    sample = sampler.sample(0.0)
    assert sample is not None and sample.rss_bytes > 0
    assert sample.gpu_utilization == pytest.approx(0.9)  # summed: 1.0 = one GPU busy
    assert sample.gpu_memory_used_bytes == 2 << 30
    sampler.close()
    assert nvml.initialized == 0
    without = ProcessSampler(os.getpid()).sample(0.0)
    assert without is not None and without.gpu_utilization is None


def test_a_saturated_worker_is_reported() -> None:
    result = _result([_window(0, 1000, cpu_s=0.97)], workers_capped=True)
    [warning] = result.warnings
    assert "client saturated" in warning and "97%" in warning and "no free core" in warning


def test_an_open_loop_that_fell_behind_says_why() -> None:
    level = LoadLevel(request_rate=1000)
    windows = [_window(0, 700, sent=700, late_sends=300, max_send_lag_s=0.2, cap_waits=12)]
    result = _result(windows, level=level)
    assert result.send_rate_per_s == pytest.approx(700)
    assert result.max_send_lag_ms == pytest.approx(200)
    assert any("sent 700 req/s of the 1000 asked" in w for w in result.warnings)
    assert any("42.9% of requests were sent over 1 ms late" in w for w in result.warnings)
    assert all("--max-inflight" in w for w in result.warnings)


def test_an_unstable_level_and_a_level_where_everything_failed_are_flagged() -> None:
    result = _result(
        [_window(i, 0, errors={"http 400": 10}) for i in range(3)],
        stable=False,
        windows_measured=10,
    )
    assert result.requests == 0 and result.p99_ms is None
    assert any("not stable" in w and "after 10 windows" in w for w in result.warnings)
    assert any("every request failed: http 400 x30 (why)" in w for w in result.warnings)
