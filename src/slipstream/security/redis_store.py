"""The GCRA of :mod:`slipstream.security.limits` in Redis: one Lua script, so the read,
the decision and the write are atomic, and every server process sharing the Redis
shares each key's budget. The clock is Redis's own (``TIME``), so the processes' clocks
need not agree.

After a failed call the store answers StoreUnavailable without asking Redis for
``_RETRY_AFTER_FAILURE_S``, so an outage costs each request nothing but a check.
"""

from __future__ import annotations

import time
from typing import Any

from slipstream.security.limits import LimitStore, StoreUnavailable, Verdict

# KEYS[1]: the bucket. ARGV: interval_us, capacity_us, cost, force (1/0).
# Returns {allowed, retry_after_us, reset_us}.
_GCRA = """
local interval = tonumber(ARGV[1])
local capacity = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or now)
if tat < now then tat = now end
local new_tat = tat + cost * interval
local ahead = new_tat - now
if ahead > capacity and ARGV[4] ~= '1' then
  return {0, math.floor(ahead - capacity), math.floor(tat - now)}
end
if cost > 0 then
  redis.call('SET', KEYS[1], string.format('%.0f', new_tat), 'PX', math.ceil(ahead / 1000) + 1000)
end
return {1, 0, math.floor(ahead)}
"""
_PREFIX = "slipstream:ratelimit:"
_RETRY_AFTER_FAILURE_S = 0.5
# A Redis that does not answer within this is treated as down for the request at hand.
_SOCKET_TIMEOUT_S = 0.5


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

    async def acquire(
        self, bucket: str, rate_per_s: float, burst: int, cost: int, force: bool = False
    ) -> Verdict:
        from redis.exceptions import RedisError

        if self._down_until and time.monotonic() < self._down_until:
            raise StoreUnavailable("Redis failed a moment ago")
        interval_us = 1e6 / rate_per_s
        args = [interval_us, burst * interval_us, cost, 1 if force else 0]
        try:
            allowed, retry_us, reset_us = await self._script(keys=[_PREFIX + bucket], args=args)
        except (RedisError, OSError) as exc:
            self._down_until = time.monotonic() + _RETRY_AFTER_FAILURE_S
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from None
        self._down_until = 0.0
        return Verdict(bool(allowed), retry_us / 1e6, reset_us / 1e6)

    async def close(self) -> None:
        await self._client.aclose()
