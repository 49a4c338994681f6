"""Rate limits shared by several server processes: the checks of every process go to one
place that holds each key's budget, a :class:`Backend`. Redis is one
(:mod:`slipstream.security.redis_store`, for replicas); the engine process of
``--frontends N`` is the other (:class:`LocalBackend` there, reached over the engine link
by :mod:`slipstream.engine.limit_store`), so the front ends of one server share each key's
budget without a Redis.

:class:`SharedStore` is the process's side, whatever the backend:

- Checks go to the backend together: one call at a time carries every check that queued
  meanwhile, and identical checks (one key's requests) travel as one entry with a count,
  of which the backend admits as many as the bucket holds, in order. Under load a request
  so costs a small share of one call, not a call.
- A fast key does not need a call a request: where a key's rate is high, a call asks for
  a *lease* beyond the checks at hand, up to ``LEASE_S`` of the key's rate, and the tokens
  granted beyond them are spent by this process's next requests without asking
  (:meth:`SharedStore.take_now`). The backend has counted them already, so the shared
  budget holds; a lease unspent after the time it stands for is dropped (admitting less,
  never more). A key under ``2 / LEASE_S`` requests/s gets no lease.
- Requests in flight are counted per process in the backend; a process holding some says
  so every ``gone_after_s / 5``, and one silent for ``gone_after_s`` (killed, or cut off)
  stops counting.
- After a failed call the store answers StoreUnavailable without asking for
  ``_RETRY_AFTER_FAILURE_S``, so an outage costs each request nothing but a check.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from slipstream.security.limits import LimitStore, StoreUnavailable, Verdict

# A process holding requests in flight says so five times in this; one silent for it (it
# stopped, or lost the backend) no longer counts.
GONE_S = 5.0
_RETRY_AFTER_FAILURE_S = 0.5
# Most entries sent in one call.
_MAX_ENTRIES_PER_CALL = 512
# A lease is at most this much of a key's rate (and at most its burst).
LEASE_S = 0.005


@dataclass(frozen=True, slots=True, eq=False)
class Shape:
    """One kind of check (a rate, burst, cost and whether it is forced), worked out once:
    one object per kind, compared by identity."""

    interval_us: float  # the time one unit of cost takes up in the bucket
    capacity_us: float  # how far ahead of now the bucket may run: the burst's time
    cost: int  # units one check takes (0: a check that takes nothing, tokens' admission)
    force: bool  # taken even into debt, never refused
    wait_offset_us: float  # a refused check's wait: its reset time plus this
    lease: int  # tokens asked for beyond the checks at hand (0: no lease)
    lease_s: float  # how long leased tokens may be spent


@dataclass(frozen=True, slots=True)
class RateCheck:
    """``count`` checks of one shape on ``bucket``, asked together."""

    bucket: str
    shape: Shape
    count: int


@dataclass(frozen=True, slots=True)
class Entry:
    """``count`` requests asking to be in flight on ``bucket``, whose limit is ``limit``."""

    bucket: str
    limit: int
    count: int


class Backend(ABC):
    """Where the shared budgets live. Each method is one atomic step for every process
    using it; any exception means the backend could not answer."""

    @abstractmethod
    async def admit(self, checks: list[RateCheck]) -> list[tuple[int, int]]:
        """Per check, in order: how many of its ``count`` were admitted (the first ones),
        and the bucket's reset time in microseconds after them (GCRA: see
        :func:`slipstream.security.limits.gcra`)."""

    @abstractmethod
    async def enter(self, process: str, gone_ms: int, entries: list[Entry]) -> list[int]:
        """``process`` is alive; per entry, how many of its requests entered (every
        process's requests in flight together stay within the limit; a process silent
        for ``gone_ms`` counts none)."""

    @abstractmethod
    async def hold(self, process: str, changes: dict[str, int]) -> None:
        """``process`` is alive, and its requests in flight on each bucket changed by so
        many (releases, requests admitted while the backend could not be asked)."""

    async def close(self) -> None:  # noqa: B027 - a backend may hold nothing
        """Release connections."""


class LocalBackend(Backend):
    """The budgets in this process's memory, for the other processes of one server (the
    engine process answers its front ends with one). The same steps as Redis's scripts."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # Bucket -> its theoretical arrival time, us (one per key and limit: as many as
        # the keys, so nothing is dropped).
        self._tats: dict[str, float] = {}
        # Bucket -> process -> its requests in flight there; process -> its last sign, ms.
        self._holders: dict[str, dict[str, int]] = {}
        self._alive: dict[str, float] = {}

    async def admit(self, checks: list[RateCheck]) -> list[tuple[int, int]]:
        now = self._clock() * 1e6
        answers = []
        for check in checks:
            shape = check.shape
            tat = max(self._tats.get(check.bucket, now), now)
            admitted = check.count
            if not shape.force:
                if shape.cost == 0:
                    admitted = 0 if tat - now > shape.capacity_us else admitted
                else:
                    room = (shape.capacity_us - (tat - now)) / (shape.cost * shape.interval_us)
                    admitted = min(max(math.floor(room + 1e-9), 0), check.count)
            new_tat = tat + admitted * shape.cost * shape.interval_us
            if admitted > 0 and shape.cost > 0:
                self._tats[check.bucket] = new_tat
            answers.append((admitted, math.floor(new_tat - now)))
        return answers

    async def enter(self, process: str, gone_ms: int, entries: list[Entry]) -> list[int]:
        now = self._clock() * 1e3
        self._alive[process] = now
        answers = []
        for entry in entries:
            holders = self._holders.setdefault(entry.bucket, {})
            total = 0
            for holder, count in list(holders.items()):
                if now - self._alive.get(holder, 0.0) > gone_ms:
                    del holders[holder]
                    self._alive.pop(holder, None)
                else:
                    total += count
            entered = min(max(entry.limit - total, 0), entry.count)
            if entered:
                holders[process] = holders.get(process, 0) + entered
            answers.append(entered)
        return answers

    async def hold(self, process: str, changes: dict[str, int]) -> None:
        self._alive[process] = self._clock() * 1e3
        for bucket, change in changes.items():
            holders = self._holders.setdefault(bucket, {})
            count = holders.get(process, 0) + change
            if count > 0:
                holders[process] = count
            else:
                holders.pop(process, None)
                if not holders:
                    del self._holders[bucket]


# (bucket, shape) -> the futures of the checks waiting on it.
_Entries = dict[tuple[str, Shape], list["asyncio.Future[Verdict]"]]


class _Lease:
    __slots__ = ("tokens", "until")

    def __init__(self, tokens: int, until: float) -> None:
        self.tokens = tokens
        self.until = until


class SharedStore(LimitStore):
    """GCRA buckets and requests in flight kept by ``backend`` for every process using it
    (see the module docstring). ``gone_after_s``: how long a process holding requests in
    flight may stay silent (stopped, or cut off) before they no longer count."""

    def __init__(self, backend: Backend, name: str, gone_after_s: float = GONE_S) -> None:
        self._backend = backend
        self._name = name  # what the errors call the backend ("Redis", "the engine")
        self._gone_ms = round(gone_after_s * 1000)
        self._hold_every_s = gone_after_s / 5
        self._down_until = 0.0
        self._pending: _Entries = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # A flush is scheduled or a call is under way: new checks just queue.
        self._busy = False
        # (rate, burst, cost, force) -> its shape, worked out once.
        self._shapes: dict[tuple[float, int, int, bool], Shape] = {}
        # Bucket -> tokens the backend granted this process ahead of its requests.
        self._leases: dict[str, _Lease] = {}
        # Requests in flight: this process's name in the backend, its own counts (bucket
        # -> requests), and the changes to them the backend has not been told.
        self._process = uuid.uuid4().hex
        self._held: dict[str, int] = {}
        self._untold: dict[str, int] = {}
        self._holding: asyncio.Task[None] | None = None
        # Requests waiting to enter, by bucket: the limit and their futures. They go to
        # the backend as one call a turn of the loop (the next once one is under way).
        self._entering: dict[str, tuple[int, list[asyncio.Future[bool]]]] = {}
        self._entering_busy = False
        self._telling = False

    def take_now(self, bucket: str, rate_per_s: float, burst: int, cost: int) -> bool:
        """Admit one check from this process's lease on ``bucket``, without a call; False
        when there is none (then :meth:`acquire` asks the backend)."""
        lease = self._leases.get(bucket)
        if lease is None or cost != 1:
            return False
        if time.monotonic() >= lease.until:
            del self._leases[bucket]
            return False
        lease.tokens -= 1
        if not lease.tokens:
            del self._leases[bucket]
        return True

    def _shape(self, rate_per_s: float, burst: int, cost: int, force: bool) -> Shape:
        key = (rate_per_s, burst, cost, force)
        shape = self._shapes.get(key)
        if shape is None:
            interval_us = 1e6 / rate_per_s
            capacity_us = burst * interval_us
            lease = 0
            if cost == 1 and not force:
                lease = min(burst, math.floor(rate_per_s * LEASE_S))
                lease = lease if lease > 1 else 0
            shape = self._shapes[key] = Shape(
                interval_us, capacity_us, cost, force,
                cost * interval_us - capacity_us, lease, lease * interval_us / 1e6,
            )  # fmt: skip
        return shape

    def _check_up(self) -> None:
        if self._down_until and time.monotonic() < self._down_until:
            raise StoreUnavailable(f"{self._name} failed a moment ago")

    def _failed(self, exc: Exception) -> StoreUnavailable:
        self._down_until = time.monotonic() + _RETRY_AFTER_FAILURE_S
        return StoreUnavailable(f"{type(exc).__name__}: {exc}")

    async def acquire(
        self, bucket: str, rate_per_s: float, burst: int, cost: int, force: bool = False
    ) -> Verdict:
        self._check_up()
        shape = self._shape(rate_per_s, burst, cost, force)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Verdict] = loop.create_future()
        waiting = self._pending.get((bucket, shape))
        if waiting is None:
            self._pending[bucket, shape] = [future]
        else:
            waiting.append(future)
        if not self._busy:
            self._busy = True
            loop.call_soon(self._flush)
        verdict = await future
        if verdict.allowed:
            return verdict
        reset_s = verdict.reset_s
        return Verdict(False, reset_s + shape.wait_offset_us / 1e6, reset_s)

    def _flush(self) -> None:
        """Send what is queued as one call; checks arriving meanwhile wait for the next,
        so under load each call carries what queued during the last round trip."""
        if not self._pending:
            self._busy = False
            return
        batch: _Entries = {}
        for entry in list(self._pending)[:_MAX_ENTRIES_PER_CALL]:
            futures = self._pending.pop(entry)
            if entry[0] in self._leases:
                futures = self._spend_lease(entry[0], futures)
            if futures:
                batch[entry] = futures
        if not batch:
            self._busy = False
            return
        self._start(self._call(batch), self._call_done)

    def _start(self, call: Any, done: Callable[[asyncio.Task[None]], None]) -> None:
        task = asyncio.get_running_loop().create_task(call)
        self._tasks.add(task)
        task.add_done_callback(done)

    def _spend_lease(
        self, bucket: str, futures: list[asyncio.Future[Verdict]]
    ) -> list[asyncio.Future[Verdict]]:
        """Admit checks that queued while their bucket's lease came in; the rest."""
        lease = self._leases[bucket]
        spent = min(lease.tokens, len(futures)) if time.monotonic() < lease.until else 0
        for future in futures[:spent]:
            if not future.done():
                future.set_result(_ADMITTED)
        lease.tokens -= spent
        if not lease.tokens or not spent:
            del self._leases[bucket]
        return futures[spent:]

    def _call_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            self._flush()

    async def _call(self, batch: _Entries) -> None:
        checks = [RateCheck(bucket, shape, len(futures) + shape.lease)
                  for (bucket, shape), futures in batch.items()]  # fmt: skip
        try:
            replies = await self._backend.admit(checks)
            if len(replies) != len(batch):
                raise ValueError(f"{len(replies)} answers for {len(batch)} entries")
        except Exception as exc:  # any failure of the store leaves the limiter to decide
            _fail(batch.values(), self._failed(exc))
            return
        except BaseException as exc:  # cancelled: the waiting requests must not hang
            _fail(batch.values(), StoreUnavailable(f"the call was stopped: {exc!r}"))
            raise
        self._down_until = 0.0
        for ((bucket, shape), futures), (admitted, reset_us) in zip(
            batch.items(), replies, strict=True
        ):
            if admitted > len(futures):
                self._leases[bucket] = _Lease(
                    admitted - len(futures), time.monotonic() + shape.lease_s
                )
            refused = Verdict(False, 0.0, reset_us / 1e6)  # its wait: see acquire
            for position, future in enumerate(futures):
                if not future.done():
                    future.set_result(_ADMITTED if position < admitted else refused)

    async def enter(self, bucket: str, limit: int) -> bool:
        self._check_up()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        waiting = self._entering.get(bucket)
        if waiting is None:
            self._entering[bucket] = (limit, [future])
        else:
            waiting[1].append(future)
        if not self._entering_busy:
            self._entering_busy = True
            loop.call_soon(self._send_entering)
        return await future

    def _send_entering(self) -> None:
        if not self._entering:
            self._entering_busy = False
            return
        batch, self._entering = self._entering, {}
        self._start(self._call_entering(batch), self._entering_done)

    def _entering_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            self._send_entering()

    async def _call_entering(
        self, batch: dict[str, tuple[int, list[asyncio.Future[bool]]]]
    ) -> None:
        entries = [Entry(bucket, limit, len(futures)) for bucket, (limit, futures) in batch.items()]
        try:
            entered = await self._backend.enter(self._process, self._gone_ms, entries)
            if len(entered) != len(entries):
                raise ValueError(f"{len(entered)} counts for {len(entries)} keys")
        except Exception as exc:
            _fail((futures for _, futures in batch.values()), self._failed(exc))
            return
        except BaseException as exc:  # cancelled (closing): the requests must not hang
            stopped = StoreUnavailable(f"the call was stopped: {exc!r}")
            _fail((futures for _, futures in batch.values()), stopped)
            raise
        self._down_until = 0.0
        for entry, count in zip(entries, entered, strict=True):
            for position, future in enumerate(batch[entry.bucket][1]):
                if position >= count:
                    if not future.done():
                        future.set_result(False)
                elif future.done():  # its request went away meanwhile: the count back
                    self._change(entry.bucket, -1)
                else:
                    self._count(entry.bucket, 1)
                    future.set_result(True)

    def hold(self, bucket: str) -> None:
        self._count(bucket, 1)
        self._change(bucket, 1)

    def leave(self, bucket: str) -> None:
        self._count(bucket, -1)
        self._change(bucket, -1)

    def _change(self, bucket: str, change: int) -> None:
        """A change of this process's count the backend has not counted; told at the end
        of this turn of the loop (a request waiting in another process may enter), or with
        the next sign of life if the backend cannot be told now."""
        self._untold[bucket] = self._untold.get(bucket, 0) + change
        if not self._telling:
            self._telling = True
            asyncio.get_running_loop().call_soon(self._tell_soon)

    def _tell_soon(self) -> None:
        self._telling = False
        self._start(self._tell(), self._tasks.discard)

    def _count(self, bucket: str, change: int) -> None:
        held = self._held.get(bucket, 0) + change
        if held:
            self._held[bucket] = held
        else:
            del self._held[bucket]
        if self._holding is None or self._holding.done():
            self._holding = asyncio.get_running_loop().create_task(self._keep_holding())

    async def _tell(self) -> None:
        """This process's sign of life and every change the backend has not been told."""
        changes, self._untold = self._untold, {}
        try:
            await self._backend.hold(self._process, changes)
        except Exception:  # told with the next sign of life
            for bucket, change in changes.items():
                self._untold[bucket] = self._untold.get(bucket, 0) + change

    async def _keep_holding(self) -> None:
        """While this process holds requests in flight (or has changes to tell), a sign
        of life five times per ``gone_after_s``, so they keep counting."""
        while self._held or self._untold:
            await asyncio.sleep(self._hold_every_s)
            await self._tell()

    async def close(self) -> None:
        tasks = list(self._tasks)
        if self._holding is not None:
            tasks.append(self._holding)
        for task in tasks:
            task.cancel()
        # Let them unwind before the backend goes: a call cancelled mid-flight gives its
        # connection back (or drops it) then, not when its task is collected later, with
        # its socket left open.
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._backend.close()


_ADMITTED = Verdict(True, 0.0, 0.0)


def _fail(waiting: Iterable[list[asyncio.Future[Any]]], failure: StoreUnavailable) -> None:
    for futures in waiting:
        for future in futures:
            if not future.done():
                future.set_exception(failure)
