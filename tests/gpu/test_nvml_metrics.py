"""Triton's GPU series from the real NVML, in a real server's /metrics, once per GPU in
one process and in the split layout.

Skipped where torch sees no GPU (tests/gpu/conftest.py) and where NVML (the gpu extra)
does not start or lists none; ``make test-gpu`` runs it.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from slipstream.observability.gpu import GpuReading, Gpus
from tests.utils import RemoteServer

GIB = 2**30


@pytest.fixture(scope="module")
def readings() -> Iterator[list[GpuReading]]:
    """What NVML reads in this process: the GPUs a server here should report."""
    pytest.importorskip("pynvml", reason="nvidia-ml-py (the gpu extra) is not installed")
    gpus = Gpus.open()
    if gpus is None:
        pytest.skip("NVML does not start here or lists no GPU")
    yield gpus.read()
    gpus.close()


def series(text: str, name: str) -> dict[str, float]:
    """``name``'s samples in a scrape, by GPU UUID; each sample's labels are gpu_uuid only."""
    samples = re.findall(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.MULTILINE)
    by_uuid = {}
    for labels, value in samples:
        match = re.fullmatch(r'gpu_uuid="([^"]+)"', labels)
        assert match, f"{name}{{{labels}}}: expected the gpu_uuid label alone"
        assert match[1] not in by_uuid, f"{name} twice for {match[1]}"
        by_uuid[match[1]] = float(value)
    return by_uuid


@pytest.mark.parametrize("frontends", [0, 2], ids=["one-process", "split"])
def test_gpu_series_with_plausible_values(
    readings: list[GpuReading], tmp_path: Path, frontends: int
) -> None:
    uuids = {reading.uuid for reading in readings}
    repo = tmp_path / "models"
    repo.mkdir()
    with RemoteServer(repo, ["--frontends", str(frontends)], log_dir=tmp_path) as server:
        first = httpx.get(server.url("/metrics")).text
        time.sleep(2.0)
        text = httpx.get(server.url("/metrics")).text
    for reading in readings:
        uuid = reading.uuid
        total = series(text, "nv_gpu_memory_total_bytes")
        used = series(text, "nv_gpu_memory_used_bytes")
        assert set(total) == set(used) == uuids
        assert total[uuid] == reading.memory_total_bytes and total[uuid] > GIB
        assert 0 <= used[uuid] <= total[uuid]
        # A GPU in MIG mode offers no utilization, some boards no power: where this
        # process's NVML reads one, the server exports it.
        if reading.utilization is not None:
            assert 0.0 <= series(text, "nv_gpu_utilization")[uuid] <= 1.0
        if reading.power_w is not None and reading.power_limit_w is not None:
            limit = series(text, "nv_gpu_power_limit")[uuid]
            assert limit == pytest.approx(reading.power_limit_w) and 20 <= limit <= 2000
            assert 0 < series(text, "nv_gpu_power_usage")[uuid] <= 2 * limit
        if reading.energy_j is not None:
            # Joules since the server started: a powered GPU uses some in 2 s.
            before = series(first, "nv_energy_consumption")[uuid]
            assert 0 <= before < series(text, "nv_energy_consumption")[uuid]
