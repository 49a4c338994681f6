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

Large frames (tensors of at least 64 KB) cross through shared memory instead, when both
sides could set it up (:mod:`slipstream.engine.arena`): copied once into the sender's
arena, they travel as their place, and the receiver reads them there. On the socket such
a frame's length has its top bit set and its 16 bytes are the place (offset, size). The
link's own messages (an arena's name, that it is mapped, places given back) travel as
tuples headed by ``_CONTROL`` and are never handed on.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from slipstream.engine import arena as arenas
from slipstream.engine.arena import MIN_FRAME_BYTES, IncomingArena, OutgoingArena
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
# A frame in the sender's arena: its length has this bit set; the frame is its place.
_IN_ARENA = 1 << 63
_PLACE = struct.Struct("<QQ")
# The head of the link's own messages (a string no caller's message starts with).
_CONTROL = "\x00link"

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
        arena: bool = True,
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
        # Shared memory for large frames (``arena``): ours, usable once the peer mapped it,
        # and the peer's; places the peer's arrays no longer use, sent back once a turn.
        self._want_arena = arena
        self._outgoing: OutgoingArena | None = None
        self._outgoing_ready = False
        self._incoming: IncomingArena | None = None
        self._freed: list[tuple[int, int]] = []
        self._freed_lock = threading.Lock()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    # -- asyncio's protocol ----------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self._transport = transport
        self._loop = asyncio.get_running_loop()
        if self._want_arena:
            self._offer_arena()
        if self._on_made is not None:
            self._on_made(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._outbox.clear()
        if self._outgoing is not None:
            self._outgoing.close()
            self._outgoing, self._outgoing_ready = None, False
        # Arrays over the peer's arena may live on: the mapping goes with the last one.
        self._incoming = None
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
        lengths = sizes
        if self._outgoing_ready and len(raws) > 1:
            lengths = self._into_arena(raws, sizes)
        head = _PREFIX.pack(8 * len(raws) + sum(sizes), len(raws)) + b"".join(
            _LENGTH.pack(length) for length in lengths
        )
        self._transport.writelines([head, *raws])

    def _into_arena(self, raws: list[Any], sizes: list[int]) -> list[int]:
        """Copy each large frame into our arena where it has room; such a frame becomes
        its place (``raws`` and ``sizes`` are changed); the lengths to send."""
        assert self._outgoing is not None
        lengths = list(sizes)
        for index in range(1, len(raws)):
            if sizes[index] < MIN_FRAME_BYTES:
                continue
            place = self._outgoing.place(raws[index])
            if place is None:
                continue  # no room now: through the socket
            raws[index] = _PLACE.pack(*place)
            sizes[index] = _PLACE.size
            lengths[index] = _PLACE.size | _IN_ARENA
        return lengths

    # -- the arenas ------------------------------------------------------------------------

    def _offer_arena(self) -> None:
        try:
            self._outgoing = OutgoingArena.create(arenas.ARENA_BYTES)
        except OSError as exc:
            logger.info("tensors cross this link through its socket: no shared memory (%s)", exc)
            return
        self.post((_CONTROL, "arena", self._outgoing.path, self._outgoing.size))

    def _on_control(self, message: tuple[Any, ...]) -> None:
        kind = message[1]
        if kind == "free":
            if self._outgoing is not None:
                for offset, nbytes in message[2]:
                    self._outgoing.release(offset, nbytes)
        elif kind == "arena":
            try:
                self._incoming = IncomingArena.open(message[2], message[3], self._freed_place)
            except (OSError, ValueError) as exc:
                logger.warning("cannot map the peer's shared memory (%s): using the socket", exc)
                self.post((_CONTROL, "unmapped"))
            else:
                self.post((_CONTROL, "mapped"))
        elif self._outgoing is not None:  # "mapped" or "unmapped": the peer has opened it
            self._outgoing.opened()
            if kind == "mapped":
                self._outgoing_ready = True
            else:
                self._outgoing.close()
                self._outgoing = None

    def _freed_place(self, offset: int, nbytes: int) -> None:
        """A place of the peer's arena no array uses any more (any thread may call it):
        sent back at the end of the loop's turn."""
        with self._freed_lock:
            self._freed.append((offset, nbytes))
            first = len(self._freed) == 1
        loop = self._loop
        if first and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._send_freed)

    def _send_freed(self) -> None:
        with self._freed_lock:
            freed, self._freed = self._freed, []
        if freed and self._transport is not None:
            self.post((_CONTROL, "free", freed))

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
        try:
            for index in range(count):
                (size,) = _LENGTH.unpack_from(message, _PREFIX.size + 8 * index)
                if size & _IN_ARENA:
                    size &= ~_IN_ARENA
                    frames.append(self._from_arena(message[position : position + size]))
                else:
                    frame = message[position : position + size]
                    frames.append(bytes(frame) if copy and index else frame)
                position += size
            messages = decode(frames)
        except Exception:
            logger.exception("an undecodable message; dropped")
            return
        for value in messages:
            try:
                if type(value) is tuple and value and value[0] == _CONTROL:
                    self._on_control(value)
                else:
                    self._on_message(self, value)
            except Exception:
                logger.exception("a message could not be handled; dropped")

    def _from_arena(self, place: memoryview) -> Any:
        if self._incoming is None:
            raise ValueError("a frame in shared memory, but no arena of the peer is mapped")
        offset, nbytes = _PLACE.unpack(place)
        return self._incoming.view(offset, nbytes)
