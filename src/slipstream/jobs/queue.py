"""Asynchronous inference jobs in Redis: the keys, and what the server asks of them.

One job is one request to run later. Its keys share one hash tag, so every script below
also runs on a Redis Cluster:

- ``{slipstream-jobs}:stream``: one entry per unfinished job (its id, model, version and
  request as a V2 binary body). Workers read it in the consumer group ``workers`` and
  delete an entry when its job ends, so the stream's length is the number of jobs not
  yet done: what ``max_pending`` bounds and what an autoscaler (KEDA) reads.
- ``{slipstream-jobs}:job:<id>``: the job's record (a hash): ``state`` pending, done or
  failed, ``model``, ``version``, ``attempts``, then ``result`` (the V2 JSON response) or
  ``error``; it expires ``pending_ttl_s`` after submission, ``result_ttl_s`` after it ends.
- ``{slipstream-jobs}:dead``: the dead letters: every job that failed, with its request
  and why (a client error, its own ``timeout`` run out, or ``max_attempts`` faults or
  crashes in a row), and every entry that was not a job (a field missing).

Submitting is one script: an existing record is answered as it stands (a client's job id
is an idempotency key: the same id twice is one job), a full stream is refused (503),
else the entry and the record are written together. Workers are
:class:`slipstream.jobs.consumer.JobConsumer`.

Example::

    queue = JobQueue("redis://localhost:6379", max_pending=100_000)
    submitted = await queue.submit("job-1", "add_sub", "", body, header_length)
    status = await queue.status("job-1")     # JobStatus(state="pending", ...) or None
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

from slipstream.errors import Unavailable
from slipstream.jobs.codec import JobState, JobStatus

logger = logging.getLogger(__name__)

PREFIX = "{slipstream-jobs}:"
STREAM = PREFIX + "stream"
DEAD = PREFIX + "dead"
GROUP = "workers"
# A Redis that does not answer within this is down, for the request at hand.
_SOCKET_TIMEOUT_S = 2.0

# KEYS: stream, record. ARGV: job id, model, version, header length, body, max pending,
# pending ttl. Returns {"new" | "exists" | "full", state}.
_SUBMIT = """
local state = redis.call('HGET', KEYS[2], 'state')
if state then return {'exists', state} end
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[6]) then return {'full', ''} end
local entry = redis.call('XADD', KEYS[1], '*', 'job', ARGV[1], 'model', ARGV[2],
                         'version', ARGV[3], 'header_length', ARGV[4], 'body', ARGV[5])
redis.call('HSET', KEYS[2], 'state', 'pending', 'model', ARGV[2], 'version', ARGV[3],
           'entry', entry, 'attempts', 0)
redis.call('EXPIRE', KEYS[2], ARGV[7])
return {'new', 'pending'}
"""
_STATUS_FIELDS = ("state", "model", "version", "attempts", "result", "error", "error_status")


def record_key(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}"


def new_job_id() -> str:
    """A job id nobody can guess (128 random bits)."""
    return uuid.uuid4().hex


def redis_client(url: str) -> Any:
    """An asyncio Redis client for ``url`` that fails fast instead of retrying."""
    from redis.asyncio import Redis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    return Redis.from_url(url, socket_timeout=_SOCKET_TIMEOUT_S,
                          socket_connect_timeout=_SOCKET_TIMEOUT_S,
                          retry=Retry(NoBackoff(), 0))  # fmt: skip


@dataclass(frozen=True, slots=True)
class Submitted:
    """What a submission did."""

    job_id: str
    # False: a job of this id existed already, and is what the client gets.
    created: bool
    state: JobState


class JobQueue:
    """The server's side of the job stream at ``url`` (``redis://host:port[/db]``)."""

    def __init__(self, url: str, max_pending: int = 100_000, pending_ttl_s: int = 86_400) -> None:
        """``max_pending``: unfinished jobs the stream holds before submissions get 503;
        ``pending_ttl_s``: how long a job may wait for a worker before it is forgotten."""
        self._client = redis_client(url)
        self._submit = self._client.register_script(_SUBMIT)
        self.max_pending = max_pending
        self._pending_ttl_s = pending_ttl_s

    async def submit(
        self, job_id: str, model: str, version: str, body: bytes, header_length: int
    ) -> Submitted:
        """Store one job; Unavailable (503) when the stream is full or Redis is down."""
        try:
            outcome, state = await self._submit(
                keys=[STREAM, record_key(job_id)],
                args=[job_id, model, version, header_length, body, self.max_pending,
                      self._pending_ttl_s],
            )  # fmt: skip
        except Exception as exc:
            raise _unreachable(exc) from None
        if outcome == b"full":
            raise Unavailable(
                f"the job queue is full: {self.max_pending} jobs wait for a worker "
                "(--jobs-max-pending); retry later, or start more `slipstream worker`s",
                retry_after_s=5,
            )
        return Submitted(job_id, outcome == b"new", state.decode())

    async def status(self, job_id: str) -> JobStatus | None:
        """The job's record; None when there is none (never submitted, or expired)."""
        try:
            values = await self._client.hmget(record_key(job_id), _STATUS_FIELDS)
        except Exception as exc:
            raise _unreachable(exc) from None
        state, model, version, attempts, result, error, error_status = values
        if state is None:
            return None
        return JobStatus(
            job_id, state.decode(), model.decode(), version.decode(), int(attempts or 0),
            result or b"", (error or b"").decode(), int(error_status or 0),
        )  # fmt: skip

    async def pending(self) -> int:
        """Jobs submitted and not yet finished (the stream's length)."""
        try:
            return int(await self._client.xlen(STREAM))
        except Exception as exc:
            raise _unreachable(exc) from None

    async def close(self) -> None:
        await self._client.aclose()


def _unreachable(exc: Exception) -> Unavailable:
    logger.warning("job queue: Redis failed: %s: %s", type(exc).__name__, exc)
    return Unavailable(
        f"the job queue (Redis) is unreachable: {type(exc).__name__}; retry later",
        retry_after_s=1,
    )
