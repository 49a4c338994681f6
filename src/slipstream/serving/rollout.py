"""Rollouts: which version a request that names none runs on, and how that changes.

One controller per server. For each model it keeps a :class:`Route`, rebuilt whenever the
model's serving versions or its rollout change:

- a **progressive rollout** (``POST /v2/models/{m}/rollout``, ``slipstream rollout
  start``) routes by its state's weights, judges each analysis window (candidate against
  baseline, serving/rollout_analysis.py), steps up, promotes at the end or rolls back;
  its state persists (``REPO/<model>/rollout.json``, or Redis: serving/rollout_store.py)
  and resumes after a restart; it pauses, saying why, when its candidate or baseline
  stops serving;
- else a model's config.yaml ``rollout:`` gives static weights (A/B) and a shadow;
- else there is no route and the serving core resolves the newest version as before.

A request naming a version explicitly bypasses all of this. The serving core asks
:meth:`Rollouts.route` per request: two dict lookups and an identity check when nothing
changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from slipstream.config import format_validation_error
from slipstream.errors import InvalidRequest, ModelNotFound
from slipstream.observability.rollout_metrics import RolloutMetrics
from slipstream.serving.manager import ModelManager
from slipstream.serving.model import ModelVersion
from slipstream.serving.rollout_analysis import Verdict, VersionWindow, Window, judge
from slipstream.serving.rollout_split import Split, Splitter
from slipstream.serving.rollout_state import RolloutPlan, RolloutState
from slipstream.serving.rollout_store import FileStore, RolloutStore, StoreError
from slipstream.serving.shadow import RunCopies, ShadowMirror
from slipstream.types import InferRequest

logger = logging.getLogger(__name__)

_DEFAULT_STICKY_KEY = "route_key"
# Copies a rollout's shadow queue holds (config.yaml's shadow.queue for static shadows).
_ROLLOUT_SHADOW_QUEUE = 256


@dataclass(slots=True)
class Route:
    """How one model's requests that name no version pick one, now."""

    # The serving versions this route was built for: a reload makes a new dict.
    versions: dict[int, ModelVersion]
    # None: no split (the newest version serves, as without rollouts).
    splitter: Splitter | None
    # The request parameter whose value is the route key when no header gave one.
    sticky_key: str
    # Mirrors requests answered by other versions to its own.
    shadow: ShadowMirror | None
    # The running rollout's analysis window, which requests are recorded into.
    window: Window | None

    @property
    def idle(self) -> bool:
        return self.splitter is None and self.shadow is None

    def choose(self, request: InferRequest) -> str:
        """The version to run ``request`` on ("" for the default one)."""
        if self.splitter is None:
            return ""
        key = request.route_key
        if not key and request.parameters:
            value = request.parameters.get(self.sticky_key)
            key = "" if value is None else str(value)
        return self.splitter.choose(key)


class Rollouts:
    """Every model's route and rollout; see the module docstring."""

    def __init__(
        self,
        repository: Path,
        models: ModelManager,
        metrics: RolloutMetrics,
        run: RunCopies,
        store: RolloutStore | None = None,
    ) -> None:
        self._repository = repository
        self._store = store or FileStore(repository)
        self._models = models
        self._metrics = metrics
        self._run = run
        self._routes: dict[str, Route] = {}
        self._states: dict[str, RolloutState] = {}
        self._windows: dict[str, Window] = {}
        # The last baseline window large enough to judge against (see judge()).
        self._references: dict[str, VersionWindow | None] = {}
        self._verdicts: dict[str, Verdict] = {}
        self._shadows: dict[str, tuple[tuple[str, float, int], ShadowMirror]] = {}
        # model -> the running rollout whose windows a task judges, and that task.
        self._tasks: dict[str, tuple[RolloutState, asyncio.Task[None]]] = {}
        # Retired shadow mirrors closing in the background (kept referenced until done).
        self._closing: set[asyncio.Task[None]] = set()

    # -- routing (per request) -----------------------------------------------------------

    def route(self, name: str) -> Route | None:
        """The route of ``name``'s unversioned requests; None when the default applies."""
        versions = self._models.serving(name)
        route = self._routes.get(name)
        if route is None or route.versions is not versions:
            if not versions and name not in self._states:
                return None  # unknown or unloaded: nothing kept for a name never served
            route = self._build(name, versions)
        return None if route.idle else route

    def _build(self, name: str, versions: dict[int, ModelVersion]) -> Route:
        state = self._states.get(name)
        if state is not None and state.status == "running":
            self._pause_if_unserved(name, state, versions)
        config = versions[max(versions)].config.rollout if versions else None
        sticky_key = config.sticky_key if config else _DEFAULT_STICKY_KEY
        window = None
        shadow_spec: tuple[str, float, int] | None = None
        if state is not None:
            weights = state.weights()
            if state.status == "running":
                window = self._windows.setdefault(name, Window())
            if state.active and state.plan.shadow_share > 0:
                shadow_spec = (state.plan.candidate, state.plan.shadow_share, _ROLLOUT_SHADOW_QUEUE)
        elif config is not None:
            weights = config.weights
            if config.shadow is not None:
                shadow_spec = (config.shadow.version, config.shadow.share, config.shadow.queue)
        else:
            weights = {}
        split = Split.of({v: w for v, w in weights.items() if int(v) in versions})
        if shadow_spec is not None and int(shadow_spec[0]) not in versions:
            shadow_spec = None
        shadow = self._shadow(name, shadow_spec)
        if shadow is not None:
            shadow.window = window.shadow if window is not None else None
        route = Route(versions, Splitter(split) if split else None, sticky_key, shadow, window)
        self._routes[name] = route
        metrics = self._metrics
        if route.idle and state is None:
            # Series only for models that route: not one per model of the repository.
            for series in (metrics.weights, metrics.states, metrics.steps):
                series.pop(name, None)
            return route
        metrics.weights[name] = split.shares() if split else {}
        metrics.states[name] = state.status if state else "none"
        metrics.steps[name] = state.step if state else 0
        return route

    def _pause_if_unserved(
        self, name: str, state: RolloutState, versions: dict[int, ModelVersion]
    ) -> None:
        """Pause a running rollout whose candidate or baseline no longer serves (unloaded,
        removed from the repository): its windows could judge nothing, and without the
        baseline the unproven candidate takes all the traffic. Said in its status, its
        history, the log and ``slipstream_rollout_state``; resume once both serve again."""
        missing = _unserved(state, versions)
        if not missing:
            return
        if not versions and name in self._models.asleep():
            return  # unloaded for being idle: its next request loads both again
        state.pause_unserved(
            f"paused: {missing} of {name!r} stopped serving; load it again and resume, or abort"
        )
        logger.warning("model %s: rollout of version %s %s", name, state.plan.candidate,
                       state.reason)  # fmt: skip
        self._save(name, state)

    def _shadow(self, name: str, spec: tuple[str, float, int] | None) -> ShadowMirror | None:
        """The model's mirror for ``spec`` (version, share, queue), reused while unchanged."""
        current = self._shadows.get(name)
        if current is not None and current[0] == spec:
            return current[1]
        if current is not None:
            del self._shadows[name]
            # Close the old one's workers in the background: routing never awaits.
            closing = asyncio.get_running_loop().create_task(current[1].close())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
        if spec is None:
            return None
        version, share, queue = spec
        mirror = ShadowMirror(version, share, queue, self._run, self._metrics.shadow(name, version))
        self._shadows[name] = (spec, mirror)
        return mirror

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Read the persisted rollouts; resume the running ones."""
        try:
            documents = self._store.load_all()
        except StoreError as exc:
            logger.error("rollouts: %s; starting without them", exc)
            documents = {}
        for name, document in documents.items():
            try:
                state = RolloutState.from_json(document)
            except (ValueError, KeyError, TypeError) as exc:
                logger.error("model %s: ignoring its persisted rollout, which cannot be read: "
                             "%s", name, exc)  # fmt: skip
                continue
            self._states[name] = state
            logger.info("model %s: rollout of version %s is %s at step %d (%g%%)", name,
                        state.plan.candidate, state.status, state.step,
                        state.candidate_weight())  # fmt: skip
            if state.status == "running":
                self._start_analysis(name)

    async def close(self) -> None:
        tasks = [task for _, task in self._tasks.values()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.gather(*(mirror.close() for _, mirror in self._shadows.values()))

    # -- the admin API -------------------------------------------------------------------

    def status(self, name: str) -> dict[str, Any]:
        """What ``GET /v2/models/{name}/rollout`` answers."""
        if not (self._repository / name).is_dir():
            raise ModelNotFound(f"model {name!r} is not in the repository")
        route = self.route(name)
        weights = route.splitter.split.shares() if route and route.splitter else {}
        state = self._states.get(name)
        if state is None:
            return {"model": name, "status": "none", "weights": weights}
        verdict = self._verdicts.get(name)
        last = None if verdict is None else {
            "outcome": verdict.outcome, "reasons": list(verdict.reasons),
            "figures": verdict.figures,
        }  # fmt: skip
        return {**state.to_json(), "weights": weights, "candidate": state.plan.candidate,
                "baseline": state.plan.baseline, "last_verdict": last}  # fmt: skip

    async def act(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /v2/models/{name}/rollout``: {"action": "start", <plan>} or
        {"action": "pause" | "resume" | "promote" | "abort"}."""
        action = body.get("action")
        if action == "start":
            self._begin(name, {k: v for k, v in body.items() if k != "action"})
        else:
            state = self._states.get(name)
            if state is None or not isinstance(action, str):
                if not isinstance(action, str):
                    raise InvalidRequest(
                        f"action: expected one of start, pause, resume, promote, abort; "
                        f"got {action!r}"
                    )
                raise ModelNotFound(
                    f"model {name!r} has no rollout; start one with "
                    '{"action": "start", "candidate": "<version>"}'
                )
            if action in ("resume", "promote"):
                self._check_serving(name, state, action)
            state.act(action)
            self._changed(name, state)
        return self.status(name)

    def _check_serving(self, name: str, state: RolloutState, action: str) -> None:
        """Refuse to resume without both versions, or to promote a candidate that does
        not serve (it would get 100% of nothing)."""
        missing = _unserved(state, self._models.serving(name))
        if action == "promote" and missing and "candidate" not in missing:
            missing = ""
        if missing:
            raise InvalidRequest(
                f"action: cannot {action} the rollout of {name!r}: {missing} does not "
                "serve; load it first, or abort"
            )

    def _begin(self, name: str, fields: dict[str, Any]) -> None:
        versions = self._models.serving(name)
        if not versions:
            self._models.resolve(name)  # 404 / 503 naming why nothing serves
        try:
            plan = RolloutPlan.model_validate(fields)
        except ValidationError as exc:
            raise InvalidRequest(format_validation_error("rollout", exc)) from None
        current = self._states.get(name)
        if current is not None and current.active:
            raise InvalidRequest(
                f"action: model {name!r} has a {current.status} rollout of version "
                f"{current.plan.candidate}; promote or abort it first"
            )
        loaded = ", ".join(map(str, sorted(versions)))
        if int(plan.candidate) not in versions:
            raise InvalidRequest(
                f"candidate: version {plan.candidate} of {name!r} is not loaded (loaded: "
                f"{loaded}); serve both versions (version_policy: {{all: {{}}}}) and load it"
            )
        baseline = plan.baseline or self._serving_version(name, versions, plan.candidate)
        if not baseline or baseline == plan.candidate or int(baseline) not in versions:
            raise InvalidRequest(
                f"baseline: version {baseline or '(none)'} of {name!r} is not a loaded "
                f"version other than the candidate (loaded: {loaded})"
            )
        state = RolloutState.start(name, plan.model_copy(update={"baseline": baseline}))
        self._references.pop(name, None)
        self._verdicts.pop(name, None)
        self._changed(name, state)

    def _serving_version(self, name: str, versions: dict[int, ModelVersion], candidate: str) -> str:
        """What serves the requests naming no version now, other than ``candidate``."""
        route = self.route(name)
        if route is not None and route.splitter is not None:
            shares = route.splitter.split.shares()
            shares.pop(candidate, None)
            if shares:
                return max(shares, key=lambda v: shares[v])
        others = [v for v in versions if str(v) != candidate]
        return str(max(others)) if others else ""

    def _changed(self, name: str, state: RolloutState) -> None:
        """Persist, reroute and (re)start or stop the analysis after a transition."""
        self._states[name] = state
        self._save(name, state)
        self._windows[name] = Window()
        self._routes.pop(name, None)
        judged, task = self._tasks.get(name, (None, None))
        keep = (
            judged is state and state.status == "running" and task is not None and not task.done()
        )
        if task is not None and not keep and task is not asyncio.current_task():
            task.cancel()
        if state.status == "running" and not keep:
            self._start_analysis(name)
        self.route(name)  # metrics show the new weights at once

    def _save(self, name: str, state: RolloutState) -> None:
        """Persist the state (see serving/rollout_store.py); a failure is logged and the
        rollout goes on in memory, to be lost with the process."""
        try:
            self._store.save(name, state.to_json())
        except StoreError as exc:
            logger.error("model %s: the rollout's state is not persisted: %s", name, exc)

    # -- analysis ------------------------------------------------------------------------

    def _start_analysis(self, name: str) -> None:
        task = asyncio.get_running_loop().create_task(self._analyse(name))
        self._tasks[name] = (self._states[name], task)

    async def _analyse(self, name: str) -> None:
        """Judge a window every interval while the rollout runs."""
        state = self._states[name]
        while state.status == "running" and self._states.get(name) is state:
            await asyncio.sleep(state.plan.interval_s)
            self.route(name)  # pauses it when a version stopped serving, without traffic too
            if state.status != "running" or self._states.get(name) is not state:
                return
            window = self._windows.get(name) or Window()
            fresh = self._windows[name] = Window()
            route = self._routes.get(name)
            if route is not None:
                route.window = fresh
                if route.shadow is not None:
                    route.shadow.window = fresh.shadow
            verdict, self._references[name] = judge(state.plan, window, self._references.get(name))
            self._verdicts[name] = verdict
            self._metrics.count_verdict(name, verdict.outcome)
            detail = "; ".join(verdict.reasons) or _passed(verdict)
            if state.on_window(verdict.outcome, detail):
                logger.info("model %s: rollout window %s (%s); now %s at %g%%", name,
                            verdict.outcome, detail, state.status,
                            state.candidate_weight())  # fmt: skip
                self._changed(name, state)


def _unserved(state: RolloutState, versions: dict[int, ModelVersion]) -> str:
    """The rollout's versions that do not serve, in words ("" when both do)."""
    plan = state.plan
    missing = [f"the {role} (version {version})"
               for role, version in (("candidate", plan.candidate), ("baseline", plan.baseline))
               if int(version) not in versions]  # fmt: skip
    return " and ".join(missing)


def _passed(verdict: Verdict) -> str:
    f = verdict.figures
    text = (f"{f['candidate_requests']:.0f} candidate requests, error rate "
            f"{f['candidate_error_rate']:.2%} vs {f['baseline_error_rate']:.2%}")  # fmt: skip
    if "p99_ratio" in f:
        text += f", p99 x{f['p99_ratio']:.2f}"
    if f["shadow_compared"]:
        text += f", shadow agreement {f['shadow_agreement']:.2%}"
    return text
