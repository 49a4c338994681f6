"""One connection between a front end and the engine: a Unix socket read and written by
the asyncio loop, sending in batches.

Why not ZeroMQ (which this package used first): every ZeroMQ message crosses its I/O
thread on each side, so a call's round trip woke four more threads than the two loops.
On one shared core (`benchmarks/transport.py`: the engine's client and host against the
same frames over a Unix socket, both processes on one core) a call cost 207 us of CPU
through ZeroMQ and 112 us here. The loop now writes the socket and the peer's loop reads it.

Sending: ``post`` queues a message, and once per turn of the loop every message queued
goes as one write (one pickle of the list, one ``writelines``): under load a turn gathers
many answers or requests; a lone request costs what one message did.

On the socket a message is a prefix (its length after the prefix, its frame count), each
frame's length, then the frames (:mod:`slipstream.engine.wire`: a pickled header, then
each large buffer out of band). Reading: small messages are parsed from one receive
buffer (a receive takes as many as have come); a message over ``LARGE_BYTES`` is received
into a buffer of its own, and its arrays are rebuilt over that buffer's memory without a
copy (read-only).
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from slipstream.engine.wire import decode, encode

logger = logging.getLogger(__name__)

# A message's prefix: the bytes after the prefix, the number of frames.
_PREFIX = struct.Struct("<QI")
_LENGTH = struct.Struct("<Q")
# Messages at least this large get a receive buffer of their own (their tensors then
# cross without a copy); smaller ones are copied out of the shared receive buffer.
LARGE_BYTES = 65_536
# The shared receive buffer: twice the largest message it holds, so that after moving a
# partial message to its front there is always room for the rest.
_BUFFER_BYTES = 2 * LARGE_BYTES

# (the link it came on, message) for each message received.
OnMessage = Callable[["Link", Any], None]


class Link(asyncio.BufferedProtocol):
    """One connection's protocol; see the module docstring.

    ``on_lost``: called once the connection is gone (its queued messages are dropped).
    ``on_unencodable``: called with a message that cannot be pickled (it is dropped).
    """

    def __init__(
        self,
        on_message: OnMessage,
        on_made: Callable[[Link], None] | None = None,
        on_lost: Callable[[Link], None] | None = None,
        on_unencodable: Callable[[Link, Any], None] | None = None,
    ) -> None:
        self._on_message = on_message
        self._on_made = on_made
        self._on_lost = on_lost
        self._on_unencodable = on_unencodable
        # uvloop's transports are not asyncio.Transport subclasses.
        self._transport: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox: list[Any] = []
        self._flush_scheduled = False
        self._buffer = bytearray(_BUFFER_BYTES)
        self._filled = 0
        # A large message being received into its own buffer, and how much of it has come.
        self._large: memoryview | None = None
        self._large_filled = 0

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    # -- asyncio's protocol ----------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self._transport = transport
        self._loop = asyncio.get_running_loop()
        if self._on_made is not None:
            self._on_made(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._outbox.clear()
        if self._on_lost is not None:
            self._on_lost(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._large is not None:
            return self._large[self._large_filled :]
        return memoryview(self._buffer)[self._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._large is not None:
            self._large_filled += nbytes
            if self._large_filled == len(self._large):
                whole = self._large.toreadonly()
                self._large = None
                self._deliver(whole, copy=False)
            return
        self._filled += nbytes
        self._parse()

    def eof_received(self) -> bool:
        return False  # close the transport: the peer has gone

    # -- sending -----------------------------------------------------------------------------

    def post(self, message: Any) -> None:
        """Queue ``message``; it is sent at the end of this turn of the loop (dropped if
        the connection is gone by then)."""
        self._outbox.append(message)
        if not self._flush_scheduled and self._loop is not None:
            self._flush_scheduled = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        """Send what is queued now (:meth:`post` calls it at the end of the turn)."""
        self._flush_scheduled = False
        messages, self._outbox = self._outbox, []
        if self._transport is None or not messages:
            return
        frames = self._encode(messages)
        if frames is None:
            return
        raws = [frames[0], *(buffer.raw() for buffer in frames[1:])]
        sizes = [memoryview(raw).nbytes for raw in raws]
        head = _PREFIX.pack(8 * len(raws) + sum(sizes), len(raws)) + b"".join(
            _LENGTH.pack(size) for size in sizes
        )
        self._transport.writelines([head, *raws])

    def _encode(self, messages: list[Any]) -> list[Any] | None:
        """The frames of ``messages``; one that cannot be pickled is left out (and handed
        to ``on_unencodable``) rather than losing the whole batch."""
        try:
            return encode(messages)
        except Exception:
            kept = []
            for message in messages:
                try:
                    encode(message)
                except Exception:
                    logger.exception("a message cannot be encoded; dropped")
                    if self._on_unencodable is not None:
                        self._on_unencodable(self, message)
                else:
                    kept.append(message)
            return encode(kept) if kept else None

    # -- receiving ---------------------------------------------------------------------------

    def _parse(self) -> None:
        """Deliver every whole message in the receive buffer; start a large one's own
        buffer; move what is left of a partial message to the front."""
        buffer, end = self._buffer, self._filled
        view = memoryview(buffer)
        start = 0
        while end - start >= _PREFIX.size:
            size, _ = _PREFIX.unpack_from(buffer, start)
            whole = _PREFIX.size + size
            if whole >= LARGE_BYTES:
                have = min(end - start, whole)
                # Not zeroed (np.empty, not bytearray): it is filled whole. A 1 MB
                # echo costs ~6% less CPU a round trip for it.
                large = np.empty(whole, np.uint8).data
                large[:have] = view[start : start + have]
                start += have
                if have == whole:
                    self._deliver(large.toreadonly(), copy=False)
                    continue
                self._large, self._large_filled = large, have
                break
            if end - start < whole:
                break
            self._deliver(view[start : start + whole], copy=True)
            start += whole
        if start:
            buffer[: end - start] = buffer[start:end]
            self._filled = end - start

    def _deliver(self, message: memoryview, copy: bool) -> None:
        """Decode one message (its prefix included) and hand over what it carries.
        ``copy``: the message lies in the shared receive buffer, so its out-of-band
        frames are copied out before that buffer is used again."""
        _, count = _PREFIX.unpack_from(message, 0)
        position = _PREFIX.size + 8 * count
        frames: list[Any] = []
        for index in range(count):
            (size,) = _LENGTH.unpack_from(message, _PREFIX.size + 8 * index)
            frame = message[position : position + size]
            frames.append(bytes(frame) if copy and index else frame)
            position += size
        try:
            messages = decode(frames)
        except Exception:
            logger.exception("an undecodable message; dropped")
            return
        for value in messages:
            try:
                self._on_message(self, value)
            except Exception:
                logger.exception("a message could not be handled; dropped")
