"""Triton's GPU series in a real server's /metrics: absent without a GPU, and once per GPU
with one, in one process and in the split layout (``--frontends 2``).

This machine has no GPU, so the "with one" cases start the server with a fake pynvml
(``tests/fake_nvml.py``) first on its PYTHONPATH; ``tests/gpu/test_nvml_metrics.py`` does
the same against a real GPU.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
import pytest

from slipstream.observability.gpu import Gpus
from tests.fake_nvml import FakeGpu, install_module
from tests.models import build_add_sub
from tests.utils import RemoteServer

A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"
SERIES = ("nv_gpu_utilization", "nv_gpu_memory_used_bytes", "nv_gpu_memory_total_bytes",
          "nv_gpu_power_usage", "nv_gpu_power_limit", "nv_energy_consumption")  # fmt: skip


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_add_sub(tmp_path_factory.mktemp("gpu-metrics") / "models").parent


def series(text: str, name: str) -> dict[str, float]:
    """Each sample of ``name`` in a scrape: its labels as written, and its value."""
    samples = re.findall(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.MULTILINE)
    assert len(samples) == len({labels for labels, _ in samples}), samples  # no repeats
    return {labels: float(value) for labels, value in samples}


def test_no_gpu_series_where_there_is_no_gpu(repo: Path, tmp_path: Path) -> None:
    """The installed nvidia-ml-py on this machine, which has no GPU."""
    pytest.importorskip("pynvml")
    gpus = Gpus.open()
    if gpus is not None:
        gpus.close()
        pytest.skip("this machine has a GPU: tests/gpu reads it")
    with RemoteServer(repo, log_dir=tmp_path) as server:
        text = server.http.get("/metrics").text
        assert "slipstream_request_success_total" in text  # a real scrape
        assert "nv_gpu" not in text and "nv_energy" not in text
        assert "NVML" not in server.log_text()


@pytest.mark.parametrize("frontends", [0, 2], ids=["one-process", "split"])
def test_gpu_series_once_per_gpu(repo: Path, tmp_path: Path, frontends: int) -> None:
    install_module(tmp_path / "fake", [FakeGpu(A, utilization_pct=25), FakeGpu(B)])
    path = [str(tmp_path / "fake"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {"PYTHONPATH": os.pathsep.join(path), "CUDA_VISIBLE_DEVICES": "0,1"}
    args = ["--frontends", str(frontends)]
    with RemoteServer(repo, args, log_dir=tmp_path, env=env) as server:
        for _ in range(6):  # fresh connections: in the split layout either front end answers
            text = httpx.get(server.url("/metrics")).text
            for name in SERIES:
                # Once per GPU, and no frontend label: only the engine reads the GPUs.
                assert set(series(text, name)) == {f'gpu_uuid="{A}"', f'gpu_uuid="{B}"'}
            assert series(text, "nv_gpu_utilization")[f'gpu_uuid="{A}"'] == 0.25
            assert series(text, "nv_gpu_power_limit")[f'gpu_uuid="{B}"'] == 700.0
        # NVML opened by one process: the engine in the split layout, not each front end.
        assert server.log_text().count(f"GPU metrics from NVML: {A}, {B}") == 1
