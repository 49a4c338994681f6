"""What a rollout measures over one analysis window, and the verdict it draws from it.

The candidate is compared with the baseline measured side by side over the same window
(not against fixed thresholds): the error-rate difference, the ratio of p99 latencies,
and, when requests are mirrored, the share of the candidate's shadow answers that agree
with the baseline's. A window with too few candidate requests is inconclusive (neither
a pass nor a failure). A p99 slower by less than ``min_p99_delta_ms`` passes whatever
the ratio: sub-millisecond latencies are doubled by a scheduler stall or two, which
says nothing of the candidate. When the baseline serves too little of a window to judge it (the
100% step), the last baseline window that was large enough stands in for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from slipstream.errors import ClientError, InvalidRequest, SlipstreamError
from slipstream.runtime.data_errors import refused
from slipstream.serving.rollout_state import RolloutPlan

# Latencies kept per version and window; beyond it the window's p99 is that of the first
# samples (bounded memory whatever the traffic).
_MAX_SAMPLES = 50_000
# Latencies per version a window needs for its p99 to rest on more than 3 requests.
_P99_SAMPLES = 300

Outcome = Literal["pass", "fail", "inconclusive"]
# How a runtime's refusal of a request's data begins (runtime/data_errors.py).
_REFUSED = refused("").message


def counts_against_version(error: SlipstreamError) -> bool:
    """Whether a request that failed with ``error`` counts as an error of the version
    that ran it. A request the client got wrong (malformed, a tensor the config does not
    take) fails on every version alike and is left out; data a version's model refused
    while running it counts, although it is answered 400 too: another version may serve
    it (a candidate with a smaller vocabulary refuses tokens the baseline takes)."""
    if not isinstance(error, ClientError):
        return True
    return isinstance(error, InvalidRequest) and error.message.startswith(_REFUSED)


@dataclass(slots=True)
class VersionWindow:
    """One version's requests in the current window."""

    requests: int = 0
    # Requests that failed other than by the client's fault (counts_against_version).
    errors: int = 0
    # Seconds each successful request took in the serving core.
    latencies_s: list[float] = field(default_factory=list)

    def record(self, ok: bool, seconds: float) -> None:
        self.requests += 1
        if not ok:
            self.errors += 1
        elif len(self.latencies_s) < _MAX_SAMPLES:
            self.latencies_s.append(seconds)

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def quantile_s(self, q: float, samples: int = 0) -> float:
        """The ``q`` quantile of the latencies, of ``samples`` evenly spread ones when
        fewer than all (two versions are compared at one sample count)."""
        latencies = self.latencies_s
        if not latencies:
            return 0.0
        if 0 < samples < len(latencies):
            latencies = [latencies[i * len(latencies) // samples] for i in range(samples)]
        return float(np.quantile(latencies, q))


def tail_quantile(samples: int) -> float:
    """The tail quantile ``samples`` latencies can measure: 0.99 from 300 on, else the one
    that leaves the 3 slowest above it (1 - 3/n), so one stalled request (a GC pause, a
    busy neighbour) cannot decide a small window; at least the median."""
    if samples >= _P99_SAMPLES:
        return 0.99
    return max(0.5, 1.0 - 3.0 / samples) if samples else 0.5


@dataclass(slots=True)
class ShadowWindow:
    """The shadow comparisons finished in the current window."""

    compared: int = 0
    agreed: int = 0
    failed: int = 0
    dropped: int = 0

    @property
    def agreement(self) -> float:
        return self.agreed / self.compared if self.compared else 1.0


@dataclass(slots=True)
class Window:
    """Everything one analysis window gathered; the serving core records into it."""

    versions: dict[str, VersionWindow] = field(default_factory=dict)
    shadow: ShadowWindow = field(default_factory=ShadowWindow)

    def version(self, version: str) -> VersionWindow:
        found = self.versions.get(version)
        if found is None:
            found = self.versions[version] = VersionWindow()
        return found


@dataclass(frozen=True, slots=True)
class Verdict:
    """The judgement of one window."""

    outcome: Outcome
    # Why, in words: each failed check, or what made it inconclusive.
    reasons: tuple[str, ...]
    # The figures judged: error rates, p99s, their ratio, agreement, request counts.
    figures: dict[str, float]


def judge(
    plan: RolloutPlan, window: Window, reference: VersionWindow | None
) -> tuple[Verdict, VersionWindow | None]:
    """The verdict on ``window``, and the baseline window later windows may judge against
    (``reference``: the last large-enough one, or None)."""
    base = window.versions.get(plan.baseline, VersionWindow())
    cand = window.versions.get(plan.candidate, VersionWindow())
    if base.requests >= plan.min_requests and base.latencies_s:
        reference = base
    shadow = window.shadow
    figures = {
        "baseline_requests": float(base.requests),
        "candidate_requests": float(cand.requests),
        "baseline_error_rate": base.error_rate,
        "candidate_error_rate": cand.error_rate,
        "shadow_compared": float(shadow.compared),
        "shadow_agreement": shadow.agreement,
    }
    if cand.requests < plan.min_requests:
        reason = f"{cand.requests} candidate requests, fewer than min_requests {plan.min_requests}"
        return Verdict("inconclusive", (reason,), figures), reference
    failed = []
    baseline_errors = (
        reference.error_rate
        if base.requests < plan.min_requests and reference
        else (base.error_rate)
    )
    increase = cand.error_rate - baseline_errors
    figures["error_rate_increase"] = increase
    if increase > plan.max_error_rate_increase:
        failed.append(
            f"error rate {cand.error_rate:.2%} vs baseline {baseline_errors:.2%} "
            f"(+{increase:.2%} > max_error_rate_increase {plan.max_error_rate_increase:.2%})"
        )
    if reference is not None and cand.latencies_s:
        samples = min(len(reference.latencies_s), len(cand.latencies_s))
        q = tail_quantile(samples)
        base_p99, cand_p99 = reference.quantile_s(q, samples), cand.quantile_s(q, samples)
        ratio = cand_p99 / base_p99 if base_p99 > 0 else 1.0
        delta_ms = (cand_p99 - base_p99) * 1e3
        figures |= {"baseline_p99_ms": base_p99 * 1e3, "candidate_p99_ms": cand_p99 * 1e3,
                    "p99_ratio": ratio, "p99_delta_ms": delta_ms, "tail_quantile": q}  # fmt: skip
        if ratio > plan.max_p99_ratio and delta_ms >= plan.min_p99_delta_ms:
            failed.append(
                f"p{q * 100:.4g} latency {cand_p99 * 1e3:.2f} ms vs baseline "
                f"{base_p99 * 1e3:.2f} ms over {samples} requests each "
                f"(x{ratio:.2f} > max_p99_ratio {plan.max_p99_ratio}, "
                f"+{delta_ms:.2f} ms >= min_p99_delta_ms {plan.min_p99_delta_ms:g})"
            )
    if shadow.compared >= max(plan.min_requests, 1) and shadow.agreement < plan.min_agreement:
        failed.append(
            f"shadow agreement {shadow.agreement:.2%} < min_agreement {plan.min_agreement:.2%}"
        )
    if failed:
        return Verdict("fail", tuple(failed), figures), reference
    return Verdict("pass", (), figures), reference
