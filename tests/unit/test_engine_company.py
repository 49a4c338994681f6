"""When a front end's lone request waits for company (``engine/company.py``).

The rule on a fake clock: a client alone never makes it wait, requests held at once make
the next lone one wait until as many are in flight again, and that memory fades after
one to two windows. A stateful machine checks the rule against the history of arrivals.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from slipstream.engine.company import PROBE_EVERY, Company

WINDOW = 0.05


def _two_at_once(company: Company, now: float) -> None:
    """Two requests in flight at ``now``, both done since."""
    company.arrived(now)
    company.arrived(now)
    company.done()
    company.done()


def test_a_client_alone_never_waits() -> None:
    company = Company(0.001, WINDOW)
    now = 0.0
    for _ in range(1000):
        company.arrived(now)
        assert not company.expecting()
        company.done()
        now += 0.0003


def test_requests_held_at_once_make_a_lone_one_wait_until_as_many_are_in_flight() -> None:
    company = Company(0.001, WINDOW)
    for _ in range(3):
        company.arrived(0.0)
    for _ in range(3):
        company.done()
    company.arrived(0.001)
    assert company.expecting()  # one in flight where three were
    company.arrived(0.0012)
    assert company.expecting()
    company.arrived(0.0014)
    assert not company.expecting()  # as many as before: none more is due


def test_the_memory_of_a_peak_fades_after_one_to_two_windows() -> None:
    company = Company(0.001, WINDOW)
    _two_at_once(company, 0.0)
    company.arrived(0.06)  # the next window: the one before still counts
    assert company.expecting()
    company.done()
    company.arrived(0.115)  # two windows on: the peak of two is forgotten
    assert not company.expecting()
    company.done()
    company.arrived(0.5)  # long after: nothing remembered
    assert not company.expecting()


def _expecting(company: Company, now: float) -> None:
    """Two in flight at ``now``, then one: the front end expects company."""
    _two_at_once(company, now)
    company.arrived(now)
    assert company.expecting()
    company.done()


def test_holds_nobody_joins_stop_but_for_probes_and_joined_ones_bring_them_back() -> None:
    company = Company(0.001, WINDOW)
    _expecting(company, 0.0)
    company.arrived(0.0)
    failed = 0
    while failed < 100 and company.should_hold():  # each hold times out alone
        company.held(joined=False)
        failed += 1
    assert 3 <= failed <= 8  # a few, not forever
    asked = [company.should_hold() for _ in range(4 * PROBE_EVERY)]
    assert sum(asked) == 4  # one probe in PROBE_EVERY
    # (the refusal that ended the loop above was the first of PROBE_EVERY)
    assert asked.index(True) == PROBE_EVERY - 2
    for _ in range(20):  # the probes are joined now: holding comes back
        assert any(company.should_hold() for _ in range(PROBE_EVERY))
        company.held(joined=True)
    assert all(company.should_hold() for _ in range(10))
    assert company.joined_share > 0.9


def test_no_hold_never_waits() -> None:
    company = Company(0.0, WINDOW)
    _two_at_once(company, 0.0)
    company.arrived(0.001)
    assert not company.expecting()
    assert not company.should_hold()


def test_bad_arguments_and_a_done_without_a_request_are_refused() -> None:
    with pytest.raises(ValueError, match="most_s"):
        Company(-1.0)
    with pytest.raises(ValueError, match="window_s"):
        Company(0.001, 0.0)
    with pytest.raises(RuntimeError, match="without a request"):
        Company().done()


class CompanyMachine(RuleBasedStateMachine):
    """Random arrivals and completions on a fake clock. Right after each arrival (when
    the front end asks), the rule is checked against the history: it waits only for a
    peak seen within the last two windows, and never while as many requests are in
    flight as any arrival of the last window saw."""

    def __init__(self) -> None:
        super().__init__()
        self.company = Company(0.001, WINDOW)
        self.now = 0.0
        self.active = 0
        self.history: list[tuple[float, int]] = []  # (arrival time, in flight after it)
        self.refused = 0  # eligible requests refused a hold in a row

    @rule(gap=st.floats(0.0, 3 * WINDOW, allow_nan=False))
    def arrive(self, gap: float) -> None:
        self.now += gap
        self.company.arrived(self.now)
        self.active += 1
        self.history.append((self.now, self.active))
        # (a margin for the windows' edges in floating point)
        recent = [seen for at, seen in self.history if at > self.now - WINDOW + 1e-9]
        lately = [seen for at, seen in self.history if at > self.now - 2 * WINDOW - 1e-9]
        if self.company.expecting():
            assert self.active < max(lately)
        else:
            assert self.active >= max(recent)

    @rule(joined=st.booleans())
    def lone_request(self, joined: bool) -> None:
        """A turn's lone request asks whether to wait; a hold ends joined or not."""
        expecting = self.company.expecting()
        share = self.company.joined_share
        holds = self.company.should_hold()
        assert not holds or expecting  # never without company due
        if expecting and share >= 0.5:
            assert holds  # holds that pay go on
        if expecting and not holds:
            self.refused += 1
            assert self.refused < PROBE_EVERY  # a probe comes
        if holds:
            self.refused = 0
            self.company.held(joined)
        assert 0.0 <= self.company.joined_share <= 1.0

    @precondition(lambda self: self.active > 0)
    @rule()
    def finish(self) -> None:
        self.company.done()
        self.active -= 1

    @invariant()
    def counts_agree(self) -> None:
        assert self.company.active == self.active
        assert self.company.peak >= self.active  # the peak counts those in flight now


TestCompanyMachine = CompanyMachine.TestCase
TestCompanyMachine.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)
