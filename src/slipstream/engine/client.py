"""The front-end side of the process boundary: calls into the engine process.

One :class:`EngineClient` per front-end process holds a connection to the engine's Unix
socket (:mod:`slipstream.engine.host`). Calls are matched to answers by id, so any
number run at once on one connection. When the engine process goes away the connection
closes: every call in flight fails at once with 503 and Retry-After instead of hanging,
new calls are refused the same way, and the client connects again (every 50 ms) until
the restarted engine answers; calls flow again from then on.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric

from slipstream.engine.channel import Link
from slipstream.engine.wire import error_state, rebuild_error
from slipstream.errors import Unavailable

logger = logging.getLogger(__name__)

# What a client should wait before trying again while the engine (re)starts.
RETRY_AFTER_S = 1
# How often a client without its engine tries to connect.
_RECONNECT_S = 0.05
_END = object()


class EngineGone(Unavailable):
    """The engine process is not there (starting, or restarting after it stopped)."""


class EngineClient:
    """Calls to the engine listening at ``path``; see the module docstring."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._link: Link | None = None
        self._ids = itertools.count()
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._streams: dict[int, asyncio.Queue[Any]] = {}
        self._connected = asyncio.Event()
        self._lost = asyncio.Event()
        self._connecting: asyncio.Task[None] | None = None
        self._closing = False
        # What the engine's absence cost, for /metrics (see EngineLinkCollector): times
        # the connection was lost, calls failed in flight then, calls refused meanwhile.
        self.losses = 0
        self.failed_in_flight = 0
        self.refused = 0

    @property
    def connected(self) -> bool:
        return self._link is not None

    def start(self) -> None:
        """Connect, and keep connecting whenever the engine goes away (call on the loop
        that will use it)."""
        self._connecting = asyncio.get_running_loop().create_task(self._keep_connected())

    async def wait_connected(self, timeout_s: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._connected.wait(), timeout_s)
        return self.connected

    async def close(self) -> None:
        self._closing = True
        if self._connecting is not None:
            self._connecting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._connecting
            self._connecting = None
        if self._link is not None:
            self._link.close()
        self._fail_all("the front end is shutting down")

    async def _keep_connected(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                await loop.create_unix_connection(self._new_link, self._path)
            except OSError:
                await asyncio.sleep(_RECONNECT_S)
                continue
            await self._lost.wait()
            self._lost.clear()

    def _new_link(self) -> Link:
        return Link(
            self._on_answer, on_made=self._made, on_lost=self._gone,
            on_unencodable=self._unsent,
        )  # fmt: skip

    def _made(self, link: Link) -> None:
        logger.info("connected to the engine process at %s", self._path)
        self._link = link
        self._connected.set()

    def _gone(self, link: Link) -> None:
        self._link = None
        self._connected.clear()
        if not self._closing:
            count = len(self._calls) + len(self._streams)
            logger.warning("the engine process went away: %d calls in flight fail", count)
            self.losses += 1
            self.failed_in_flight += count
        self._fail_all("the engine process stopped while serving the request; retry")
        self._lost.set()

    # -- calls ------------------------------------------------------------------------

    async def call(self, method: str, *args: Any) -> Any:
        """``method(*args)`` in the engine; its result, or its error raised here."""
        call_id, future = self.start_call(method, *args)
        try:
            return await future
        except asyncio.CancelledError:
            # The client went away: the engine drops the work (a queued request leaves
            # its batcher's queue), unless its answer came already.
            self.give_up(call_id)
            raise

    def start_call(
        self, method: str, *args: Any, into: asyncio.Future[Any] | None = None
    ) -> tuple[int, asyncio.Future[Any]]:
        """``method(*args)`` in the engine, without a coroutine: the call's id and the
        future its answer settles (``into``, or a new one; at once with EngineGone while
        the engine is away). Give up on it with :meth:`give_up`."""
        future = into if into is not None else asyncio.get_running_loop().create_future()
        if self._link is None:
            self.refused += 1
            future.set_exception(self._gone_error())
            return -1, future
        call_id = next(self._ids)
        self._calls[call_id] = future
        self._post(("call", call_id, method, args))
        return call_id, future

    def flush(self) -> None:
        """Send the calls made so far now, not at the end of this turn of the loop (a
        caller that itself runs at a turn's end saves a turn)."""
        if self._link is not None:
            self._link.flush()

    def give_up(self, call_id: int) -> None:
        """Nobody waits for call ``call_id`` any more: the engine drops its work."""
        future = self._calls.pop(call_id, None)
        if future is None:
            return  # answered already
        if not future.done():
            future.cancel()
        self._post(("cancel", call_id))

    async def stream(self, method: str, *args: Any) -> AsyncIterator[Any]:
        """The items ``method(*args)`` yields in the engine, as they come. Closing this
        iterator early cancels the engine's side."""
        self._check_connected()
        call_id = next(self._ids)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[call_id] = queue
        self._post(("stream", call_id, method, args))
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
        if self._link is not None:
            self._link.post(message)

    def _check_connected(self) -> None:
        if self._link is None:
            self.refused += 1
            raise self._gone_error()

    @staticmethod
    def _gone_error() -> EngineGone:
        return EngineGone(
            "the engine process is not running (starting or restarting); retry shortly",
            retry_after_s=RETRY_AFTER_S,
        )

    # -- answers and the connection ---------------------------------------------------------

    def _on_answer(self, link: Link, message: Any) -> None:
        kind, call_id = message[0], message[1]
        if kind == "ok" or kind == "err":
            future = self._calls.pop(call_id, None)
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

    def _unsent(self, link: Link, message: Any) -> None:
        """A call whose arguments cannot be pickled fails here (a fault of this server)."""
        if message[0] in ("call", "stream"):
            self._on_answer(link, ("err", message[1], error_state(RuntimeError())))

    def _fail_all(self, reason: str) -> None:
        calls, self._calls = self._calls, {}
        for future in calls.values():
            if not future.done():
                future.set_exception(EngineGone(reason, retry_after_s=RETRY_AFTER_S))
        for queue in self._streams.values():
            queue.put_nowait(EngineGone(reason, retry_after_s=RETRY_AFTER_S))


class EngineLinkCollector:
    """A front end's view of its engines' absences, as Prometheus counters: the engines'
    own series restart from zero with them, so an engine that crashes and restarts shows
    here (and in the alert on it), not as a gap."""

    def __init__(self, clients: list[EngineClient]) -> None:
        self._clients = clients

    def collect(self) -> Iterator[Metric]:
        lost = CounterMetricFamily(
            "slipstream_engine_connection_lost",
            "Times this front end lost its connection to an engine process (it stopped, "
            "or was restarted)",
        )
        failed = CounterMetricFamily(
            "slipstream_engine_unavailable_calls",
            "Calls to an engine answered 503 because it was away: in flight when it went "
            "(in_flight), or made while it was (refused); requests, health checks, scrapes",
            labels=["when"],
        )
        lost.add_metric([], sum(client.losses for client in self._clients))
        failed.add_metric(["in_flight"], sum(c.failed_in_flight for c in self._clients))
        failed.add_metric(["refused"], sum(client.refused for client in self._clients))
        yield lost
        yield failed
