"""Per-key rate limits: requests per second with a burst, concurrent requests, and tokens
per minute on the generative routes.

Rates are a GCRA (generic cell rate algorithm): one stored time per key, the
"theoretical arrival time" (TAT) of the next request, so a check is O(1) and needs no
timer. A key with rate R and burst B admits B requests at once, then one every 1/R s.
The store is this process (:class:`MemoryStore`) or Redis
(:class:`slipstream.security.redis_store.RedisStore`), where several server processes
share one budget.

Tokens are charged after a response (its usage), so a request is admitted while the
key's token budget is not in debt, and its tokens may take the budget below zero.

Requests in flight are counted by each process; a store that is not local (Redis) also
counts every process's together, so a key's concurrency limit holds across the front
ends of ``--frontends N`` and across replicas.
"""

from __future__ import annotations

import logging
import math
import time
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass

from slipstream.errors import TooManyRequests, Unavailable
from slipstream.security.keys import ApiKey, KeyLimits
from slipstream.security.metrics import FrontDoorMetrics

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Verdict:
    """A store's answer for one bucket."""

    allowed: bool
    # Seconds until the request would be allowed (0 when allowed).
    retry_after_s: float
    # Seconds until the bucket is full again (the IETF RateLimit "t").
    reset_s: float


class StoreUnavailable(Exception):
    """The store could not be asked (Redis down); the limiter decides what that means."""


class LimitStore(ABC):
    """Where GCRA arrival times live; one call per check, atomic per bucket."""

    # In this process: :meth:`acquire_now` answers without awaiting anything.
    local = False

    def acquire_now(
        self, bucket: str, rate_per_s: float, burst: int, cost: int, force: bool = False
    ) -> Verdict:
        """:meth:`acquire` of a local store, without a coroutine (the hot path)."""
        raise NotImplementedError

    @abstractmethod
    async def acquire(
        self, bucket: str, rate_per_s: float, burst: int, cost: int, force: bool = False
    ) -> Verdict:
        """Take ``cost`` from ``bucket`` if ``burst`` allows it (``force``: take it even
        into debt, never refused). Raises StoreUnavailable when the store cannot answer."""

    def take_now(self, bucket: str, rate_per_s: float, burst: int, cost: int) -> bool:
        """Admit the check without awaiting, where the store can (a lease it holds);
        False: :meth:`acquire` must decide."""
        return False

    # Concurrency shared between processes (a store that is not local): the limiter
    # counts each process's requests in flight itself, and asks such a store too.
    async def enter(self, bucket: str, limit: int) -> bool:
        """Count one more request in flight on ``bucket`` unless every process's together
        reach ``limit``; False when they do. Raises StoreUnavailable (nothing counted)."""
        raise NotImplementedError

    def hold(self, bucket: str) -> None:
        """Count one request in flight without asking (admitted while the store was
        unreachable); the store learns of it when it answers again."""
        raise NotImplementedError

    def leave(self, bucket: str) -> None:
        """One request in flight on ``bucket`` (entered or held) finished."""
        raise NotImplementedError

    async def close(self) -> None:  # noqa: B027 - most stores hold nothing to release
        """Release connections."""


def gcra(tat: float, now: float, rate_per_s: float, burst: int, cost: int, force: bool
         ) -> tuple[Verdict, float]:  # fmt: skip
    """One GCRA step: the verdict and the bucket's new arrival time (``tat`` if refused)."""
    interval = 1.0 / rate_per_s
    capacity = burst * interval
    tat = max(tat, now)
    new_tat = tat + cost * interval
    ahead = new_tat - now
    if ahead > capacity and not force:
        return Verdict(False, ahead - capacity, tat - now), tat
    return _ADMITTED, new_tat


# What an admitted check answers: nothing else of it is read (saves an object a request).
_ADMITTED = Verdict(True, 0.0, 0.0)


class MemoryStore(LimitStore):
    """Arrival times in a dict of this process."""

    local = True

    def __init__(self) -> None:
        self._tats: dict[str, float] = {}

    def acquire_now(
        self, bucket: str, rate_per_s: float, burst: int, cost: int, force: bool = False
    ) -> Verdict:
        tats = self._tats
        now = time.monotonic()
        tat = tats.get(bucket, now)
        if tat < now:
            tat = now
        interval = 1.0 / rate_per_s
        new_tat = tat + cost * interval
        if new_tat - now <= burst * interval or force:
            tats[bucket] = new_tat  # the admitted path of gcra(), without its tuple
            return _ADMITTED
        verdict, tats[bucket] = gcra(tat, now, rate_per_s, burst, cost, force)
        return verdict

    async def acquire(
        self, bucket: str, rate_per_s: float, burst: int, cost: int, force: bool = False
    ) -> Verdict:
        return self.acquire_now(bucket, rate_per_s, burst, cost, force)


@dataclass(frozen=True, slots=True)
class _Plan:
    """One key's limits as its checks use them."""

    limits: KeyLimits
    bucket: str
    tokens: str
    in_flight: str
    rate_per_s: float
    burst: int
    max_concurrent: int
    tokens_per_minute: int


def _burst(rate_per_s: float, burst: int) -> int:
    return burst or max(1, math.ceil(rate_per_s))


class Limiter:
    """The three limits of every key; :meth:`admit` before a request, :meth:`release`
    after it, :meth:`charge_tokens` once a generative response's usage is known."""

    def __init__(
        self, store: LimitStore, metrics: FrontDoorMetrics, fail_closed: bool = False
    ) -> None:
        self.store = store
        self._metrics = metrics
        self._fail_closed = fail_closed
        self._in_flight: Counter[str] = Counter()
        self._store_down = False
        self._local = store.local
        # Key name -> what its checks need, built once (again when its limits change).
        self._plans: dict[str, _Plan] = {}

    @property
    def local(self) -> bool:
        """Whether :meth:`admit_now` may be used (the store is this process)."""
        return self._local

    def admit_now(self, key: ApiKey, generative: bool) -> bool:
        """:meth:`admit` of a local store, without a coroutine (the hot path)."""
        plan = self._plans.get(key.name)
        if plan is None or plan.limits is not key.limits or plan.max_concurrent:
            plan = self._plan(key)  # (re)built, and the concurrency limit checked
        if plan.rate_per_s:
            verdict = self.store.acquire_now(plan.bucket, plan.rate_per_s, plan.burst, 1)
            if not verdict.allowed:
                self._check_requests(key, plan.burst, verdict)
        if generative and plan.tokens_per_minute:
            tpm = plan.tokens_per_minute
            self._check_tokens(key, self.store.acquire_now(plan.tokens, tpm / 60.0, tpm, 0))
        if plan.max_concurrent:  # _count_in, inline on the hot path
            self._in_flight[key.name] += 1
            return True
        return False

    def _plan(self, key: ApiKey) -> _Plan:
        """What ``key``'s checks need; refuses it first when its requests in flight are
        at its limit."""
        plan = self._plans.get(key.name)
        if plan is None or plan.limits is not key.limits:
            limits = key.limits
            plan = self._plans[key.name] = _Plan(
                limits, f"req:{key.name}", f"tok:{key.name}", f"conc:{key.name}",
                limits.requests_per_s,
                _burst(limits.requests_per_s, limits.burst) if limits.requests_per_s else 0,
                limits.max_concurrent, limits.tokens_per_minute,
            )  # fmt: skip
        if plan.max_concurrent and self._in_flight[key.name] >= plan.max_concurrent:
            self._refuse_concurrency(key)
        return plan

    def _refuse_concurrency(self, key: ApiKey) -> None:
        limit = key.limits.max_concurrent
        self._metrics.limited[key.name, "concurrency"] += 1
        raise TooManyRequests(
            f"API key {key.name!r}: {limit} requests in flight already; wait for one to finish",
            retry_after_s=1,
            headers=_headers("concurrency", limit, 0, 1.0),
        )

    async def admit(self, key: ApiKey, generative: bool) -> bool:
        """Admit one request of ``key`` or raise TooManyRequests; True when it counted
        toward the key's concurrency (then :meth:`release` it)."""
        if self._local:
            return self.admit_now(key, generative)
        plan = self._plan(key)
        rate, burst = plan.rate_per_s, plan.burst
        if rate and not self.store.take_now(plan.bucket, rate, burst, 1):
            self._check_requests(key, burst, await self._ask(plan.bucket, rate, burst, 1))
        if generative and plan.tokens_per_minute:
            tpm = plan.tokens_per_minute
            self._check_tokens(key, await self._ask(plan.tokens, tpm / 60.0, tpm, 0))
        if plan.max_concurrent:
            await self._enter(key, plan)
        return self._count_in(key, plan)

    async def _enter(self, key: ApiKey, plan: _Plan) -> None:
        """The store's count of ``key``'s requests in flight in every process, one more;
        refused (429) at its limit. A store that cannot answer: as :meth:`_ask`."""
        try:
            entered = await self.store.enter(plan.in_flight, plan.max_concurrent)
        except StoreUnavailable as exc:
            self._store_failed(exc)  # raises when failing closed
            self.store.hold(plan.in_flight)
            return
        self._store_answered()
        if not entered:
            self._refuse_concurrency(key)

    def _check_requests(self, key: ApiKey, burst: int, verdict: Verdict) -> None:
        if not verdict.allowed:
            rate = key.limits.requests_per_s
            self._refuse(key, "requests", burst, burst / rate, verdict,
                         f"{rate:g} requests/s (burst {burst})")  # fmt: skip

    def _check_tokens(self, key: ApiKey, verdict: Verdict) -> None:
        if not verdict.allowed:
            tpm = key.limits.tokens_per_minute
            self._refuse(key, "tokens", tpm, 60.0, verdict, f"{tpm} tokens/minute")

    def _count_in(self, key: ApiKey, plan: _Plan) -> bool:
        if plan.max_concurrent:
            self._in_flight[key.name] += 1
            return True
        return False

    def release(self, key: ApiKey) -> None:
        self._in_flight[key.name] -= 1
        if not self._in_flight[key.name]:
            del self._in_flight[key.name]
        if not self._local:
            self.store.leave(self._plans[key.name].in_flight)

    async def tokens_wait_s(self, key: ApiKey) -> float:
        """Seconds until ``key``'s tokens per minute admit a generative request (0: now),
        neither refusing nor counting: for work that waits its turn (a batch's requests)."""
        tpm = key.limits.tokens_per_minute
        if not tpm:
            return 0.0
        verdict = await self._ask(f"tok:{key.name}", tpm / 60.0, tpm, 0)
        return 0.0 if verdict.allowed else verdict.retry_after_s

    async def charge_tokens(self, key: ApiKey, tokens: int) -> None:
        tpm = key.limits.tokens_per_minute
        if tpm and tokens > 0:
            await self._ask(f"tok:{key.name}", tpm / 60.0, tpm, tokens, force=True)

    async def _ask(
        self, bucket: str, rate_per_s: float, burst: int, cost: int, force: bool = False
    ) -> Verdict:
        try:
            verdict = await self.store.acquire(bucket, rate_per_s, burst, cost, force)
        except StoreUnavailable as exc:
            self._store_failed(exc)
            return Verdict(True, 0.0, 0.0)
        self._store_answered()
        return verdict

    def _store_failed(self, exc: StoreUnavailable) -> None:
        """The store could not answer: log it once, count it; raise 503 when failing
        closed (else the check admits)."""
        if not self._store_down:
            self._store_down = True
            logger.error("rate-limit store unreachable (%s): requests are %s until it "
                         "answers again", exc,
                         "refused" if self._fail_closed else "admitted")  # fmt: skip
        if self._fail_closed:
            self._metrics.store_errors["refused"] += 1
            raise Unavailable(
                "the rate-limit store is unreachable; retry shortly", retry_after_s=1
            ) from None
        self._metrics.store_errors["admitted"] += 1

    def _store_answered(self) -> None:
        if self._store_down:
            self._store_down = False
            logger.warning("rate-limit store answers again")

    def _refuse(self, key: ApiKey, limit: str, quota: int, window_s: float, verdict: Verdict,
                what: str) -> None:  # fmt: skip
        self._metrics.limited[key.name, limit] += 1
        retry = max(1, math.ceil(verdict.retry_after_s))
        raise TooManyRequests(
            f"API key {key.name!r} is over its limit of {what}; retry after {retry} s",
            retry_after_s=retry,
            headers=_headers(limit, quota, math.ceil(window_s), verdict.reset_s),
        )


def _headers(policy: str, quota: int, window_s: float, reset_s: float) -> list[tuple[str, str]]:
    """RateLimit-Policy and RateLimit as draft-ietf-httpapi-ratelimit-headers writes them."""
    window = f";w={math.ceil(window_s)}" if window_s else ""
    return [
        ("ratelimit-policy", f'"{policy}";q={quota}{window}'),
        ("ratelimit", f'"{policy}";r=0;t={max(1, math.ceil(reset_s))}'),
    ]
