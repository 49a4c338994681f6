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
- :func:`configure`, at the start of each server process: glibc's allocator keeps
  buffers of up to 16 MB in its heap and gives the heap's top back only past 32 MB free.
  By default it maps each buffer over 128 KB afresh and unmaps it when freed (raising
  that limit only as it sees larger buffers freed, state that varies from run to run),
  so every request's tensor buffers (an image's 600 KB, its response) page-faulted anew:
  up to 185,000 faults a second in a front end, a third of its time (benchmarks/README.md,
  "Large tensors"). Environment variables (``MALLOC_MMAP_THRESHOLD_``,
  ``MALLOC_TRIM_THRESHOLD_``) a user set win.
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
import os
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

# The most often trim() hands memory back; a call sooner does nothing.
TRIM_INTERVAL_S = 10.0
# How long after a retirement the collection runs (retirements come in bursts: a model's
# versions, a repository poll's changes).
RECLAIM_DELAY_S = 1.0


# mallopt's parameters (malloc.h) and the values configure() gives them.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 16 * 1024 * 1024
TRIM_THRESHOLD_BYTES = 32 * 1024 * 1024


def _find(name: str) -> Callable[..., int] | None:
    try:
        function: Callable[..., int] = getattr(ctypes.CDLL(None), name)
    except (AttributeError, OSError):
        return None
    return function


_malloc_trim = _find("malloc_trim")
_mallopt = _find("mallopt")
_last_trim = float("-inf")
# The loop a reclaim is pending on, if any (a pending one on a closed loop never runs).
_reclaim_loop: asyncio.AbstractEventLoop | None = None


def configure() -> bool:
    """Keep tensor-sized buffers in the heap (see the module docstring); False where
    this is not glibc or the environment sets the thresholds."""
    if _mallopt is None or any(
        name in os.environ for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
    ):
        return False
    # Setting either threshold also turns off glibc's adjusting of them.
    return bool(
        _mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        and _mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )


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
