"""The batcher as a state machine: random arrivals, cancellations, runs and clock ticks.

Hypothesis drives the real :class:`Batcher` on an event loop with a virtual clock and
instances whose runs finish only when the test says so, then checks after every step:

* every dispatched batch is what the policy says it should be, given what was queued at
  that instant: the highest-priority oldest request first, then the queued ones that
  share its shapes in (priority, arrival) order while they fit ``max_batch_size``, cut
  at the largest preferred size a prefix fills; a batch that is neither full nor
  preferred leaves before the queue delay only when there is no delay;
* no batch exceeds ``max_batch_size``, mixes shapes, or runs a request twice;
* the queue never stalls: with an instance free and a request queued, the delay timer is
  armed (and a dispatch follows within the delay);
* every request ends, with its own rows doubled, a timeout only after its deadline, a
  refusal only when the queue was full, or its cancellation; and when the test stops
  feeding it, the batcher drains everything within a bounded number of steps.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from slipstream.config import parse_model_config
from slipstream.errors import InvalidRequest, RequestTimeout, Unavailable
from slipstream.observability.metrics import ServerMetrics
from slipstream.observability.stats import ModelStatsRecorder
from slipstream.runtime.base import Backend, ModelSignature
from slipstream.scheduling.batcher import Batcher

# Loop iterations that settle one step: arrival -> deferred dispatch -> run -> answer.
_SETTLE_TURNS = 40
WIDTHS = (1, 2, 3)


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock moves only when the test advances it."""

    def __init__(self) -> None:
        super().__init__()
        self.now_s = 1000.0

    def time(self) -> float:
        return self.now_s


class ManualExecutor(Executor):
    """Runs a batch when it is dispatched, but answers only when :meth:`finish` says so."""

    def __init__(self, running: list[ManualExecutor]) -> None:
        self._running = running
        # Dispatched runs, oldest first: their future and (result, exception).
        self._held: list[tuple[Future[Any], tuple[Any, BaseException | None]]] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        try:
            outcome: tuple[Any, BaseException | None] = (fn(*args, **kwargs), None)
        except Exception as exc:
            outcome = (None, exc)
        self._held.append((future, outcome))
        self._running.append(self)
        return future

    def finish(self) -> None:
        future, (result, exc) = self._held.pop(0)
        self._running.remove(self)
        if exc is None:
            future.set_result(result)
        else:
            future.set_exception(exc)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        pass


@dataclass
class Req:
    rid: int
    rows: int
    width: int
    # 0-based level: 0 is the highest priority.
    level: int
    arrival_s: float
    deadline_s: float | None
    poison: bool
    # The queue was full when it arrived: a 503 is allowed.
    refusable: bool = False
    task: asyncio.Task[Any] | None = None
    cancelled: bool = False
    dispatched: bool = False
    ended: bool = False

    def inputs(self) -> np.ndarray:
        x = np.full((self.rows, self.width), float(self.rid), np.float32)
        if self.poison:
            x[:] = -1.0 - self.rid
        return x


def _rid_of(value: float) -> int:
    """The request id a row carries (poisoned rows carry -1 - id)."""
    return int(value) if value >= 0 else int(-value - 1)


class RecordingBackend(Backend):
    """Doubles ``x``; a negative value (a poisoned request) is a bad input."""

    name = "recording"

    def __init__(self, on_run: Callable[[np.ndarray], None]) -> None:
        self._on_run = on_run

    @classmethod
    def load(cls, path: Path, parameters: dict[str, str], instance_count: int) -> Backend:
        raise NotImplementedError

    def signature(self) -> ModelSignature:
        return ModelSignature((), ())

    def run(self, inputs: dict[str, np.ndarray], output_names: Sequence[str]) -> dict[str, Any]:
        x = inputs["x"]
        self._on_run(x)
        if np.any(x < 0):
            raise InvalidRequest("input 'x': negative values are not allowed")
        return {"y": x * 2}


class BatcherMachine(RuleBasedStateMachine):
    @initialize(
        instances=st.integers(1, 3),
        max_batch_size=st.integers(1, 8),
        preferred=st.lists(st.integers(1, 8), max_size=3),
        delay_us=st.sampled_from([0, 0, 200, 1000]),
        levels=st.integers(0, 3),
        max_queue_size=st.sampled_from([0, 3, 12]),
        default_timeout_us=st.sampled_from([0, 0, 500, 3000]),
        inline_us=st.sampled_from([0, 1_000_000]),
        level_policy=st.sampled_from(
            [
                None,
                None,
                {"max_queue_size": 2},
                {"default_timeout_microseconds": 700},
                {
                    "max_queue_size": 1,
                    "default_timeout_microseconds": 300,
                    "allow_timeout_override": False,
                },
            ]
        ),
    )
    def start(
        self,
        instances: int,
        max_batch_size: int,
        preferred: list[int],
        delay_us: int,
        levels: int,
        max_queue_size: int,
        default_timeout_us: int,
        inline_us: int,
        level_policy: dict[str, Any] | None,
    ) -> None:
        batching: dict[str, Any] = {
            "max_queue_delay_microseconds": delay_us,
            "preferred_batch_size": preferred,
            "priority_levels": levels,
            "default_timeout_microseconds": default_timeout_us,
            "inline_execution_max_microseconds": inline_us,
        }
        if max_queue_size:
            batching["max_queue_size"] = max_queue_size
        if levels and level_policy is not None:  # priority 1's own queue policy
            batching["priority_queue_policy"] = {1: level_policy}
        config = parse_model_config(
            {"max_batch_size": max_batch_size, "dynamic_batching": batching}, "test"
        )
        self.config = config
        self.loop = VirtualClockLoop()
        self.running: list[ManualExecutor] = []
        self.reqs: dict[int, Req] = {}
        self.ids = itertools.count(1)
        self.max_batch_size = max_batch_size
        self.preferred = set(preferred)
        self.delay_s = delay_us / 1e6
        self.levels = max(1, levels)
        self.max_queue_size = config.dynamic_batching.max_queue_size
        self.default_timeout_s = default_timeout_us / 1e6
        # Per 0-based level: (its queue's own bound or 0, default timeout s, override).
        self.policies = [(0, self.default_timeout_s, True)] * self.levels
        for level, policy in config.dynamic_batching.priority_queue_policy.items():
            self.policies[level - 1] = (
                policy.max_queue_size,
                policy.default_timeout_microseconds / 1e6,
                policy.allow_timeout_override,
            )
        metrics = ServerMetrics()
        # Policy violations seen at dispatch (raised there, they would only fail the batch).
        self.violations: list[str] = []
        # Requests of a batch that failed on a bad input: each is run again alone.
        self.reruns: set[int] = set()
        backends = [RecordingBackend(self._on_dispatch) for _ in range(instances)]
        self.instances = instances
        self.batcher = Batcher(
            config,
            backends,
            ["y"],
            metrics.for_model("m", "1"),
            ModelStatsRecorder("m", "1"),
            executor_factory=lambda: ManualExecutor(self.running),
            clock_ns=lambda: round(self.loop.now_s * 1e9),
        )

    # -- the policy, checked at each dispatch ----------------------------------------------

    def _on_dispatch(self, x: np.ndarray) -> None:
        try:
            self._check_dispatch(x)
        except AssertionError as exc:
            self.violations.append(str(exc))

    def _check_dispatch(self, x: np.ndarray) -> None:
        rids = list(dict.fromkeys(_rid_of(float(v)) for v in x[:, 0]))
        if len(rids) == 1 and rids[0] in self.reruns:
            self.reruns.discard(rids[0])  # isolating the bad request of a failed batch
            return
        batch = [self.reqs[rid] for rid in rids]
        if len(batch) > 1 and any(r.poison for r in batch):
            self.reruns.update(rids)
        assert len(x) <= self.max_batch_size, f"batch of {len(x)} rows"
        assert sum(r.rows for r in batch) == len(x)
        assert {r.width for r in batch} == {x.shape[1]}, "a batch mixed shapes"
        for r in batch:
            assert not r.dispatched, f"request {r.rid} ran twice"
            assert not r.ended, f"request {r.rid} ran after it ended"
            r.dispatched = True
        still_queued = [
            r for q in self.batcher._queues for p in q for r in [self.reqs[self._rid(p)]]
        ]
        expected = self._expected_batch(batch + still_queued)
        assert [r.rid for r in batch] == [r.rid for r in expected], (
            f"dispatched {[r.rid for r in batch]}, policy says {[r.rid for r in expected]}"
        )

    @staticmethod
    def _rid(pending: Any) -> int:
        return _rid_of(float(pending.inputs["x"][0, 0]))

    def _expected_batch(self, queued: list[Req]) -> list[Req]:
        order = sorted(queued, key=lambda r: (r.level, r.rid))
        head = order[0]
        plan, rows = [], 0
        for r in order:
            if r.width == head.width and rows + r.rows <= self.max_batch_size:
                plan.append(r)
                rows += r.rows
        prefix, cut = 0, 0
        for index, r in enumerate(plan, 1):
            prefix += r.rows
            if prefix in self.preferred:
                cut = index
        if cut:
            return plan[:cut]
        if self.delay_s and rows < self.max_batch_size:
            oldest = min(r.arrival_s for r in queued)
            assert self.loop.now_s >= oldest + self.delay_s - 1e-9, (
                "a batch that is neither full nor preferred left before the queue delay"
            )
        return plan

    # -- steps -----------------------------------------------------------------------------

    def settle(self) -> None:
        async def turns() -> None:
            for _ in range(_SETTLE_TURNS):
                await asyncio.sleep(0)

        self.loop.run_until_complete(turns())
        for r in self.reqs.values():
            if r.task is not None and r.task.done() and not r.ended:
                self._check_outcome(r)

    def _check_outcome(self, r: Req) -> None:
        r.ended = True
        task = r.task
        assert task is not None
        if task.cancelled():
            assert r.cancelled
            return
        exc = task.exception()
        if exc is None:
            assert r.dispatched and not r.poison
            np.testing.assert_array_equal(task.result()["y"], r.inputs() * 2)
        elif isinstance(exc, RequestTimeout):
            assert not r.dispatched, f"request {r.rid} ran and timed out"
            assert r.deadline_s is not None and self.loop.now_s >= r.deadline_s - 1e-9
        elif isinstance(exc, InvalidRequest):
            assert r.poison and r.dispatched, exc
        elif isinstance(exc, Unavailable):
            assert "is full" in exc.message
            assert r.refusable, f"request {r.rid} refused with a queue of room"
        else:
            raise AssertionError(f"request {r.rid} failed: {exc!r}")

    @rule(
        rows=st.integers(1, 8),
        width=st.sampled_from(WIDTHS),
        priority=st.integers(0, 3),
        timeout_us=st.sampled_from([0, 0, 0, 300, 2000]),
        poison=st.sampled_from([False] * 9 + [True]),
    )
    def arrive(self, rows: int, width: int, priority: int, timeout_us: int, poison: bool) -> None:
        rows = min(rows, self.max_batch_size)
        now = self.loop.now_s
        default_level = max(1, self.config.dynamic_batching.default_priority_level) - 1
        level = priority - 1 if 0 < priority <= self.levels else default_level
        level_bound, default_s, override = self.policies[level]
        # A request's own timeout may shorten its level's default (where the policy lets
        # it), never lengthen it.
        requested_s = timeout_us / 1e6 if override else 0.0
        timeout_s = min([t for t in (requested_s, default_s) if t], default=0.0)
        r = Req(
            rid=next(self.ids),
            rows=rows,
            width=width,
            level=level,
            arrival_s=now,
            deadline_s=now + timeout_s if timeout_s else None,
            poison=poison,
        )
        r.refusable = self.batcher.num_pending >= self.max_queue_size or bool(
            level_bound and len(self.batcher._queues[level]) >= level_bound
        )
        self.reqs[r.rid] = r
        key = ((width,),)
        r.task = self.loop.create_task(
            self.batcher.submit({"x": r.inputs()}, rows, key, priority, timeout_us)
        )
        self.settle()
        if r.refusable:  # a full queue (the model's, or its level's) refuses at once
            assert r.ended and isinstance(r.task.exception(), Unavailable), (
                f"request {r.rid} was queued past a full queue"
            )

    @precondition(lambda self: any(not r.ended for r in self.reqs.values()))
    @rule(pick=st.integers(0, 1000))
    def cancel(self, pick: int) -> None:
        live = [r for r in self.reqs.values() if not r.ended and r.task is not None]
        r = live[pick % len(live)]
        r.cancelled = True
        r.task.cancel()  # type: ignore[union-attr]
        self.settle()

    @precondition(lambda self: bool(self.running))
    @rule(pick=st.integers(0, 1000))
    def finish_run(self, pick: int) -> None:
        self.running[pick % len(self.running)].finish()
        self.settle()

    @rule(dt_us=st.integers(1, 4000))
    def advance(self, dt_us: int) -> None:
        self.loop.now_s += dt_us / 1e6
        self.settle()

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def dispatches_follow_the_policy(self) -> None:
        assert not getattr(self, "violations", []), self.violations

    @invariant()
    def no_request_waits_past_its_deadline(self) -> None:
        now = self.loop.now_s if hasattr(self, "loop") else 0.0
        for r in getattr(self, "reqs", {}).values():
            if r.deadline_s is not None and not r.dispatched and not r.ended:
                assert now < r.deadline_s + 1e-6, f"request {r.rid} queued past its deadline"

    @invariant()
    def never_stalls(self) -> None:
        if not hasattr(self, "batcher"):
            return
        free = self.instances - len(self.running)
        if free and self.batcher.num_pending:
            timer = self.batcher._delay_timer
            assert timer is not None, "an instance is free, a request waits, nothing is armed"
            oldest = min(
                r.arrival_s for r in self.reqs.values() if not r.dispatched and not r.ended
            )
            assert timer.when() <= oldest + self.delay_s + 1e-6

    def teardown(self) -> None:
        if not hasattr(self, "loop"):
            return
        try:
            # Stop feeding: everything must end within a bounded number of steps.
            for _ in range(4 * len(self.reqs) + 10):
                if all(r.ended for r in self.reqs.values()):
                    break
                while self.running:
                    self.running[0].finish()
                    self.settle()
                self.loop.now_s += self.delay_s + 0.005
                self.settle()
            stuck = [r.rid for r in self.reqs.values() if not r.ended]
            assert not stuck, f"requests {stuck} never ended"
            assert self.batcher.num_pending == 0
        finally:
            self.loop.close()


BatcherMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_batcher_state_machine = BatcherMachine.TestCase
