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
import zmq.asyncio

from slipstream.engine.wire import decode, encode, error_state
from slipstream.errors import SlipstreamError

logger = logging.getLogger(__name__)

Call = Callable[..., Awaitable[Any]]
Stream = Callable[..., AsyncIterator[Any]]

# Messages queued towards one front end before sends wait (ZeroMQ's default is 1,000;
# a front end with a few thousand requests in flight would stall the engine's replies).
HIGH_WATER_MARK = 100_000


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
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.SNDHWM, HIGH_WATER_MARK)
        self._socket.setsockopt(zmq.RCVHWM, HIGH_WATER_MARK)
        # A reply to a front end that has gone raises instead of vanishing, so the
        # stream feeding it is cancelled (an LLM sequence stops generating).
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._socket.setsockopt(zmq.LINGER, 0)
        # (front end, call id) -> the task answering it, for cancels.
        self._tasks: dict[tuple[bytes, int], asyncio.Task[None]] = {}
        self._reader: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Bind and start answering (call on the loop that will serve)."""
        self._socket.bind(self._address)
        self._reader = asyncio.create_task(self._read())

    async def close(self) -> None:
        """Stop reading, cancel unfinished calls, close the socket."""
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        for task in list(self._tasks.values()):
            task.cancel()
        self._socket.close(linger=0)
        self._context.term()

    async def _read(self) -> None:
        socket = self._socket
        while True:
            frames = await socket.recv_multipart(copy=False)
            peer = frames[0].bytes
            try:
                message = decode(frames[1:])
            except Exception:
                logger.exception("undecodable message from a front end; dropped")
                continue
            kind = message[0]
            if kind == "call" or kind == "stream":
                _, call_id, method, args = message
                run = self._answer if kind == "call" else self._stream
                self._track((peer, call_id), asyncio.create_task(run(peer, call_id, method, args)))
            elif kind == "cancel":
                running = self._tasks.get((peer, message[1]))
                if running is not None:
                    running.cancel()
            elif kind == "tell":
                self._tell(message[1], message[2])

    def _track(self, key: tuple[bytes, int], task: asyncio.Task[None]) -> None:
        self._tasks[key] = task
        task.add_done_callback(lambda _: self._tasks.pop(key, None))

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
            await self._send(peer, ("err", call_id, error_state(exc)))
            return
        await self._send(peer, ("ok", call_id, result))

    async def _stream(self, peer: bytes, call_id: int, method: str, args: Any) -> None:
        items: AsyncIterator[Any] | None = None
        try:
            items = self._streams[method](*args)
            async for item in items:
                if not await self._send(peer, ("item", call_id, item)):
                    return
        except asyncio.CancelledError:
            return
        except BaseException as exc:
            self._log_fault(method, exc)
            await self._send(peer, ("err", call_id, error_state(exc)))
            return
        finally:
            aclose = getattr(items, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
        await self._send(peer, ("end", call_id))

    async def _send(self, peer: bytes, message: Any) -> bool:
        """Send to ``peer``; False when it is gone (or the message cannot be encoded,
        which then answers the call with an internal error instead)."""
        try:
            frames = encode(message)
        except Exception:
            logger.exception("engine: cannot encode the answer to call %s", message[1])
            frames = encode(("err", message[1], error_state(RuntimeError())))
        try:
            await self._socket.send_multipart([peer, *frames], copy=False)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return False
            raise
        return True

    @staticmethod
    def _log_fault(method: str, exc: BaseException) -> None:
        """Internal faults are logged here, once; a client's error is only answered."""
        if isinstance(exc, KeyError) and exc.args and exc.args[0] == method:
            logger.error("a front end called %r, which the engine does not serve", method)
        elif not isinstance(exc, SlipstreamError):
            logger.error("engine: %s failed", method, exc_info=exc)
