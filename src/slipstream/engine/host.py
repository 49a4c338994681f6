"""The engine side of the process boundary: answers the front ends' calls.

The engine process binds one ZeroMQ ROUTER socket; every front end connects a DEALER
(:mod:`slipstream.engine.client`). Each call runs as its own task, so a slow model never
holds up another's requests, and requests from every front end meet in the same
batchers. The messages, all encoded by :mod:`slipstream.engine.wire`:

    front end -> engine                      engine -> front end
    ("call", id, method, args)               ("ok", id, result) | ("err", id, error)
    ("stream", id, method, args)             ("item", id, value)... ("end", id) | ("err", ...)
    ("cancel", id)                           (the call's task is cancelled: no answer)
    ("tell", method, args)                   (none: one-way, e.g. a metrics snapshot)

Which methods exist is the caller's choice (``calls`` and ``streams``): this module
knows nothing of models or protocols.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import zmq

from slipstream.engine.channel import Channel, open_socket
from slipstream.engine.wire import error_state
from slipstream.errors import SlipstreamError

logger = logging.getLogger(__name__)

Call = Callable[..., Awaitable[Any]]
Stream = Callable[..., AsyncIterator[Any]]


class EngineHost:
    """Serves ``calls`` and ``streams`` on a ROUTER socket at ``address`` until closed."""

    def __init__(
        self,
        address: str,
        calls: Mapping[str, Call],
        streams: Mapping[str, Stream] | None = None,
        tells: Mapping[str, Callable[..., None]] | None = None,
    ) -> None:
        self._address = address
        self._calls = dict(calls)
        self._streams = dict(streams or {})
        self._tells = dict(tells or {})
        self._context = zmq.Context()
        self._socket = open_socket(self._context, zmq.ROUTER)
        # A reply to a front end that has gone raises instead of vanishing, so its calls
        # and streams are cancelled (an LLM sequence stops generating).
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # (front end, call id) -> the task answering it, for cancels.
        self._tasks: dict[tuple[bytes, int], asyncio.Task[None]] = {}
        self._channel = Channel(
            self._socket, self._on_message, routed=True, on_lost=self._cancel_peer,
            on_unencodable=self._answer_unencodable,
        )  # fmt: skip

    def start(self) -> None:
        """Bind and start answering (call on the loop that will serve)."""
        self._socket.bind(self._address)
        self._channel.start()

    async def close(self) -> None:
        """Stop reading, cancel unfinished calls, close the socket."""
        self._channel.stop()
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._socket.close(linger=0)
        self._context.term()

    def _on_message(self, peer: bytes | None, message: Any) -> None:
        assert peer is not None
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

    def _cancel_peer(self, peer: bytes) -> None:
        """A front end that went away: nothing it asked for is worth finishing."""
        for (owner, _), task in list(self._tasks.items()):
            if owner == peer:
                task.cancel()

    def _answer_unencodable(self, peer: bytes | None, message: Any) -> None:
        if peer is not None and message[0] in ("ok", "item"):
            state = error_state(RuntimeError("the answer cannot be sent"))
            self._channel.post(("err", message[1], state), peer)

    def _tell(self, method: str, args: tuple[Any, ...]) -> None:
        handler = self._tells.get(method)
        if handler is None:
            logger.warning("a front end told the engine %r, which it does not know", method)
            return
        try:
            handler(*args)
        except Exception:
            logger.exception("engine: %s failed", method)

    async def _answer(self, peer: bytes, call_id: int, method: str, args: Any) -> None:
        try:
            call = self._calls[method]
            result = await call(*args)
        except asyncio.CancelledError:
            return  # the front end gave up on it (the client went away): no answer
        except BaseException as exc:
            self._log_fault(method, exc)
            self._channel.post(("err", call_id, error_state(exc)), peer)
            return
        self._channel.post(("ok", call_id, result), peer)

    async def _stream(self, peer: bytes, call_id: int, method: str, args: Any) -> None:
        items: AsyncIterator[Any] | None = None
        try:
            items = self._streams[method](*args)
            async for item in items:
                self._channel.post(("item", call_id, item), peer)
        except asyncio.CancelledError:
            return
        except BaseException as exc:
            self._log_fault(method, exc)
            self._channel.post(("err", call_id, error_state(exc)), peer)
            return
        finally:
            aclose = getattr(items, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
        self._channel.post(("end", call_id), peer)

    @staticmethod
    def _log_fault(method: str, exc: BaseException) -> None:
        """Internal faults are logged here, once; a client's error is only answered."""
        if isinstance(exc, KeyError) and exc.args and exc.args[0] == method:
            logger.error("a front end called %r, which the engine does not serve", method)
        elif not isinstance(exc, SlipstreamError):
            logger.error("engine: %s failed", method, exc_info=exc)
