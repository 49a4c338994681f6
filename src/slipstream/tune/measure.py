"""A trial's load curve, measured with the bench core: concurrency doubled until the SLO
breaks, then the gap between the last level within it and the first beyond it halved
once. Each level is bench's (warm-up, windows until stable, the same figures and the
same cost formula as ``slipstream bench --price-per-hour``).

Example::

    curve = measure_curve(MeasureSettings(url="http://127.0.0.1:8000", model="mlp"), slo)
    print(curve.best.throughput_infer_per_s if curve.best else "SLO unmet")
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from slipstream.bench.core.endpoint import parse_endpoint
from slipstream.bench.core.errors import BenchError
from slipstream.bench.core.levels import LoadLevel
from slipstream.bench.v2.results import LevelResult
from slipstream.bench.v2.runner import LevelRunner, ProgressListener, build_requests, worker_plan
from slipstream.bench.v2.server_api import ServerApi, connect_api
from slipstream.bench.v2.settings import BenchSettings
from slipstream.bench.v2.workers import WorkerPool
from slipstream.tune.settings import Slo, TuneInputError

_API_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class MeasureSettings:
    """How each level of a trial is measured (bench's options of the same names)."""

    url: str
    model: str
    warmup_s: float = 0.5
    window_s: float = 1.0
    max_windows: int = 6
    stability_pct: float = 10.0
    # Highest concurrency tried.
    max_concurrency: int = 64
    # Priced profiles: bench's cost per 1M inferences comes with each level.
    price_per_hour: float | None = None
    # Sample the server's CPU and RSS (bench --server-pid).
    server_pid: int | None = None
    # Inputs from a file (bench --input-data); random data otherwise.
    input_data: str | None = None
    shapes: dict[str, list[int]] = field(default_factory=dict)

    def bench_settings(self, concurrency: int) -> BenchSettings:
        return BenchSettings(
            url=self.url,
            model=self.model,
            concurrency=[concurrency],
            warmup_s=self.warmup_s,
            window_s=self.window_s,
            max_windows=max(3, self.max_windows),
            stability_pct=self.stability_pct,
            price_per_hour=self.price_per_hour or None,
            server_pid=self.server_pid,
            input_data=Path(self.input_data) if self.input_data else None,
            shapes=self.shapes,
            workers=1,
        )


@dataclass
class LoadCurve:
    """The levels measured, lowest concurrency first."""

    levels: list[LevelResult]
    # The highest-throughput level within the SLO; None: none was.
    best: LevelResult | None


def slo_ratio(level: LevelResult, slo: Slo) -> float:
    """How far ``level`` is from the SLO: <= 1 within every bound, 2.0 = twice a bound.
    A level with failed requests or no figures is infinitely far."""
    if level.errors or level.requests == 0:
        return float("inf")
    ratios = []
    for name, bound in slo.latency_ms.items():
        value = getattr(level, name)
        ratios.append(float("inf") if value is None else value / bound)
    if slo.min_throughput is not None:
        throughput = level.throughput_infer_per_s
        ratios.append(slo.min_throughput / throughput if throughput > 0 else float("inf"))
    return max(ratios, default=0.0)


def within_latency(level: LevelResult, slo: Slo) -> bool:
    """Every latency bound met and no request failed (the throughput floor aside)."""
    return slo_ratio(level, Slo(slo.latency_ms)) <= 1.0


def measure_curve(
    settings: MeasureSettings, slo: Slo, progress: ProgressListener | None = None
) -> LoadCurve:
    """Measure levels until the latency SLO breaks; BenchError when bench cannot run,
    TuneInputError when it cannot make requests from the tune's inputs."""
    first = settings.bench_settings(1)
    endpoint = parse_endpoint(first.url, first.protocol)
    api = connect_api(endpoint, first.model, "", _API_TIMEOUT_S)
    try:
        try:
            requests = build_requests(first, api.signature())
        except BenchError as exc:
            # The inputs are the tune's, not the configuration's: every trial would fail
            # the same way.
            raise TuneInputError(
                f"{exc} (slipstream tune takes --shape and --input-data)"
            ) from None
        pool = WorkerPool(lambda worker_id: worker_plan(first, endpoint, requests, worker_id))
        try:
            return _sweep(settings, slo, pool, api, progress or ProgressListener())
        finally:
            pool.close()
    finally:
        api.close()


def _sweep(
    settings: MeasureSettings,
    slo: Slo,
    pool: WorkerPool,
    api: ServerApi,
    progress: ProgressListener,
) -> LoadCurve:
    levels: dict[int, LevelResult] = {}

    def run(concurrency: int) -> LevelResult:
        bench = settings.bench_settings(concurrency)
        runner = LevelRunner(bench, pool, api, None, progress)
        levels[concurrency] = runner.run(LoadLevel(concurrency=concurrency))
        return levels[concurrency]

    good, concurrency = 0, 1
    while concurrency <= settings.max_concurrency:
        if not within_latency(run(concurrency), slo):
            break
        good, concurrency = concurrency, concurrency * 2
    else:
        concurrency = 0
    if good and concurrency and concurrency - good > 1:
        run((good + concurrency) // 2)
    ordered = [levels[c] for c in sorted(levels)]
    within = [level for level in ordered if slo_ratio(level, slo) <= 1.0]
    best = max(within, key=lambda level: level.throughput_infer_per_s, default=None)
    return LoadCurve(levels=ordered, best=best)
