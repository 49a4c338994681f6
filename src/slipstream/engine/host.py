"""The engine side of the process boundary: answers the front ends' calls.

The engine process listens on one Unix socket; every front end connects to it
(:mod:`slipstream.engine.client`), one :class:`~slipstream.engine.channel.Link` per front
end. Each call runs as its own task (gathered calls, below, as one task per gathering),
so a slow model never holds up another's requests, and requests from every front end
meet in the same batchers. The messages, all encoded
by :mod:`slipstream.engine.wire`:

    front end -> engine                      engine -> front end
    ("call", id, method, args)               ("ok", id, result) | ("err", id, error)
    ("stream", id, method, args)             ("item", id, value)... ("end", id) | ("err", ...)
    ("cancel", id)                           (the call's task is cancelled: no answer)
    ("tell", method, args)                   (none: one-way, e.g. a metrics snapshot)

A front end whose connection closes (it stopped, or was killed) has its calls and
streams cancelled at once (an LLM sequence stops generating).

Calls of a ``gathered`` method (the engine's ``infer`` and ``infer_group``,
``engine/remote.py``) that reach the engine in one turn of its loop, from one front end
or several, are answered together by that method's gatherer, in one task: under load,
with many front ends or gRPC (whose front ends send one request a message), this is
what lets the engine stack them. A lone
one runs as any call. A gathered call given up on gets no answer; the work is dropped
when every call gathered with it is given up on.

Which methods exist is the caller's choice (``calls`` and ``streams``): this module
knows nothing of models or protocols.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from typing import Any

from slipstream.engine.channel import Link
from slipstream.engine.wire import error_state
from slipstream.errors import SlipstreamError

logger = logging.getLogger(__name__)

Call = Callable[..., Awaitable[Any]]
Stream = Callable[..., AsyncIterator[Any]]
# The answer to one of a gatherer's calls, by its place: (index, ok, result | error state).
Reply = Callable[[int, bool, Any], None]
# Several calls of one method at once: their arguments, and the reply to make for each
# call as soon as its answer is known.
Gatherer = Callable[[list[tuple[Any, ...]], Reply], Awaitable[None]]


class _Gathering:
    """Calls a gatherer answers together: those whose clients still wait, and its task."""

    __slots__ = ("live", "task")

    def __init__(self, live: set[tuple[Link, int]]) -> None:
        self.live = live
        self.task: asyncio.Task[None] | None = None


class EngineHost:
    """Serves ``calls`` and ``streams`` on the Unix socket at ``path`` until closed."""

    def __init__(
        self,
        path: str,
        calls: Mapping[str, Call],
        streams: Mapping[str, Stream] | None = None,
        tells: Mapping[str, Callable[..., None]] | None = None,
        gathered: Mapping[str, Gatherer] | None = None,
    ) -> None:
        self._path = path
        self._calls = dict(calls)
        self._streams = dict(streams or {})
        self._tells = dict(tells or {})
        self._server: asyncio.AbstractServer | None = None
        self._links: set[Link] = set()
        # (front end, call id) -> the task answering it, for cancels.
        self._tasks: dict[tuple[Link, int], asyncio.Task[None]] = {}
        # Gathered calls: this turn's, by method, and those in a gatherer's hands.
        self._gathered = dict(gathered or {})
        self._turn: dict[str, list[tuple[Link, int, Any]]] = {}
        self._gathering: dict[tuple[Link, int], _Gathering] = {}

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
        self._turn.clear()  # gathered this turn, not started: never will be
        gathering = {g.task for g in self._gathering.values() if g.task is not None}
        tasks = [*self._tasks.values(), *gathering]
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
        if kind == "call" and message[2] in self._gathered:
            _, call_id, method, args = message
            if not self._turn:
                asyncio.get_running_loop().call_soon(self._start_turn)
            self._turn.setdefault(method, []).append((peer, call_id, args))
        elif kind == "call" or kind == "stream":
            _, call_id, method, args = message
            run = self._answer if kind == "call" else self._stream
            self._start(peer, call_id, run(peer, call_id, method, args))
        elif kind == "cancel":
            self._cancel((peer, message[1]))
        elif kind == "tell":
            self._tell(message[1], message[2])

    def _start(self, peer: Link, call_id: int, answer: Coroutine[Any, Any, None]) -> None:
        key = (peer, call_id)
        task = asyncio.create_task(answer)
        self._tasks[key] = task
        task.add_done_callback(lambda _: self._tasks.pop(key, None))

    def _start_turn(self) -> None:
        """This turn's calls of each gathered method: a lone one as any call, several
        in one call of the method's gatherer."""
        turn, self._turn = self._turn, {}
        for method, calls in turn.items():
            if len(calls) == 1:
                peer, call_id, args = calls[0]
                self._start(peer, call_id, self._answer(peer, call_id, method, args))
            elif calls:
                gathering = _Gathering({(peer, call_id) for peer, call_id, _ in calls})
                gathering.task = asyncio.create_task(
                    self._answer_gathered(method, calls, gathering)
                )
                self._gathering.update(dict.fromkeys(gathering.live, gathering))

    def _cancel(self, key: tuple[Link, int]) -> None:
        """Call ``key``'s client went away: its work is dropped, a gathered call's when
        every call gathered with it is gone too."""
        running = self._tasks.get(key)
        if running is not None:
            running.cancel()
            return
        gathering = self._gathering.pop(key, None)
        if gathering is not None:
            gathering.live.discard(key)
            if not gathering.live and gathering.task is not None:
                gathering.task.cancel()
            return
        for calls in self._turn.values():  # not started yet: it never will be
            calls[:] = [call for call in calls if (call[0], call[1]) != key]

    def _lost(self, peer: Link) -> None:
        """A front end that went away: nothing it asked for is worth finishing."""
        self._links.discard(peer)
        for calls in self._turn.values():  # not started yet: they never will be
            calls[:] = [call for call in calls if call[0] != peer]
        for key in [key for key in [*self._tasks, *self._gathering] if key[0] == peer]:
            self._cancel(key)

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

    async def _answer_gathered(
        self, method: str, calls: list[tuple[Link, int, Any]], gathering: _Gathering
    ) -> None:
        replied = [False] * len(calls)

        def reply(index: int, ok: bool, value: Any) -> None:
            peer, call_id, _ = calls[index]
            replied[index] = True
            key = (peer, call_id)
            self._gathering.pop(key, None)
            if key in gathering.live:
                gathering.live.discard(key)
                peer.post(("ok" if ok else "err", call_id, value))

        try:
            await self._gathered[method]([args for _, _, args in calls], reply)
        except asyncio.CancelledError:
            return  # every call's client went away: no answers
        except BaseException as exc:
            self._log_fault(method, exc)
            state = error_state(exc)
        else:
            if all(replied):
                return
            logger.error("engine: %s left calls unanswered", method)
            state = error_state(RuntimeError("the engine did not answer this call"))
        finally:
            for peer, call_id, _ in calls:
                self._gathering.pop((peer, call_id), None)
        for index, done in enumerate(replied):
            if not done:
                reply(index, False, state)

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
