"""The engine side of the process boundary: answers the front ends' calls.

The engine process listens on one Unix socket; every front end connects to it
(:mod:`slipstream.engine.client`), one :class:`~slipstream.engine.channel.Link` per front
end. Each call runs as its own task, so a slow model never holds up another's requests,
and requests from every front end meet in the same batchers. The messages, all encoded
by :mod:`slipstream.engine.wire`:

    front end -> engine                      engine -> front end
    ("call", id, method, args)               ("ok", id, result) | ("err", id, error)
    ("stream", id, method, args)             ("item", id, value)... ("end", id) | ("err", ...)
    ("cancel", id)                           (the call's task is cancelled: no answer)
    ("tell", method, args)                   (none: one-way, e.g. a metrics snapshot)

A front end whose connection closes (it stopped, or was killed) has its calls and
streams cancelled at once (an LLM sequence stops generating).

Which methods exist is the caller's choice (``calls`` and ``streams``): this module
knows nothing of models or protocols.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from slipstream.engine.channel import Link
from slipstream.engine.wire import error_state
from slipstream.errors import SlipstreamError

logger = logging.getLogger(__name__)

Call = Callable[..., Awaitable[Any]]
Stream = Callable[..., AsyncIterator[Any]]


class EngineHost:
    """Serves ``calls`` and ``streams`` on the Unix socket at ``path`` until closed."""

    def __init__(
        self,
        path: str,
        calls: Mapping[str, Call],
        streams: Mapping[str, Stream] | None = None,
        tells: Mapping[str, Callable[..., None]] | None = None,
    ) -> None:
        self._path = path
        self._calls = dict(calls)
        self._streams = dict(streams or {})
        self._tells = dict(tells or {})
        self._server: asyncio.AbstractServer | None = None
        self._links: set[Link] = set()
        # (front end, call id) -> the task answering it, for cancels.
        self._tasks: dict[tuple[Link, int], asyncio.Task[None]] = {}

    async def start(self) -> None:
        """Listen and start answering (on the loop that will serve). A socket file left
        by an engine that died is replaced."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(self._link, self._path)

    def _link(self) -> Link:
        return Link(
            self._on_message, on_made=self._links.add, on_lost=self._lost,
            on_unencodable=self._answer_unencodable,
        )  # fmt: skip

    async def close(self) -> None:
        """Stop listening, cancel unfinished calls, close every connection."""
        if self._server is not None:
            self._server.close()
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for link in list(self._links):
            link.close()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    def _on_message(self, peer: Link, message: Any) -> None:
        kind = message[0]
        if kind == "call" or kind == "stream":
            _, call_id, method, args = message
            run = self._answer if kind == "call" else self._stream
            key = (peer, call_id)
            task = asyncio.create_task(run(peer, call_id, method, args))
            self._tasks[key] = task
            task.add_done_callback(lambda _: self._tasks.pop(key, None))
        elif kind == "cancel":
            running = self._tasks.get((peer, message[1]))
            if running is not None:
                running.cancel()
        elif kind == "tell":
            self._tell(message[1], message[2])

    def _lost(self, peer: Link) -> None:
        """A front end that went away: nothing it asked for is worth finishing."""
        self._links.discard(peer)
        for (owner, _), task in list(self._tasks.items()):
            if owner == peer:
                task.cancel()

    def _answer_unencodable(self, peer: Link, message: Any) -> None:
        if message[0] in ("ok", "item"):
            state = error_state(RuntimeError("the answer cannot be sent"))
            peer.post(("err", message[1], state))

    def _tell(self, method: str, args: tuple[Any, ...]) -> None:
        handler = self._tells.get(method)
        if handler is None:
            logger.warning("a front end told the engine %r, which it does not know", method)
            return
        try:
            handler(*args)
        except Exception:
            logger.exception("engine: %s failed", method)

    async def _answer(self, peer: Link, call_id: int, method: str, args: Any) -> None:
        try:
            call = self._calls[method]
            result = await call(*args)
        except asyncio.CancelledError:
            return  # the front end gave up on it (the client went away): no answer
        except BaseException as exc:
            self._log_fault(method, exc)
            peer.post(("err", call_id, error_state(exc)))
            return
        peer.post(("ok", call_id, result))

    async def _stream(self, peer: Link, call_id: int, method: str, args: Any) -> None:
        items: AsyncIterator[Any] | None = None
        try:
            items = self._streams[method](*args)
            async for item in items:
                peer.post(("item", call_id, item))
        except asyncio.CancelledError:
            return
        except BaseException as exc:
            self._log_fault(method, exc)
            peer.post(("err", call_id, error_state(exc)))
            return
        finally:
            aclose = getattr(items, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
        peer.post(("end", call_id))

    @staticmethod
    def _log_fault(method: str, exc: BaseException) -> None:
        """Internal faults are logged here, once; a client's error is only answered."""
        if isinstance(exc, KeyError) and exc.args and exc.args[0] == method:
            logger.error("a front end called %r, which the engine does not serve", method)
        elif not isinstance(exc, SlipstreamError):
            logger.error("engine: %s failed", method, exc_info=exc)
