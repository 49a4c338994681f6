"""A ZeroMQ socket driven by an asyncio loop, sending in batches.

Profiles of the split layout under load had the front end and the engine each spend a
quarter of their time in pyzmq's sends (each send wakes ZeroMQ's I/O thread) and most of
the rest pickling one message at a time. So a channel never sends at once: ``post``
queues a message, and once per turn of the loop every message queued for a peer goes as
one ZeroMQ message (one pickle of the list, one send). Under load a turn gathers many
answers or requests; a lone request costs what one message did.

Reading is as direct: the loop watches ZeroMQ's file descriptor and every message waiting
is read in one pass, without zmq.asyncio's futures. The descriptor is edge-triggered and
also consumed by sends, so after a send the socket is asked again whether messages wait.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import zmq

from slipstream.engine.wire import decode, encode

logger = logging.getLogger(__name__)

# Messages queued towards a peer before sends wait (ZeroMQ's default is 1,000; a front
# end with a few thousand requests in flight would stall).
HIGH_WATER_MARK = 100_000
# Frames at least this large are sent without a copy (the copy of a small frame costs less
# than the release callback a zero-copy frame needs).
ZERO_COPY_BYTES = 65_536
# How long a batch waits before it is tried again when the peer's queue is full.
_FULL_RETRY_S = 0.001

# (peer or None, message) for each message received.
OnMessage = Callable[[bytes | None, Any], None]


def open_socket(context: zmq.Context[Any], kind: int) -> zmq.Socket[Any]:
    """A socket of ``kind`` with this package's queue bounds, closed without lingering."""
    socket: zmq.Socket[Any] = context.socket(kind)
    socket.setsockopt(zmq.SNDHWM, HIGH_WATER_MARK)
    socket.setsockopt(zmq.RCVHWM, HIGH_WATER_MARK)
    socket.setsockopt(zmq.LINGER, 0)
    return socket


class Channel:
    """``socket`` read and written on the running loop; see the module docstring.

    ``routed``: a ROUTER socket (messages carry the peer's identity first). ``on_lost``:
    called with a peer a ROUTER can no longer reach (its messages are dropped).
    ``on_unencodable``: called with a message that cannot be pickled (it is dropped).
    """

    def __init__(
        self,
        socket: zmq.Socket[Any],
        on_message: OnMessage,
        routed: bool = False,
        on_lost: Callable[[bytes], None] | None = None,
        on_unencodable: Callable[[bytes | None, Any], None] | None = None,
    ) -> None:
        self.socket = socket
        self._on_message = on_message
        self._routed = routed
        self._on_lost = on_lost
        self._on_unencodable = on_unencodable
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_scheduled = False
        self._flush_scheduled = False
        # Messages waiting for the next flush, by peer (None: the DEALER's one peer).
        self._outbox: dict[bytes | None, list[Any]] = {}

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.socket.FD, self._drain)
        self._schedule_drain()  # messages may have come before the reader was added

    def stop(self) -> None:
        if self._loop is not None and not self.socket.closed:
            self._loop.remove_reader(self.socket.FD)
        self._loop = None
        self._outbox.clear()

    def post(self, message: Any, peer: bytes | None = None) -> None:
        """Queue ``message`` for ``peer``; it is sent at the end of this turn of the loop."""
        waiting = self._outbox.get(peer)
        if waiting is None:
            self._outbox[peer] = [message]
        else:
            waiting.append(message)
        if not self._flush_scheduled and self._loop is not None:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        outbox, self._outbox = self._outbox, {}
        retry: dict[bytes | None, list[Any]] = {}
        for peer, messages in outbox.items():
            frames = self._encode(peer, messages)
            if frames is None:
                continue
            if peer is not None:
                frames.insert(0, peer)
            copy = not any(_nbytes(frame) >= ZERO_COPY_BYTES for frame in frames)
            try:
                _send_frames(self.socket, frames, copy)
            except zmq.Again:
                retry[peer] = messages  # the peer's queue is full: try again shortly
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH or peer is None:
                    raise
                if self._on_lost is not None:
                    self._on_lost(peer)
        if retry and self._loop is not None:
            for peer, messages in retry.items():
                self._outbox.setdefault(peer, [])[:0] = messages
            self._flush_scheduled = True
            self._loop.call_later(_FULL_RETRY_S, self._flush)
        self._schedule_drain()

    def _encode(self, peer: bytes | None, messages: list[Any]) -> list[Any] | None:
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
                    logger.exception("a message to %s cannot be encoded; dropped", peer)
                    if self._on_unencodable is not None:
                        self._on_unencodable(peer, message)
                else:
                    kept.append(message)
            return encode(kept) if kept else None

    def _schedule_drain(self) -> None:
        if not self._drain_scheduled and self._loop is not None:
            self._drain_scheduled = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._drain_scheduled = False
        socket = self.socket
        if socket.closed or self._loop is None:
            return
        while int(socket.getsockopt(zmq.EVENTS)) & _POLLIN:
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            peer = frames[0].bytes if self._routed else None
            try:
                messages = decode(frames[1:] if self._routed else frames)
            except Exception:
                logger.exception("an undecodable message from %s; dropped", peer)
                continue
            for message in messages:
                try:
                    self._on_message(peer, message)
                except Exception:
                    logger.exception("a message from %s could not be handled; dropped", peer)


# pyzmq's flags are enum.Flag members, and every `|` or `&` on one runs Python code in
# the enum module (send_multipart ORs SNDMORE once per frame): ~2% of an engine's loop.
_SEND_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_SEND_LAST = int(zmq.NOBLOCK)
_POLLIN = int(zmq.POLLIN)


def _send_frames(socket: zmq.Socket[Any], frames: list[Any], copy: bool) -> None:
    """``send_multipart(frames, NOBLOCK)`` with the flags as plain ints. ZeroMQ queues a
    multipart message whole or not at all: only the first frame can raise Again."""
    last = len(frames) - 1
    for index, frame in enumerate(frames):
        socket.send(frame, _SEND_MORE if index < last else _SEND_LAST, copy=copy)


def _nbytes(frame: Any) -> int:
    if isinstance(frame, bytes):
        return len(frame)
    return memoryview(frame).nbytes
