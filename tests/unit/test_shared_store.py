"""The engine's budgets (:class:`LocalBackend`, what the front ends of ``--frontends N``
ask) against the GCRA that one process runs (:func:`slipstream.security.limits.gcra`):
any sequence of checks, several at once with a count, admits as many as that GCRA would
admit checking them one at a time, and leaves each bucket where it would. Rates, times and
costs are chosen so that every figure is exact in binary floating point."""

from __future__ import annotations

import asyncio
import math

from hypothesis import example, given
from hypothesis import strategies as st

from slipstream.security.limits import gcra
from slipstream.security.shared_store import LocalBackend, RateCheck, Shape

RATES_BURSTS = [(1.0, 10), (2.0, 3), (8.0, 1), (4.0, 40)]


def _shape(rate: float, burst: int, cost: int, force: bool) -> Shape:
    interval_us = 1e6 / rate
    return Shape(interval_us, burst * interval_us, cost, force, 0.0, 0, 0.0)


class _Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


checks = st.tuples(
    st.sampled_from(["a", "b"]),
    st.sampled_from(RATES_BURSTS),
    st.sampled_from([0, 1, 1, 1, 3]),  # cost: mostly requests, some tokens' admissions
    st.sampled_from([False, False, False, True]),  # forced: tokens charged after a response
    st.integers(1, 12),
    st.integers(0, 96).map(lambda n: n / 64),  # seconds since the last check
)


@given(st.lists(checks, max_size=40))
# A budget charged exactly full, then checked: not in debt, so admitted.
@example([("a", (8.0, 1), 1, True, 1, 0.0), ("a", (8.0, 1), 0, False, 1, 0.0)])
def test_the_engines_budget_admits_as_the_one_process_gcra(steps: list[tuple]) -> None:  # type: ignore[type-arg]
    clock = _Clock()
    backend = LocalBackend(clock)
    tats: dict[str, float] = {}
    for bucket, (rate, burst), cost, force, count, advance_s in steps:
        clock.now_s += advance_s
        now = clock.now_s
        ((admitted, reset_us),) = asyncio.run(
            backend.admit([RateCheck(bucket, _shape(rate, burst, cost, force), count)])
        )
        expected = 0
        for _ in range(count):
            verdict, tats[bucket] = gcra(tats.get(bucket, now), now, rate, burst, cost, force)
            expected += verdict.allowed
        assert admitted == expected
        tat = max(tats.get(bucket, now), now)
        assert reset_us == math.floor((tat - now) * 1e6)
