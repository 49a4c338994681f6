"""The event loop a decoupled Python model's ``async def execute`` runs on.

Triton awaits a decoupled model's coroutines on one event loop per instance, so the
instance takes its next requests while earlier ones wait (on I/O, on ``async_exec``,
on ``asyncio.sleep``): an ``execute`` returns to the batcher as soon as its coroutine
is started, and the requests are answered through their senders as it runs.
:class:`ModelLoop` is that loop, in a thread of its own, bound to the server for BLS
calls for its whole life.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from typing import Any

logger = logging.getLogger(__name__)

# How long an unload waits for the coroutines it cancels to unwind.
_CLOSE_TIMEOUT_S = 5.0


class ModelLoop:
    """One instance's loop for its coroutines, run in a thread until :meth:`close`."""

    def __init__(self, name: str, bind: Callable[[], AbstractContextManager[None]]) -> None:
        """``bind``: entered on the loop's thread for its life (the server for exec)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._run, args=(bind,), name=f"slipstream-loop-{name}", daemon=True
        )
        self._thread.start()

    def _run(self, bind: Callable[[], AbstractContextManager[None]]) -> None:
        asyncio.set_event_loop(self._loop)
        with bind():
            self._loop.run_forever()

    def start(self, work: Awaitable[Any]) -> concurrent.futures.Future[Any]:
        """Run ``work`` on the loop, beside what already runs there; its future."""
        return asyncio.run_coroutine_threadsafe(_awaited(work), self._loop)

    def close(self) -> None:
        """Cancel what still runs (an unload: its requests are answered as failed by
        their futures' callbacks), then stop the loop and its thread."""
        if self._loop.is_closed():
            return
        try:
            asyncio.run_coroutine_threadsafe(_cancel_all(), self._loop).result(_CLOSE_TIMEOUT_S)
        except (concurrent.futures.TimeoutError, RuntimeError):
            logger.warning("unload: a Python model's coroutines did not end when cancelled")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(_CLOSE_TIMEOUT_S)
        if not self._thread.is_alive():
            self._loop.close()


async def _awaited(work: Awaitable[Any]) -> Any:
    return await work


async def _cancel_all() -> None:
    current = asyncio.current_task()
    tasks = [task for task in asyncio.all_tasks() if task is not current]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
