"""The server process's heap: short garbage-collector pauses, and freed memory given back.

- :func:`settle`, once the server is ready: every object made so far (the imported
  modules, the first models) lives as long as the process, so it is moved out of the
  collector's sight (``gc.freeze``). A full collection then walks only what was made
  since instead of everything; under 3,000 hostile connections a full collection of the
  whole heap held the event loop for tens of milliseconds, the legitimate client's p99.
- :func:`reclaim_soon`, after a model version or engine is retired: its objects may be
  among the frozen ones, where the collector never looks, so they are unfrozen and
  collected once (a second later, coalesced), then the rest is frozen again. An unloaded
  model's memory comes back at once rather than at some later full collection.
- :func:`trim`: freed memory that glibc keeps in its heap (it returns only the top of the
  heap by itself) is handed back to the operating system with ``malloc_trim(0)``; the
  HTTP server calls it after connections have closed (a few hundred microseconds, at most
  once every :data:`TRIM_INTERVAL_S`). Without glibc (musl, macOS) it does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

# The most often trim() hands memory back; a call sooner does nothing.
TRIM_INTERVAL_S = 10.0
# How long after a retirement the collection runs (retirements come in bursts: a model's
# versions, a repository poll's changes).
RECLAIM_DELAY_S = 1.0


def _find_malloc_trim() -> Callable[[int], int] | None:
    try:
        function: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None
    return function


_malloc_trim = _find_malloc_trim()
_last_trim = float("-inf")
# The loop a reclaim is pending on, if any (a pending one on a closed loop never runs).
_reclaim_loop: asyncio.AbstractEventLoop | None = None


def settle() -> None:
    """Freeze what exists now (call once the process is ready)."""
    gc.collect()
    gc.freeze()
    trim(force=True)


def reclaim_soon() -> None:
    """Collect what retired models left, in a second (coalesced); needs a running loop."""
    global _reclaim_loop
    loop = asyncio.get_running_loop()
    if _reclaim_loop is loop:
        return
    _reclaim_loop = loop
    loop.call_later(RECLAIM_DELAY_S, _reclaim_now)


def _reclaim_now() -> None:
    global _reclaim_loop
    _reclaim_loop = None
    started = time.perf_counter()
    gc.unfreeze()
    freed = gc.collect()
    gc.freeze()
    trim(force=True)
    logger.debug("reclaimed %d objects in %.1f ms", freed, (time.perf_counter() - started) * 1000)


def trim(force: bool = False) -> bool:
    """Give freed heap memory back to the OS, at most every TRIM_INTERVAL_S unless
    ``force``; False when it did nothing."""
    global _last_trim
    now = time.monotonic()
    if _malloc_trim is None or (not force and now - _last_trim < TRIM_INTERVAL_S):
        return False
    _last_trim = now
    _malloc_trim(0)
    return True
