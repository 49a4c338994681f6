"""How many threads a CPU engine's forward passes should use, as the host's load changes.

Used by the llama.cpp engine and by the torch backend on the CPU. llama.cpp splits each
forward pass across its threads, and its threads meet at a spin barrier after every
operation. When another process (a front end, a load generator, a neighbour on the
host) takes one of the cores, the thread that loses its core holds every other one
spinning at the next barrier until the scheduler gives the core back. Measured here (one
stream of SmolLM2-135M, 2 cores, `benchmarks/llm_threads.py`): beside two busy processes
2 threads made 37 tokens/s and 1 thread 55; on an idle host, 95 and 84.

:class:`ThreadGovernor` reads the kernel's CPU pressure (PSI: the share of time in
which some runnable task waited for a CPU) between steps. When the cores are crowded, it
gives up a thread; when they have been calm for a while, it tries one more, and backs off
(doubling the wait) each time that crowds them again. Without PSI (kernels before 4.20,
or PSI disabled) the thread count stays where it started.

torch's OpenMP threads wait for each other after every op the same way. An MLP's batches
of 8 (384 -> 1536 -> 384, `benchmarks/torch_threads.py`) ran at 20,370 rows/s on 2
threads and 17,215 on 1 on an idle host here, but beside one busy process at 6,674 and
17,165. :class:`GovernedThreads` drives a governor from a backend's runs and applies its
count on the thread that runs the model, where torch reads it (:class:`AppliedThreads`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from slipstream.runtime.base import cgroup_file

logger = logging.getLogger(__name__)

# A decision needs at least this much wall time of steps observed.
WINDOW_S = 0.25
# Above this share of stalled time a thread is given up; below CALM one more is tried.
# An idle host running 2 threads on 2 cores reads ~1-2%; one busy neighbour, 50%.
CROWDED = 0.25
CALM = 0.05
# The calm time before trying one more thread, doubled after each try that crowded the
# cores (up to LONGEST_WAIT_S), reset by one that did not.
FIRST_WAIT_S = 2.0
LONGEST_WAIT_S = 60.0


def pressure_source() -> Callable[[], int] | None:
    """A reader of the microseconds in which some task waited for a CPU (PSI's ``some``
    total): this cgroup's where it has one, else the host's; None without PSI."""
    candidates = [cgroup_file("cpu.pressure"), Path("/proc/pressure/cpu")]
    for path in candidates:
        if path is None:
            continue
        reader = _stall_reader(path)
        try:
            reader()
        except (OSError, ValueError):
            continue
        return reader
    return None


def _stall_reader(path: Path) -> Callable[[], int]:
    def read() -> int:
        with open(path, "rb") as file:
            first = file.readline()  # b"some avg10=... total=N"
        if not first.startswith(b"some "):
            raise ValueError(f"{path}: unexpected contents {first[:40]!r}")
        return int(first.rsplit(b"total=", 1)[1])

    return read


class ThreadGovernor:
    """The thread count for the next step (see the module docstring). Call
    :meth:`observe` before each step; it answers a new count, or None to keep the one.
    Call :meth:`resting` when the engine goes idle: the pressure until its next step says
    nothing about its own threads. (A step may be long: one of a crowded host's can take
    seconds, and is judged like any other.)"""

    def __init__(
        self,
        most: int,
        stalled_us: Callable[[], int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.most = max(1, most)
        self.threads = self.most
        self._stalled_us = stalled_us
        self._clock = clock
        self._since = clock()
        self._stalled_at_since = stalled_us()
        self._rested = False
        self._calm_since = self._since
        self._wait_s = FIRST_WAIT_S
        self._trying = False  # the last change added a thread; not yet judged

    def observe(self) -> int | None:
        now = self._clock()
        if self._rested:
            self._rested = False
            self._restart(now)
        elapsed = now - self._since
        if elapsed < WINDOW_S:
            return None
        stalled = self._stalled_us()
        share = (stalled - self._stalled_at_since) / 1e6 / elapsed
        self._since, self._stalled_at_since = now, stalled
        if share > CROWDED:
            self._calm_since = now
            if self._trying:  # that thread crowded the cores: wait longer before the next
                self._wait_s = min(2 * self._wait_s, LONGEST_WAIT_S)
                self._trying = False
            if self.threads > 1:
                return self._set(self.threads - 1, share)
            return None
        if share >= CALM:
            self._calm_since = now
            return None
        if self._trying:  # calm with the added thread: keep it
            self._trying = False
            self._wait_s = FIRST_WAIT_S
        if self.threads < self.most and now - self._calm_since >= self._wait_s:
            self._calm_since = now
            self._trying = True
            return self._set(self.threads + 1, share)
        return None

    def resting(self) -> None:
        self._rested = True

    def _restart(self, now: float) -> None:
        self._since = now
        self._stalled_at_since = self._stalled_us()
        self._calm_since = now

    def _set(self, threads: int, share: float) -> int:
        logger.info(
            "CPU %s (tasks waited %.0f%% of the time): forward passes now use %d of %d "
            "threads", "crowded" if threads < self.threads else "calm", 100 * share,
            threads, self.most,
        )  # fmt: skip
        self.threads = threads
        return threads


class AppliedThreads:
    """A thread count applied on each thread that runs a model: call :meth:`before` on
    that thread before each run, :meth:`after` when it ends. torch keeps its count per
    thread: a count set on the thread that loaded a model does not reach the instance
    thread that runs it (``intra_op_thread_count: 1`` set where the model loaded ran
    the MLP above at 6,699 rows/s beside a busy process, as 2 threads do; set on the
    running thread, at 17,165)."""

    def __init__(self, threads: int, apply: Callable[[int], None]) -> None:
        self.threads = threads
        self._apply = apply
        self._applied = threading.local()

    def before(self) -> None:
        threads = self.threads
        if getattr(self._applied, "threads", None) != threads:
            self._apply(threads)
            self._applied.threads = threads

    def after(self) -> None:
        pass


class GovernedThreads(AppliedThreads):
    """The count of a :class:`ThreadGovernor` driven by a model's runs, applied as
    :class:`AppliedThreads` does. :meth:`before` reads the pressure first. A pause longer
    than ``idle_s`` between runs counts as rest: the pressure while the model was idle
    says nothing about its threads."""

    def __init__(
        self,
        governor: ThreadGovernor,
        apply: Callable[[int], None],
        idle_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(governor.threads, apply)
        self.governor = governor
        self._idle_s = idle_s
        self._clock = clock
        self._ended: float | None = None

    def before(self) -> None:
        if self._ended is None or self._clock() - self._ended > self._idle_s:
            self.governor.resting()
        self.governor.observe()
        self.threads = self.governor.threads
        super().before()

    def after(self) -> None:
        self._ended = self._clock()
