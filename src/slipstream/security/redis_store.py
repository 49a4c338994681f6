"""The shared rate limits of :mod:`slipstream.security.shared_store` in Redis, for several
servers (replicas) sharing one budget per key: three Lua scripts, so each read, decision
and write is atomic. The clock is Redis's own (``TIME``), so the processes' clocks need
not agree. The keys share a hash tag, so the scripts also run on a Redis Cluster.

How checks travel together, leases and requests in flight: see
:mod:`slipstream.security.shared_store`, whose :class:`LocalBackend` takes the same
steps in a process's memory.
"""

from __future__ import annotations

from typing import Any

from slipstream.security.shared_store import (
    GONE_S,
    Backend,
    Entry,
    RateCheck,
    Shape,
    SharedStore,
)

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
# A Redis that does not answer within this is treated as down for the requests at hand.
_SOCKET_TIMEOUT_S = 0.5


def redis_client(url: str) -> Any:
    """An asyncio Redis client for ``url`` that fails fast instead of retrying."""
    from redis.asyncio import Redis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    return Redis.from_url(url, socket_timeout=_SOCKET_TIMEOUT_S,
                          socket_connect_timeout=_SOCKET_TIMEOUT_S,
                          retry=Retry(NoBackoff(), 0))  # fmt: skip


class RedisBackend(Backend):
    """The shared budgets in the Redis at ``url``, one script call a step."""

    def __init__(self, url: str) -> None:
        self._client = redis_client(url)
        self._gcra = self._client.register_script(_GCRA)
        self._enter = self._client.register_script(_ENTER)
        self._hold = self._client.register_script(_HOLD)
        # Each shape's script argument "interval capacity cost force", formatted once.
        self._texts: dict[Shape, str] = {}

    async def admit(self, checks: list[RateCheck]) -> list[tuple[int, int]]:
        replies = await self._gcra(
            keys=[_PREFIX + check.bucket for check in checks],
            args=[f"{self._text(check.shape)} {check.count}" for check in checks],
        )
        if len(replies) != 2 * len(checks):
            raise ValueError(f"{len(replies)} numbers for {len(checks)} entries")
        return [(int(replies[2 * i]), int(replies[2 * i + 1])) for i in range(len(checks))]

    def _text(self, shape: Shape) -> str:
        text = self._texts.get(shape)
        if text is None:
            text = self._texts[shape] = (
                f"{shape.interval_us:.3f} {shape.capacity_us:.3f} {shape.cost} {int(shape.force)}"
            )
        return text

    async def enter(self, process: str, gone_ms: int, entries: list[Entry]) -> list[int]:
        args: list[Any] = [process, gone_ms]
        for entry in entries:
            args += [entry.limit, entry.count]
        keys = [_PREFIX + entry.bucket for entry in entries]
        return [int(count) for count in await self._enter(keys=[*keys, _ALIVE], args=args)]

    async def hold(self, process: str, changes: dict[str, int]) -> None:
        await self._hold(
            keys=[_ALIVE, *(_PREFIX + bucket for bucket in changes)],
            args=[process, *changes.values()],
        )

    async def close(self) -> None:
        await self._client.aclose()


class RedisStore(SharedStore):
    """GCRA buckets in Redis at ``url`` (``redis://host:port[/db]``); ``gone_after_s``:
    how long a process holding requests in flight may stay silent (stopped, or cut off
    from Redis) before they no longer count."""

    def __init__(self, url: str, gone_after_s: float = GONE_S) -> None:
        super().__init__(RedisBackend(url), "Redis", gone_after_s)
