"""The thread governor of CPU engines (``runtime/cpu_share.py``) over a fake clock and a fake
PSI counter, and the cores a process may use (``runtime/base.py``)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from slipstream.runtime import base
from slipstream.runtime.base import usable_cpu_count
from slipstream.runtime.cpu_share import (
    CALM,
    CROWDED,
    FIRST_WAIT_S,
    LONGEST_WAIT_S,
    WINDOW_S,
    AppliedThreads,
    GovernedThreads,
    ThreadGovernor,
    pressure_source,
)


class Host:
    """A clock and a stall counter that advance together: ``run(seconds, share)``."""

    def __init__(self) -> None:
        self.now = 100.0
        self.stalled_us = 0

    def run(self, seconds: float, share: float) -> None:
        self.now += seconds
        self.stalled_us += round(seconds * share * 1e6)

    def governor(self, most: int) -> ThreadGovernor:
        return ThreadGovernor(most, lambda: self.stalled_us, lambda: self.now)


def _steps(host: Host, governor: ThreadGovernor, seconds: float, share: float) -> list[int]:
    """Steps of 50 ms for ``seconds`` at ``share``: the counts the governor answered."""
    changes = []
    for _ in range(round(seconds / 0.05)):
        host.run(0.05, share)
        threads = governor.observe()
        if threads is not None:
            changes.append(threads)
    return changes


def test_crowded_cores_cost_a_thread_a_window_down_to_one() -> None:
    host = Host()
    governor = host.governor(4)
    assert _steps(host, governor, WINDOW_S * 0.8, 1.0) == []  # no window complete yet
    assert _steps(host, governor, 4 * WINDOW_S, 1.0) == [3, 2, 1]
    assert governor.threads == 1


def test_moderate_pressure_changes_nothing() -> None:
    host = Host()
    governor = host.governor(2)
    assert _steps(host, governor, 3 * FIRST_WAIT_S, (CALM + CROWDED) / 2) == []
    assert governor.threads == 2


def _calm_until_a_try(host: Host, governor: ThreadGovernor) -> float:
    """Calm steps until the governor tries one more thread: how long that took."""
    started = host.now
    while not _steps(host, governor, 0.05, 0.0):
        assert host.now - started < 2 * LONGEST_WAIT_S
    return host.now - started


def test_calm_cores_get_the_thread_back_and_a_crowding_try_waits_twice_as_long() -> None:
    host = Host()
    governor = host.governor(2)
    assert _steps(host, governor, 0.5, 0.5) == [1]
    # (The calm clock starts with the first whole calm window: within two of the start.)
    assert FIRST_WAIT_S <= _calm_until_a_try(host, governor) <= FIRST_WAIT_S + 2 * WINDOW_S
    # The try crowds the cores at once: back to one, and each such try doubles the wait.
    for wait in (2 * FIRST_WAIT_S, 4 * FIRST_WAIT_S):
        assert _steps(host, governor, WINDOW_S + 0.06, 0.6) == [1]
        assert wait <= _calm_until_a_try(host, governor) <= wait + 2 * WINDOW_S
    # This try stays calm for a window: kept, and the wait is back to FIRST_WAIT_S.
    assert _steps(host, governor, 1.0, 0.0) == [] and governor.threads == 2
    assert _steps(host, governor, 0.3, 0.6) == [1]
    assert FIRST_WAIT_S <= _calm_until_a_try(host, governor) <= FIRST_WAIT_S + 2 * WINDOW_S


def test_pressure_while_the_engine_rests_is_not_counted() -> None:
    host = Host()
    governor = host.governor(2)
    _steps(host, governor, 0.5, 0.0)
    governor.resting()
    host.run(5, 1.0)  # the engine idle, the host crowded meanwhile
    assert _steps(host, governor, 0.5, 0.0) == []
    assert governor.threads == 2


def test_long_steps_of_a_crowded_host_are_judged() -> None:
    host = Host()
    governor = host.governor(2)
    assert _steps(host, governor, 0.05, 0.9) == []
    host.run(3.0, 0.9)  # one step of 3 s
    assert governor.observe() == 1


def test_one_thread_has_nothing_to_give_up() -> None:
    host = Host()
    governor = host.governor(1)
    assert _steps(host, governor, 10, 1.0) == []
    assert _steps(host, governor, 10, 0.0) == []
    assert governor.threads == 1


def _on_new_thread(function: object) -> None:
    thread = threading.Thread(target=function)  # type: ignore[arg-type]
    thread.start()
    thread.join()


def test_a_count_is_applied_once_on_each_thread_that_runs() -> None:
    applied: list[tuple[str, int]] = []
    count = AppliedThreads(3, lambda n: applied.append((threading.current_thread().name, n)))

    def runs() -> None:
        for _ in range(3):
            count.before()
            count.after()

    runs()
    runs()
    assert applied == [("MainThread", 3)]
    _on_new_thread(runs)
    assert len(applied) == 2 and applied[1][0] != "MainThread" and applied[1][1] == 3


def test_governed_runs_apply_the_governors_count_where_they_run() -> None:
    host = Host()
    applied: list[int] = []
    runs = GovernedThreads(host.governor(2), applied.append, clock=lambda: host.now)

    def step(seconds: float, share: float) -> None:
        runs.before()
        host.run(seconds, share)
        runs.after()

    step(0.05, 1.0)
    assert applied == [2]
    for _ in range(round(2 * WINDOW_S / 0.05)):
        step(0.05, 1.0)  # back to back on crowded cores: a thread given up
    assert runs.threads == 1 and applied == [2, 1]
    for _ in range(round(2 * FIRST_WAIT_S / 0.05)):
        step(0.05, 0.0)
    assert runs.threads == 2 and applied == [2, 1, 2]


def test_a_pause_between_runs_is_rest() -> None:
    host = Host()
    runs = GovernedThreads(host.governor(2), lambda n: None, clock=lambda: host.now)
    for _ in range(10):
        runs.before()
        host.run(0.05, 0.0)
        runs.after()
        host.run(WINDOW_S * 1.5, 1.0)  # idle longer than a window, the host crowded
    assert runs.threads == 2
    # The same crowding between runs closer together is the runs' own.
    for _ in range(10):
        runs.before()
        host.run(0.05, 0.0)
        runs.after()
        host.run(WINDOW_S / 2, 1.0)
    assert runs.threads == 1


class GovernorMachine(RuleBasedStateMachine):
    """Any run of steps: the count stays within 1..most, it falls only after a crowded
    window, rises only after FIRST_WAIT_S or more of calm, one at a time."""

    @initialize(most=st.integers(1, 6))
    def start(self, most: int) -> None:
        self.host = Host()
        self.governor = self.host.governor(most)
        self.most = most
        self.calm_since = self.host.now
        self.window: list[tuple[float, float]] = []  # (seconds, share) since the last window

    @rule(
        seconds=st.floats(0.001, 0.4),
        share=st.sampled_from([0.0, 0.01, CALM / 2, 0.1, CROWDED + 0.01, 0.6, 1.0]),
        gap=st.booleans(),
    )
    def step(self, seconds: float, share: float, gap: bool) -> None:
        before = self.governor.threads
        if gap:  # the engine idle, the host crowded: the step starts a fresh window
            self.governor.resting()
            self.host.run(1.5, 1.0)
            self.host.run(seconds, share)
            assert self.governor.observe() is None and self.governor.threads == before
            self.window = []
            self.calm_since = self.host.now
            return
        self.host.run(seconds, share)
        self.window.append((seconds, share))
        answer = self.governor.observe()
        elapsed = sum(s for s, _ in self.window)
        if elapsed < WINDOW_S - 1e-9:
            assert answer is None
            return
        mean = sum(s * p for s, p in self.window) / elapsed
        self.window = []
        if answer is None:
            assert self.governor.threads == before
        else:
            assert answer == self.governor.threads and abs(answer - before) == 1
            if answer < before:
                assert mean > CROWDED - 1e-6
            else:
                assert mean < CALM + 1e-6
                assert self.host.now - self.calm_since >= FIRST_WAIT_S - 1e-9
        if mean >= CALM or answer is not None:
            self.calm_since = self.host.now

    @invariant()
    def within_bounds(self) -> None:
        assert 1 <= self.governor.threads <= self.most
        assert FIRST_WAIT_S <= self.governor._wait_s <= LONGEST_WAIT_S


GovernorMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60,
                                             deadline=None)  # fmt: skip
test_governor_states = GovernorMachine.TestCase


def test_this_hosts_pressure_counter_reads_and_grows() -> None:
    read = pressure_source()
    if not Path("/proc/pressure/cpu").exists():
        assert read is None
        return
    assert read is not None
    first = read()
    assert first >= 0 and read() >= first


def test_a_cgroup_cpu_quota_caps_the_cores(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    quota = tmp_path / "cpu.max"
    monkeypatch.setattr(base, "cgroup_file", lambda name: quota)
    affinity = len(os.sched_getaffinity(0))
    quota.write_text("max 100000\n")
    assert usable_cpu_count() == affinity
    quota.write_text("50000 100000\n")  # half a core: still one thread
    assert usable_cpu_count() == 1
    quota.write_text(f"{100000 * affinity + 1} 100000\n")  # a little over: affinity wins
    assert usable_cpu_count() == affinity
    quota.write_text("garbage\n")
    assert usable_cpu_count() == affinity
