"""GPU readings from NVML: Triton's nv_gpu_* series, what a GPU that fails or lacks a
reading leaves out, and silence where there is no GPU.

NVML is a fake here (``tests/fake_nvml.py``: this machine and CI have no GPU);
``tests/gpu/test_nvml_metrics.py`` reads a real GPU through a real server.
"""

from __future__ import annotations

import logging
import sys

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from slipstream.observability.gpu import GpuCollector, Gpus, visible_indices
from slipstream.observability.merge import merged_text, snapshot
from slipstream.observability.metrics import ServerMetrics
from tests.fake_nvml import FakeGpu, FakeNvml

A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"
SERIES = ("nv_gpu_utilization", "nv_gpu_memory_used_bytes", "nv_gpu_memory_total_bytes",
          "nv_gpu_power_usage", "nv_gpu_power_limit", "nv_energy_consumption")  # fmt: skip


@pytest.fixture(autouse=True)
def every_gpu_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake GPUs are all this process's, whatever the host's CUDA_VISIBLE_DEVICES."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def registry_of(nvml: FakeNvml, visible: str | None = None) -> CollectorRegistry:
    gpus = Gpus.open(nvml, visible)
    assert gpus is not None
    registry = CollectorRegistry()
    registry.register(GpuCollector(gpus))
    return registry


def test_triton_names_labels_and_units() -> None:
    gpu = FakeGpu(A, utilization_pct=37, memory_used=3 << 30, memory_total=80 << 30,
                  power_mw=123_456, power_limit_mw=700_000, energy_mj=9_000_000)  # fmt: skip
    registry = registry_of(FakeNvml([gpu]))
    gpu.energy_mj += 12_500  # 12.5 J after the server started
    sample = registry.get_sample_value
    label = {"gpu_uuid": A}
    assert sample("nv_gpu_utilization", label) == pytest.approx(0.37)
    assert sample("nv_gpu_memory_used_bytes", label) == 3 << 30
    assert sample("nv_gpu_memory_total_bytes", label) == 80 << 30
    assert sample("nv_gpu_power_usage", label) == pytest.approx(123.456)
    assert sample("nv_gpu_power_limit", label) == pytest.approx(700.0)
    assert sample("nv_energy_consumption", label) == pytest.approx(12.5)
    # The exact names Triton's dashboards query: no _total suffix on the energy counter.
    text = generate_latest(registry).decode()
    for name in SERIES:
        assert f'{name}{{gpu_uuid="{A}"}} ' in text
    assert "nv_energy_consumption_total" not in text
    assert "# TYPE nv_energy_consumption gauge" in text


def test_readings_are_taken_at_each_scrape() -> None:
    gpu = FakeGpu(A, utilization_pct=10)
    registry = registry_of(FakeNvml([gpu]))
    assert registry.get_sample_value("nv_gpu_utilization", {"gpu_uuid": A}) == 0.1
    gpu.utilization_pct, gpu.memory_used = 95, 7 << 30
    assert registry.get_sample_value("nv_gpu_utilization", {"gpu_uuid": A}) == 0.95
    assert registry.get_sample_value("nv_gpu_memory_used_bytes", {"gpu_uuid": A}) == 7 << 30


def test_a_gpu_lost_at_scrape_time_is_left_out_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lost = FakeGpu(B)
    registry = registry_of(FakeNvml([FakeGpu(A), lost]))
    lost.lost = True
    with caplog.at_level(logging.WARNING, logger="slipstream.observability.gpu"):
        for _ in range(3):
            text = generate_latest(registry).decode()  # the scrape itself does not fail
            assert f'nv_gpu_memory_used_bytes{{gpu_uuid="{A}"}}' in text
            assert B not in text
    assert [r.getMessage() for r in caplog.records if B in r.getMessage()] == [
        f"GPU {B} cannot be read through NVML, its readings are left out while it fails: "
        "GPU is lost"
    ]
    lost.lost = False  # back on the bus: its series come back
    assert registry.get_sample_value("nv_gpu_memory_used_bytes", {"gpu_uuid": B}) == 1 << 30


def test_a_reading_the_gpu_does_not_offer_is_left_out() -> None:
    # A GPU in MIG mode answers NotSupported for utilization; boards without a power
    # sensor for power. The other readings stay.
    mig = FakeGpu(A, unsupported={"utilization", "energy"})
    registry = registry_of(FakeNvml([mig]))
    sample = registry.get_sample_value
    assert sample("nv_gpu_utilization", {"gpu_uuid": A}) is None
    assert sample("nv_energy_consumption", {"gpu_uuid": A}) is None
    assert sample("nv_gpu_power_usage", {"gpu_uuid": A}) == 70.0
    text = generate_latest(registry).decode()
    assert "nv_gpu_utilization" not in text  # no empty family either


@pytest.mark.parametrize(
    ("nvml", "visible"),
    [
        (FakeNvml([FakeGpu(A)], init_fails=True), None),  # no driver
        (FakeNvml([]), None),  # a driver, no GPU
        (FakeNvml([FakeGpu(A)]), ""),  # CUDA_VISIBLE_DEVICES= hides every GPU
        (FakeNvml([FakeGpu(A, lost=True)]), None),  # the only GPU unreadable at start
    ],
    ids=["no-driver", "no-gpu", "none-visible", "unreadable"],
)
def test_without_a_gpu_nothing_is_opened_and_nothing_logged_above_debug(
    nvml: FakeNvml, visible: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="slipstream.observability.gpu"):
        assert Gpus.open(nvml, visible) is None
    assert caplog.records and all(r.levelno == logging.DEBUG for r in caplog.records)
    assert nvml.initialized == 0  # NVML let go again


def test_without_pynvml_nothing_is_opened(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # as if the gpu extra were missing
    with caplog.at_level(logging.DEBUG, logger="slipstream.observability.gpu"):
        assert Gpus.open() is None
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]


def test_the_real_pynvml_on_this_machine_opens_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """The installed nvidia-ml-py on a machine without a GPU (this one, CI)."""
    pytest.importorskip("pynvml")
    with caplog.at_level(logging.DEBUG, logger="slipstream.observability.gpu"):
        gpus = Gpus.open()
    if gpus is not None:
        gpus.close()
        pytest.skip("this machine has a GPU: tests/gpu reads it")
    assert caplog.records and all(r.levelno == logging.DEBUG for r in caplog.records)


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        (None, [0, 1, 2]),
        ("2,0", [2, 0]),
        ("1,1", [1]),
        ("GPU-b", [1]),  # a UUID prefix
        ("GPU-", []),  # names more than one: the list ends there
        ("0,7,2", [0]),  # CUDA stops at the first entry that names no GPU
        ("-1", []),
        ("", []),
        ("MIG-1234", [0, 1, 2]),  # a MIG slice: every GPU (NVML lists GPUs, not slices)
    ],
)
def test_cuda_visible_devices(visible: str | None, expected: list[int]) -> None:
    assert visible_indices(visible, ["GPU-a1", "GPU-b2", "GPU-c3"]) == expected


def test_a_gpu_nvml_cannot_read_at_start_is_left_out() -> None:
    # CUDA may see GPU 1; NVML cannot read it, so it has no readings.
    assert visible_indices(None, ["GPU-a1", None]) == [0]
    assert visible_indices("1,0", ["GPU-a1", None]) == [0]


def test_visible_devices_default_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    gpus = Gpus.open(FakeNvml([FakeGpu(A), FakeGpu(B)]))
    assert gpus is not None and gpus.uuids == [B]


def test_the_split_layout_merge_keeps_one_series_per_gpu() -> None:
    """The engine's registry has the GPU collector, the front ends' do not: merged, each
    GPU's series comes once, without a frontend label."""
    engine = ServerMetrics(with_transport=False)
    gpus = Gpus.open(FakeNvml([FakeGpu(A), FakeGpu(B)]))
    assert gpus is not None
    engine.registry.register(GpuCollector(gpus))
    reports = [({}, snapshot(engine.registry))]
    reports += [({"frontend": str(i)}, snapshot(ServerMetrics().registry)) for i in range(2)]
    text = merged_text(reports).decode()
    lines = [line for line in text.splitlines() if line.startswith("nv_gpu_power_usage{")]
    assert sorted(lines) == [f'nv_gpu_power_usage{{gpu_uuid="{uuid}"}} 70.0' for uuid in (A, B)]
