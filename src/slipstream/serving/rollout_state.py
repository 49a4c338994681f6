"""A progressive rollout's plan and state machine: steps, verdicts, pause, promote, abort.

Pure data and transitions, no I/O: the controller (serving/rollout.py) feeds it window
verdicts and the admin API's actions, persists it after each change, and routes by its
``weights()``.

    running --pass--> next step ... --pass at the last step--> promoted
    running --fail (failure_limit times)--> rolled_back (candidate at 0%)
    running <--pause / resume--> paused
    running --the candidate or the baseline stops serving--> paused (with the reason)
    running | paused --promote--> promoted;  --abort--> aborted (candidate at 0%)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from slipstream.errors import InvalidRequest

Status = Literal["running", "paused", "promoted", "rolled_back", "aborted"]
ACTIVE: tuple[Status, ...] = ("running", "paused")
# Events a rollout's history keeps (inconclusive windows are counted in metrics only).
Event = Literal["start", "pass", "fail", "promote", "rollback", "pause", "resume", "abort"]


class RolloutPlan(BaseModel):
    """What ``slipstream rollout start`` / ``POST /v2/models/{m}/rollout`` asks for."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    candidate: str = Field(pattern=r"^[1-9][0-9]{0,17}$", description="the version rolled out")
    baseline: str = Field(
        "", pattern=r"^([1-9][0-9]{0,17})?$", description="compared against; default: serving"
    )
    steps: list[float] = Field(
        default_factory=lambda: [5.0, 25.0, 50.0, 100.0],
        min_length=1,
        description="candidate traffic share (percent) of each step, increasing",
    )
    interval_s: float = Field(60.0, gt=0, description="seconds per analysis window")
    failure_limit: int = Field(1, ge=1, description="failed windows before the rollback")
    min_requests: int = Field(20, ge=1, description="candidate requests to judge a window")
    max_error_rate_increase: float = Field(
        0.01, ge=0, le=1, description="candidate error rate minus the baseline's, at most"
    )
    max_p99_ratio: float = Field(1.5, gt=0, description="candidate p99 / baseline p99, at most")
    min_p99_delta_ms: float = Field(
        2.0, ge=0, description="a p99 this much slower or less passes, whatever the ratio"
    )
    min_agreement: float = Field(
        0.99, ge=0, le=1, description="share of shadow answers agreeing with the baseline's"
    )
    shadow_share: float = Field(
        0.0, ge=0, le=1, description="share of the baseline's requests mirrored to the candidate"
    )

    @field_validator("steps")
    @classmethod
    def _increasing(cls, steps: list[float]) -> list[float]:
        if any(not 0 < s <= 100 for s in steps) or steps != sorted(set(steps)):
            raise ValueError(f"{steps}: expected increasing percentages in (0, 100]")
        return steps

    @model_validator(mode="after")
    def _two_versions(self) -> RolloutPlan:
        if self.baseline == self.candidate:
            raise ValueError(f"baseline and candidate are both version {self.candidate}")
        return self


@dataclass(slots=True)
class RolloutState:
    """Where one model's rollout is; ``to_json`` / ``from_json`` persist it."""

    model: str
    plan: RolloutPlan
    status: Status = "running"
    # Index into plan.steps of the step running now (or when it ended).
    step: int = 0
    # Failed windows so far (the rollback comes at plan.failure_limit).
    failures: int = 0
    # Why it ended, or why the server paused it (a version stopped serving); "" else.
    reason: str = ""
    # Events, oldest first: {"at": unix seconds, "event", "step", "weight", "detail"}.
    history: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def start(cls, model: str, plan: RolloutPlan, now: float | None = None) -> RolloutState:
        state = cls(model, plan)
        state._log("start", f"candidate {plan.candidate} against {plan.baseline}", now)
        return state

    @property
    def active(self) -> bool:
        return self.status in ACTIVE

    def candidate_weight(self) -> float:
        if self.status == "promoted":
            return 100.0
        if self.status in ("rolled_back", "aborted"):
            return 0.0
        return self.plan.steps[self.step]

    def weights(self) -> dict[str, float]:
        """Traffic share (percent) per version for requests that name none."""
        share = self.candidate_weight()
        return {self.plan.baseline: 100.0 - share, self.plan.candidate: share}

    # -- transitions ---------------------------------------------------------------------

    def on_window(self, outcome: str, detail: str, now: float | None = None) -> bool:
        """Apply one window's verdict; True when the state changed (persist it)."""
        if self.status != "running" or outcome == "inconclusive":
            return False
        if outcome == "pass":
            self._log("pass", detail, now)
            if self.step + 1 < len(self.plan.steps):
                self.step += 1
            else:
                self._finish("promoted", "promote", "passed every step", now)
            return True
        self.failures += 1
        self._log("fail", detail, now)
        if self.failures >= self.plan.failure_limit:
            self._finish("rolled_back", "rollback", detail, now)
        return True

    def act(self, action: str, now: float | None = None) -> None:
        """pause, resume, promote or abort by hand; InvalidRequest when not possible now."""
        allowed = {"pause": ("running",), "resume": ("paused",),
                   "promote": ACTIVE, "abort": ACTIVE}  # fmt: skip
        if action not in allowed:
            raise InvalidRequest(
                f"action: {action!r} is not one of start, pause, resume, promote, abort"
            )
        if self.status not in allowed[action]:
            raise InvalidRequest(
                f"action: cannot {action} a rollout that is {self.status} "
                f"(possible when {' or '.join(allowed[action])})"
            )
        if action == "pause":
            self.status = "paused"
            self._log("pause", "by hand", now)
        elif action == "resume":
            self.status = "running"
            self.reason = ""
            self._log("resume", "by hand", now)
        elif action == "promote":
            self._finish("promoted", "promote", "promoted by hand", now)
        else:
            self._finish("aborted", "abort", "aborted by hand", now)

    def pause_unserved(self, reason: str, now: float | None = None) -> None:
        """Pause a running rollout one of whose versions stopped serving: no window can
        judge it, and a missing baseline leaves the candidate all the traffic. Resume
        and abort then work as after a pause by hand."""
        self.status = "paused"
        self.reason = reason
        self._log("pause", reason, now)

    def _finish(self, status: Status, event: Event, reason: str, now: float | None) -> None:
        self.status = status
        self.reason = reason
        self._log(event, reason, now)

    def _log(self, event: Event, detail: str, now: float | None) -> None:
        self.history.append({
            "at": round(time.time() if now is None else now, 3), "event": event,
            "step": self.step, "weight": self.candidate_weight(), "detail": detail,
        })  # fmt: skip

    # -- persistence ---------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model, "plan": self.plan.model_dump(), "status": self.status,
            "step": self.step, "failures": self.failures, "reason": self.reason,
            "history": self.history,
        }  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RolloutState:
        """The state ``to_json`` wrote; ValueError (pydantic's included) when it is not."""
        plan = RolloutPlan.model_validate(data["plan"])
        status = data["status"]
        if status not in ("running", "paused", "promoted", "rolled_back", "aborted"):
            raise ValueError(f"status: {status!r} is not a rollout status")
        step = int(data["step"])
        if not 0 <= step < len(plan.steps):
            raise ValueError(f"step: {step} is not a step of {plan.steps}")
        return cls(str(data["model"]), plan, status, step, int(data["failures"]),
                   str(data.get("reason", "")), list(data.get("history", [])))  # fmt: skip
