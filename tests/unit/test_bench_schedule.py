"""The shared load driver of both bench modes, on a virtual clock (no sockets, no waiting).

Each test runs the driver in an event loop whose clock jumps to the next timer whenever
nothing is ready, so a 100 ms "service time" is exact and takes no real time: the
schedule, the in-flight cap, the send lag and the stop rules are checked to the
microsecond, not within a real loop's timer slack.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import pytest

from slipstream.bench.core.schedule import (
    EARLY_SEND_S,
    LoadDriver,
    arrival_gaps_s,
    corrected_latency_s,
)

T = TypeVar("T")
LATE_S = 0.01


class _VirtualSelector(selectors.DefaultSelector):
    """Never blocks: when nothing is ready, moves the loop's clock to the next timer."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[Any]:
        ready: list[Any] = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise RuntimeError("deadlock: nothing ready and no timer pending")
        self._loop.now_s += timeout
        return ready


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose ``time()`` advances only when every task waits on a timer."""

    def __init__(self) -> None:
        self.now_s = 1000.0
        super().__init__(_VirtualSelector(self))

    def time(self) -> float:
        return self.now_s


def run_virtual(main: Callable[[VirtualTimeLoop], Coroutine[Any, Any, T]]) -> T:
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(main(loop))
    finally:
        loop.close()


@dataclass
class Sent:
    seq: int
    scheduled_s: float
    sent_s: float
    done_s: float
    # Requests outstanding (this one included) when it went.
    outstanding: int


class FakeServer:
    """Answers every request after ``service_s`` of virtual time; logs what it saw."""

    def __init__(self, loop: VirtualTimeLoop, service_s: float) -> None:
        self.loop = loop
        self.service_s = service_s
        self.outstanding = 0
        # seq -> requests outstanding (this one included) when it went.
        self.seen: dict[int, int] = {}
        self.log: list[Sent] = []

    async def send(self, seq: int) -> int:
        self.outstanding += 1
        self.seen[seq] = self.outstanding
        await asyncio.sleep(self.service_s)
        self.outstanding -= 1
        return seq

    def record(
        self, seq: int, scheduled_s: float, sent_s: float, done_s: float, outcome: int
    ) -> None:
        assert outcome == seq and done_s == self.loop.time()
        self.log.append(Sent(seq, scheduled_s, sent_s, done_s, self.seen[seq]))

    def driver(self, **options: Any) -> LoadDriver[int]:
        options.setdefault("requests", 1_000_000)  # every send its own request number
        return LoadDriver(
            self.send, self.record, late_send_s=LATE_S, clock=self.loop.time, **options
        )


def _constant(rate_per_s: float) -> Any:
    return arrival_gaps_s(rate_per_s, "constant", np.random.default_rng(0))


def test_open_loop_sends_each_request_at_its_time_minus_the_early_wake() -> None:
    async def main(loop: VirtualTimeLoop) -> tuple[FakeServer, LoadDriver, float]:
        server = FakeServer(loop, service_s=0.002)
        driver = server.driver(total=50)
        start_s = loop.time() + 0.5
        await driver.open_loop(_constant(100.0), start_s)
        return server, driver, start_s

    server, driver, start_s = run_virtual(main)
    assert sorted(s.seq for s in server.log) == list(range(50))
    for sent in sorted(server.log, key=lambda s: s.seq):
        assert sent.scheduled_s == pytest.approx(start_s + sent.seq * 0.01, abs=1e-9)
        assert sent.sent_s == pytest.approx(sent.scheduled_s - EARLY_SEND_S, abs=1e-6)
    assert driver.stats.sent == 50 and driver.stats.late_sends == 0
    assert driver.stats.peak_inflight == 1 and driver.stats.inflight_cap_waits == 0


def test_open_loop_caps_outstanding_requests_and_counts_the_wait_from_the_schedule() -> None:
    # 100 req/s into a server that takes 50 ms with at most 2 outstanding: it serves
    # 40 req/s, so sends fall further and further behind their schedule.
    async def main(loop: VirtualTimeLoop) -> tuple[FakeServer, LoadDriver]:
        server = FakeServer(loop, service_s=0.05)
        driver = server.driver(max_inflight=2, total=20)
        await driver.open_loop(_constant(100.0), loop.time())
        return server, driver

    server, driver = run_virtual(main)
    log = sorted(server.log, key=lambda s: s.seq)
    assert max(s.outstanding for s in log) == 2 and driver.stats.peak_inflight == 2
    assert driver.stats.inflight_cap_waits > 0
    lags = [s.sent_s - s.scheduled_s for s in log]
    assert driver.stats.late_sends == sum(lag > LATE_S for lag in lags) > 10
    assert driver.stats.max_send_lag_s == pytest.approx(max(lags))
    # Request k goes when request k-2 ends: 25 ms per request, against 10 ms planned.
    assert log[19].sent_s - log[1].sent_s == pytest.approx(9 * 0.05, abs=1e-6)
    latencies = [corrected_latency_s(s.scheduled_s, s.sent_s, s.done_s) for s in log]
    assert latencies[-1] == pytest.approx(log[-1].done_s - log[-1].scheduled_s)
    assert latencies[-1] > 0.05 + 0.1  # the service time plus the wait for a slot


def test_open_loop_stops_on_its_event_and_lets_started_requests_finish() -> None:
    async def main(loop: VirtualTimeLoop) -> tuple[FakeServer, float]:
        server = FakeServer(loop, service_s=0.3)
        stop = asyncio.Event()
        driver = server.driver(stop=stop)
        start_s = loop.time()
        loop.call_at(start_s + 0.95, stop.set)
        await driver.open_loop(_constant(10.0), start_s)
        assert server.outstanding == 0
        return server, loop.time() - start_s

    server, elapsed_s = run_virtual(main)
    # Sends at 0, 0.1, ..., 0.9 (each 1 ms early); the one due at 1.0 was stopped.
    assert [s.seq for s in server.log] == list(range(10))
    assert elapsed_s == pytest.approx(0.9 - EARLY_SEND_S + 0.3, abs=1e-6)


def test_closed_loop_stops_after_total_requests_with_users_outstanding() -> None:
    async def main(loop: VirtualTimeLoop) -> tuple[FakeServer, LoadDriver, float]:
        server = FakeServer(loop, service_s=0.1)
        driver = server.driver(total=10)
        start_s = loop.time()
        await driver.closed_loop(users=3)
        return server, driver, loop.time() - start_s

    server, driver, elapsed_s = run_virtual(main)
    assert sorted(s.seq for s in server.log) == list(range(10))
    assert max(s.outstanding for s in server.log) == 3 and driver.stats.peak_inflight == 3
    assert all(s.sent_s == s.scheduled_s for s in server.log)
    assert elapsed_s == pytest.approx(0.4)  # rounds at 0, 0.1, 0.2 and one request at 0.3
    assert driver.stats.sent == 0  # send counts are the open loop's


def test_closed_loop_stops_on_its_event_after_each_user_s_request() -> None:
    async def main(loop: VirtualTimeLoop) -> tuple[FakeServer, float]:
        server = FakeServer(loop, service_s=0.1)
        stop = asyncio.Event()
        driver = server.driver(stop=stop)
        start_s = loop.time()
        loop.call_at(start_s + 0.25, stop.set)
        await driver.closed_loop(users=3)
        return server, loop.time() - start_s

    server, elapsed_s = run_virtual(main)
    assert len(server.log) == 9 and elapsed_s == pytest.approx(0.3)


def test_taking_the_stats_starts_a_fresh_window() -> None:
    async def main(loop: VirtualTimeLoop) -> list[int]:
        server = FakeServer(loop, service_s=0.001)
        driver = server.driver(total=30)
        counts = []
        loop.call_at(loop.time() + 0.105, lambda: counts.append(driver.take_stats().sent))
        await driver.open_loop(_constant(100.0), loop.time())
        counts.append(driver.take_stats().sent)
        return counts

    assert run_virtual(main) == [11, 19]


def test_a_fault_in_send_is_raised_by_the_loop() -> None:
    async def broken(seq: int) -> int:
        if seq == 3:
            raise KeyError("bug")
        return seq

    async def main(loop: VirtualTimeLoop) -> None:
        driver = LoadDriver(
            broken, lambda *_: None, requests=5, late_send_s=LATE_S, total=5, clock=loop.time
        )
        await driver.open_loop(_constant(100.0), loop.time())

    with pytest.raises(KeyError):
        run_virtual(main)


def test_requests_are_sent_in_turn_from_the_first() -> None:
    # A V2 worker's inputs cycle from its own first one; OpenAI sends each once.
    async def main(loop: VirtualTimeLoop) -> list[int]:
        server = FakeServer(loop, service_s=0.01)
        await server.driver(requests=3, first=2, total=7).closed_loop(users=1)
        return [s.seq for s in server.log]

    assert run_virtual(main) == [2, 0, 1, 2, 0, 1, 2]
