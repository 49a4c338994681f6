"""Shared-memory regions registered by clients: Triton's systemsharedmemory and
cudasharedmemory extensions.

A region is a window (``offset``, ``byte_size``) of a POSIX shared-memory object the
client created (``/dev/shm/<key>``), mapped here once at registration with mmap. Any
process can map the same object by its key, which is how a future engine process will
read the same tensors without a copy through the front end.

Every access is checked against the region's bounds before a byte is touched: an
offset or size past the end of a region, a region that is not registered, two outputs
of a request overlapping in one region, all answer 400 naming the cause. An input is
read as a read-only numpy view of the mapping, with no copy (BYTES elements excepted);
an output is copied into its region once the model has run.

A client that shrinks its object below a registered region after registering it makes
the next access to the lost pages fault (SIGBUS) in any process that maps it, Triton's
included. The size of the object is checked again at every access, which catches a
shrink between requests but not one racing a request; that is why client shared memory
is off unless the server runs with ``--allow-client-shm``: enable it only for clients
on this host that you trust.

On a server with API keys, each key has regions of its own: a region belongs to the key
that registered it (its ``owner``, the key's name), and only requests with that key see
it in status, read or write it, or unregister it; another key's region is "not
registered" to them, and two keys may each register a region of the same name. On a
server without keys every region has the owner "".

A CUDA region is device memory a client exported as a CUDA IPC handle
(``tritonclient.utils.cuda_shared_memory``), opened here once at registration
(:mod:`slipstream.serving.cuda_ipc`). Inputs are copied from it to the host and outputs
back into it, each with one synchronous copy; the same bounds are checked first. Both
kinds share one table of names, as in Triton: a name is a system region or a CUDA one.

Example (what ``tritonclient.utils.shared_memory`` does on the client side)::

    regions = SystemSharedMemory(allowed=True)
    regions.register("input", "/input_simple", offset=0, byte_size=64, owner="ci")
    regions.read_inputs(request)            # InferRequest.shared_memory_inputs -> inputs
    targets = regions.output_targets(request)   # of request.owner's regions
    ...
    regions.write_outputs(targets, response, request.owner)
"""

from __future__ import annotations

import logging
import mmap
import os
import stat
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from slipstream.datatypes import V2_TO_NUMPY
from slipstream.errors import InvalidRequest, ModelNotFound
from slipstream.protocol import grpc_codec
from slipstream.serving.cuda_ipc import CudaIpc
from slipstream.types import (
    CudaRegionStatus,
    InferRequest,
    InferResponse,
    SharedMemoryInput,
    SharedMemoryRef,
    SharedMemoryRegionStatus,
)

logger = logging.getLogger(__name__)

# Where Linux keeps POSIX shared-memory objects: shm_open("/name") opens /dev/shm/name.
SHM_DIR = "/dev/shm"
# NAME_MAX: the longest file name in /dev/shm.
MAX_KEY_BYTES = 255
# Region names are the client's labels; bounded so a status reply stays small.
MAX_NAME_CHARS = 256
# Each region holds a mapping and a descriptor: bounded so that no client can exhaust
# the process's descriptors or address space by registering without end.
MAX_REGIONS = 1024
# With API keys, what one key may hold of them: no key can take the whole table and leave
# the other keys without regions.
MAX_REGIONS_PER_KEY = 256
# Input arrays kept per region (see _Region.arrays).
_MAX_CACHED_ARRAYS = 64

_DISABLED = (
    "client shared memory is disabled on this server; start it with --allow-client-shm "
    "(only for trusted clients on this host), or send the tensors in the request"
)


class RegionNotFound(ModelNotFound):
    """The status of a region that is not registered: 404 / NOT_FOUND, as in Triton.
    (A request that reads or writes an unregistered region is a 400: its field is wrong.)"""


@dataclass(slots=True, eq=False)
class _Region:
    status: SharedMemoryRegionStatus
    # The object's descriptor, kept to check its size at every access.
    fd: int
    # The mapping (from the page boundary at or below offset) and the region's bytes in it.
    mapping: mmap.mmap
    view: memoryview
    # Read-only input arrays over the region by (offset, size, datatype, shape): clients
    # send the same tensors at the same places request after request, and the view is
    # the same array every time (saves ~2 us of its ~8 us per request).
    arrays: dict[tuple[int, int, str, tuple[int, ...]], np.ndarray] = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class _CudaRegion:
    status: CudaRegionStatus
    # The region's device address in this process (cudaIpcOpenMemHandle's).
    pointer: int


_R = TypeVar("_R", _Region, _CudaRegion)


def _size(region: _Region | _CudaRegion) -> int:
    return region.status.byte_size


class SystemSharedMemory:
    """The registered regions of one server; see the module docstring."""

    def __init__(self, allowed: bool, cuda: CudaIpc | None = None) -> None:
        # False: every register is refused; status lists nothing, unregister is a no-op.
        self.allowed = allowed
        # (owner, region name) -> the region, of either kind.
        self._regions: dict[tuple[str, str], _Region | _CudaRegion] = {}
        self.cuda = cuda if cuda is not None else CudaIpc()

    # -- the extension's API ------------------------------------------------------------

    def register(self, name: str, key: str, offset: int, byte_size: int, owner: str = "") -> None:
        """Map ``byte_size`` bytes at ``offset`` of the object ``key`` as ``owner``'s
        region ``name``."""
        self._check_new(name, byte_size, owner)
        path = os.path.join(SHM_DIR, _check_key(key))
        try:
            # O_NOFOLLOW: a symlink planted in /dev/shm must not map another file.
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise InvalidRequest(
                f"key {key!r}: cannot open shared memory object {path}: {exc.strerror}; "
                "create it first (shm_open) and register it from this host"
            ) from None
        try:
            region = _map(name, key, fd, offset, byte_size, owner)
        except BaseException:
            os.close(fd)
            raise
        self._regions[owner, name] = region
        logger.info("registered shared memory region %r (%s, %d bytes) of key %r",
                    name, key, byte_size, owner or "-")  # fmt: skip

    def register_cuda(
        self, name: str, raw_handle: bytes, device_id: int, byte_size: int, owner: str = ""
    ) -> None:
        """Open the device memory ``raw_handle`` exports (a CUDA IPC handle, on GPU
        ``device_id``) as ``owner``'s region ``name`` of ``byte_size`` bytes."""
        self._check_new(name, byte_size, owner)
        pointer = self.cuda.open(raw_handle, device_id)
        status = CudaRegionStatus(name, device_id, byte_size, owner, raw_handle)
        self._regions[owner, name] = _CudaRegion(status, pointer)
        logger.info("registered CUDA shared memory region %r (device %d, %d bytes) of key %r",
                    name, device_id, byte_size, owner or "-")  # fmt: skip

    def status(self, name: str = "", owner: str = "") -> list[SharedMemoryRegionStatus]:
        """Every system region of ``owner`` (``name`` empty), or the one named; 404 for
        a name ``owner`` has not registered as a system region."""
        return [region.status for region in self._listed(_Region, name, owner)]

    def cuda_status(self, name: str = "", owner: str = "") -> list[CudaRegionStatus]:
        """:meth:`status` of CUDA regions."""
        return [region.status for region in self._listed(_CudaRegion, name, owner)]

    def registered(self) -> list[SharedMemoryRegionStatus]:
        """Every system region of every owner (what an engine started again registers
        again)."""
        return [r.status for _, r in sorted(self._regions.items()) if isinstance(r, _Region)]

    def registered_cuda(self) -> list[CudaRegionStatus]:
        """:meth:`registered` of CUDA regions."""
        return [r.status for _, r in sorted(self._regions.items()) if isinstance(r, _CudaRegion)]

    def unregister(self, name: str = "", owner: str = "") -> None:
        """Unmap ``owner``'s system region ``name``, or every system region of ``owner``.
        Unknown names are a no-op, as in Triton, so that a client may always clean up."""
        self._unregister(_Region, name, owner)

    def unregister_cuda(self, name: str = "", owner: str = "") -> None:
        """:meth:`unregister` of CUDA regions."""
        self._unregister(_CudaRegion, name, owner)

    def close(self) -> None:
        for region in self._regions.values():
            self._release(region)
        self._regions.clear()

    def _check_new(self, name: str, byte_size: int, owner: str) -> None:
        """Refuse a registration before anything is opened: disabled, a bad or taken
        name, a full table, an empty region."""
        if not self.allowed:
            raise InvalidRequest(_DISABLED)
        check_region_name(name)
        if (owner, name) in self._regions:
            raise InvalidRequest(
                f"shared memory region {name!r} is already registered; unregister it "
                "first or register under another name"
            )
        if len(self._regions) >= MAX_REGIONS:
            raise InvalidRequest(
                f"{MAX_REGIONS} shared memory regions are registered already; unregister "
                "regions no longer in use"
            )
        if owner and sum(held == owner for held, _ in self._regions) >= MAX_REGIONS_PER_KEY:
            raise InvalidRequest(
                f"this API key holds {MAX_REGIONS_PER_KEY} shared memory regions already, "
                "the most one key may; unregister regions no longer in use"
            )
        if byte_size <= 0:
            raise InvalidRequest(f"byte_size: {byte_size}; a region holds at least one byte")

    def _listed(self, kind: type[_R], name: str, owner: str) -> list[_R]:
        if not name:
            return [
                region
                for (each, _), region in sorted(self._regions.items())
                if each == owner and isinstance(region, kind)
            ]
        check_region_name(name)
        region = self._regions.get((owner, name))
        if not isinstance(region, kind):
            what = "CUDA shared memory" if kind is _CudaRegion else "shared memory"
            raise RegionNotFound(f"{what} region {name!r} is not registered")
        return [region]

    def _unregister(self, kind: type, name: str, owner: str) -> None:
        if name:
            check_region_name(name)
            names = [(owner, name)]
        else:
            names = [each for each in self._regions if each[0] == owner]
        for each in names:
            if isinstance(self._regions.get(each), kind):
                self._release(self._regions.pop(each))

    def _release(self, region: _Region | _CudaRegion) -> None:
        if isinstance(region, _CudaRegion):
            self.cuda.close(region.status.raw_handle, region.status.device_id)
        else:
            _unmap(region)

    # -- inference ----------------------------------------------------------------------

    def read_inputs(self, request: InferRequest) -> None:
        """Move ``request.shared_memory_inputs`` into ``request.inputs``, read from their
        regions (views, no copy, for fixed-size datatypes)."""
        owner = request.owner
        for name, tensor in request.shared_memory_inputs.items():
            ref = tensor.ref
            region = self._regions.get((owner, ref.region))
            if isinstance(region, _CudaRegion):
                request.inputs[name] = self._read_cuda(name, tensor, owner)
                continue
            key = (ref.offset, ref.byte_size, tensor.datatype, tuple(tensor.shape))
            array = None if region is None else region.arrays.get(key)
            if region is not None and array is not None:
                _check_object(region, f"input '{name}'")
            else:
                array = _tensor(name, tensor, self._bytes(ref, owner, f"input '{name}'"))
                if array.dtype != object and region is not None:
                    if len(region.arrays) >= _MAX_CACHED_ARRAYS:
                        region.arrays.clear()
                    region.arrays[key] = array
            request.inputs[name] = array
        request.shared_memory_inputs = {}

    def output_targets(self, request: InferRequest) -> dict[str, SharedMemoryRef]:
        """The regions (of ``request.owner``) the request's outputs go to, checked before
        the model runs."""
        targets = {o.name: o.shared_memory for o in request.outputs or () if o.shared_memory}
        placed: list[tuple[str, SharedMemoryRef]] = []
        for name, ref in targets.items():
            # Bounds only: the object's size is checked right before the write.
            self._checked(ref, request.owner, f"output '{name}'")
            for other, taken in placed:
                if _overlap(ref, taken):
                    raise InvalidRequest(
                        f"output '{name}': its bytes in region {ref.region!r} overlap those "
                        f"of output '{other}'; give each output its own bytes"
                    )
            placed.append((name, ref))
        return targets

    def write_outputs(
        self, targets: dict[str, SharedMemoryRef], response: InferResponse, owner: str = ""
    ) -> None:
        """Copy each targeted output into its region (of ``owner``, the request's); the
        response keeps shapes only."""
        for name, ref in targets.items():
            data = grpc_codec.raw_buffer(response.outputs[name])[1]
            if len(data) > ref.byte_size:
                raise InvalidRequest(
                    f"output '{name}': {len(data)} bytes do not fit in its "
                    f"shared_memory_byte_size of {ref.byte_size}"
                )
            # Looked up again: the region may have been unregistered while the model ran.
            region = self._checked(ref, owner, f"output '{name}'")
            if isinstance(region, _CudaRegion):
                self.cuda.to_device(
                    region.status.device_id, region.pointer + ref.offset, memoryview(data)
                )
            else:
                _check_object(region, f"output '{name}'")
                region.view[ref.offset : ref.offset + len(data)] = data
        response.in_shared_memory = frozenset(targets)

    # -- bounds -------------------------------------------------------------------------

    def _checked(self, ref: SharedMemoryRef, owner: str, where: str) -> _Region | _CudaRegion:
        """``owner``'s region ``ref`` names, after checking ``ref`` against its bounds."""
        region = self._regions.get((owner, ref.region))
        if region is None:
            raise InvalidRequest(
                f"{where}: shared memory region {ref.region!r} is not registered; register "
                "it first (POST /v2/systemsharedmemory/region/<name>/register or "
                "SystemSharedMemoryRegister; cudasharedmemory for device memory)"
            )
        size = _size(region)
        if ref.offset > size or ref.byte_size > size - ref.offset:
            raise InvalidRequest(
                f"{where}: shared_memory_offset {ref.offset} + shared_memory_byte_size "
                f"{ref.byte_size} is past the end of region {ref.region!r} ({size} bytes)"
            )
        return region

    def _bytes(self, ref: SharedMemoryRef, owner: str, where: str) -> memoryview:
        """The bytes ``ref`` names in ``owner``'s system region, after checking them
        against the region's bounds and the object's current size."""
        region = self._checked(ref, owner, where)
        assert isinstance(region, _Region)  # read_inputs sends CUDA regions elsewhere
        _check_object(region, where)
        return region.view[ref.offset : ref.offset + ref.byte_size]

    def _read_cuda(self, name: str, tensor: SharedMemoryInput, owner: str) -> np.ndarray:
        """An input copied from a CUDA region to the host."""
        where = f"input '{name}'"
        region = self._checked(tensor.ref, owner, where)
        assert isinstance(region, _CudaRegion)
        data = self.cuda.to_host(
            region.status.device_id, region.pointer + tensor.ref.offset, tensor.ref.byte_size
        )
        return _tensor(name, tensor, data.data)


class RegionCalls:
    """The region calls of the serving contract (``InferenceService``), answered from a
    server's ``shared_memory`` table."""

    shared_memory: SystemSharedMemory

    async def region_status(
        self, name: str = "", owner: str = ""
    ) -> list[SharedMemoryRegionStatus]:
        return self.shared_memory.status(name, owner)

    async def register_region(
        self, name: str, key: str, offset: int, byte_size: int, owner: str = ""
    ) -> None:
        self.shared_memory.register(name, key, offset, byte_size, owner)

    async def unregister_region(self, name: str = "", owner: str = "") -> None:
        self.shared_memory.unregister(name, owner)

    async def cuda_region_status(self, name: str = "", owner: str = "") -> list[CudaRegionStatus]:
        return self.shared_memory.cuda_status(name, owner)

    async def register_cuda_region(
        self, name: str, raw_handle: bytes, device_id: int, byte_size: int, owner: str = ""
    ) -> None:
        self.shared_memory.register_cuda(name, raw_handle, device_id, byte_size, owner)

    async def unregister_cuda_region(self, name: str = "", owner: str = "") -> None:
        self.shared_memory.unregister_cuda(name, owner)


def _check_object(region: _Region, where: str) -> None:
    """400 when the client shrank the object below the region: touching the lost pages
    would fault (SIGBUS) instead."""
    end = region.status.offset + region.status.byte_size
    # The object's size as lseek's end: 0.3 us against fstat's 1.05 (fstat builds a
    # stat_result). Nothing reads through the descriptor, so its position is free to move.
    object_size = os.lseek(region.fd, 0, os.SEEK_END)
    if object_size < end:
        raise InvalidRequest(
            f"{where}: shared memory object {region.status.key!r} of region "
            f"{region.status.name!r} shrank to {object_size} bytes, below the region's end "
            f"at {end}; unregister the region and register it again"
        )


def _tensor(name: str, tensor: SharedMemoryInput, data: memoryview) -> np.ndarray:
    if tensor.datatype == "BYTES":  # length-prefixed elements, copied out of the region
        try:
            return grpc_codec.decode_raw_tensor(name, "BYTES", tensor.shape, bytes(data))
        except InvalidRequest as exc:
            where = f"its {len(data)} bytes in region {tensor.ref.region!r}"
            raise InvalidRequest(exc.message.replace("raw_input_contents", where)) from None
    array = np.frombuffer(data, dtype=V2_TO_NUMPY[tensor.datatype]).reshape(tensor.shape)
    # The region is the client's memory: a model must never write into it.
    array.flags.writeable = False
    return array


def check_region_name(name: str) -> None:
    """400 for a region name of no characters or too many."""
    if not name or len(name) > MAX_NAME_CHARS:
        raise InvalidRequest(
            f"region name {name[:40]!r}: {len(name)} characters; expected 1 to {MAX_NAME_CHARS}"
        )


def _check_key(key: str) -> str:
    """The file name in /dev/shm of a POSIX shared-memory name such as "/input0"."""
    name = key[1:] if key.startswith("/") else key
    if len(name.encode()) > MAX_KEY_BYTES:
        raise InvalidRequest(
            f"key: {len(name.encode())} bytes after its leading '/'; a shared memory "
            f"object's name holds at most {MAX_KEY_BYTES}"
        )
    if not name or "/" in name or "\0" in name or name in (".", ".."):
        raise InvalidRequest(
            f"key {key!r}: expected a POSIX shared memory name: '/' and then a name "
            "without '/' (as given to shm_open), e.g. '/input_simple'"
        )
    return name


def _map(name: str, key: str, fd: int, offset: int, byte_size: int, owner: str) -> _Region:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise InvalidRequest(f"key {key!r}: not a shared memory object")
    if offset > info.st_size or byte_size > info.st_size - offset:
        raise InvalidRequest(
            f"offset {offset} + byte_size {byte_size} is past the end of shared memory "
            f"object {key!r} ({info.st_size} bytes)"
        )
    # mmap offsets must be page aligned: map from the page holding the region's start.
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    mapping = mmap.mmap(fd, offset + byte_size - start, offset=start)
    view = memoryview(mapping)[offset - start : offset - start + byte_size]
    status = SharedMemoryRegionStatus(name, key, offset, byte_size, owner)
    return _Region(status, fd, mapping, view)


def _unmap(region: _Region) -> None:
    os.close(region.fd)
    region.arrays.clear()
    try:
        region.view.release()
        region.mapping.close()
    except BufferError:
        # A request still reads a view of it: the mapping goes when the last view does.
        pass


def _overlap(a: SharedMemoryRef, b: SharedMemoryRef) -> bool:
    return (
        a.region == b.region
        and a.offset < b.offset + b.byte_size
        and b.offset < a.offset + a.byte_size
    )
