"""Per-model-version queue and dynamic batcher.

One :class:`Batcher` owns a model version's instances and its queue. Its loop is event
driven rather than a polling task: every arrival and every finished batch calls
:meth:`Batcher._schedule`, which does three steps while an instance is free:

1. pick what to run (:meth:`_next_batch`): the highest-priority, oldest request and the
   queued ones after it that share its shapes, up to ``max_batch_size``; cut at the
   largest preferred batch size that they fill exactly, if any; with a queue delay and
   neither a full nor a preferred batch, wait (at most the delay) for more;
2. execute it on the instance's own thread (:func:`execute`: gather, run, split), or,
   for a lone request on a model that runs in microseconds, right on the event loop,
   where two thread hand-offs would cost more than the run itself;
3. resolve each request's future when the batch returns (:meth:`_finish`).

With ``max_queue_delay_microseconds = 0`` it never waits on purpose: an arrival is
dispatched at the end of the event-loop iteration that decoded it, so a lone request
runs at once, requests read in the same poll share a batch, and batches grow with load.
Queue policy: priority levels (1 is the highest), a per-request or default timeout after
which a queued request is failed and never run, and ``max_queue_size`` beyond which
arrivals are refused at once (503).

A Python model whose config has no dynamic_batching (Triton's default scheduler) gets
one request per run, as Triton hands its ``execute`` one.

Preferred sizes are a preference, as in Triton: a request of more rows than any of them
(up to ``max_batch_size``) still runs, and so does a request whose shapes no other shares.
Whenever an instance is free and a request is queued, :meth:`_next_batch` either returns
a batch or has the delay timer armed: the queue can never stall.

A traced request (:mod:`slipstream.observability.timestamps`) gets its run's times
recorded: queue start and end as it is submitted and answered, its batch's compute times
when the batch is done. An untraced one costs one context-variable read in ``submit``,
and a batch one check of an empty dict.

Time comes from ``clock_ns`` (the monotonic clock the event loop also uses); timers are
the loop's, so a test loop with a virtual clock, given the same clock, drives timeouts
and delays without waiting.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field

from slipstream.config import ModelConfig
from slipstream.errors import (
    RequestTimeout,
    Unavailable,
)
from slipstream.observability.metrics import ModelMetrics
from slipstream.observability.stats import ModelStatsRecorder
from slipstream.observability.timestamps import RECORDING, ModelRun
from slipstream.runtime.base import Backend, RequestContext
from slipstream.scheduling.execution import Arrays, BatchResult, Pending, as_served_error, execute

logger = logging.getLogger(__name__)


# Queued requests of other shapes (or too many rows) that one batch looks past, per
# priority level, before it stops growing: bounds the work of one dispatch.
_SCAN_LIMIT = 64
# The coarsest timer tick of the event loops we run on (uvloop's: 1 ms).
_TIMER_TICK_S = 0.001


def _instance_thread() -> Executor:
    return ThreadPoolExecutor(1, thread_name_prefix="slipstream-instance")


@dataclass(slots=True, eq=False)
class _Instance:
    backend: Backend
    # One thread per instance: runs never overlap on an instance, and the GIL-releasing
    # runtimes compute while the event loop goes on accepting requests.
    executor: Executor = field(default_factory=_instance_thread)
    # When its last batch ended on its thread, if requests were waiting when the loop
    # took that batch back; else 0. The next batch's start minus this is time the
    # instance (on a GPU, the device) sat idle with work queued.
    ready_ns: int = 0


class Batcher:
    """The queue and instances of one model version; see the module docstring."""

    def __init__(
        self,
        config: ModelConfig,
        instances: Sequence[Backend],
        output_names: Sequence[str],
        metrics: ModelMetrics,
        stats: ModelStatsRecorder,
        executor_factory: Callable[[], Executor] = _instance_thread,
        clock_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        """``executor_factory`` makes each instance's executor (one thread by default);
        ``clock_ns`` must tick with the event loop's ``time()``."""
        batching = config.dynamic_batching
        self._max_batch_size = max(1, config.max_batch_size or 0)
        self._batches = bool(config.max_batch_size)
        self._delay_ns = batching.max_queue_delay_microseconds * 1000
        self._preferred = frozenset(s for s in batching.preferred_batch_size if s > 0)
        self._largest_preferred = max(self._preferred, default=self._max_batch_size)
        self._max_queue_size = batching.max_queue_size
        self._levels = max(1, batching.priority_levels)
        # Per level (index 0 = priority 1): its queue's own bound (0: none), and its
        # requests' default timeout and override; priority_queue_policy's or the default's.
        default = (0, batching.default_timeout_microseconds, batching.allow_timeout_override)
        self._policies = [default] * self._levels
        for level, policy in batching.priority_queue_policy.items():
            self._policies[level - 1] = (
                policy.max_queue_size,
                policy.default_timeout_microseconds,
                policy.allow_timeout_override,
            )
        self._default_level = max(1, batching.default_priority_level) - 1
        self._queues: list[deque[Pending]] = [deque() for _ in range(self._levels)]
        self._num_pending = 0
        self._pending_rows = 0
        self._instances = [_Instance(backend, executor_factory()) for backend in instances]
        self._free = list(self._instances)
        self._busy = 0
        self._outputs = list(output_names)
        # Never inline for a backend that takes requests: its run is the user's code, which
        # may block or call back into the server (a Python model's BLS).
        takes_requests = any(backend.takes_requests for backend in instances)
        # Triton's default scheduler (no dynamic_batching): a Python model's execute gets
        # one request, which code written as `request = requests[0]` relies on. A model
        # that batches rows gets requests queued together as one run all the same: its
        # outputs are the same, and no request ever waits for another.
        self._one_request_per_run = takes_requests and config.default_scheduler
        self._inline_max_ns = (
            -1 if takes_requests else batching.inline_execution_max_microseconds * 1000
        )
        # -1 until measured: the first batch always runs on an instance thread.
        self._recent_run_ns = -1
        self._clock_ns = clock_ns
        self._metrics = metrics
        metrics.pending_requests = lambda: self._num_pending
        metrics.oldest_pending_age_s = self._oldest_pending_age_s
        self._stats = stats
        self._delay_timer: asyncio.TimerHandle | None = None
        # A dispatch is scheduled for the end of the current loop iteration.
        self._dispatch_soon = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False
        # The traced requests queued or running, and their runs (timestamps.py): empty
        # unless a request is traced, so that a batch's only cost of tracing is one check.
        self._runs: dict[Pending, ModelRun] = {}

    @property
    def num_pending(self) -> int:
        """Requests waiting in the queue (not yet on an instance)."""
        return self._num_pending

    async def submit(
        self,
        inputs: Arrays,
        rows: int,
        shape_key: tuple[tuple[int, ...], ...],
        priority: int = 0,
        timeout_us: int = 0,
        requests: int = 1,
        context: RequestContext | None = None,
    ) -> Arrays:
        """Queue one validated request and wait for its outputs (full batch-dim arrays).
        ``requests`` > 1: the inputs are that many client requests stacked, counted each
        in the statistics (queue time, compute shares) but queued and run as one.
        ``context``: the request's id and parameters, for backends that take requests.
        A traced request (:data:`RECORDING` set) gets a run of its own recorded."""
        recording = RECORDING.get()
        if recording is not None:
            run = recording.run(*self._metrics.labels)
            if run is not None:
                return await self._submit_traced(
                    run, inputs, rows, shape_key, priority, timeout_us, requests, context
                )
        pending = self._enqueue(inputs, rows, shape_key, priority, timeout_us, requests)
        pending.context = context
        try:
            return await pending.future
        except asyncio.CancelledError:
            # The client went away: a request still queued is dropped, never run.
            self._withdraw(pending)
            raise

    async def _submit_traced(
        self,
        run: ModelRun,
        inputs: Arrays,
        rows: int,
        shape_key: tuple[tuple[int, ...], ...],
        priority: int,
        timeout_us: int,
        requests: int,
        context: RequestContext | None,
    ) -> Arrays:
        """:meth:`submit` of a traced request: ``run`` gets its queue start and end here,
        its compute times when its batch is done (:meth:`_stamp`)."""
        try:
            pending = self._enqueue(inputs, rows, shape_key, priority, timeout_us, requests)
            run.queue_start_ns = time.monotonic_ns()
            pending.context = context
            self._runs[pending] = run
            try:
                return await pending.future
            except asyncio.CancelledError:
                self._withdraw(pending)
                raise
            finally:
                self._runs.pop(pending, None)
        finally:
            run.request_end_ns = time.monotonic_ns()

    def enqueue(
        self,
        inputs: Arrays,
        rows: int,
        shape_key: tuple[tuple[int, ...], ...],
        priority: int = 0,
        timeout_us: int = 0,
    ) -> asyncio.Future[Arrays]:
        """:meth:`submit` without a coroutine: queue the request and return the future
        its outputs settle (refusals raise here, as from ``submit``). Cancelling the
        future drops a request still queued."""
        pending = self._enqueue(inputs, rows, shape_key, priority, timeout_us, 1)
        pending.future.add_done_callback(functools.partial(self._dropped, pending))
        return pending.future

    def _dropped(self, pending: Pending, future: asyncio.Future[Arrays]) -> None:
        if future.cancelled():
            self._withdraw(pending)

    def _withdraw(self, pending: Pending) -> None:
        """The client went away: a request still queued is dropped, never run; queued or
        running, it counts as cancelled, as its statistics count it failed."""
        self._remove(pending)
        self._metrics.count_failure("cancelled")

    def _enqueue(
        self,
        inputs: Arrays,
        rows: int,
        shape_key: tuple[tuple[int, ...], ...],
        priority: int,
        timeout_us: int,
        requests: int,
    ) -> Pending:
        if self._closed:
            raise Unavailable("model is unloading; retry on another version", retry_after_s=1)
        if self._num_pending >= self._max_queue_size:
            self._metrics.count_failure("queue_full")
            raise Unavailable(
                f"queue is full ({self._max_queue_size} requests waiting); retry later",
                retry_after_s=1,
            )
        # 0, or a level the model does not have, is its default level, as in Triton: one
        # client's priority may reach models with fewer levels (or none).
        level = priority - 1 if 0 < priority <= self._levels else self._default_level
        most = self._policies[level][0]
        if most and len(self._queues[level]) >= most:
            self._metrics.count_failure("queue_full")
            raise Unavailable(
                f"the queue of priority level {level + 1} is full ({most} requests waiting, "
                "its priority_queue_policy's max_queue_size); retry later",
                retry_after_s=1,
            )
        loop = asyncio.get_running_loop()
        pending = Pending(
            inputs=inputs,
            rows=rows,
            shape_key=shape_key,
            level=level,
            future=loop.create_future(),
            enqueue_ns=self._clock_ns(),
            requests=requests,
        )
        timeout_us = self._timeout_us(timeout_us, level)
        if timeout_us:
            pending.deadline_ns = pending.enqueue_ns + timeout_us * 1000
            pending.timeout_handle = loop.call_later(timeout_us / 1e6, self._expire, pending)
        self._queues[pending.level].append(pending)
        self._num_pending += requests
        self._pending_rows += rows
        self._idle.clear()
        if not self._dispatch_soon:
            # Dispatch at the end of this loop iteration, not now: requests that arrived
            # together (read from several sockets in one poll) are still being decoded,
            # and they should join this batch rather than wait for the next one.
            self._dispatch_soon = True
            loop.call_soon(self._deferred_schedule)
        return pending

    async def close(self, timeout_s: float) -> None:
        """Stop taking requests, let queued and running ones finish (bounded), free all."""
        self._closed = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            logger.warning("unload: requests still running after %.1f s", timeout_s)
        for queue in self._queues:
            while queue:
                pending = queue.popleft()
                self._cancel_timeout(pending)
                if not pending.future.done():
                    pending.future.set_exception(Unavailable("model was unloaded"))
        self._num_pending = self._pending_rows = 0
        for instance in self._instances:
            instance.executor.shutdown(wait=True)
            instance.backend.close()

    # -- the loop: schedule, execute, finish ------------------------------------------

    def _deferred_schedule(self) -> None:
        self._dispatch_soon = False
        self._schedule()

    def _schedule(self) -> None:
        while self._free and self._num_pending:
            batch = self._next_batch()
            if not batch:
                # Waiting on purpose, never stalled: the delay timer calls back.
                assert self._delay_timer is not None, "queued requests and nothing armed"
                return
            instance = self._free.pop()
            self._busy += 1
            self._metrics.dispatch_count += 1
            if self._runs_inline(batch):
                # A lone request on a fast model: running it here saves the two thread
                # hand-offs (~30-70 us), more than the loop is blocked for.
                instance.ready_ns = 0
                self._finish(instance, batch, execute(instance.backend, batch, self._outputs))
                continue
            loop = asyncio.get_running_loop()
            done = loop.run_in_executor(
                instance.executor, execute, instance.backend, batch, self._outputs
            )
            done.add_done_callback(functools.partial(self._on_thread_done, instance, batch))

    def _runs_inline(self, batch: list[Pending]) -> bool:
        return (
            len(batch) == 1
            and self._busy == 1
            and not self._num_pending
            and 0 <= self._recent_run_ns <= self._inline_max_ns
        )

    def _next_batch(self) -> list[Pending]:
        """Take the next batch off the queue, or [] with the delay timer armed to wait.

        A preferred batch size that the queue fills is dispatched at once, even with no
        delay: for compute-bound models past their cache-friendly size, a batch of the
        preferred size finishes more rows per second than one big batch.
        """
        capacity = self._max_batch_size if self._batches else 1
        if self._one_request_per_run:
            return self._take(self._plan(capacity, 1))  # the head, whatever its rows
        # No prefix past the largest preferred size can be preferred: look that far first.
        batch = self._plan(capacity, min(self._largest_preferred, capacity))
        rows = 0
        cut = 0
        for index, pending in enumerate(batch, 1):
            rows += pending.rows
            if rows in self._preferred:
                cut = index
        if cut:
            return self._take(batch[:cut])
        if self._largest_preferred <= rows < capacity:  # stopped short, not out of requests
            batch = self._plan(capacity, capacity)
            rows = sum(pending.rows for pending in batch)
        if self._delay_ns and rows < capacity:
            oldest_ns = min(q[0].enqueue_ns for q in self._queues if q)
            wait_ns = oldest_ns + self._delay_ns - self._clock_ns()
            if wait_ns > 0:
                self._arm_delay_timer(wait_ns)
                return []
        return self._take(batch)

    def _plan(self, capacity: int, enough: int) -> list[Pending]:
        """The head request (highest priority, oldest) and those after it that can join.

        Joining means sharing the head's shapes and fitting in ``capacity`` rows; the head
        always fits (submit refused anything above max_batch_size). The plan stops growing
        at ``enough`` rows. Nothing leaves the queue here.
        """
        batch: list[Pending] = []
        rows = 0
        key: tuple[tuple[int, ...], ...] | None = None
        for queue in self._queues:
            skipped = 0
            for pending in queue:
                if rows >= enough or skipped >= _SCAN_LIMIT:
                    break
                if key is None:
                    key = pending.shape_key
                if pending.shape_key != key or rows + pending.rows > capacity:
                    skipped += 1
                    continue
                batch.append(pending)
                rows += pending.rows
            if rows >= enough:
                break
        return batch

    def _take(self, batch: list[Pending]) -> list[Pending]:
        """Move ``batch`` (from :meth:`_plan`) off the queues."""
        now_ns = self._clock_ns()
        rows = 0
        for pending in batch:
            self._cancel_timeout(pending)
            pending.dispatch_ns = now_ns
            rows += pending.rows
        # Usually the batch is the front of the queues; requests it looked past (other
        # shapes, too many rows) keep their places.
        popped = 0
        for queue in self._queues:
            while queue and queue[0].dispatch_ns:
                queue.popleft()
                popped += 1
        if popped < len(batch):
            for level, queue in enumerate(self._queues):
                self._queues[level] = deque(p for p in queue if not p.dispatch_ns)
        self._num_pending -= sum(pending.requests for pending in batch)
        self._pending_rows -= rows
        return batch

    def _on_thread_done(
        self, instance: _Instance, batch: list[Pending], done: asyncio.Future[BatchResult]
    ) -> None:
        try:
            result = done.result()
        except BaseException as exc:  # the worker itself failed (e.g. shut down)
            result = BatchResult(outcomes=[exc] * len(batch))
        if instance.ready_ns and result.started_ns:
            self._metrics.instance_idle.observe((result.started_ns - instance.ready_ns) / 1e9)
        self._finish(instance, batch, result)
        instance.ready_ns = result.ended_ns if self._num_pending else 0
        self._schedule()

    def _finish(self, instance: _Instance, batch: list[Pending], result: BatchResult) -> None:
        self._free.append(instance)
        self._busy -= 1
        self._record(batch, result)
        if self._runs:
            self._stamp(batch, result)
        for pending, outcome in zip(batch, result.outcomes, strict=True):
            if pending.future.done():  # cancelled while it ran
                continue
            if isinstance(outcome, BaseException):
                pending.future.set_exception(as_served_error(outcome))
            else:
                pending.future.set_result(outcome)
        if not self._busy and not self._num_pending:
            self._idle.set()

    def _record(self, batch: list[Pending], result: BatchResult) -> None:
        if not result.rows:
            return
        compute_ns = result.input_ns + result.infer_ns + result.output_ns
        # Smoothed run time decides whether the next lone batch may run inline.
        recent = self._recent_run_ns
        self._recent_run_ns = compute_ns if recent < 0 else (3 * recent + compute_ns) // 4
        requests = sum(pending.requests for pending in batch)
        self._stats.record_batch(
            batch_size=result.rows,
            num_requests=requests,
            input_ns=result.input_ns,
            infer_ns=result.infer_ns,
            output_ns=result.output_ns,
            end_ms=int(time.time() * 1000),
        )
        metrics = self._metrics
        metrics.execution_count += 1
        metrics.inference_count += result.rows
        metrics.batch_size.observe(result.rows)
        metrics.compute_duration.observe(compute_ns / 1e9)
        metrics.compute_request_ns += compute_ns * requests
        for pending in batch:
            queue_ns = pending.dispatch_ns - pending.enqueue_ns
            metrics.queue_duration.observe(queue_ns / 1e9, pending.requests)
            self._stats.record_queue(queue_ns * pending.requests, pending.requests)

    def _stamp(self, batch: list[Pending], result: BatchResult) -> None:
        """The compute times of the traced requests of ``batch``: the batch's, taken on
        the instance's thread by perf_counter_ns (the monotonic clock; timestamps.py)."""
        for pending in batch:
            run = self._runs.pop(pending, None)
            if run is None or not result.started_ns:  # its worker failed: never computed
                continue
            run.compute_start_ns = result.started_ns
            run.compute_input_end_ns = result.started_ns + result.input_ns
            run.compute_output_start_ns = run.compute_input_end_ns + result.infer_ns
            run.compute_end_ns = result.ended_ns

    # -- queue housekeeping -------------------------------------------------------------

    def _timeout_us(self, requested_us: int, level: int) -> int:
        """How long a request of ``level`` may wait in the queue (0: no limit). As Triton's
        queue policy (the level's own, else the default): a request's own timeout applies
        only where the policy allows an override, and only to shorten a default it has;
        where it has none, the request's applies."""
        _, default, override = self._policies[level]
        if not requested_us or not override:
            return default
        return min(requested_us, default) if default else requested_us

    def _expire(self, pending: Pending) -> None:
        pending.timeout_handle = None
        early_ns = pending.deadline_ns - self._clock_ns()
        if early_ns > 0:
            # A loop's timers can fire early: uvloop's count whole milliseconds, so a
            # 200 us timeout fires at the next turn, before the request could be
            # dispatched. Wait out the rest (at least a tick of such a loop).
            pending.timeout_handle = asyncio.get_running_loop().call_later(
                max(early_ns / 1e9, _TIMER_TICK_S), self._expire, pending
            )
            return
        if self._remove(pending):
            self._metrics.count_failure("timeout")
            waited_us = (self._clock_ns() - pending.enqueue_ns) // 1000
            pending.future.set_exception(
                RequestTimeout(f"request timed out after waiting {waited_us} us in the queue")
            )

    def _remove(self, pending: Pending) -> bool:
        """Drop a request that is still queued; False when it already left the queue."""
        if pending.dispatch_ns:
            return False
        try:
            self._queues[pending.level].remove(pending)
        except ValueError:
            return False
        self._cancel_timeout(pending)
        self._num_pending -= pending.requests
        self._pending_rows -= pending.rows
        if not self._busy and not self._num_pending:
            self._idle.set()
        return True

    def _oldest_pending_age_s(self) -> float:
        """Seconds the oldest queued request has waited; 0 when none waits."""
        heads = [q[0].enqueue_ns for q in self._queues if q]
        return (self._clock_ns() - min(heads)) / 1e9 if heads else 0.0

    @staticmethod
    def _cancel_timeout(pending: Pending) -> None:
        if pending.timeout_handle is not None:
            pending.timeout_handle.cancel()
            pending.timeout_handle = None

    def _arm_delay_timer(self, wait_ns: int) -> None:
        if self._delay_timer is not None:
            return
        loop = asyncio.get_running_loop()

        def fire() -> None:
            self._delay_timer = None
            self._schedule()

        self._delay_timer = loop.call_later(wait_ns / 1e9, fire)
