"""A stand-in for pynvml, for the machines without a GPU (this one, CI).

It is deliberately minimal: only the calls ``slipstream.observability.gpu`` makes, each
answering from a :class:`FakeGpu` the test sets, in NVML's units (percent, milliwatts,
millijoules, bytes). It proves what the code does with NVML's answers and failures, not
that NVML answers so: ``tests/gpu`` runs the real library where a GPU is present.

    nvml = FakeNvml([FakeGpu("GPU-0000", utilization_pct=50)])
    gpus = Gpus.open(nvml)

``install_module(directory, gpus)`` writes it as ``directory/pynvml.py``, for a server
started with that directory first on PYTHONPATH (so its engine process imports it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any


class NVMLError(Exception):
    """What every failing call raises, as pynvml's NVMLError_* all derive from NVMLError."""


@dataclass
class FakeGpu:
    uuid: str
    utilization_pct: int = 0
    memory_used: int = 1 << 30
    memory_total: int = 80 << 30
    power_mw: int = 70_000
    power_limit_mw: int = 700_000
    energy_mj: int = 5_000_000
    # Readings this GPU answers NotSupported: "utilization", "power", "power_limit",
    # "energy".
    unsupported: set[str] = field(default_factory=set)
    # Every call fails (the GPU fell off the bus).
    lost: bool = False


class FakeNvml:
    NVMLError = NVMLError

    def __init__(self, gpus: list[FakeGpu], init_fails: bool = False) -> None:
        self.gpus = gpus
        self.init_fails = init_fails
        self.initialized = 0

    def nvmlInit(self) -> None:
        if self.init_fails:
            raise NVMLError("NVML Shared Library Not Found")
        self.initialized += 1

    def nvmlShutdown(self) -> None:
        self.initialized -= 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        return self._check(self.gpus[index])

    def nvmlDeviceGetUUID(self, gpu: FakeGpu) -> str:
        return self._check(gpu).uuid

    def nvmlDeviceGetMemoryInfo(self, gpu: FakeGpu) -> Any:
        self._check(gpu)
        return SimpleNamespace(used=gpu.memory_used, total=gpu.memory_total)

    def nvmlDeviceGetUtilizationRates(self, gpu: FakeGpu) -> Any:
        return SimpleNamespace(gpu=self._check(gpu, "utilization").utilization_pct)

    def nvmlDeviceGetPowerUsage(self, gpu: FakeGpu) -> int:
        return self._check(gpu, "power").power_mw

    def nvmlDeviceGetPowerManagementLimit(self, gpu: FakeGpu) -> int:
        return self._check(gpu, "power_limit").power_limit_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, gpu: FakeGpu) -> int:
        return self._check(gpu, "energy").energy_mj

    def _check(self, gpu: FakeGpu, reading: str = "") -> FakeGpu:
        if gpu.lost:
            raise NVMLError("GPU is lost")
        if reading in gpu.unsupported:
            raise NVMLError("Not Supported")
        return gpu


def install_module(directory: Path, gpus: list[FakeGpu]) -> Path:
    """``directory/pynvml.py``: this fake with ``gpus``, for another process to import."""
    directory.mkdir(parents=True, exist_ok=True)
    module = directory / "pynvml.py"
    # This file, then one FakeNvml whose methods are the module's functions.
    module.write_text(
        Path(__file__).read_text()
        + f"\n\n_nvml = FakeNvml({gpus!r})\n\n\n"
        + "def __getattr__(name: str) -> Any:\n    return getattr(_nvml, name)\n"
    )
    return module
