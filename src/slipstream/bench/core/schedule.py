"""The load loops shared by both bench modes: when to send, how many at once, when to
stop, and how a late send's latency is counted.

:class:`LoadDriver` sends one load level's requests through the mode's ``send`` (start
request ``index``, await its outcome) and hands each outcome to its ``record``; the
mode's ``requests`` are sent in turn from ``first``. Open loop: at
planned arrival times whatever the responses do, with an in-flight cap; closed loop:
``users`` virtual users, each sending its next request when its last one ended. It
stops when its ``stop`` event is set (V2: the coordinator's stable windows or
``--duration``) or after ``total`` sends (OpenAI: a fixed request count), and always
lets the requests it started finish.

Example (an open loop of 100 requests at 20 per second)::

    driver = LoadDriver(send, record, requests=100, late_send_s=0.01, max_inflight=8,
                        total=100)
    await driver.open_loop(arrival_gaps_s(20.0, "poisson", rng), time.monotonic())
    print(driver.stats.late_sends, driver.stats.peak_inflight)
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

# Open loop: a send this close to its scheduled time goes now. Event-loop timers wake up
# to ~1 ms late (epoll and libuv timeouts are whole milliseconds); sending up to that
# much early, and counting its latency from the actual send, keeps timer slack out of
# the measured latency.
EARLY_SEND_S = 0.001
T = TypeVar("T")

# Warn when more than this share of an open loop's sends left late: its latencies are
# then mostly the client's queue, not the server's.
LATE_SEND_SHARE = 0.01
# A client process above this share of one core is taken as saturated: the load it
# generates, not the server, may be what limits the figures.
SATURATED_CPU_PCT = 90.0

# A request's outcome, as the mode's client returns it (an error key, a stream state).
R = TypeVar("R")
# Starts request ``index`` (of the mode's requests); awaiting it gives the outcome. It
# raises only for a fault of the benchmark, never for a failed request.
Send = Callable[[int], Awaitable[R]]
# Takes a finished request: (index, scheduled_s, sent_s, done_s, outcome), times on the
# driver's clock (scheduled_s == sent_s in a closed loop). Two plain calls instead of
# one coroutine wrapping the client's: a coroutine frame per request cost ~0.5 us.
Record = Callable[[int, float, float, float, R], None]


def run_event_loop(coroutine: Coroutine[Any, Any, T], fast: bool = True) -> T:
    """Run ``coroutine`` on a fresh event loop: uvloop where installed and ``fast``
    (grpc.aio measured faster on asyncio's own loop), else asyncio's."""
    if fast:
        try:
            import uvloop
        except ImportError:  # pragma: no cover - uvloop is absent on Windows
            pass
        else:
            return uvloop.run(coroutine)
    return asyncio.run(coroutine)


def arrival_gaps_s(
    rate_per_s: float, distribution: str, rng: np.random.Generator, chunk: int = 4096
) -> Iterator[float]:
    """Gaps between scheduled sends of an open loop: constant ``1/rate``, or exponential
    with that mean (a Poisson process). Drawn ``chunk`` at a time: one numpy call per
    4096 sends instead of one per send.
    """
    mean_gap_s = 1.0 / rate_per_s
    if distribution == "constant":
        while True:
            yield mean_gap_s
    if distribution != "poisson":
        raise ValueError(f"distribution: expected constant or poisson, got {distribution!r}")
    while True:
        yield from rng.exponential(mean_gap_s, size=chunk).tolist()


def corrected_latency_s(scheduled_s: float, sent_s: float, done_s: float) -> float:
    """Latency of an open-loop request, corrected for coordinated omission.

    A request the client could not send on time (every connection busy, or its event
    loop late) still counts from when it *should* have been sent: the wait is what a
    user arriving at that moment would see. One sent early (timer slack) counts from
    when it was actually sent.

    >>> corrected_latency_s(scheduled_s=1.0, sent_s=1.5, done_s=1.75)
    0.75
    """
    return done_s - min(scheduled_s, sent_s)


@dataclass
class SendStats:
    """How the driver's sends went since the stats were last taken."""

    # Open loop: requests started, those started more than late_send_s after their
    # schedule, and the worst such lag.
    sent: int = 0
    late_sends: int = 0
    max_send_lag_s: float = 0.0
    # Open loop: how often the in-flight cap held a due send back.
    inflight_cap_waits: int = 0
    # Most requests outstanding at once (both loops).
    peak_inflight: int = 0

    @staticmethod
    def total(parts: Iterable[SendStats]) -> SendStats:
        """Several windows' or workers' stats as one."""
        total = SendStats()
        for part in parts:
            total.sent += part.sent
            total.late_sends += part.late_sends
            total.max_send_lag_s = max(total.max_send_lag_s, part.max_send_lag_s)
            total.inflight_cap_waits += part.inflight_cap_waits
            total.peak_inflight = max(total.peak_inflight, part.peak_inflight)
        return total


class LoadDriver(Generic[R]):
    """Sends one load level's requests through ``send``; see the module docstring.

    ``late_send_s``: an open-loop send this long after its schedule counts as late (a
    mode picks what is noise for its requests). ``max_inflight``: the open loop's cap
    on outstanding requests; a due send waits for a slot, and its wait counts in its
    latency. ``clock`` is the time source of ``scheduled_s`` and ``sent_s``
    (``loop.time`` of a virtual-time loop in tests).
    """

    def __init__(
        self,
        send: Send[R],
        record: Record[R],
        *,
        requests: int,
        first: int = 0,
        late_send_s: float,
        max_inflight: int | None = None,
        total: int | None = None,
        stop: asyncio.Event | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._send = send
        self._record = record
        self._late_send_s = late_send_s
        self._max_inflight = max_inflight or sys.maxsize
        self._total = sys.maxsize if total is None else total
        self._stop = stop or asyncio.Event()
        self._clock = clock
        self._slot_freed = asyncio.Event()
        self._requests = requests
        # The request the next send sends (first + sends so far, modulo requests).
        self._next_index = first % requests
        # Sends started so far.
        self._next_seq = 0
        self.inflight = 0
        self.stats = SendStats()

    def take_stats(self) -> SendStats:
        """The stats so far, starting fresh ones (a V2 worker takes them per window)."""
        stats, self.stats = self.stats, SendStats(peak_inflight=self.inflight)
        return stats

    def _done(self) -> bool:
        return self._next_seq >= self._total or self._stop.is_set()

    async def closed_loop(self, users: int) -> None:
        """``users`` users, each with one request outstanding, until the driver stops."""
        # Every user sends at once and again as soon as its request ends: the most
        # outstanding is known, and the hot loop below keeps no count.
        self.inflight = min(users, self._total)
        self.stats.peak_inflight = max(self.stats.peak_inflight, self.inflight)
        await asyncio.gather(*(self._user() for _ in range(users)))
        self.inflight = 0

    async def _user(self) -> None:
        # The hot loop of a closed-loop run: locals, no method calls of the driver's
        # own (each costs ~0.1 us of the ~2 us a turn costs with an instant client).
        clock, send, record = self._clock, self._send, self._record
        stop, total = self._stop, self._total
        requests = self._requests
        while self._next_seq < total and not stop.is_set():
            self._next_seq += 1
            index = self._next_index
            self._next_index = (index + 1) % requests
            sent_s = clock()
            outcome = await send(index)
            record(index, sent_s, sent_s, clock(), outcome)

    async def open_loop(self, gaps_s: Iterator[float], start_s: float) -> None:
        """Send on schedule whatever the responses do: the first at ``start_s``, each
        next one a gap later. Returns when the driver stopped and its requests ended."""
        tasks: set[asyncio.Task[None]] = set()
        faults: list[BaseException] = []

        def finished(task: asyncio.Task[None]) -> None:
            tasks.discard(task)
            if not task.cancelled() and task.exception() is not None:
                faults.append(task.exception())  # type: ignore[arg-type]

        try:
            await self._schedule(gaps_s, start_s, tasks, finished)
            if tasks:
                await asyncio.wait(set(tasks))
        finally:
            for task in list(tasks):
                task.cancel()
        if faults:
            raise faults[0]  # a fault of the benchmark, not a failed request

    async def _schedule(
        self,
        gaps_s: Iterator[float],
        scheduled_s: float,
        tasks: set[asyncio.Task[None]],
        finished: Callable[[asyncio.Task[None]], None],
    ) -> None:
        clock = self._clock
        while not self._done():
            now_s = clock()
            if scheduled_s > now_s + EARLY_SEND_S:
                await asyncio.sleep(scheduled_s - now_s - EARLY_SEND_S)
                continue
            if self.inflight >= self._max_inflight:
                self.stats.inflight_cap_waits += 1
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            self._next_seq += 1
            index = self._next_index
            self._next_index = (index + 1) % self._requests
            self._started()  # counted now, so a burst of due sends respects the cap
            task = asyncio.create_task(self._open_send(index, scheduled_s))
            tasks.add(task)
            task.add_done_callback(finished)
            scheduled_s += next(gaps_s)
            if scheduled_s < now_s:
                await asyncio.sleep(0)  # behind schedule: let responses be read meanwhile

    async def _open_send(self, index: int, scheduled_s: float) -> None:
        sent_s = self._clock()
        stats = self.stats
        stats.sent += 1
        lag_s = sent_s - scheduled_s
        if lag_s > self._late_send_s:
            stats.late_sends += 1
            stats.max_send_lag_s = max(stats.max_send_lag_s, lag_s)
        try:
            outcome = await self._send(index)
        finally:
            self.inflight -= 1
            self._slot_freed.set()
        self._record(index, scheduled_s, sent_s, self._clock(), outcome)

    def _started(self) -> None:
        self.inflight += 1
        if self.inflight > self.stats.peak_inflight:
            self.stats.peak_inflight = self.inflight
