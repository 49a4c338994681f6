"""The CUDA runtime calls behind Triton's cudasharedmemory extension: open a client's
CUDA IPC handle, copy between its device memory and the host, close it.

A client (``tritonclient.utils.cuda_shared_memory``) allocates device memory with
``cudaMalloc``, exports it with ``cudaIpcGetMemHandle`` and sends the handle's 64 raw
bytes; the server maps the same allocation with ``cudaIpcOpenMemHandle``. The calls go
through NVIDIA's own bindings, ``cuda-bindings`` (what tritonclient uses on its side;
the ``gpu`` extra installs it), imported on first use so that a CPU server never pays for
them. A handle cannot be opened in the process that made it: CUDA refuses it.

Example (a region's bytes read to the host and written back)::

    ipc = CudaIpc()
    pointer = ipc.open(raw_handle, device_id=0)       # InvalidRequest when it cannot
    data = ipc.to_host(0, pointer + offset, byte_size)  # np.ndarray of uint8
    ipc.to_device(0, pointer + offset, memoryview(data))
    ipc.close(raw_handle, device_id=0)
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any

import numpy as np

from slipstream.errors import InvalidRequest

logger = logging.getLogger(__name__)

# cudaIpcMemHandle_t's size (CUDA_IPC_HANDLE_SIZE in every CUDA release).
HANDLE_BYTES = 64

_MISSING = (
    "CUDA shared memory needs NVIDIA's cuda-bindings package on the server "
    "(pip install 'slipstream[gpu]'); use system shared memory (/v2/systemsharedmemory) "
    "or send the tensors in the request"
)


class CudaIpc:
    """The CUDA runtime as the regions use it; one per server. Calls are serialized:
    the runtime's current device is per thread, and each call sets it first."""

    def __init__(self) -> None:
        self._runtime: Any = None
        self._lock = threading.Lock()
        # None: not asked yet.
        self._devices: int | None = None
        # (handle, device) -> [pointer, how many regions use it]: CUDA maps a handle once
        # per process, and two regions may name the same memory (two owners, or two
        # windows a client registered under two names).
        self._mapped: dict[tuple[bytes, int], list[int]] = {}

    def device_count(self) -> int:
        """How many CUDA devices this process can use (0 without the bindings, a driver
        or a device); asked once."""
        if self._devices is None:
            runtime = self._load(required=False)
            if runtime is None:
                self._devices = 0
            else:
                error, count = runtime.cudaGetDeviceCount()
                self._devices = count if error == runtime.cudaError_t.cudaSuccess else 0
                if self._devices == 0:
                    logger.info("CUDA shared memory is off: %s", self._message(error))
        return self._devices

    def open(self, raw_handle: bytes, device_id: int) -> int:
        """Map the allocation ``raw_handle`` exports on device ``device_id``; its device
        pointer. InvalidRequest naming the field when the handle cannot be opened."""
        runtime = self._load(required=True)
        if len(raw_handle) != HANDLE_BYTES:
            raise InvalidRequest(
                f"raw_handle: {len(raw_handle)} bytes; a CUDA IPC handle "
                f"(cudaIpcGetMemHandle) is {HANDLE_BYTES}"
            )
        count = self.device_count()
        if count == 0:
            error = runtime.cudaGetDeviceCount()[0]
            raise InvalidRequest(
                f"device_id {device_id}: this server has no usable CUDA device "
                f"({self._message(error)}); use system shared memory instead"
            )
        if not 0 <= device_id < count:
            raise InvalidRequest(
                f"device_id {device_id}: this server has CUDA devices 0 to {count - 1}"
            )
        handle = runtime.cudaIpcMemHandle_t()
        # cuda-bindings 13 exposes the handle's bytes only through its address.
        ctypes.memmove(handle.getPtr(), raw_handle, HANDLE_BYTES)
        with self._lock:
            mapped = self._mapped.get((raw_handle, device_id))
            if mapped is not None:
                mapped[1] += 1
                return mapped[0]
            self._check(runtime.cudaSetDevice(device_id)[0], "cudaSetDevice")
            error, pointer = runtime.cudaIpcOpenMemHandle(
                handle, runtime.cudaIpcMemLazyEnablePeerAccess
            )
            if error != runtime.cudaError_t.cudaSuccess:
                raise InvalidRequest(
                    f"raw_handle: CUDA cannot open it on device {device_id} "
                    f"({self._message(error)}); send the handle of memory allocated on that "
                    "device by a live process other than the server"
                )
            self._mapped[raw_handle, device_id] = [int(pointer), 1]
        return int(pointer)

    def close(self, raw_handle: bytes, device_id: int) -> None:
        """Release one region's use of the mapping; the last one unmaps it."""
        runtime = self._load(required=True)
        with self._lock:
            mapped = self._mapped.get((raw_handle, device_id))
            if mapped is None:
                return
            mapped[1] -= 1
            if mapped[1]:
                return
            del self._mapped[raw_handle, device_id]
            runtime.cudaSetDevice(device_id)
            error = runtime.cudaIpcCloseMemHandle(mapped[0])[0]
        if error != runtime.cudaError_t.cudaSuccess:
            logger.warning("closing a CUDA IPC mapping failed: %s", self._message(error))

    def to_host(self, device_id: int, pointer: int, byte_size: int) -> np.ndarray:
        """``byte_size`` bytes at device address ``pointer``, copied into a new array."""
        host = np.empty(byte_size, dtype=np.uint8)
        if byte_size:
            self._copy(device_id, host.ctypes.data, pointer, byte_size)
        return host

    def to_device(self, device_id: int, pointer: int, data: memoryview) -> None:
        """Copy ``data`` (contiguous bytes) to device address ``pointer``."""
        if not data.nbytes:
            return
        source = np.frombuffer(data, dtype=np.uint8)
        self._copy(device_id, pointer, source.ctypes.data, data.nbytes)

    def _copy(self, device_id: int, destination: int, source: int, byte_size: int) -> None:
        runtime = self._load(required=True)
        with self._lock:
            self._check(runtime.cudaSetDevice(device_id)[0], "cudaSetDevice")
            # Synchronous: the copy is done (and the client's own writes, which it synced
            # before sending the request, are seen) when this returns.
            error = runtime.cudaMemcpy(
                destination, source, byte_size, runtime.cudaMemcpyKind.cudaMemcpyDefault
            )[0]
        self._check(error, "cudaMemcpy")

    def _check(self, error: Any, call: str) -> None:
        # The likely cause is the client's: memory freed (or a process gone) while its
        # region is still registered. The request fails; the region stays registered.
        if error != self._runtime.cudaError_t.cudaSuccess:
            raise InvalidRequest(
                f"CUDA shared memory: {call} failed ({self._message(error)}); keep a "
                "region's memory allocated until it is unregistered"
            )

    def _message(self, error: Any) -> str:
        runtime = self._runtime
        if runtime is None:
            return "cuda-bindings is not installed"
        name = runtime.cudaGetErrorName(error)[1]
        text = runtime.cudaGetErrorString(error)[1]
        return f"{name.decode()}: {text.decode()}"

    def _load(self, required: bool) -> Any:
        if self._runtime is None:
            try:
                # Optional and heavy: imported on first use only.
                import cuda.bindings.runtime as runtime
            except ImportError:
                if required:
                    raise InvalidRequest(_MISSING) from None
                return None
            self._runtime = runtime
        return self._runtime
