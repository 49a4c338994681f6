"""A worker's side of the job stream: read, claim, finish, reclaim.

Delivery is at least once (Redis consumer groups), made exactly once in effect:

- A worker reads entries with ``XREADGROUP``; they stay in the group's pending list
  until the worker finishes them.
- Before running a batch it *claims* the jobs: one script counts an attempt on each
  record that is still pending and returns it (with the last fault), so a job already
  done elsewhere is acknowledged without running, and one past ``max_attempts`` goes to
  the dead letters instead of running again.
- Finishing a job is one script: the result (or failure) is written only while the
  record is still pending, then the entry is acknowledged (``XACK``) and deleted
  (``XDEL``). Two workers that ran the same job (a slow one and the one that reclaimed
  it) so write one result; a worker killed between running and finishing wrote nothing.
- A fault (a model error that is not the request's) leaves the entry pending; entries
  idle longer than ``reclaim_after_s`` (faulted, or held by a worker that died) are taken
  over with ``XAUTOCLAIM`` by any live worker and run again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

from slipstream.jobs.queue import DEAD, GROUP, STREAM, record_key, redis_client

logger = logging.getLogger(__name__)

# KEYS: the jobs' records. ARGV: max attempts. Returns per job {attempts, last error};
# attempts -1 when the job has ended already, -2 when its record is gone (expired before
# a worker took it), max + 1 (not counted) when its attempts are spent.
_CLAIM = """
local out = {}
for i = 1, #KEYS do
  local state = redis.call('HGET', KEYS[i], 'state')
  if state == 'pending' then
    local attempts = tonumber(redis.call('HGET', KEYS[i], 'attempts') or 0)
    if attempts < tonumber(ARGV[1]) then
      attempts = redis.call('HINCRBY', KEYS[i], 'attempts', 1)
    else
      attempts = attempts + 1
    end
    out[2 * i - 1] = attempts
    out[2 * i] = redis.call('HGET', KEYS[i], 'last_error') or ''
  else
    out[2 * i - 1] = state and -1 or -2
    out[2 * i] = ''
  end
end
return out
"""
# KEYS: stream, dead letters, record. ARGV: entry id, group, outcome (done, failed, retry,
# ack), result, error, error status, result ttl, max dead letters. Returns 1 when this
# call wrote the job's end, else 0.
_FINISH = """
local outcome = ARGV[3]
local state = redis.call('HGET', KEYS[3], 'state')
if outcome == 'retry' then
  if state == 'pending' then redis.call('HSET', KEYS[3], 'last_error', ARGV[5]) end
  return 0
end
local wrote = 0
if state == 'pending' and outcome == 'done' then
  redis.call('HSET', KEYS[3], 'state', 'done', 'result', ARGV[4])
  redis.call('HINCRBY', KEYS[3], 'results', 1)
  redis.call('EXPIRE', KEYS[3], ARGV[7])
  wrote = 1
elseif state == 'pending' and outcome == 'failed' then
  redis.call('HSET', KEYS[3], 'state', 'failed', 'error', ARGV[5], 'error_status', ARGV[6])
  redis.call('HINCRBY', KEYS[3], 'results', 1)
  redis.call('EXPIRE', KEYS[3], ARGV[7])
  local found = redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1])
  if #found > 0 then
    local fields = found[1][2]
    table.insert(fields, 'error')
    table.insert(fields, ARGV[5])
    table.insert(fields, 'attempts')
    table.insert(fields, redis.call('HGET', KEYS[3], 'attempts'))
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[8], '*', unpack(fields))
  end
  wrote = 1
end
redis.call('XACK', KEYS[1], ARGV[2], ARGV[1])
redis.call('XDEL', KEYS[1], ARGV[1])
return wrote
"""
# Dead letters kept (approximately; the oldest go first).
_MAX_DEAD = 100_000
# One blocking read waits this long for new jobs before the loop looks around again.
_BLOCK_MS = 1000


@dataclass(frozen=True, slots=True)
class StoredJob:
    """One entry of the stream, as a worker read it."""

    # The stream entry's id (what XACK takes).
    entry_id: bytes
    job_id: str
    model_name: str
    model_version: str
    # The request as a V2 binary-extension body (jobs/codec.py), and its JSON's length.
    body: bytes
    header_length: int


@dataclass(frozen=True, slots=True)
class Claim:
    """A claimed job: how many times it has been started (this one included)."""

    job: StoredJob
    # -1: ended already (acknowledge, don't run); -2: its record expired.
    attempts: int
    # The fault of the previous attempt ("" on the first).
    last_error: str


Outcome = Literal["done", "failed", "retry", "ack"]


@dataclass(frozen=True, slots=True)
class Finished:
    """What became of one job run by this worker."""

    job: StoredJob
    outcome: Outcome
    # The V2 JSON response (done).
    result: bytes = b""
    # Why it failed (failed), or the fault to try again after (retry).
    error: str = ""
    error_status: int = 0


class JobConsumer:
    """One worker's consumer in the group; see the module docstring."""

    def __init__(
        self, url: str, consumer: str, reclaim_after_s: float = 60.0, result_ttl_s: int = 3600
    ) -> None:
        self._client = redis_client(url)
        self._claim = self._client.register_script(_CLAIM)
        self._finish = self._client.register_script(_FINISH)
        self.consumer = consumer
        self._min_idle_ms = int(reclaim_after_s * 1000)
        self._result_ttl_s = result_ttl_s
        self._reclaim_cursor = b"0-0"

    async def ensure_group(self) -> None:
        """Create the stream and the group when missing (every worker may try)."""
        from redis.exceptions import ResponseError

        try:
            await self._client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def read(self, count: int, block_ms: int = _BLOCK_MS) -> list[StoredJob]:
        """Up to ``count`` new jobs, waiting at most ``block_ms`` for the first."""
        replies = await self._client.xreadgroup(
            GROUP, self.consumer, {STREAM: ">"}, count=count, block=block_ms
        )
        return [_stored(entry_id, fields) for _, entries in replies or []
                for entry_id, fields in entries if fields]  # fmt: skip

    async def reclaim(self, count: int) -> list[StoredJob]:
        """Up to ``count`` jobs idle in the group longer than the reclaim timeout (their
        worker died, or their last attempt faulted), now this consumer's."""
        reply = await self._client.xautoclaim(
            STREAM, GROUP, self.consumer, self._min_idle_ms, self._reclaim_cursor, count=count
        )
        self._reclaim_cursor = reply[0]
        return [_stored(entry_id, fields) for entry_id, fields in reply[1] if fields]

    async def claim(self, jobs: list[StoredJob], max_attempts: int) -> list[Claim]:
        """Count an attempt on each job still pending and not spent (one script call)."""
        if not jobs:
            return []
        reply = await self._claim(keys=[record_key(job.job_id) for job in jobs],
                                  args=[max_attempts])  # fmt: skip
        return [Claim(job, int(reply[2 * i]), _text(reply[2 * i + 1]))
                for i, job in enumerate(jobs)]  # fmt: skip

    async def finish(self, finished: list[Finished]) -> int:
        """Write every job's end in one round trip; returns how many ends were written."""
        if not finished:
            return 0
        async with self._client.pipeline(transaction=False) as pipe:
            for item in finished:
                await self._finish(
                    keys=[STREAM, DEAD, record_key(item.job.job_id)],
                    args=[item.job.entry_id, GROUP, item.outcome, item.result, item.error,
                          item.error_status, self._result_ttl_s, _MAX_DEAD],
                    client=pipe,
                )  # fmt: skip
            replies = await pipe.execute()
        return sum(int(reply) for reply in replies)

    async def close(self) -> None:
        await self._client.aclose()


def _stored(entry_id: bytes, fields: dict[bytes, bytes]) -> StoredJob:
    return StoredJob(
        entry_id, _text(fields[b"job"]), _text(fields[b"model"]), _text(fields[b"version"]),
        fields[b"body"], int(fields[b"header_length"]),
    )  # fmt: skip


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
