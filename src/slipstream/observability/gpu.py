"""The GPUs of this machine as NVML reads them, for ``/metrics``, bench and profile.

NVML is the driver's management library (what nvidia-smi shows); NVIDIA's bindings are
the ``gpu`` extra (nvidia-ml-py, imported as ``pynvml``). Every reading is a handful of
calls into the driver at the moment it is asked for (a scrape, a bench window, between
profile runs): no thread polls in the background.

:class:`GpuCollector` exports Triton's GPU series under Triton's names and label
(``gpu_uuid``), so Triton's dashboards and alerts read them unchanged:
``nv_gpu_utilization`` (0..1), ``nv_gpu_memory_used_bytes``, ``nv_gpu_memory_total_bytes``,
``nv_gpu_power_usage`` and ``nv_gpu_power_limit`` (watts), ``nv_energy_consumption``
(joules since the server started). Without pynvml, without a driver, or without a device
:meth:`Gpus.open` returns None and nothing GPU-related is exported or logged above DEBUG.

    gpus = Gpus.open()
    if gpus is not None:
        registry.register(GpuCollector(gpus))
        for reading in gpus.read():
            print(reading.uuid, reading.utilization, reading.memory_used_bytes)
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

# Readings some GPUs do not offer (NVML answers NotSupported): utilization on a GPU in MIG
# mode, power on some boards, the energy counter before Volta. Asked once at open.
_OPTIONAL = ("utilization", "power", "power_limit", "energy")


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One GPU at one moment. None: this GPU does not offer that reading."""

    # NVML's UUID ("GPU-5f3c..."): Triton's gpu_uuid label.
    uuid: str
    # Device memory in use by every process on the GPU, and its size.
    memory_used_bytes: int
    memory_total_bytes: int
    # Share of NVML's last sample period (1/6 s to 1 s by device) a kernel ran, 0..1.
    utilization: float | None
    power_w: float | None
    # The power management limit the board is held to.
    power_limit_w: float | None
    # Energy the GPU used since it was opened (the server's start), joules.
    energy_j: float | None


@dataclass(frozen=True, slots=True)
class GpuTotals:
    """Every visible GPU's readings at one moment, added up."""

    # Summed over the GPUs (2.0 = two GPUs busy); None when none reports it.
    utilization: float | None
    memory_used_bytes: int


def totals(readings: Sequence[GpuReading]) -> GpuTotals | None:
    """The readings added up; None when there are none."""
    if not readings:
        return None
    utilizations = [r.utilization for r in readings if r.utilization is not None]
    return GpuTotals(
        utilization=sum(utilizations) if utilizations else None,
        memory_used_bytes=sum(r.memory_used_bytes for r in readings),
    )


@dataclass(slots=True)
class _Device:
    uuid: str
    handle: Any
    # The _OPTIONAL readings this GPU answered at open.
    offers: frozenset[str]
    # The energy counter at open, millijoules since the driver loaded.
    energy_at_open_mj: int


class Gpus:
    """The GPUs this process may use, opened once through NVML."""

    def __init__(self, nvml: Any, devices: list[_Device]) -> None:
        self._nvml = nvml
        self._devices = devices
        # GPUs whose reading failed once: logged that time only.
        self._failed: set[str] = set()

    @classmethod
    def open(cls, nvml: Any = None, visible_devices: str | None = None) -> Gpus | None:
        """The GPUs ``CUDA_VISIBLE_DEVICES`` (or ``visible_devices``) lets this process
        use; None when pynvml is not installed, NVML does not start (no driver) or no GPU
        is visible. ``nvml``: the pynvml module (a stand-in in tests)."""
        if nvml is None:
            try:
                nvml = importlib.import_module("pynvml")
            except ImportError:
                logger.debug("no GPU metrics: pynvml is not installed (the gpu extra)")
                return None
        try:
            nvml.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            logger.debug("no GPU metrics: NVML does not start (%s)", exc)
            return None
        if visible_devices is None:
            visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
        try:
            devices = _open_devices(nvml, visible_devices)
        except Exception as exc:
            logger.debug("no GPU metrics: NVML cannot list the GPUs (%s)", exc)
            devices = []
        if not devices:
            logger.debug("no GPU metrics: no GPU visible")
            nvml.nvmlShutdown()
            return None
        logger.debug("GPUs read through NVML: %s", ", ".join(d.uuid for d in devices))
        return cls(nvml, devices)

    @property
    def uuids(self) -> list[str]:
        return [device.uuid for device in self._devices]

    def read(self) -> list[GpuReading]:
        """Every GPU's reading now. A GPU that cannot be read (lost, a driver error) is
        left out, and logged the first time only."""
        readings = []
        for device in self._devices:
            try:
                readings.append(self._read(device))
            except Exception as exc:
                if device.uuid not in self._failed:
                    self._failed.add(device.uuid)
                    logger.warning("GPU %s cannot be read through NVML, its readings are left "
                                   "out while it fails: %s", device.uuid, exc)  # fmt: skip
        return readings

    def close(self) -> None:
        """Let NVML go (the process's exit does it too)."""
        self._nvml.nvmlShutdown()

    def _read(self, device: _Device) -> GpuReading:
        nvml, handle, offers = self._nvml, device.handle, device.offers
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        utilization = power_w = power_limit_w = energy_j = None
        if "utilization" in offers:
            utilization = nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100
        if "power" in offers:
            power_w = nvml.nvmlDeviceGetPowerUsage(handle) / 1000  # milliwatts
        if "power_limit" in offers:
            power_limit_w = nvml.nvmlDeviceGetPowerManagementLimit(handle) / 1000
        if "energy" in offers:
            energy_mj = nvml.nvmlDeviceGetTotalEnergyConsumption(handle)
            energy_j = (energy_mj - device.energy_at_open_mj) / 1000
        return GpuReading(
            uuid=device.uuid,
            memory_used_bytes=int(memory.used),
            memory_total_bytes=int(memory.total),
            utilization=utilization,
            power_w=power_w,
            power_limit_w=power_limit_w,
            energy_j=energy_j,
        )


def _open_devices(nvml: Any, visible_devices: str | None) -> list[_Device]:
    handles: list[Any] = []
    uuids: list[str | None] = []
    for index in range(nvml.nvmlDeviceGetCount()):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = str(nvml.nvmlDeviceGetUUID(handle))
            nvml.nvmlDeviceGetMemoryInfo(handle)
        except nvml.NVMLError as exc:  # no permission, lost at boot, ...
            logger.debug("GPU %d left out: NVML cannot read it (%s)", index, exc)
            handle, uuid = None, None
        handles.append(handle)
        uuids.append(uuid)
    devices = []
    for index in visible_indices(visible_devices, uuids):
        offers, energy_mj = _probe(nvml, handles[index])
        devices.append(_Device(str(uuids[index]), handles[index], offers, energy_mj))
    return devices


def _probe(nvml: Any, handle: Any) -> tuple[frozenset[str], int]:
    """The optional readings this GPU answers, and its energy counter now."""
    calls = {
        "utilization": nvml.nvmlDeviceGetUtilizationRates,
        "power": nvml.nvmlDeviceGetPowerUsage,
        "power_limit": nvml.nvmlDeviceGetPowerManagementLimit,
        "energy": nvml.nvmlDeviceGetTotalEnergyConsumption,
    }
    offers, energy_mj = set(), 0
    for name in _OPTIONAL:
        try:
            value = calls[name](handle)
        except nvml.NVMLError as exc:
            logger.debug("GPU reading %s not offered: %s", name, exc)
            continue
        offers.add(name)
        if name == "energy":
            energy_mj = int(value)
    return frozenset(offers), energy_mj


def visible_indices(visible_devices: str | None, uuids: Sequence[str | None]) -> list[int]:
    """NVML indices of the GPUs that ``CUDA_VISIBLE_DEVICES`` lets CUDA use, of those NVML
    lists (``uuids``, None for one it cannot read).

    Unset: every GPU. Entries are indices or UUID prefixes ("GPU-5f3c"); as CUDA does, the
    list ends at the first entry that names no GPU ("" or "-1": none). An index is taken in
    NVML's order (PCI bus), which is CUDA's too unless the GPUs differ in speed and
    CUDA_DEVICE_ORDER is left at FASTEST_FIRST. A MIG entry ("MIG-...") names a slice NVML
    does not list as a GPU: with one, every GPU is read.
    """
    readable = [i for i, uuid in enumerate(uuids) if uuid is not None]
    if visible_devices is None:
        return readable
    chosen: list[int] = []
    for entry in (part.strip() for part in visible_devices.split(",")):
        if entry.startswith("MIG-"):
            return readable
        if entry.isdigit():
            matches = [int(entry)] if int(entry) < len(uuids) else []
        else:
            matches = [i for i, u in enumerate(uuids) if entry and (u or "").startswith(entry)]
        if len(matches) != 1:
            break
        if matches[0] not in chosen:
            chosen.append(matches[0])
    return [index for index in chosen if uuids[index] is not None]


class GpuCollector(Collector):
    """Triton's nv_gpu_* series (and nv_energy_consumption), read from NVML at each scrape."""

    # (name, help, GpuReading attribute); help as Triton words it.
    _FAMILIES = (
        ("nv_gpu_utilization", "GPU utilization rate [0.0 - 1.0)", "utilization"),
        ("nv_gpu_memory_total_bytes", "GPU total memory, in bytes", "memory_total_bytes"),
        ("nv_gpu_memory_used_bytes", "GPU used memory, in bytes", "memory_used_bytes"),
        ("nv_gpu_power_usage", "GPU power usage in watts", "power_w"),
        ("nv_gpu_power_limit", "GPU power management limit in watts", "power_limit_w"),
        ("nv_energy_consumption", "GPU energy consumption in joules since the server started",
         "energy_j"),
    )  # fmt: skip

    def __init__(self, gpus: Gpus) -> None:
        self._gpus = gpus

    def collect(self) -> Iterator[Metric]:
        readings = self._gpus.read()
        for name, documentation, attribute in self._FAMILIES:
            # Triton types nv_energy_consumption a counter; prometheus_client would write a
            # counter's family as <name>_total, which Triton's dashboards would not find,
            # so it is a gauge here (rate() reads either).
            family = Metric(name, documentation, "gauge")
            for reading in readings:
                value = getattr(reading, attribute)
                if value is not None:
                    family.add_sample(name, {"gpu_uuid": reading.uuid}, float(value))
            if family.samples:
                yield family
