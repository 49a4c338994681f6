"""The drift monitor of one version: sampling off the hot path, references captured or
read from the version's file, windows tested in the worker thread."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from slipstream.config import DriftSettings
from slipstream.monitor.sampler import REFERENCE_FILE, DriftMonitor


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not {what} after {timeout_s} s"
        time.sleep(0.01)


@pytest.fixture
def monitors() -> Iterator[list[DriftMonitor]]:
    made: list[DriftMonitor] = []
    yield made
    for monitor in made:
        monitor.close()


def offer_rows(monitor: DriftMonitor, rows: np.ndarray, batch: int = 10) -> None:
    for start in range(0, len(rows), batch):
        part = rows[start : start + batch]
        monitor.offer({"input": part}, {"label": (part[:, 0] > 0).astype(np.int64)})


def test_a_reference_is_captured_then_a_shifted_window_is_found(
    monitors: list[DriftMonitor],
) -> None:
    rng = np.random.default_rng(0)
    settings = DriftSettings(enable=True, window=500, reference_samples=1000, min_interval_s=0)
    monitor = DriftMonitor("mlp", "1", settings)
    monitors.append(monitor)
    offer_rows(monitor, rng.normal(size=(1000, 8)).astype(np.float32))
    wait_until(lambda: monitor.state.reference == "captured", "captured")
    shifted = rng.normal(size=(500, 8)).astype(np.float32)
    shifted[:, 3] += 0.5
    offer_rows(monitor, shifted)
    wait_until(lambda: "input" in monitor.state.reports, "tested")
    doc = monitor.to_json()
    assert doc["reference"] == "captured" and doc["reference_rows"] == 1000
    assert doc["detected"] is True and doc["sampled"] == 150 and doc["dropped"] == 0
    # One window, of two tensors: counted once (and the two tests on their own).
    assert (doc["windows"], doc["tensor_tests"]) == (1, 2)
    drifted = [f["feature"] for f in doc["tensors"]["input"]["features"] if f["drifted"]]
    assert "3" in drifted
    # Prediction drift: the label is categorical, and feature 0 did not move.
    assert doc["tensors"]["label"]["features"][0]["kind"] == "categorical"


def test_a_version_s_reference_file_is_used_and_other_tensors_are_left_out(
    monitors: list[DriftMonitor], tmp_path: Path
) -> None:
    rng = np.random.default_rng(1)
    np.savez(tmp_path / REFERENCE_FILE, input=rng.normal(size=(2000, 4)))
    settings = DriftSettings(enable=True, window=200)
    monitor = DriftMonitor("mlp", "2", settings, version_dir=tmp_path)
    monitors.append(monitor)
    assert monitor.state.reference == "file" and monitor.state.reference_rows == 2000
    offer_rows(monitor, rng.normal(size=(200, 4)))
    wait_until(lambda: monitor.state.windows == 1, "tested")
    doc = monitor.to_json()
    assert list(doc["tensors"]) == ["input"]
    assert doc["detected"] is False


def test_a_full_queue_drops_and_counts_and_sampling_takes_its_share(
    monitors: list[DriftMonitor],
) -> None:
    stopped = DriftMonitor("m", "1", DriftSettings(enable=True, queue_size=3))
    stopped.close()  # no worker: the queue only fills
    for _ in range(10):
        stopped.offer({"x": np.zeros((1, 2))}, {})
    assert (stopped.state.sampled, stopped.state.dropped) == (3, 7)
    half = DriftMonitor("m", "1", DriftSettings(enable=True, sample_rate=0.5))
    monitors.append(half)
    for _ in range(1000):
        half.offer({"x": np.zeros((1, 2))}, {})
    assert 400 <= half.state.sampled <= 600


def test_tensors_it_cannot_test_are_skipped_with_the_reason_and_the_rest_go_on(
    monitors: list[DriftMonitor],
) -> None:
    rng = np.random.default_rng(2)
    settings = DriftSettings(enable=True, window=100, reference_samples=100, min_interval_s=0)
    monitor = DriftMonitor("m", "1", settings)
    monitors.append(monitor)
    for _ in range(10):
        tensors = {"x": rng.normal(size=(10, 3)), "z": rng.normal(size=(10, 2))}
        monitor.offer({**tensors, "scale": np.float32(1.0)}, {})
    wait_until(lambda: monitor.state.reference == "captured", "captured")
    for _ in range(10):  # x changes width: its windows cannot be compared any more
        monitor.offer({"x": rng.normal(size=(10, 5)), "z": rng.normal(size=(10, 2))}, {})
    wait_until(lambda: "z" in monitor.state.reports, "z tested")
    assert "batch dimension" in monitor.state.skipped["scale"]
    assert "5 features, the reference has 3" in monitor.state.skipped["x"]
    assert monitor.to_json()["windows"] == 1 and "x" not in monitor.state.reports


def test_after_a_window_requests_are_not_sampled_until_the_interval_has_passed(
    monitors: list[DriftMonitor],
) -> None:
    """A busy model pays for one window per interval: the gate closes at a window's last
    row and offers in between cost a flag check."""
    rng = np.random.default_rng(3)
    settings = DriftSettings(enable=True, window=50, reference_samples=50, min_interval_s=0.5)
    monitor = DriftMonitor("m", "1", settings)
    monitors.append(monitor)
    for _ in range(10):  # the reference
        monitor.offer({"x": rng.normal(size=(5, 2))}, {})
    wait_until(lambda: monitor.state.reference == "captured", "captured")
    for _ in range(10):  # a window
        monitor.offer({"x": rng.normal(size=(5, 2))}, {})
    wait_until(lambda: monitor.state.windows == 1, "tested")
    sampled = monitor.state.sampled
    for _ in range(100):
        monitor.offer({"x": rng.normal(size=(5, 2))}, {})
    assert monitor.state.sampled == sampled  # inside the interval: none taken
    time.sleep(0.6)
    wait_until(lambda: monitor._open, "reopened")
    for _ in range(10):
        monitor.offer({"x": rng.normal(size=(5, 2))}, {})
    wait_until(lambda: monitor.state.windows == 2, "the next window tested")


def test_a_capture_ends_though_a_tensor_few_requests_carry_falls_short(
    monitors: list[DriftMonitor],
) -> None:
    """Most clients ask for the label only, one for every output: the capture ends with
    the tensors that have their rows, the short one left out with the reason."""
    rng = np.random.default_rng(4)
    settings = DriftSettings(enable=True, window=100, reference_samples=200, min_interval_s=0)
    monitor = DriftMonitor("digits", "1", settings)
    monitors.append(monitor)
    x = rng.normal(size=(1, 4))
    monitor.offer({"input": x}, {"label": np.zeros(1, np.int64), "probabilities": x})
    offer_rows(monitor, rng.normal(size=(300, 4)))
    wait_until(lambda: monitor.state.windows == 1, "captured and tested")
    doc = monitor.to_json()
    assert doc["reference"] == "captured" and doc["reference_rows"] == 201  # 1 + 200
    assert sorted(doc["tensors"]) == ["input", "label"]
    assert "1 rows when the reference was captured from 200" in doc["skipped"]["probabilities"]


@pytest.mark.parametrize(
    ("arrays", "reason"),
    [
        ({"input": np.zeros((1, 4))}, "at least 2 samples, got 1"),
        ({}, "it holds no arrays"),
        (None, "cannot be read"),
    ],
)
def test_a_reference_file_it_cannot_use_turns_monitoring_off_with_the_reason(
    monitors: list[DriftMonitor],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    arrays: dict[str, np.ndarray] | None,
    reason: str,
) -> None:
    """Never an exception out of the version's load: the version serves unmonitored."""
    path = tmp_path / REFERENCE_FILE
    if arrays is None:
        path.write_bytes(b"not a zip file")
    else:
        np.savez(path, **arrays)  # type: ignore[arg-type]
    monitor = DriftMonitor("mlp", "1", DriftSettings(enable=True), version_dir=tmp_path)
    monitors.append(monitor)
    offer_rows(monitor, np.zeros((20, 4)))  # not sampled, never raises
    doc = monitor.to_json()
    disabled = str(doc["disabled"])
    assert reason in disabled and "slipstream monitor reference" in disabled
    assert doc["sampled"] == 0 and doc["tensors"] == {}
    assert f"drift monitoring of mlp:1 is off: {path}" in caplog.text
