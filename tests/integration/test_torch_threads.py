"""The torch backend's intra-op threads on the CPU (``runtime/torch.py``,
``runtime/cpu_share.py``): real torch, real OpenMP threads, real neighbours spinning on
every core and the host's own CPU pressure (PSI).

A model's count reaches the thread that runs it: torch keeps the count per thread, so one
set where the model was loaded (or by a model loaded later) does not. Counted as the
OpenMP workers a fresh instance thread starts: one team of N threads is N - 1 workers.
Without a count, an instance starts with every usable core's thread and gives threads up
once neighbours crowd the cores.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from slipstream.runtime.base import usable_cpu_count
from slipstream.runtime.cpu_share import pressure_source
from slipstream.runtime.torch import TorchBackend
from tests.torch_models import export_mlp

pytestmark = pytest.mark.skipif(
    usable_cpu_count() < 2, reason="needs 2 cores for a second intra-op thread"
)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_mlp(tmp_path_factory.mktemp("torch-threads") / "model.pt2")


def _run(backend: TorchBackend) -> None:
    x = np.ones((64, 384), np.float32)
    signature = backend.signature()
    backend.run({signature.inputs[0].name: x}, [signature.outputs[0].name])


def _workers_started(work: Callable[[], None]) -> int:
    """OS threads a fresh thread (an instance's, as the server starts them) leaves
    behind while it still runs ``work``: the OpenMP workers of its team."""
    found: list[int] = []

    def run() -> None:
        before = set(os.listdir("/proc/self/task"))
        work()
        found.append(len(set(os.listdir("/proc/self/task")) - before))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return found[0]


def test_each_model_runs_with_its_own_count(model_path: Path) -> None:
    one = TorchBackend.load(model_path, {"intra_op_thread_count": "1"}, 1)
    two = TorchBackend.load(model_path, {"intra_op_thread_count": "2"}, 1)
    try:
        # Loaded last, ``two`` used to set every model's count.
        assert _workers_started(lambda: [_run(one) for _ in range(5)]) == 0
        assert _workers_started(lambda: [_run(two) for _ in range(5)]) == 1
        assert one.cpu_threads == 1 and two.cpu_threads == 2
    finally:
        one.close()
        two.close()


def _run_until(backend: TorchBackend, threads: int, seconds: float) -> int | None:
    """Runs back to back on one thread until the instance's count is ``threads`` or
    ``seconds`` pass; the count at the end."""

    def work() -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and backend.cpu_threads != threads:
            _run(backend)

    _workers_started(work)
    return backend.cpu_threads


@pytest.mark.skipif(pressure_source() is None, reason="needs the kernel's CPU pressure (PSI)")
def test_default_threads_give_way_to_busy_neighbours(model_path: Path, neighbours: None) -> None:
    backend = TorchBackend.load(model_path, {}, 1)
    try:
        assert backend.cpu_threads == usable_cpu_count()
        assert _run_until(backend, 1, 30) == 1
        # The next instance thread starts with the one thread.
        assert _workers_started(lambda: _run(backend)) == 0
    finally:
        backend.close()


def test_a_given_count_stays_beside_busy_neighbours(model_path: Path, neighbours: None) -> None:
    backend = TorchBackend.load(model_path, {"intra_op_thread_count": "2"}, 1)
    try:
        assert _run_until(backend, 1, 1.5) == 2
        assert _workers_started(lambda: _run(backend)) == 1
    finally:
        backend.close()
