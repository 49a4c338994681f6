"""Shared-memory arenas: how a link's large tensors cross between a front end and the
engine without going through the socket.

Each side of a link (:mod:`slipstream.engine.channel`) makes an *outgoing* arena, an
anonymous shared-memory file of ``ARENA_BYTES`` (``memfd_create``), and tells the peer
where to open it (``/proc/<pid>/fd/<fd>``: the processes of one server run as one user);
the peer maps it read-only and says so, and the maker closes its descriptor. The memory
has no name anywhere, so nothing outlives the two processes, whichever way they end. A
frame of at least ``MIN_FRAME_BYTES``
(a tensor's data) is then copied once into the sender's arena and crosses the socket as
its place (offset, size); the receiver rebuilds the tensor over its mapping of that
place, without a copy. Through the socket the same bytes were copied twice (into the
kernel and out of it) and took several reads and writes a message, since a Unix socket
buffers ~200 KB.

A place is given back when the receiver no longer holds any array over it: the arrays
are built over one read-only holder array per place, and the holder's finalizer (which
can run in any thread, wherever the last array is dropped) queues the place, which the
receiver's link sends back in a ``free`` message. A sender whose arena is full, or a
frame too large for it, sends that frame through the socket as before; a side that
cannot make or map an arena (no ``/dev/shm``, or it is full) keeps to the socket.

The arena's pages are reserved when it is made (``posix_fallocate``): writing into a
sparse shared-memory file that memory can no longer back would kill the process with
SIGBUS, while a reservation that fails only leaves the link on the socket.

Example (both ends in one process)::

    outgoing = OutgoingArena.create()                # then tell the peer outgoing.path
    incoming = IncomingArena.open(outgoing.path, outgoing.size, on_free=print)
    outgoing.opened()                                # the peer has it: our fd goes
    place = outgoing.place(memoryview(b"x" * 100_000))   # (offset, size), or None
    array = incoming.view(*place)                     # read-only uint8 over the bytes
    del array                                         # on_free(offset, size) runs
    outgoing.release(*place)                          # once the peer says so
"""

from __future__ import annotations

import bisect
import logging
import mmap
import os
import re
import weakref
from collections.abc import Callable

import numpy as np

logger = logging.getLogger(__name__)

# Each direction of each link: room for 16 requests of a 600 KB image tensor, say, and
# the answers' tensors in the other direction.
ARENA_BYTES = 32 * 1024 * 1024
# Frames below this cross through the socket: a place costs a message back (the free)
# and a finalizer, which small frames do not repay.
MIN_FRAME_BYTES = 65_536
# Places start on cache lines: arrays over them are aligned for any dtype.
_ALIGN = 64


class Blocks:
    """First-fit allocation of ``size`` bytes: places are taken and given back in any
    order, and free neighbours merge."""

    def __init__(self, size: int) -> None:
        self.size = size
        # Free blocks as sorted starts and, for each start, its length.
        self._starts = [0]
        self._lengths = {0: size}

    @property
    def free_bytes(self) -> int:
        return sum(self._lengths.values())

    def take(self, nbytes: int) -> int | None:
        """The offset of ``nbytes`` free bytes (rounded up to the alignment), or None."""
        need = -(-nbytes // _ALIGN) * _ALIGN
        for index, start in enumerate(self._starts):
            length = self._lengths[start]
            if length >= need:
                del self._lengths[start]
                if length == need:
                    del self._starts[index]
                else:
                    self._starts[index] = start + need
                    self._lengths[start + need] = length - need
                return start
        return None

    def give(self, offset: int, nbytes: int) -> None:
        """Free the place :meth:`take` returned for ``nbytes``."""
        length = -(-nbytes // _ALIGN) * _ALIGN
        index = bisect.bisect_left(self._starts, offset)
        after = self._starts[index] if index < len(self._starts) else None
        if after is not None and after < offset + length:
            raise ValueError(f"place {offset}+{length} overlaps the free block at {after}")
        if index and (before := self._starts[index - 1]) + self._lengths[before] > offset:
            raise ValueError(f"place {offset}+{length} overlaps a free block before it")
        if after == offset + length:  # merge with the block after
            length += self._lengths.pop(after)
            del self._starts[index]
        if index and (before := self._starts[index - 1]) + self._lengths[before] == offset:
            self._lengths[before] += length  # merge into the block before
            return
        self._starts.insert(index, offset)
        self._lengths[offset] = length


class OutgoingArena:
    """The arena one side writes its large frames into."""

    def __init__(self, fd: int, mapping: mmap.mmap, size: int) -> None:
        # Where the peer opens it, until it says it has.
        self.path = f"/proc/{os.getpid()}/fd/{fd}"
        self.size = size
        # Our descriptor while the peer may still open it; closed however this ends.
        self._fds = [fd]
        weakref.finalize(self, _close_all, self._fds)
        self._mapping = mapping
        self._blocks = Blocks(size)

    @classmethod
    def create(cls, size: int = ARENA_BYTES) -> OutgoingArena:
        """A new arena; OSError when memory cannot back it."""
        fd = os.memfd_create("slipstream-link", os.MFD_CLOEXEC)
        try:
            os.posix_fallocate(fd, 0, size)
            mapping = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, mapping, size)

    @property
    def free_bytes(self) -> int:
        return self._blocks.free_bytes

    def place(self, data: memoryview) -> tuple[int, int] | None:
        """``data`` copied into a free place: (offset, size); None when none is free."""
        nbytes = data.nbytes
        offset = self._blocks.take(nbytes)
        if offset is None:
            return None
        self._mapping[offset : offset + nbytes] = data.cast("B") if data.ndim != 1 else data
        return offset, nbytes

    def release(self, offset: int, nbytes: int) -> None:
        self._blocks.give(offset, nbytes)

    def opened(self) -> None:
        """The peer has mapped the arena, or never will: our descriptor is no longer
        needed (the mappings keep the memory)."""
        _close_all(self._fds)

    def close(self) -> None:
        self.opened()
        self._mapping.close()


def _close_all(fds: list[int]) -> None:
    while fds:
        os.close(fds.pop())


class IncomingArena:
    """The peer's arena, mapped read-only; arrays over its places."""

    def __init__(self, mapping: mmap.mmap, size: int, on_free: Callable[[int, int], None]) -> None:
        self.size = size
        self._mapping = mapping
        self._on_free = on_free

    @classmethod
    def open(cls, path: str, size: int, on_free: Callable[[int, int], None]) -> IncomingArena:
        """Map the peer's arena at ``path``; OSError (or ValueError for a size it does not
        have) when it cannot be."""
        if not re.fullmatch(r"/proc/\d+/fd/\d+", path):
            raise ValueError(f"{path!r} is not a link arena")
        # Not O_NOFOLLOW: /proc/<pid>/fd/<fd> is a link to the memfd, which opening follows.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size != size:
                raise ValueError(f"{path} does not hold {size} bytes")
            mapping = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        return cls(mapping, size, on_free)

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """A read-only uint8 array over the place; ``on_free(offset, nbytes)`` runs once
        no array over it remains. ValueError for a place outside the arena."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"place {offset}+{nbytes} is outside the {self.size}-byte arena")
        # Arrays made from this one (frombuffer, views, reshapes) keep it as their base,
        # so its finalizer runs only when the last of them is gone.
        holder = np.frombuffer(self._mapping, np.uint8, count=nbytes, offset=offset)
        weakref.finalize(holder, self._on_free, offset, nbytes)
        return holder
