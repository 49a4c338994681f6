"""The front-end side of the process boundary: calls into the engine process.

One :class:`EngineClient` per front-end process holds a ZeroMQ DEALER socket connected
to the engine's ROUTER (:mod:`slipstream.engine.host`). Calls are matched to answers by
id, so any number run at once on one socket. The client watches the connection itself
(ZeroMQ's socket monitor): when the engine process goes away, every call in flight fails
at once with 503 and Retry-After instead of hanging, new calls are refused the same way,
and calls flow again as soon as the restarted engine is connected.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from slipstream.engine.host import HIGH_WATER_MARK
from slipstream.engine.wire import decode, encode, rebuild_error
from slipstream.errors import Unavailable

logger = logging.getLogger(__name__)

# What a client should wait before trying again while the engine (re)starts.
RETRY_AFTER_S = 1
_END = object()


class EngineGone(Unavailable):
    """The engine process is not there (starting, or restarting after it stopped)."""


class EngineClient:
    """Calls to the engine at ``address``; see the module docstring."""

    def __init__(self, address: str) -> None:
        self._address = address
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.SNDHWM, HIGH_WATER_MARK)
        self._socket.setsockopt(zmq.RCVHWM, HIGH_WATER_MARK)
        self._socket.setsockopt(zmq.LINGER, 0)
        # Queue nothing for a peer that is not connected: a call made while the engine
        # is away is refused by this client, never parked in ZeroMQ's pipe.
        self._socket.setsockopt(zmq.IMMEDIATE, 1)
        self._socket.setsockopt(zmq.RECONNECT_IVL, 50)
        self._monitor = self._socket.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
        )
        self._ids = itertools.count()
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._streams: dict[int, asyncio.Queue[Any]] = {}
        self._connected = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def start(self) -> None:
        """Connect and start reading answers (call on the loop that will use it)."""
        self._socket.connect(self._address)
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._watch())]

    async def wait_connected(self, timeout_s: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._connected.wait(), timeout_s)
        return self.connected

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._fail_all("the front end is shutting down")
        self._socket.disable_monitor()
        self._monitor.close(linger=0)
        self._socket.close(linger=0)
        self._context.term()

    # -- calls ------------------------------------------------------------------------

    async def call(self, method: str, *args: Any) -> Any:
        """``method(*args)`` in the engine; its result, or its error raised here."""
        call_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            await self._send(("call", call_id, method, args))
            return await future
        except asyncio.CancelledError:
            # The client went away: the engine drops the work (a queued request leaves
            # its batcher's queue). Awaiting the answer cancelled ``future`` too, so an
            # answer that came is a result, anything else is work still running there.
            if future.cancelled() or not future.done():
                self._post(("cancel", call_id))
            raise
        finally:
            self._calls.pop(call_id, None)

    async def stream(self, method: str, *args: Any) -> AsyncIterator[Any]:
        """The items ``method(*args)`` yields in the engine, as they come. Closing this
        iterator early cancels the engine's side."""
        call_id = next(self._ids)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[call_id] = queue
        finished = False
        try:
            await self._send(("stream", call_id, method, args))
            while True:
                item = await queue.get()
                if item is _END:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
        finally:
            self._streams.pop(call_id, None)
            if not finished:
                self._post(("cancel", call_id))

    def tell(self, method: str, *args: Any) -> None:
        """A one-way message (dropped while the engine is away)."""
        self._post(("tell", method, args))

    def _post(self, message: Any) -> None:
        """Send without waiting (from a cancelled task too); dropped while the engine is
        away or its queue is full."""
        if not self.connected:
            return
        with contextlib.suppress(zmq.Again):
            self._socket.send_multipart(encode(message), flags=zmq.NOBLOCK)

    async def _send(self, message: Any) -> None:
        if not self.connected:
            raise EngineGone(
                "the engine process is not running (starting or restarting); retry shortly",
                retry_after_s=RETRY_AFTER_S,
            )
        await self._socket.send_multipart(encode(message), copy=False)

    # -- answers and the connection ---------------------------------------------------------

    async def _read(self) -> None:
        socket = self._socket
        while True:
            frames = await socket.recv_multipart(copy=False)
            try:
                message = decode(frames)
            except Exception:
                logger.exception("undecodable answer from the engine; dropped")
                continue
            kind, call_id = message[0], message[1]
            if kind == "ok" or kind == "err":
                future = self._calls.get(call_id)
                if future is not None and not future.done():
                    if kind == "ok":
                        future.set_result(message[2])
                    else:
                        future.set_exception(rebuild_error(message[2]))
                    continue
            queue = self._streams.get(call_id)
            if queue is None:
                continue  # an answer to a call given up on
            if kind == "item":
                queue.put_nowait(message[2])
            elif kind == "end":
                queue.put_nowait(_END)
            elif kind == "err":
                queue.put_nowait(rebuild_error(message[2]))

    async def _watch(self) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_CONNECTED:
                logger.info("connected to the engine process")
                self._connected.set()
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._connected.clear()
                count = len(self._calls) + len(self._streams)
                logger.warning("the engine process went away: %d calls in flight fail", count)
                self._fail_all("the engine process stopped while serving the request; retry")

    def _fail_all(self, reason: str) -> None:
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineGone(reason, retry_after_s=RETRY_AFTER_S))
        for queue in self._streams.values():
            queue.put_nowait(EngineGone(reason, retry_after_s=RETRY_AFTER_S))
