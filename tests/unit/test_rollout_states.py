"""The rollout state machine under random verdicts and actions (hypothesis, stateful).

A model of the rules runs beside the real :class:`RolloutState`: after every window
verdict or manual action the two agree on status, step, failures and weights; the
candidate's weight is a step of the plan while active, 100 once promoted and 0 once
rolled back or aborted; a finished rollout never changes again; every change survives a
to_json / from_json round trip (what a restarted server reads).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from pydantic import ValidationError

from slipstream.errors import InternalError, InvalidRequest, ModelNotFound, Unavailable
from slipstream.runtime.data_errors import refused
from slipstream.serving.rollout_analysis import (
    VersionWindow,
    Window,
    counts_against_version,
    judge,
)
from slipstream.serving.rollout_state import RolloutPlan, RolloutState

ACTIONS = ("pause", "resume", "promote", "abort")


class RolloutMachine(RuleBasedStateMachine):
    @initialize(
        steps=st.lists(st.integers(1, 100), min_size=1, max_size=5, unique=True).map(sorted),
        failure_limit=st.integers(1, 3),
    )
    def start(self, steps: list[int], failure_limit: int) -> None:
        plan = RolloutPlan(candidate="2", baseline="1", steps=[float(s) for s in steps],
                           failure_limit=failure_limit)  # fmt: skip
        self.state = RolloutState.start("m", plan, now=0.0)
        self.status, self.step, self.failures = "running", 0, 0
        self.steps, self.limit = steps, failure_limit

    @rule(outcome=st.sampled_from(["pass", "fail", "inconclusive"]))
    def window(self, outcome: str) -> None:
        changed = self.state.on_window(outcome, "test")
        expect_change = self.status == "running" and outcome != "inconclusive"
        assert changed == expect_change
        if not expect_change:
            return
        if outcome == "pass":
            if self.step + 1 < len(self.steps):
                self.step += 1
            else:
                self.status = "promoted"
        else:
            self.failures += 1
            if self.failures >= self.limit:
                self.status = "rolled_back"

    @rule(action=st.sampled_from(ACTIONS))
    def act(self, action: str) -> None:
        allowed = {"pause": ("running",), "resume": ("paused",),
                   "promote": ("running", "paused"), "abort": ("running", "paused")}  # fmt: skip
        if self.status not in allowed[action]:
            with pytest.raises(InvalidRequest):
                self.state.act(action)
            return
        self.state.act(action)
        self.status = {"pause": "paused", "resume": "running", "promote": "promoted",
                       "abort": "aborted"}[action]  # fmt: skip

    @invariant()
    def agrees_with_the_model(self) -> None:
        state = self.state
        assert (state.status, state.step, state.failures) == (
            self.status, self.step, self.failures)  # fmt: skip
        weight = state.candidate_weight()
        if self.status in ("running", "paused"):
            assert weight == self.steps[self.step]
        else:
            assert weight == (100.0 if self.status == "promoted" else 0.0)
            assert state.reason
        assert sum(state.weights().values()) == pytest.approx(100.0)

    @invariant()
    def survives_a_restart(self) -> None:
        again = RolloutState.from_json(json.loads(json.dumps(self.state.to_json())))
        assert again.to_json() == self.state.to_json()


TestRolloutMachine = RolloutMachine.TestCase
TestRolloutMachine.settings = settings(max_examples=150, stateful_step_count=25, deadline=None)


def window(base: tuple[int, int, float], cand: tuple[int, int, float]) -> Window:
    """A window of (requests, errors, latency in seconds) for baseline 1 and candidate 2."""
    w = Window()
    for version, (requests, errors, latency) in (("1", base), ("2", cand)):
        for i in range(requests):
            w.version(version).record(i >= errors, latency)
    return w


PLAN = RolloutPlan(candidate="2", baseline="1", min_requests=50)


def test_a_healthy_candidate_passes() -> None:
    verdict, _ = judge(PLAN, window((500, 0, 0.001), (100, 0, 0.0011)), None)
    assert verdict.outcome == "pass"


def test_errors_fail_against_the_baseline_not_a_fixed_threshold() -> None:
    verdict, _ = judge(PLAN, window((500, 25, 0.001), (100, 5, 0.001)), None)
    assert verdict.outcome == "pass"  # both at 5%: the candidate is no worse
    verdict, _ = judge(PLAN, window((500, 0, 0.001), (100, 5, 0.001)), None)
    assert verdict.outcome == "fail" and "error rate" in verdict.reasons[0]


def test_a_slow_candidate_fails_on_p99_and_too_few_requests_is_inconclusive() -> None:
    verdict, reference = judge(PLAN, window((500, 0, 0.001), (100, 0, 0.003)), None)
    assert verdict.outcome == "fail" and "max_p99_ratio" in verdict.reasons[0]
    assert verdict.figures["p99_ratio"] == pytest.approx(3.0)
    verdict, _ = judge(PLAN, window((500, 0, 0.001), (49, 0, 0.003)), None)
    assert verdict.outcome == "inconclusive"
    # At 100% the baseline gets nothing: the last large-enough baseline window judges.
    assert isinstance(reference, VersionWindow)
    verdict, _ = judge(PLAN, window((0, 0, 0.0), (100, 0, 0.003)), reference)
    assert verdict.outcome == "fail"


def test_the_plan_names_the_field_it_refuses() -> None:
    with pytest.raises(ValidationError, match="steps"):
        RolloutPlan(candidate="2", steps=[50.0, 25.0])
    with pytest.raises(ValidationError, match="candidate"):
        RolloutPlan(candidate="x")
    with pytest.raises(ValidationError, match="both version 2"):
        RolloutPlan(candidate="2", baseline="2")


def test_p99s_are_compared_at_the_same_sample_count() -> None:
    # One distribution; the canary has 30 requests, the baseline 3000. The p99 of 30
    # samples sits near their maximum, a lower quantile than the p99 of 3000: compared
    # as they are, the canary would look faster; at one sample count, neither does.
    rng = np.random.default_rng(0)
    plain, fair = [], []
    for _ in range(200):
        base, cand = VersionWindow(), VersionWindow()
        for value in rng.exponential(0.001, 3000):
            base.record(True, float(value))
        for value in rng.exponential(0.001, 30):
            cand.record(True, float(value))
        plain.append(cand.quantile_s(0.99) / base.quantile_s(0.99))
        fair.append(cand.quantile_s(0.99, 30) / base.quantile_s(0.99, 30))
    assert np.median(plain) < 0.9
    assert np.median(fair) == pytest.approx(1.0, abs=0.1)


def test_one_stalled_request_does_not_decide_a_small_window() -> None:
    # 30 canary requests as fast as the baseline's, one of them stalled for 50 ms.
    latencies = [0.005] * 29 + [0.05]
    w = window((300, 0, 0.005), (0, 0, 0.0))
    for latency in latencies:
        w.version("2").record(True, latency)
    small = PLAN.model_copy(update={"min_requests": 20})
    verdict, _ = judge(small, w, None)
    assert verdict.outcome == "pass", verdict
    assert verdict.figures["tail_quantile"] == pytest.approx(0.9)
    # Every request 3x slower fails whatever the quantile.
    verdict, _ = judge(small, window((300, 0, 0.005), (30, 0, 0.015)), None)
    assert verdict.outcome == "fail"


def test_a_p99_slower_by_less_than_min_p99_delta_ms_never_fails_on_its_own() -> None:
    # Sub-millisecond requests: a few scheduler stalls put one version's p99 at 2.5x the
    # other's, 1.5 ms apart, which says nothing of the model (byte-identical versions
    # were rolled back so). The default floor is 2 ms.
    verdict, _ = judge(PLAN, window((500, 0, 0.001), (100, 0, 0.0025)), None)
    assert verdict.outcome == "pass", verdict
    assert verdict.figures["p99_ratio"] == pytest.approx(2.5)
    assert verdict.figures["p99_delta_ms"] == pytest.approx(1.5)
    # Past the floor the ratio decides; a floor of 0 leaves the ratio alone.
    verdict, _ = judge(PLAN, window((500, 0, 0.001), (100, 0, 0.004)), None)
    assert verdict.outcome == "fail" and "min_p99_delta_ms 2" in verdict.reasons[0]
    ratio_only = PLAN.model_copy(update={"min_p99_delta_ms": 0.0})
    verdict, _ = judge(ratio_only, window((500, 0, 0.001), (100, 0, 0.0025)), None)
    assert verdict.outcome == "fail"


def test_a_runtime_refusal_counts_against_its_version_and_a_malformed_request_does_not() -> None:
    assert counts_against_version(refused("Gather node 'g': indices element out of data bounds"))
    assert counts_against_version(InternalError("model execution failed"))
    assert counts_against_version(Unavailable("queue is full"))
    assert not counts_against_version(InvalidRequest("input 'INPUT0': expected shape [-1, 4]"))
    assert not counts_against_version(ModelNotFound("model 'm' has no version 3"))


def test_a_rollout_paused_for_a_missing_version_resumes_as_after_a_pause_by_hand() -> None:
    state = RolloutState.start("m", RolloutPlan(candidate="2", baseline="1"), now=0.0)
    state.pause_unserved("paused: the candidate (version 2) of 'm' stopped serving")
    assert (state.status, state.history[-1]["event"]) == ("paused", "pause")
    assert "candidate" in state.reason
    again = RolloutState.from_json(json.loads(json.dumps(state.to_json())))
    assert again.reason == state.reason  # a restart keeps saying why
    state.act("resume")
    assert (state.status, state.reason) == ("running", "")
