"""The GCRA of :mod:`slipstream.security.limits` in Redis: one Lua script, so the read,
the decision and the write are atomic, and every server process sharing the Redis
shares each key's budget. The clock is Redis's own (``TIME``), so the processes' clocks
need not agree.

Checks that arrive while a call is being prepared go to Redis together: the requests of
one event-loop turn share one script call (and one round trip), which the script runs
in order, so a burst of concurrent requests costs Redis, and this process's CPU, about
one call instead of one each. The keys share a hash tag, so the script also runs on a
Redis Cluster.

After a failed call the store answers StoreUnavailable without asking Redis for
``_RETRY_AFTER_FAILURE_S``, so an outage costs each request nothing but a check.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from slipstream.security.limits import LimitStore, StoreUnavailable, Verdict

# KEYS: one bucket per check. ARGV: per check interval_us, capacity_us, cost, force (1/0).
# Returns per check: allowed, retry_after_us, reset_us.
_GCRA = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local out = {}
for i = 1, #KEYS do
  local base = (i - 1) * 4
  local interval = tonumber(ARGV[base + 1])
  local capacity = tonumber(ARGV[base + 2])
  local cost = tonumber(ARGV[base + 3])
  local tat = tonumber(redis.call('GET', KEYS[i]) or now)
  if tat < now then tat = now end
  local new_tat = tat + cost * interval
  local ahead = new_tat - now
  if ahead > capacity and ARGV[base + 4] ~= '1' then
    out[#out + 1] = 0
    out[#out + 1] = math.floor(ahead - capacity)
    out[#out + 1] = math.floor(tat - now)
  else
    if cost > 0 then
      redis.call('SET', KEYS[i], string.format('%.0f', new_tat), 'PX',
                 math.ceil(ahead / 1000) + 1000)
    end
    out[#out + 1] = 1
    out[#out + 1] = 0
    out[#out + 1] = math.floor(ahead)
  end
end
return out
"""
_PREFIX = "{slipstream-ratelimit}:"
_RETRY_AFTER_FAILURE_S = 0.5
# A Redis that does not answer within this is treated as down for the requests at hand.
_SOCKET_TIMEOUT_S = 0.5
# Most checks sent in one script call.
_MAX_CHECKS_PER_CALL = 512


def redis_client(url: str) -> Any:
    """An asyncio Redis client for ``url`` that fails fast instead of retrying."""
    from redis.asyncio import Redis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    return Redis.from_url(url, socket_timeout=_SOCKET_TIMEOUT_S,
                          socket_connect_timeout=_SOCKET_TIMEOUT_S,
                          retry=Retry(NoBackoff(), 0))  # fmt: skip


class RedisStore(LimitStore):
    """GCRA buckets in Redis at ``url`` (``redis://host:port[/db]``)."""

    def __init__(self, url: str) -> None:
        self._client = redis_client(url)
        self._script = self._client.register_script(_GCRA)
        self._down_until = 0.0
        # Checks waiting for the next script call: (bucket, args, future).
        self._pending: list[tuple[str, list[Any], asyncio.Future[Verdict]]] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def acquire(
        self, bucket: str, rate_per_s: float, burst: int, cost: int, force: bool = False
    ) -> Verdict:
        if self._down_until and time.monotonic() < self._down_until:
            raise StoreUnavailable("Redis failed a moment ago")
        interval_us = 1e6 / rate_per_s
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Verdict] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.append(
            (_PREFIX + bucket, [interval_us, burst * interval_us, cost, 1 if force else 0], future)
        )
        return await future

    def _flush(self) -> None:
        while self._pending:
            batch = self._pending[:_MAX_CHECKS_PER_CALL]
            del self._pending[:_MAX_CHECKS_PER_CALL]
            task = asyncio.get_running_loop().create_task(self._call(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _call(self, batch: list[tuple[str, list[Any], asyncio.Future[Verdict]]]) -> None:
        from redis.exceptions import RedisError

        args = [value for _, check, _ in batch for value in check]
        try:
            replies = await self._script(keys=[bucket for bucket, _, _ in batch], args=args)
        except (RedisError, OSError) as exc:
            self._down_until = time.monotonic() + _RETRY_AFTER_FAILURE_S
            failure = StoreUnavailable(f"{type(exc).__name__}: {exc}")
            for _, _, future in batch:
                if not future.done():
                    future.set_exception(failure)
            return
        except BaseException as exc:  # cancelled: the waiting requests must not hang
            for _, _, future in batch:
                if not future.done():
                    future.set_exception(StoreUnavailable(f"the call was stopped: {exc!r}"))
            raise
        self._down_until = 0.0
        for index, (_, _, future) in enumerate(batch):
            allowed, retry_us, reset_us = replies[3 * index : 3 * index + 3]
            if not future.done():
                future.set_result(Verdict(bool(allowed), retry_us / 1e6, reset_us / 1e6))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self._client.aclose()
