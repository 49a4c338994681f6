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
- Redis counts an entry's idle time from its read, not from its last sign of life, so a
  worker *holds* what it read until the round ends: it never reclaims those entries
  itself, and :meth:`JobConsumer.refresh_held` (``XCLAIM ... JUSTID`` to itself, which
  zeroes the idle time and leaves the delivery count alone) keeps them from looking idle
  to other workers while they wait in its batcher. Only a worker that stopped, or an
  attempt that faulted, lets an entry go idle, and only that counts another attempt.
- An entry that is not a job (a field missing or unreadable: written by hand, or by
  another program) goes to the dead letters on its own; the jobs read with it run.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from slipstream.jobs.queue import DEAD, GROUP, STREAM, record_key, redis_client

logger = logging.getLogger(__name__)

# KEYS: the jobs' records. ARGV: max attempts. Returns per job {attempts, last error, its
# HTTP status}; attempts -1 when the job has ended already, -2 when its record is gone
# (expired before a worker took it), max + 1 (not counted) when its attempts are spent.
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
    out[3 * i - 2] = attempts
    out[3 * i - 1] = redis.call('HGET', KEYS[i], 'last_error') or ''
    out[3 * i] = redis.call('HGET', KEYS[i], 'last_error_status') or ''
  else
    out[3 * i - 2] = state and -1 or -2
    out[3 * i - 1] = ''
    out[3 * i] = ''
  end
end
return out
"""
# KEYS: stream, dead letters, record. ARGV: entry id, group, outcome (done, failed, retry,
# ack, malformed), result, error, error status, result ttl, max dead letters. Returns 1
# when this call wrote the job's end, else 0. A malformed entry ends its record only when
# the record names that entry (its job id may be anything, even another job's).
_FINISH = """
local outcome = ARGV[3]
local state = redis.call('HGET', KEYS[3], 'state')
if outcome == 'retry' then
  if state == 'pending' then
    redis.call('HSET', KEYS[3], 'last_error', ARGV[5], 'last_error_status', ARGV[6])
  end
  return 0
end
local wrote = 0
if state == 'pending' and outcome == 'done' then
  redis.call('HSET', KEYS[3], 'state', 'done', 'result', ARGV[4])
  redis.call('HINCRBY', KEYS[3], 'results', 1)
  redis.call('EXPIRE', KEYS[3], ARGV[7])
  wrote = 1
elseif state == 'pending' and (outcome == 'failed' or
    (outcome == 'malformed' and redis.call('HGET', KEYS[3], 'entry') == ARGV[1])) then
  redis.call('HSET', KEYS[3], 'state', 'failed', 'error', ARGV[5], 'error_status', ARGV[6])
  redis.call('HINCRBY', KEYS[3], 'results', 1)
  redis.call('EXPIRE', KEYS[3], ARGV[7])
  wrote = 1
end
if (outcome == 'failed' and wrote == 1) or outcome == 'malformed' then
  local found = redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1])
  if #found > 0 then
    local fields = found[1][2]
    table.insert(fields, 'error')
    table.insert(fields, ARGV[5])
    table.insert(fields, 'attempts')
    table.insert(fields, redis.call('HGET', KEYS[3], 'attempts') or '0')
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[8], '*', unpack(fields))
  end
end
redis.call('XACK', KEYS[1], ARGV[2], ARGV[1])
redis.call('XDEL', KEYS[1], ARGV[1])
return wrote
"""
# KEYS: stream. ARGV: group, consumer, entry ids. Zeroes the idle time of the entries
# still this consumer's (another worker may have reclaimed one while this one stalled:
# that one is left alone); JUSTID leaves their delivery counts as they are. Returns how
# many were refreshed.
_REFRESH = """
local claim = {'XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0}
for i = 3, #ARGV do
  if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2]) > 0 then
    claim[#claim + 1] = ARGV[i]
  end
end
if #claim == 5 then return 0 end
claim[#claim + 1] = 'JUSTID'
return #redis.call(unpack(claim))
"""
# Entry ids one refresh call takes: Lua's unpack() is limited to a few thousand values.
_REFRESH_CHUNK = 1000
# Dead letters kept (approximately; the oldest go first).
_MAX_DEAD = 100_000
# One blocking read waits this long for new jobs before the loop looks around again.
_BLOCK_MS = 1000
# What a job's entry holds (jobs/queue.py writes it).
_FIELDS = (b"job", b"model", b"version", b"body", b"header_length")
# The status a malformed entry's job (when it has a record) ends with: not the client's
# request at fault, but whatever wrote the entry.
_MALFORMED_STATUS = 500


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
    # The HTTP status the synchronous route answers that fault with (0: none recorded).
    last_error_status: int = 0


Outcome = Literal["done", "failed", "retry", "ack", "malformed"]


@dataclass(frozen=True, slots=True)
class Finished:
    """What became of one job run by this worker."""

    job: StoredJob
    outcome: Outcome
    # The V2 JSON response (done).
    result: bytes = b""
    # Why it failed (failed, malformed), or the fault to try again after (retry).
    error: str = ""
    # The HTTP status of that failure or fault on the synchronous route.
    error_status: int = 0


class JobConsumer:
    """One worker's consumer in the group; see the module docstring."""

    def __init__(
        self, url: str, consumer: str, reclaim_after_s: float = 60.0, result_ttl_s: int = 3600
    ) -> None:
        self._client = redis_client(url)
        self._claim = self._client.register_script(_CLAIM)
        self._finish = self._client.register_script(_FINISH)
        self._refresh = self._client.register_script(_REFRESH)
        self.consumer = consumer
        self._min_idle_ms = int(reclaim_after_s * 1000)
        self._result_ttl_s = result_ttl_s
        self._reclaim_cursor = b"0-0"
        # Entries read or reclaimed and not yet released: this worker's rounds hold them.
        self.held: set[bytes] = set()

    async def ensure_group(self) -> None:
        """Create the stream and the group when missing (every worker may try)."""
        from redis.exceptions import ResponseError

        try:
            await self._client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def read(self, count: int, block_ms: int = _BLOCK_MS) -> list[StoredJob]:
        """Up to ``count`` new jobs, waiting at most ``block_ms`` for the first; held
        until :meth:`release`."""
        replies = await self._client.xreadgroup(
            GROUP, self.consumer, {STREAM: ">"}, count=count, block=block_ms
        )
        return await self._take([entry for _, entries in replies or [] for entry in entries])

    async def reclaim(self, count: int) -> list[StoredJob]:
        """Up to ``count`` jobs idle in the group longer than the reclaim timeout (their
        worker died, or their last attempt faulted), now this consumer's and held until
        :meth:`release`. Entries this worker holds already are never among them."""
        reply = await self._client.xautoclaim(
            STREAM, GROUP, self.consumer, self._min_idle_ms, self._reclaim_cursor, count=count
        )
        self._reclaim_cursor = reply[0]
        return await self._take([e for e in reply[1] if e[0] not in self.held])

    def release(self, jobs: Iterable[StoredJob]) -> None:
        """The round of ``jobs`` is over (finished, or given up to a reclaim)."""
        self.held.difference_update(job.entry_id for job in jobs)

    async def refresh_held(self) -> int:
        """Zero the idle time of the entries held, so that no worker reclaims a job this
        one is still going to run; returns how many are still this consumer's."""
        held = list(self.held)
        refreshed = 0
        for start in range(0, len(held), _REFRESH_CHUNK):
            chunk = held[start : start + _REFRESH_CHUNK]
            refreshed += int(await self._refresh(keys=[STREAM], args=[GROUP, self.consumer,
                                                                      *chunk]))  # fmt: skip
        return refreshed

    async def claim(self, jobs: list[StoredJob], max_attempts: int) -> list[Claim]:
        """Count an attempt on each job still pending and not spent (one script call)."""
        if not jobs:
            return []
        reply = await self._claim(keys=[record_key(job.job_id) for job in jobs],
                                  args=[max_attempts])  # fmt: skip
        return [Claim(job, int(reply[3 * i]), _text(reply[3 * i + 1]),
                      int(reply[3 * i + 2] or 0)) for i, job in enumerate(jobs)]  # fmt: skip

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

    async def _take(self, entries: list[tuple[bytes, Any]]) -> list[StoredJob]:
        """The jobs among ``entries``, now held; a malformed entry is dead-lettered, and
        the jobs read with it are returned all the same."""
        jobs: list[StoredJob] = []
        malformed: list[Finished] = []
        for entry_id, fields in entries:
            if not fields:  # deleted after it was read: its job ended elsewhere
                continue
            parsed = _stored(entry_id, fields)
            if isinstance(parsed, StoredJob):
                jobs.append(parsed)
                continue
            job_id = fields.get(b"job", b"")
            logger.warning("job stream entry %s is not a job, dead-lettered: %s",
                           _text(entry_id), parsed)  # fmt: skip
            stub = StoredJob(entry_id, job_id.decode(errors="replace"), "", "", b"", 0)
            malformed.append(Finished(stub, "malformed", error=parsed,
                                      error_status=_MALFORMED_STATUS))  # fmt: skip
        # Before the jobs are held: if Redis fails here, they go idle and are reclaimed.
        await self.finish(malformed)
        self.held.update(job.entry_id for job in jobs)
        return jobs


def _stored(entry_id: bytes, fields: dict[bytes, bytes]) -> StoredJob | str:
    """The entry's job, or what is wrong with it."""
    missing = [name.decode() for name in _FIELDS if name not in fields]
    if missing:
        present = ", ".join(_text(name) for name in fields)
        return (
            f"malformed job stream entry: missing {', '.join(missing)} (has {present}); "
            "submit jobs with POST /v2/jobs or Prefer: respond-async, not XADD"
        )
    try:
        job_id, model, version = (fields[name].decode() for name in _FIELDS[:3])
    except UnicodeDecodeError:
        return "malformed job stream entry: job, model or version is not UTF-8 text"
    try:
        header_length = int(fields[b"header_length"])
    except ValueError:
        return (f"malformed job stream entry: header_length must be an integer, got "
                f"{fields[b'header_length'][:40]!r}")  # fmt: skip
    return StoredJob(entry_id, job_id, model, version, fields[b"body"], header_length)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
