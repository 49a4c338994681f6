"""The worker process: drives its share of a load level and reports each window.

A level reads as its steps: wait for the shared start, run the load (closed loop:
``concurrency`` virtual users each with one request outstanding; open loop: a scheduler
sending at the planned times), cut a window on each boundary, then stop, drain and
report. Recording a request is an append to a list; the histogram is built once per
window, so the hot loop does no numpy work.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
import traceback
from array import array
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import numpy as np
import psutil

from slipstream.bench.core.histogram import LatencyHistogram
from slipstream.bench.core.schedule import (
    LoadDriver,
    arrival_gaps_s,
    run_event_loop,
)
from slipstream.bench.v2.clients import InferClient, make_client
from slipstream.bench.v2.messages import (
    LevelDone,
    Ready,
    RunLevel,
    Shutdown,
    StopLevel,
    WindowSample,
    WorkerFailed,
    WorkerPlan,
)
from slipstream.bench.v2.sequences import WorkerSequences

# A send later than this after its schedule counts as late.
LATE_SEND_S = 0.001
# Time allowed past the request timeout for outstanding requests to finish at the end.
_DRAIN_GRACE_S = 2.0


class Pipe(Protocol):
    """The worker's end of its pipe to the coordinator (a multiprocessing Connection)."""

    def send(self, obj: Any) -> None: ...

    def recv(self) -> Any: ...

    def poll(self) -> bool: ...

    def fileno(self) -> int: ...


# Makes the worker's client for a level: (plan, most outstanding requests) -> client.
ClientFactory = Callable[[WorkerPlan, int], InferClient]


def default_client(plan: WorkerPlan, outstanding: int) -> InferClient:
    return make_client(
        plan.endpoint, plan.model, plan.version, plan.requests, plan.timeout_s, outstanding
    )


class WindowRecorder:
    """Counts for one window; swapped for a fresh one at every boundary."""

    __slots__ = ("_batch_sizes", "errors", "latencies_s", "ok_inferences", "ok_requests")

    def __init__(self, batch_sizes: list[int]) -> None:
        self._batch_sizes = batch_sizes
        self.latencies_s = array("d")
        self.ok_requests = 0
        self.ok_inferences = 0
        self.errors: dict[str, int] = {}

    def record(self, index: int, latency_s: float, error: str | None) -> None:
        if error is None:
            self.latencies_s.append(latency_s)
            self.ok_requests += 1
            self.ok_inferences += self._batch_sizes[index]
        else:
            self.errors[error] = self.errors.get(error, 0) + 1

    def histogram(self) -> LatencyHistogram:
        return LatencyHistogram.from_latencies(np.frombuffer(self.latencies_s, np.float64))


def worker_main(conn: Pipe, plan: WorkerPlan) -> None:
    """Entry point of a spawned worker process."""
    # Ctrl-C reaches the whole process group; the coordinator stops the workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    worker = Worker(conn, plan)
    try:
        run_event_loop(worker.serve(), fast=plan.endpoint.protocol != "grpc")
    except Exception:
        with contextlib.suppress(OSError):
            conn.send(WorkerFailed(plan.worker_id, traceback.format_exc()))


class Worker:
    """One process's share of the load, driven by the coordinator's commands."""

    def __init__(
        self, conn: Pipe, plan: WorkerPlan, client_factory: ClientFactory = default_client
    ) -> None:
        self._conn = conn
        self._plan = plan
        self._client_factory = client_factory
        self._batch_sizes = [r.batch_size for r in plan.requests]
        self._process = psutil.Process()
        self._recorder = WindowRecorder(self._batch_sizes)
        self._record_lock = threading.Lock()
        self._stops: dict[int, asyncio.Event] = {}
        self._rng = np.random.default_rng(plan.seed + 7919 * plan.worker_id)
        # A stateful model's sequences, kept over levels so ids are never reused.
        self._sequences = (
            WorkerSequences(plan.sequences, plan.worker_id) if plan.sequences else None
        )

    async def serve(self) -> None:
        """Run levels as the coordinator asks until Shutdown (or its pipe closes)."""
        commands: asyncio.Queue[object] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        loop.add_reader(self._conn.fileno(), self._read_commands, commands)
        self._conn.send(Ready(self._plan.worker_id))
        levels: set[asyncio.Task[None]] = set()
        try:
            while True:
                command = await commands.get()
                if isinstance(command, RunLevel):
                    self._stops.setdefault(command.level_id, asyncio.Event())
                    task = asyncio.create_task(self.run_level(command))
                    levels.add(task)
                    task.add_done_callback(levels.discard)
                elif isinstance(command, StopLevel):
                    stop = self._stops.get(command.level_id)
                    if stop is not None:
                        stop.set()
                elif isinstance(command, Shutdown):
                    break
        finally:
            loop.remove_reader(self._conn.fileno())
            for stop in self._stops.values():
                stop.set()
            if levels:
                await asyncio.wait(levels, timeout=self._plan.timeout_s + _DRAIN_GRACE_S)

    def _read_commands(self, commands: asyncio.Queue[object]) -> None:
        try:
            while self._conn.poll():
                commands.put_nowait(self._conn.recv())
        except (EOFError, OSError):  # the coordinator is gone
            commands.put_nowait(Shutdown())

    # ------------------------------------------------------------------ one level

    async def run_level(self, command: RunLevel) -> None:
        """Measure one level, sending a WindowSample per window, then LevelDone."""
        self._stops.setdefault(command.level_id, asyncio.Event())
        try:
            await self._measure(command)
        except Exception:
            self._conn.send(WorkerFailed(self._plan.worker_id, traceback.format_exc()))
        finally:
            self._stops.pop(command.level_id, None)

    async def _measure(self, command: RunLevel) -> None:
        plan = self._plan
        stop = self._stops[command.level_id]
        client = self._client_factory(plan, command.concurrency or command.max_inflight)
        await _sleep_until(command.start_at)
        self._recorder = WindowRecorder(self._batch_sizes)
        cpu_s, reconnects = self._cpu_s(), 0
        driver, tasks = self._start_load(client, command, stop)
        window_start = command.start_at
        index = -1 if command.warmup_s > 0 else 0
        while index < command.max_windows:
            end = command.start_at + command.warmup_s + (index + 1) * command.window_s
            if await _wait_until_or_stopped(end, stop):
                break
            now, cpu_now, reconnects_now = time.monotonic(), self._cpu_s(), client.reconnects
            sample = self._cut_window(client, command, index, (window_start, now))
            sample.cpu_s, sample.reconnects = cpu_now - cpu_s, reconnects_now - reconnects
            if driver is not None:
                sample.sends = driver.take_stats()
            self._conn.send(sample)
            window_start, cpu_s, reconnects = now, cpu_now, reconnects_now
            index += 1
        stop.set()
        await self._drain(tasks)
        if self._sequences is not None:
            await self._sequences.end_open(client.infer_in_sequence)
        await client.close()
        self._conn.send(LevelDone(plan.worker_id, command.level_id))

    def _start_load(
        self, client: InferClient, command: RunLevel, stop: asyncio.Event
    ) -> tuple[LoadDriver[str | None] | None, list[asyncio.Task[None]]]:
        """The level's load loop as a task, and its driver (None: the blocking user)."""
        # The blocking user sends the same bytes each time: never a sequence's requests.
        blocking = command.concurrency == 1 and self._sequences is None
        user = client.blocking_user() if blocking else None
        if user is not None:
            run = asyncio.to_thread(user.run, stop, self._record_locked, command.first_user)
            return None, [asyncio.create_task(run)]
        if command.concurrency:
            driver = self._driver(client, command.first_user, stop, None)
            return driver, [asyncio.create_task(driver.closed_loop(command.concurrency))]
        # Open loop: latency counts from the schedule, whatever the responses do.
        driver = self._driver(client, self._plan.worker_id, stop, command.max_inflight)
        gaps = arrival_gaps_s(command.request_rate, self._plan.distribution, self._rng)
        loop = driver.open_loop(gaps, command.start_at + command.phase_s)
        return driver, [asyncio.create_task(loop)]

    def _driver(
        self, client: InferClient, first: int, stop: asyncio.Event, max_inflight: int | None
    ) -> LoadDriver[str | None]:
        """A driver sending the plan's requests in turn from ``first`` (worker id or
        first user, so workers start at different inputs), recording each outcome."""

        def record(
            index: int, scheduled_s: float, sent_s: float, done_s: float, error: str | None
        ) -> None:
            # corrected_latency_s, inline: this runs once per request.
            self._recorder.record(index, done_s - min(scheduled_s, sent_s), error)

        send: Callable[[int], Awaitable[str | None]] = client.infer
        if self._sequences is not None:
            send = self._sequences.sender(client.infer_in_sequence)
        return LoadDriver(
            send,
            record,
            requests=len(self._batch_sizes),
            first=first,
            late_send_s=LATE_SEND_S,
            max_inflight=max_inflight,
            stop=stop,
        )

    def _cut_window(
        self, client: InferClient, command: RunLevel, index: int, span_s: tuple[float, float]
    ) -> WindowSample:
        """The window's counts; the caller adds its CPU, sends and reconnects."""
        with self._record_lock:
            recorder, self._recorder = self._recorder, WindowRecorder(self._batch_sizes)
        return WindowSample(
            worker_id=self._plan.worker_id,
            level_id=command.level_id,
            window_index=index,
            start_s=span_s[0],
            end_s=span_s[1],
            ok_requests=recorder.ok_requests,
            ok_inferences=recorder.ok_inferences,
            latency=recorder.histogram(),
            errors=recorder.errors,
            error_examples={k: client.error_examples.get(k, "") for k in recorder.errors},
        )

    async def _drain(self, tasks: list[asyncio.Task[None]]) -> None:
        """Let outstanding requests finish (they time out at worst), then cancel."""
        _, pending = await asyncio.wait(tasks, timeout=self._plan.timeout_s + _DRAIN_GRACE_S)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
        for task in tasks:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]

    def _cpu_s(self) -> float:
        times = self._process.cpu_times()
        return float(times.user + times.system)

    def _record_locked(self, index: int, latency_s: float, error: str | None) -> None:
        """Record from the blocking user's thread, never into a window being cut."""
        with self._record_lock:
            self._recorder.record(index, latency_s, error)


async def _sleep_until(deadline: float) -> None:
    delay = deadline - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)


async def _wait_until_or_stopped(deadline: float, stop: asyncio.Event) -> bool:
    """Wait until ``deadline``; True if ``stop`` was set first."""
    delay = deadline - time.monotonic()
    if stop.is_set():
        return True
    if delay <= 0:
        return False
    try:
        await asyncio.wait_for(stop.wait(), timeout=delay)
    except TimeoutError:  # not yet the builtin TimeoutError on Python 3.10
        return False
    return True
