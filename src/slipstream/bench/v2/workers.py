"""The coordinator's side of the worker processes: start, command, collect, stop.

Workers are *spawned*, not forked: the coordinator may hold a gRPC channel and event
loops, neither of which survives a fork.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from slipstream.bench.core.errors import BenchError
from slipstream.bench.v2.loadgen import worker_main
from slipstream.bench.v2.messages import (
    Message,
    Ready,
    RunLevel,
    Shutdown,
    StopLevel,
    WorkerFailed,
    WorkerPlan,
)

# A spawned worker imports numpy, psutil and the clients before it is ready.
_START_TIMEOUT_S = 60.0
_JOIN_TIMEOUT_S = 10.0


@dataclass
class _Worker:
    worker_id: int
    process: BaseProcess
    conn: Connection


def usable_cores() -> int:
    """Cores this process may run on: its affinity (taskset, cgroups), else all."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


class WorkerPool:
    """Worker processes, started on demand and kept for the whole run."""

    def __init__(self, make_plan: Callable[[int], WorkerPlan]) -> None:
        self._make_plan = make_plan
        self._workers: list[_Worker] = []
        self._context = multiprocessing.get_context("spawn")
        # Messages read while waiting for others, by (worker, level, window).
        self._pending: list[Message] = []

    @property
    def size(self) -> int:
        return len(self._workers)

    def grow_to(self, count: int) -> None:
        """Start workers until there are ``count``; wait until each is ready."""
        started = []
        while len(self._workers) < count:
            worker_id = len(self._workers)
            ours, theirs = self._context.Pipe()
            process = self._context.Process(
                target=worker_main,
                args=(theirs, self._make_plan(worker_id)),
                name=f"slipstream-bench-worker-{worker_id}",
                daemon=True,
            )
            process.start()
            theirs.close()
            worker = _Worker(worker_id, process, ours)
            self._workers.append(worker)
            started.append(worker)
        ids = {worker.worker_id for worker in started}

        def is_ready(message: Message) -> bool:
            return isinstance(message, Ready) and message.worker_id in ids

        self.collect(is_ready, len(started), _START_TIMEOUT_S)

    def send(self, worker_id: int, command: RunLevel | StopLevel) -> None:
        self._workers[worker_id].conn.send(command)

    def collect(
        self, wanted: Callable[[Message], bool], count: int, timeout_s: float
    ) -> list[Message]:
        """Read messages until ``count`` satisfy ``wanted``; others wait for a later call.

        Raises BenchError when a worker fails or exits, or after ``timeout_s``.
        """
        found = [m for m in self._pending if wanted(m)]
        self._pending = [m for m in self._pending if not wanted(m)]
        deadline = time.monotonic() + timeout_s
        while len(found) < count:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BenchError(
                    f"the load-generator workers did not report within {timeout_s:.0f} s; "
                    "the machine may be overloaded"
                )
            for message in self._read(remaining):
                (found if wanted(message) else self._pending).append(message)
        return found

    def _read(self, timeout_s: float) -> list[Message]:
        by_conn = {w.conn: w for w in self._workers}
        sentinels = {w.process.sentinel: w for w in self._workers}
        ready = wait([*by_conn, *sentinels], timeout=timeout_s)
        messages: list[Message] = []
        for item in ready:
            if item in by_conn:
                worker = by_conn[item]
                try:
                    while worker.conn.poll():
                        messages.append(worker.conn.recv())
                except EOFError:
                    pass
        for message in messages:
            if isinstance(message, WorkerFailed):
                raise BenchError(
                    f"load-generator worker {message.worker_id} failed:\n{message.message}"
                )
        dead = [sentinels[s] for s in ready if s in sentinels]
        if dead and not messages:
            worker = dead[0]
            raise BenchError(
                f"load-generator worker {worker.worker_id} exited with code "
                f"{worker.process.exitcode}"
            )
        return messages

    def close(self) -> None:
        """Ask every worker to stop; terminate those that do not."""
        for worker in self._workers:
            with contextlib.suppress(OSError, ValueError):
                worker.conn.send(Shutdown())
        for worker in self._workers:
            worker.process.join(_JOIN_TIMEOUT_S)
            if worker.process.is_alive():
                worker.process.terminate()
                worker.process.join(_JOIN_TIMEOUT_S)
            worker.conn.close()
        self._workers.clear()
