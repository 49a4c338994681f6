"""The coordinator's decisions, against a fake worker pool (no processes, no sockets):
how a level is split over workers, and auto mode adding workers when one saturates."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from slipstream.bench.core.histogram import LatencyHistogram
from slipstream.bench.core.levels import LoadLevel
from slipstream.bench.v2 import runner
from slipstream.bench.v2.messages import LevelDone, Message, RunLevel, StopLevel, WindowSample
from slipstream.bench.v2.results import LevelResult
from slipstream.bench.v2.runner import LevelRunner
from slipstream.bench.v2.settings import BenchSettings


class _FakePool:
    """Answers every RunLevel at once with windows whose CPU use depends on the number of
    workers the level was split over."""

    def __init__(self, cpu_pct: Callable[[int], float]) -> None:
        self.cpu_pct = cpu_pct
        self.size = 0
        self.runs: dict[int, list[RunLevel]] = {}
        self.stops: list[int] = []

    def grow_to(self, count: int) -> None:
        self.size = max(self.size, count)

    def send(self, worker_id: int, command: RunLevel | StopLevel) -> None:
        assert worker_id < self.size
        if isinstance(command, RunLevel):
            self.runs.setdefault(command.level_id, []).append(command)
        else:
            self.stops.append(command.level_id)

    def collect(
        self, wanted: Callable[[Message], bool], count: int, timeout_s: float
    ) -> list[Message]:
        level_id = max(self.runs)
        commands = self.runs[level_id]
        candidates: list[Message] = []
        for worker_id, command in enumerate(commands):
            for index in range(-1, command.max_windows):
                candidates.append(self._sample(worker_id, command, index, len(commands)))
            candidates.append(LevelDone(worker_id, level_id))
        found = [m for m in candidates if wanted(m)]
        assert len(found) >= count
        return found[:count]

    def _sample(self, worker_id: int, command: RunLevel, index: int, workers: int) -> WindowSample:
        return WindowSample(
            worker_id=worker_id,
            level_id=command.level_id,
            window_index=index,
            start_s=0.0,
            end_s=1.0,
            ok_requests=1000,
            ok_inferences=1000,
            latency=LatencyHistogram.from_latencies(np.full(1000, 0.001)),
            cpu_s=self.cpu_pct(workers) / 100,
        )


class _NoStatsApi:
    def stats_snapshot(self) -> None:
        return None


class _Notes:
    def __init__(self) -> None:
        self.notes: list[str] = []

    def level_started(self, *args: Any) -> None:
        pass

    def window_done(self, *args: Any) -> None:
        pass

    def level_done(self, *args: Any) -> None:
        pass

    def note(self, message: str) -> None:
        self.notes.append(message)


def _run(pool: _FakePool, level: LoadLevel, **settings: Any) -> tuple[LevelResult, _Notes]:
    base: dict[str, Any] = {"url": "http://h:1", "model": "m", "warmup_s": 0.01}
    base.update({"window_s": 0.01, "max_windows": 3, **settings})
    notes = _Notes()
    level_runner = LevelRunner(BenchSettings(**base), pool, _NoStatsApi(), None, notes)  # type: ignore[arg-type]
    return level_runner.run(level), notes


@pytest.fixture
def eight_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "usable_cores", lambda: 8)


def test_auto_mode_adds_workers_while_one_saturates(eight_cores: None) -> None:
    pool = _FakePool(cpu_pct=lambda workers: 190 / workers)  # 190%, 95%, 47.5%
    result, progress = _run(pool, LoadLevel(concurrency=64))
    assert [len(runs) for runs in pool.runs.values()] == [1, 2, 4]
    assert pool.stops[:2] == [0, 1]  # the saturated attempts were stopped
    assert result.workers == 4
    assert [(c.concurrency, c.first_user) for c in pool.runs[2]] == [
        (16, 0),
        (16, 16),
        (16, 32),
        (16, 48),
    ]
    assert len(progress.notes) == 2 and "retrying with 2 workers" in progress.notes[0]
    assert result.warnings == []


def test_auto_mode_never_splits_below_one_request_per_worker(eight_cores: None) -> None:
    pool = _FakePool(cpu_pct=lambda workers: 99.0)
    result, _ = _run(pool, LoadLevel(concurrency=1))
    assert [len(runs) for runs in pool.runs.values()] == [1]
    assert result.workers == 1
    assert any("client saturated" in w for w in result.warnings)


def test_auto_mode_out_of_cores_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "usable_cores", lambda: 2)
    pool = _FakePool(cpu_pct=lambda workers: 99.0)
    result, _ = _run(pool, LoadLevel(concurrency=64))
    assert [len(runs) for runs in pool.runs.values()] == [1, 2]
    assert any("no free core was left" in w for w in result.warnings)


def test_a_fixed_worker_count_is_kept_and_the_rate_interleaved(eight_cores: None) -> None:
    pool = _FakePool(cpu_pct=lambda workers: 99.0)
    result, _ = _run(pool, LoadLevel(request_rate=300.0), workers=3, max_inflight=90)
    [commands] = pool.runs.values()
    assert [c.request_rate for c in commands] == [100.0] * 3
    assert [c.phase_s for c in commands] == pytest.approx([0.0, 1 / 300, 2 / 300])
    assert {c.max_inflight for c in commands} == {30}
    assert any("try --workers" in w for w in result.warnings)


def test_a_duration_run_reports_every_window_of_equal_length(eight_cores: None) -> None:
    pool = _FakePool(cpu_pct=lambda workers: 10.0)
    result, _ = _run(pool, LoadLevel(concurrency=2), duration_s=0.05, window_s=0.02)
    [commands] = pool.runs.values()
    assert {c.max_windows for c in commands} == {2}
    assert {c.window_s for c in commands} == {0.025}
    assert result.windows == result.windows_measured == 2
    assert result.throughput_req_per_s == pytest.approx(1000.0)
