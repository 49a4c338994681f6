"""The GCRA of :mod:`slipstream.security.limits` in Redis: one Lua script, so the read,
the decision and the write are atomic, and every server process sharing the Redis
shares each key's budget. The clock is Redis's own (``TIME``), so the processes' clocks
need not agree.

Checks go to Redis together: one script call (one round trip) at a time carries every
check that queued meanwhile, and identical checks (one key's requests) travel as one
entry with a count, of which the script admits as many as the bucket holds, in order.
Under load a request so costs a small share of one call, not a call. The keys share a
hash tag, so the script also runs on a Redis Cluster.

A fast key does not need a round trip a request: where a key's rate is high, a call
asks for a *lease* beyond the checks at hand, up to ``LEASE_S`` of the key's rate, and
the tokens Redis grants beyond them are spent by this process's next requests without
asking (:meth:`RedisStore.take_now`). Redis has counted them already, so the shared
budget holds; a lease unspent after the time it stands for is dropped (admitting less,
never more). A key under ``2 / LEASE_S`` requests/s gets no lease: every check is
Redis's.

After a failed call the store answers StoreUnavailable without asking Redis for
``_RETRY_AFTER_FAILURE_S``, so an outage costs each request nothing but a check.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from slipstream.security.limits import LimitStore, StoreUnavailable, Verdict

# KEYS: one bucket per entry. ARGV: per entry "interval_us capacity_us cost force count".
# Returns two integers per entry: how many of its count were admitted (the first ones),
# and the bucket's reset time in us after them.
_GCRA = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local out = {}
for i = 1, #KEYS do
  local a, b, c, force, n = string.match(ARGV[i], '(%S+) (%S+) (%S+) (%S+) (%S+)')
  local interval, capacity, cost, count = tonumber(a), tonumber(b), tonumber(c), tonumber(n)
  local tat = tonumber(redis.call('GET', KEYS[i]) or now)
  if tat < now then tat = now end
  local admitted = count
  if force ~= '1' then
    if cost == 0 then
      if tat - now > capacity then admitted = 0 end
    else
      admitted = math.floor((capacity - (tat - now)) / (cost * interval) + 1e-9)
      if admitted < 0 then admitted = 0 end
      if admitted > count then admitted = count end
    end
  end
  local new_tat = tat + admitted * cost * interval
  if admitted > 0 and cost > 0 then
    redis.call('SET', KEYS[i], string.format('%.0f', new_tat), 'PX',
               math.ceil((new_tat - now) / 1000) + 1000)
  end
  out[2 * i - 1] = admitted
  out[2 * i] = math.floor(new_tat - now)
end
return out
"""
# Requests in flight, shared. KEYS: each key's holders hash (process -> its requests in
# flight), then every process's last sign of life (ms, Redis's clock). ARGV: this
# process, after how many ms without a sign a process counts as gone (its requests are
# dropped from every count), then per key its limit and how many requests ask to enter.
# Returns per key how many entered (the first ones).
_ENTER = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local alive = KEYS[#KEYS]
redis.call('HSET', alive, ARGV[1], now)
local out = {}
for k = 1, #KEYS - 1 do
  local holders = redis.call('HGETALL', KEYS[k])
  local total = 0
  for i = 1, #holders, 2 do
    local seen = tonumber(redis.call('HGET', alive, holders[i]) or 0)
    if now - seen > tonumber(ARGV[2]) then
      redis.call('HDEL', KEYS[k], holders[i])
      redis.call('HDEL', alive, holders[i])
    else
      total = total + tonumber(holders[i + 1])
    end
  end
  local entered = tonumber(ARGV[2 * k + 1]) - total
  if entered > tonumber(ARGV[2 * k + 2]) then entered = tonumber(ARGV[2 * k + 2]) end
  if entered < 0 then entered = 0 end
  if entered > 0 then redis.call('HINCRBY', KEYS[k], ARGV[1], entered) end
  out[k] = entered
end
return out
"""
# This process's sign of life, and changes to its counts that Redis has not seen (a
# release; a request admitted while Redis was down): KEYS[1] the signs of life, KEYS[2..]
# holders hashes; ARGV[1] this process, ARGV[2..] the change to its count in each.
# Changes add up in any order, so two calls in flight never undo each other.
_HOLD = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
redis.call('HSET', KEYS[1], ARGV[1], now)
for i = 2, #KEYS do
  if redis.call('HINCRBY', KEYS[i], ARGV[1], ARGV[i]) <= 0 then
    redis.call('HDEL', KEYS[i], ARGV[1])
  end
end
return 1
"""
_PREFIX = "{slipstream-ratelimit}:"
_ALIVE = _PREFIX + "alive"
# A process holding requests in flight says so five times in this; one silent for it (it
# stopped, or lost Redis) no longer counts.
_GONE_S = 5.0
_RETRY_AFTER_FAILURE_S = 0.5
# A Redis that does not answer within this is treated as down for the requests at hand.
_SOCKET_TIMEOUT_S = 0.5
# Most entries sent in one script call.
_MAX_ENTRIES_PER_CALL = 512
# A lease is at most this much of a key's rate (and at most its burst).
LEASE_S = 0.005


def redis_client(url: str) -> Any:
    """An asyncio Redis client for ``url`` that fails fast instead of retrying."""
    from redis.asyncio import Redis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    return Redis.from_url(url, socket_timeout=_SOCKET_TIMEOUT_S,
                          socket_connect_timeout=_SOCKET_TIMEOUT_S,
                          retry=Retry(NoBackoff(), 0))  # fmt: skip


@dataclass(frozen=True, slots=True, eq=False)
class _Shape:
    """One kind of check, formatted once (one object per kind: compared by identity)."""

    text: str  # the script's "interval capacity cost force"
    wait_offset_us: float  # a refused check's wait: its reset time plus this
    lease: int  # tokens asked for beyond the checks at hand (0: no lease)
    lease_s: float  # how long leased tokens may be spent


# (bucket, shape) -> the futures of the checks waiting on it.
_Entries = dict[tuple[str, _Shape], list["asyncio.Future[Verdict]"]]


class _Lease:
    __slots__ = ("tokens", "until")

    def __init__(self, tokens: int, until: float) -> None:
        self.tokens = tokens
        self.until = until


class RedisStore(LimitStore):
    """GCRA buckets in Redis at ``url`` (``redis://host:port[/db]``)."""

    def __init__(self, url: str, gone_after_s: float = _GONE_S) -> None:
        """``gone_after_s``: how long a process holding requests in flight may stay
        silent (stopped, or cut off from Redis) before they no longer count."""
        self._client = redis_client(url)
        self._gone_ms = round(gone_after_s * 1000)
        self._hold_every_s = gone_after_s / 5
        self._script = self._client.register_script(_GCRA)
        self._down_until = 0.0
        self._pending: _Entries = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # A flush is scheduled or a script call is under way: new checks just queue.
        self._busy = False
        # (rate, burst, cost, force) -> the entry's arguments, formatted once.
        self._shapes: dict[tuple[float, int, int, bool], _Shape] = {}
        # Prefixed bucket -> tokens Redis granted this process ahead of its requests.
        self._leases: dict[str, _Lease] = {}
        # Requests in flight: this process's name in Redis, its own counts (prefixed
        # bucket -> requests), and the changes to them Redis has not been told.
        self._enter = self._client.register_script(_ENTER)
        self._hold = self._client.register_script(_HOLD)
        self._process = uuid.uuid4().hex
        self._held: dict[str, int] = {}
        self._untold: dict[str, int] = {}
        self._holding: asyncio.Task[None] | None = None
        # Requests waiting to enter, by prefixed bucket: the limit and their futures. They
        # go to Redis as one call a turn of the loop (the next once one is under way).
        self._entering: dict[str, tuple[int, list[asyncio.Future[bool]]]] = {}
        self._entering_busy = False
        self._telling = False

    def take_now(self, bucket: str, rate_per_s: float, burst: int, cost: int) -> bool:
        """Admit one check from this process's lease on ``bucket``, without a call; False
        when there is none (then :meth:`acquire` asks Redis)."""
        lease = self._leases.get(_PREFIX + bucket)
        if lease is None or cost != 1:
            return False
        if time.monotonic() >= lease.until:
            del self._leases[_PREFIX + bucket]
            return False
        lease.tokens -= 1
        if not lease.tokens:
            del self._leases[_PREFIX + bucket]
        return True

    def _shape(self, rate_per_s: float, burst: int, cost: int, force: bool) -> _Shape:
        key = (rate_per_s, burst, cost, force)
        shape = self._shapes.get(key)
        if shape is None:
            interval_us = 1e6 / rate_per_s
            capacity_us = burst * interval_us
            text = f"{interval_us:.3f} {capacity_us:.3f} {cost} {1 if force else 0}"
            lease = 0
            if cost == 1 and not force:
                lease = min(burst, math.floor(rate_per_s * LEASE_S))
                lease = lease if lease > 1 else 0
            shape = self._shapes[key] = _Shape(
                text, cost * interval_us - capacity_us, lease, lease * interval_us / 1e6
            )
        return shape

    async def acquire(
        self, bucket: str, rate_per_s: float, burst: int, cost: int, force: bool = False
    ) -> Verdict:
        if self._down_until and time.monotonic() < self._down_until:
            raise StoreUnavailable("Redis failed a moment ago")
        shape = self._shape(rate_per_s, burst, cost, force)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Verdict] = loop.create_future()
        waiting = self._pending.get((_PREFIX + bucket, shape))
        if waiting is None:
            self._pending[_PREFIX + bucket, shape] = [future]
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
        task = asyncio.get_running_loop().create_task(self._call(batch))
        self._tasks.add(task)
        task.add_done_callback(self._call_done)

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
        try:
            replies = await self._script(
                keys=[bucket for bucket, _ in batch],
                args=[
                    f"{shape.text} {len(futures) + shape.lease}"
                    for (_, shape), futures in batch.items()
                ],
            )
            if len(replies) != 2 * len(batch):
                raise ValueError(f"{len(replies)} numbers for {len(batch)} entries")
        except Exception as exc:  # any failure of the store leaves the limiter to decide
            self._down_until = time.monotonic() + _RETRY_AFTER_FAILURE_S
            _fail(batch.values(), StoreUnavailable(f"{type(exc).__name__}: {exc}"))
            return
        except BaseException as exc:  # cancelled: the waiting requests must not hang
            _fail(batch.values(), StoreUnavailable(f"the call was stopped: {exc!r}"))
            raise
        self._down_until = 0.0
        for index, ((bucket, shape), futures) in enumerate(batch.items()):
            admitted, reset_us = replies[2 * index], replies[2 * index + 1]
            if admitted > len(futures):
                self._leases[bucket] = _Lease(
                    admitted - len(futures), time.monotonic() + shape.lease_s
                )
            refused = Verdict(False, 0.0, reset_us / 1e6)  # its wait: see acquire
            for position, future in enumerate(futures):
                if not future.done():
                    future.set_result(_ADMITTED if position < admitted else refused)

    async def enter(self, bucket: str, limit: int) -> bool:
        if self._down_until and time.monotonic() < self._down_until:
            raise StoreUnavailable("Redis failed a moment ago")
        key = _PREFIX + bucket
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        waiting = self._entering.get(key)
        if waiting is None:
            self._entering[key] = (limit, [future])
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
        task = asyncio.get_running_loop().create_task(self._call_entering(batch))
        self._tasks.add(task)
        task.add_done_callback(self._entering_done)

    def _entering_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            self._send_entering()

    async def _call_entering(
        self, batch: dict[str, tuple[int, list[asyncio.Future[bool]]]]
    ) -> None:
        keys = list(batch)
        args: list[Any] = [self._process, self._gone_ms]
        for key in keys:
            limit, futures = batch[key]
            args += [limit, len(futures)]
        try:
            entered = await self._enter(keys=[*keys, _ALIVE], args=args)
            if len(entered) != len(keys):
                raise ValueError(f"{len(entered)} counts for {len(keys)} keys")
        except Exception as exc:
            self._down_until = time.monotonic() + _RETRY_AFTER_FAILURE_S
            failure = StoreUnavailable(f"{type(exc).__name__}: {exc}")
            _fail((futures for _, futures in batch.values()), failure)
            return
        except BaseException as exc:  # cancelled (closing): the requests must not hang
            stopped = StoreUnavailable(f"the call was stopped: {exc!r}")
            _fail((futures for _, futures in batch.values()), stopped)
            raise
        self._down_until = 0.0
        for key, count in zip(keys, entered, strict=True):
            for position, future in enumerate(batch[key][1]):
                if position >= count:
                    if not future.done():
                        future.set_result(False)
                elif future.done():  # its request went away meanwhile: the count back
                    self._change(key, -1)
                else:
                    self._count(key, 1)
                    future.set_result(True)

    def hold(self, bucket: str) -> None:
        key = _PREFIX + bucket
        self._count(key, 1)
        self._change(key, 1)

    def leave(self, bucket: str) -> None:
        key = _PREFIX + bucket
        self._count(key, -1)
        self._change(key, -1)

    def _change(self, key: str, change: int) -> None:
        """A change of this process's count Redis has not counted; told at the end of
        this turn of the loop (a request waiting in another process may enter), or with
        the next sign of life if Redis cannot be told now."""
        self._untold[key] = self._untold.get(key, 0) + change
        if not self._telling:
            self._telling = True
            asyncio.get_running_loop().call_soon(self._tell_soon)

    def _tell_soon(self) -> None:
        self._telling = False
        task = asyncio.get_running_loop().create_task(self._tell())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _count(self, key: str, change: int) -> None:
        held = self._held.get(key, 0) + change
        if held:
            self._held[key] = held
        else:
            del self._held[key]
        if self._holding is None or self._holding.done():
            self._holding = asyncio.get_running_loop().create_task(self._keep_holding())

    async def _tell(self) -> None:
        """This process's sign of life and every change Redis has not been told."""
        changes, self._untold = self._untold, {}
        keys = list(changes)
        try:
            await self._hold(
                keys=[_ALIVE, *keys], args=[self._process, *(changes[k] for k in keys)]
            )
        except Exception:  # told with the next sign of life
            for key, change in changes.items():
                self._untold[key] = self._untold.get(key, 0) + change

    async def _keep_holding(self) -> None:
        """While this process holds requests in flight (or has changes to tell), a sign
        of life five times per ``gone_after_s``, so they keep counting."""
        while self._held or self._untold:
            await asyncio.sleep(self._hold_every_s)
            await self._tell()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._holding is not None:
            self._holding.cancel()
        await self._client.aclose()


_ADMITTED = Verdict(True, 0.0, 0.0)


def _fail(waiting: Iterable[list[asyncio.Future[Any]]], failure: StoreUnavailable) -> None:
    for futures in waiting:
        for future in futures:
            if not future.done():
                future.set_exception(failure)
