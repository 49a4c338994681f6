"""The split layout's parent process: starts the engine and the front ends, keeps them up.

    supervisor (this process: holds the ports, see server/ports.py; listens on none)
      |- engine process      Unix socket <socket dir>/engine      (models, batchers, LLM loop)
      |- (engine 1 ...       <socket dir>/engine-1                 one per device: --engines)
      |- front end 0         HTTP + gRPC ports (SO_REUSEPORT)      -> connected to each engine
      |- front end 1 ...

A child that dies is started again, after a back-off that doubles from 1 s to 30 s
(reset once a child has run for a minute); meanwhile the front ends answer 503 with
Retry-After (:mod:`slipstream.engine.client`). A child that exits before it was ever
ready (an engine whose models failed to start, a front end that could not bind its port)
stops the whole server with its exit code, as the one-process server does. On SIGTERM or
SIGINT the front ends drain first (the engines still answer their in-flight requests),
then the engines stop.

The children are given the targets to run (``server/split.py`` composes them), so this
module knows processes, not models. They run under ``multiprocessing``'s spawn method:
a fresh interpreter each, nothing inherited but their arguments.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event as ProcessEvent
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_FIRST_BACKOFF_S = 1.0
_MAX_BACKOFF_S = 30.0
# A child that ran this long before it died starts again without waiting.
_HEALTHY_AFTER_S = 60.0
# Beyond the drain: how long a child may take to exit before it is killed.
_EXIT_GRACE_S = 10.0


def socket_dir() -> Path:
    """A new directory for the engine's socket that only this user can open (0700):
    the messages on it are pickles, which only this server's processes may send."""
    return Path(tempfile.mkdtemp(prefix="slipstream-"))


def engine_address(directory: Path, index: int = 0) -> str:
    """The socket of the ``index``-th engine in ``directory``."""
    return str(directory / ("engine" if index == 0 else f"engine-{index}"))


def set_cpu_scheduling(policy: str) -> None:
    """Put every thread of this process, and so each it starts later, under ``policy``:
    "batch" is Linux's SCHED_BATCH, "default" changes nothing.

    Front ends and the engine hand each other messages. Under the normal policy the
    process a message wakes preempts the one that sent it, mid-batch, wherever they
    share a core: each then hands over a request or two at a time. Under SCHED_BATCH the
    woken process waits for the sender's time slice or its next wait, and gets the whole
    batch (benchmarks/frontends.py: about 1.5x the requests/s on one shared core). A process
    started under another policy (a real-time one its operator chose) is left alone, as
    is any system without SCHED_BATCH."""
    if policy != "batch":
        return
    batch = getattr(os, "SCHED_BATCH", None)
    if batch is None or os.sched_getscheduler(0) != os.SCHED_OTHER:
        return
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]  # 0: the calling thread
    for thread in threads:
        try:
            os.sched_setscheduler(thread, batch, os.sched_param(0))
        except OSError as exc:  # a thread that ended since, or a system that refuses
            if thread == 0 or thread == threading.get_native_id():
                logger.warning("cannot use SCHED_BATCH (%s): the default policy stays", exc)
                return


@dataclass(slots=True)
class _Child:
    """One child process and what it takes to start it again."""

    name: str
    target: Callable[..., None]
    args: tuple[Any, ...]
    # Set by the child once it serves (the engine: models started; a front end: listening).
    ready: ProcessEvent
    process: BaseProcess | None = None
    started_at: float = 0.0
    backoff_s: float = _FIRST_BACKOFF_S
    exited: asyncio.Event = field(default_factory=asyncio.Event)


class Supervisor:
    """Runs the engines (name -> what to run) and ``len(frontends)`` front ends; see the
    module docstring.

    Each child is called as ``target(*args, ready)`` in its process, where ``ready`` is a
    multiprocessing Event it sets once it serves.
    """

    def __init__(
        self,
        engines: dict[str, tuple[Callable[..., None], tuple[Any, ...]]],
        frontends: list[tuple[Callable[..., None], tuple[Any, ...]]],
        shutdown_timeout_s: float,
    ) -> None:
        self._context = multiprocessing.get_context("spawn")
        self._engines = [
            self._child(name, target, args) for name, (target, args) in engines.items()
        ]
        self._frontends = [
            self._child(f"front end {index}", target, args)
            for index, (target, args) in enumerate(frontends)
        ]
        self._shutdown_timeout_s = shutdown_timeout_s
        self._stopping = False

    async def run(self, stop: asyncio.Event) -> int:
        """Start everything, keep it running until ``stop`` is set; the exit code."""
        children = [*self._engines, *self._frontends]
        for child in children:
            self._start(child)
        watchers = [asyncio.create_task(self._keep_up(child)) for child in children]
        stop_task = asyncio.create_task(stop.wait())
        failures = [asyncio.create_task(self._failed_at_start(child)) for child in children]
        done, _ = await asyncio.wait({stop_task, *failures}, return_when=asyncio.FIRST_COMPLETED)
        exit_code = next((task.result() for task in failures if task in done), 0)
        self._stopping = True
        for task in (*watchers, stop_task, *failures):
            task.cancel()
        await self._stop_all()
        return exit_code

    def _child(self, name: str, target: Callable[..., None], args: tuple[Any, ...]) -> _Child:
        ready = self._context.Event()
        return _Child(name, target, (*args, ready), ready)

    def _start(self, child: _Child) -> None:
        process = self._context.Process(target=child.target, args=child.args, name=child.name)
        process.start()
        child.process, child.started_at = process, time.monotonic()
        child.exited = asyncio.Event()
        asyncio.get_running_loop().add_reader(process.sentinel, self._on_exit, child, process)
        logger.info("%s started (pid %d)", child.name, process.pid)

    def _on_exit(self, child: _Child, process: BaseProcess) -> None:
        asyncio.get_running_loop().remove_reader(process.sentinel)
        process.join(0)
        child.exited.set()

    async def _keep_up(self, child: _Child) -> None:
        """Start ``child`` again each time it dies, after its back-off."""
        while True:
            await child.exited.wait()
            if not child.ready.is_set():
                return  # it never started: the server stops (_failed_at_start)
            process = child.process
            assert process is not None
            await _reaped(process)
            ran_s = time.monotonic() - child.started_at
            if ran_s >= _HEALTHY_AFTER_S:
                child.backoff_s = 0.0
            logger.error("%s (pid %d) exited with code %s after %.1f s; starting it again in "
                         "%.0f s", child.name, process.pid, process.exitcode, ran_s,
                         child.backoff_s)  # fmt: skip
            await asyncio.sleep(child.backoff_s)
            child.backoff_s = min(_MAX_BACKOFF_S, max(_FIRST_BACKOFF_S, 2 * child.backoff_s))
            self._start(child)

    async def _failed_at_start(self, child: _Child) -> int:
        """The exit code of ``child`` if it stops before it was ever ready."""
        await child.exited.wait()
        process = child.process
        if child.ready.is_set() or process is None:
            await asyncio.Event().wait()  # it had started: _keep_up restarts it
        assert process is not None  # the wait above never ends
        await _reaped(process)
        code = process.exitcode
        logger.error("%s exited (code %s) before it was ready; stopping", child.name, code)
        return code or 1

    async def _stop_all(self) -> None:
        """Drain the front ends, then stop the engines; kill what does not exit in time."""
        await asyncio.gather(*(self._stop(child) for child in self._frontends))
        await asyncio.gather(*(self._stop(child) for child in self._engines))

    async def _stop(self, child: _Child) -> None:
        process = child.process
        if process is None or process.exitcode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.terminate()  # SIGTERM: the child drains and exits
        deadline = self._shutdown_timeout_s + _EXIT_GRACE_S
        try:
            await asyncio.wait_for(child.exited.wait(), deadline)
        except TimeoutError:
            logger.error("%s (pid %d) did not exit within %.0f s; killing it", child.name,
                         process.pid, deadline)  # fmt: skip
            process.kill()
            await asyncio.to_thread(process.join, 5)
        if process.exitcode not in (0, None):
            logger.warning("%s exited with code %s", child.name, process.exitcode)


async def _reaped(process: BaseProcess) -> None:
    """Wait until ``process``'s exit code is known: its sentinel can be readable a moment
    before the process can be reaped (the log said "exited (code None)")."""
    if process.exitcode is None:
        await asyncio.to_thread(process.join, 5)


def remove_socket_dir(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)


def watch_parent(stop: asyncio.Event, interval_s: float = 1.0) -> asyncio.Task[None]:
    """In a child: set ``stop`` when the supervisor is gone (killed with -9 it can send no
    signal), so no orphaned front end keeps a port or engine keeps the models."""
    parent = os.getppid()

    async def watch() -> None:
        while os.getppid() == parent:
            await asyncio.sleep(interval_s)
        logger.error("the supervisor process (pid %d) is gone; stopping", parent)
        stop.set()

    return asyncio.create_task(watch())
