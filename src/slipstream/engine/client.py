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
from zmq.utils.monitor import parse_monitor_message

from slipstream.engine.channel import Channel, open_socket
from slipstream.engine.wire import error_state, rebuild_error
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
        self._context = zmq.Context()
        self._socket = open_socket(self._context, zmq.DEALER)
        # Queue nothing for a peer that is not connected: a call made while the engine
        # is away is refused by this client, never parked in ZeroMQ's pipe.
        self._socket.setsockopt(zmq.IMMEDIATE, 1)
        self._socket.setsockopt(zmq.RECONNECT_IVL, 50)
        self._monitor: zmq.Socket[Any] = self._socket.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
        )
        self._channel = Channel(self._socket, self._on_answer, on_unencodable=self._unsent)
        self._ids = itertools.count()
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._streams: dict[int, asyncio.Queue[Any]] = {}
        self._connected = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def start(self) -> None:
        """Connect and start reading answers (call on the loop that will use it)."""
        self._loop = asyncio.get_running_loop()
        self._socket.connect(self._address)
        self._channel.start()
        self._loop.add_reader(self._monitor.FD, self._on_events)
        self._loop.call_soon(self._on_events)

    async def wait_connected(self, timeout_s: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._connected.wait(), timeout_s)
        return self.connected

    async def close(self) -> None:
        self._channel.stop()
        if self._loop is not None:
            self._loop.remove_reader(self._monitor.FD)
            self._loop = None
        self._fail_all("the front end is shutting down")
        self._socket.disable_monitor()
        self._monitor.close(linger=0)
        self._socket.close(linger=0)
        self._context.term()

    # -- calls ------------------------------------------------------------------------

    async def call(self, method: str, *args: Any) -> Any:
        """``method(*args)`` in the engine; its result, or its error raised here."""
        self._check_connected()
        call_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._channel.post(("call", call_id, method, args))
        try:
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
        self._check_connected()
        call_id = next(self._ids)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[call_id] = queue
        self._channel.post(("stream", call_id, method, args))
        finished = False
        try:
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
        if self.connected:
            self._channel.post(message)

    def _check_connected(self) -> None:
        if not self.connected:
            raise EngineGone(
                "the engine process is not running (starting or restarting); retry shortly",
                retry_after_s=RETRY_AFTER_S,
            )

    # -- answers and the connection ---------------------------------------------------------

    def _on_answer(self, peer: bytes | None, message: Any) -> None:
        kind, call_id = message[0], message[1]
        if kind == "ok" or kind == "err":
            future = self._calls.get(call_id)
            if future is not None and not future.done():
                if kind == "ok":
                    future.set_result(message[2])
                else:
                    future.set_exception(rebuild_error(message[2]))
                return
        queue = self._streams.get(call_id)
        if queue is None:
            return  # an answer to a call given up on
        if kind == "item":
            queue.put_nowait(message[2])
        elif kind == "end":
            queue.put_nowait(_END)
        elif kind == "err":
            queue.put_nowait(rebuild_error(message[2]))

    def _unsent(self, peer: bytes | None, message: Any) -> None:
        """A call whose arguments cannot be pickled fails here (a fault of this server)."""
        if message[0] in ("call", "stream"):
            self._on_answer(None, ("err", message[1], error_state(RuntimeError())))

    def _on_events(self) -> None:
        monitor = self._monitor
        while not monitor.closed and int(monitor.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
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
