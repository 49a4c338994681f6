"""CUDA shared-memory regions in the region registry.

This host has no GPU, so two kinds of test:
- the registry's own logic (one table of names for both kinds, bounds, owners, reads at
  offsets, writes, the split layout's journal) over :class:`HostIpc`, which stands in
  for the CUDA runtime with host memory at real addresses, copied with the same pointer
  arithmetic the runtime's copies get;
- the real CUDA runtime (cuda-bindings) on this host: every registration is refused with
  the runtime's reason, and nothing is listed.

tests/gpu/test_cuda_shared_memory.py runs the real thing with tritonclient's
cuda_shared_memory on a GPU host (``make test-gpu``).
"""

from __future__ import annotations

import ctypes
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from slipstream.errors import InvalidRequest
from slipstream.server.journal import EngineJournal
from slipstream.serving.cuda_ipc import HANDLE_BYTES, CudaIpc
from slipstream.serving.shared_memory import SHM_DIR, RegionNotFound, SystemSharedMemory
from slipstream.types import (
    InferRequest,
    InferResponse,
    RequestedOutput,
    SharedMemoryInput,
    SharedMemoryRef,
)


class HostIpc(CudaIpc):
    """ "Device memory" in host arrays: a handle names an array, its pointer is the
    array's address, and copies are memmoves between addresses."""

    def __init__(self) -> None:
        super().__init__()
        self.memory: dict[bytes, np.ndarray] = {}
        self.opened: list[int] = []

    def allocate(self, byte_size: int) -> tuple[bytes, np.ndarray]:
        handle = uuid.uuid4().bytes * (HANDLE_BYTES // 16)
        self.memory[handle] = np.zeros(byte_size, dtype=np.uint8)
        return handle, self.memory[handle]

    def device_count(self) -> int:
        return 1

    def open(self, raw_handle: bytes, device_id: int) -> int:
        if raw_handle not in self.memory:
            raise InvalidRequest("raw_handle: not a handle of this test")
        pointer = int(self.memory[raw_handle].ctypes.data)
        self.opened.append(pointer)
        return pointer

    def close(self, raw_handle: bytes, device_id: int) -> None:
        self.opened.remove(int(self.memory[raw_handle].ctypes.data))

    def to_host(self, device_id: int, pointer: int, byte_size: int) -> np.ndarray:
        host = np.empty(byte_size, dtype=np.uint8)
        ctypes.memmove(host.ctypes.data, pointer, byte_size)
        return host

    def to_device(self, device_id: int, pointer: int, data: memoryview) -> None:
        source = np.frombuffer(data, dtype=np.uint8)
        ctypes.memmove(pointer, source.ctypes.data, data.nbytes)


@pytest.fixture
def ipc() -> HostIpc:
    return HostIpc()


def _input_request(region: str, offset: int, shape: list[int], owner: str = "") -> InferRequest:
    ref = SharedMemoryRef(region, offset, 4 * int(np.prod(shape)))
    return InferRequest(
        "m", "", {}, shared_memory_inputs={"x": SharedMemoryInput("FP32", shape, ref)},
        owner=owner,
    )  # fmt: skip


def test_inputs_are_copied_from_the_device_at_their_offset(ipc: HostIpc) -> None:
    regions = SystemSharedMemory(allowed=True, cuda=ipc)
    handle, memory = ipc.allocate(64)
    memory.view(np.float32)[:] = np.arange(16)
    regions.register_cuda("gpu", handle, device_id=0, byte_size=64)
    request = _input_request("gpu", 8, [2, 2])
    regions.read_inputs(request)
    np.testing.assert_array_equal(request.inputs["x"], [[2, 3], [4, 5]])
    assert request.shared_memory_inputs == {}
    # A copy, not a view: the client may overwrite its memory once it has its answer.
    memory.view(np.float32)[2] = -1
    assert request.inputs["x"][0, 0] == 2


def test_outputs_are_written_to_the_device_at_their_offset(ipc: HostIpc) -> None:
    regions = SystemSharedMemory(allowed=True, cuda=ipc)
    handle, memory = ipc.allocate(32)
    regions.register_cuda("out", handle, device_id=0, byte_size=32)
    request = InferRequest(
        "m", "", {}, outputs=[RequestedOutput("y", shared_memory=SharedMemoryRef("out", 8, 16))]
    )
    targets = regions.output_targets(request)
    response = InferResponse("m", "1", {"y": np.full(4, 7, np.int32)})
    regions.write_outputs(targets, response)
    assert response.in_shared_memory == {"y"}
    assert memory[:8].tolist() == [0] * 8  # before the output's offset: untouched
    assert memory[8:24].view(np.int32).tolist() == [7, 7, 7, 7]
    assert memory[24:].tolist() == [0] * 8


def test_bounds_are_checked_before_any_copy(ipc: HostIpc) -> None:
    regions = SystemSharedMemory(allowed=True, cuda=ipc)
    handle, _ = ipc.allocate(64)
    regions.register_cuda("gpu", handle, device_id=0, byte_size=32)  # the first 32 bytes
    with pytest.raises(InvalidRequest, match="past the end of region 'gpu' \\(32 bytes\\)"):
        regions.read_inputs(_input_request("gpu", 24, [4]))
    too_far = InferRequest(
        "m", "", {}, outputs=[RequestedOutput("y", shared_memory=SharedMemoryRef("gpu", 33, 0))]
    )
    with pytest.raises(InvalidRequest, match="past the end"):
        regions.output_targets(too_far)
    with pytest.raises(InvalidRequest, match="byte_size: 0"):
        regions.register_cuda("empty", handle, device_id=0, byte_size=0)


def test_both_kinds_share_one_table_of_names_and_list_apart(ipc: HostIpc) -> None:
    key = f"slipstream_unit_{uuid.uuid4().hex[:12]}"
    np.zeros(16, np.float32).tofile(os.path.join(SHM_DIR, key))
    try:
        regions = SystemSharedMemory(allowed=True, cuda=ipc)
        handle, _ = ipc.allocate(64)
        regions.register("host", "/" + key, offset=0, byte_size=64)
        with pytest.raises(InvalidRequest, match="'host' is already registered"):
            regions.register_cuda("host", handle, device_id=0, byte_size=64)
        regions.register_cuda("gpu", handle, device_id=0, byte_size=64)
        with pytest.raises(InvalidRequest, match="'gpu' is already registered"):
            regions.register("gpu", "/" + key, offset=0, byte_size=64)
        assert [s.name for s in regions.status()] == ["host"]
        assert [(s.name, s.device_id, s.byte_size) for s in regions.cuda_status()] == [
            ("gpu", 0, 64)
        ]
        with pytest.raises(RegionNotFound, match="CUDA shared memory region 'host'"):
            regions.cuda_status("host")
        with pytest.raises(RegionNotFound, match="shared memory region 'gpu'"):
            regions.status("gpu")
        # Each kind's unregister leaves the other kind's regions.
        regions.unregister()
        assert regions.status() == [] and len(regions.cuda_status()) == 1
        regions.unregister("gpu")  # a system unregister does not reach a CUDA region
        assert len(regions.cuda_status()) == 1 and ipc.opened
        regions.unregister_cuda("gpu")
        assert regions.cuda_status() == [] and ipc.opened == []
    finally:
        os.unlink(os.path.join(SHM_DIR, key))


def test_each_owner_sees_only_its_own_cuda_regions(ipc: HostIpc) -> None:
    regions = SystemSharedMemory(allowed=True, cuda=ipc)
    handle, memory = ipc.allocate(16)
    memory.view(np.float32)[:] = [1, 2, 3, 4]
    regions.register_cuda("r", handle, device_id=0, byte_size=16, owner="a")
    assert regions.cuda_status(owner="b") == []
    with pytest.raises(InvalidRequest, match="'r' is not registered"):
        regions.read_inputs(_input_request("r", 0, [4], owner="b"))
    request = _input_request("r", 0, [4], owner="a")
    regions.read_inputs(request)
    assert request.inputs["x"].tolist() == [1, 2, 3, 4]
    regions.unregister_cuda(owner="b")
    assert len(regions.cuda_status(owner="a")) == 1
    regions.close()
    assert ipc.opened == []


def test_an_engine_started_again_opens_its_cuda_regions_again(ipc: HostIpc, tmp_path: Path) -> None:
    before = SystemSharedMemory(allowed=True, cuda=ipc)
    handle, memory = ipc.allocate(16)
    memory.view(np.float32)[:] = [5, 6, 7, 8]
    before.register_cuda("r", handle, device_id=0, byte_size=16, owner="a")
    EngineJournal(tmp_path / "engine-state.json").save(before)
    before.close()

    after = SystemSharedMemory(allowed=True, cuda=ipc)
    EngineJournal(tmp_path / "engine-state.json").restore_regions(after)
    assert [(s.owner, s.name, s.raw_handle) for s in after.registered_cuda()] == [
        ("a", "r", handle)
    ]
    request = _input_request("r", 4, [3], owner="a")
    after.read_inputs(request)
    assert request.inputs["x"].tolist() == [6, 7, 8]
    after.close()


def test_disabled_client_shm_refuses_cuda_regions_too(ipc: HostIpc) -> None:
    regions = SystemSharedMemory(allowed=False, cuda=ipc)
    handle, _ = ipc.allocate(16)
    with pytest.raises(InvalidRequest, match="--allow-client-shm"):
        regions.register_cuda("r", handle, device_id=0, byte_size=16)


# -- the real CUDA runtime, on a host without a GPU ---------------------------------------


@pytest.fixture
def no_gpu() -> Iterator[None]:
    pytest.importorskip("cuda.bindings.runtime")  # the gpu extra; `make install` has it
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU: tests/gpu covers it")
    yield


def test_without_a_gpu_registration_is_refused_with_the_runtimes_reason(no_gpu: None) -> None:
    ipc = CudaIpc()
    assert ipc.device_count() == 0
    regions = SystemSharedMemory(allowed=True, cuda=ipc)
    with pytest.raises(InvalidRequest) as info:
        regions.register_cuda("r", bytes(HANDLE_BYTES), device_id=0, byte_size=64)
    message = info.value.message
    assert message.startswith("device_id 0: this server has no usable CUDA device (cudaError")
    assert "use system shared memory" in message
    with pytest.raises(InvalidRequest, match="raw_handle: 3 bytes; a CUDA IPC handle"):
        regions.register_cuda("r", b"abc", device_id=0, byte_size=64)
    assert regions.cuda_status() == []
