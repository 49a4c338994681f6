"""The job stream as a worker's :class:`~slipstream.jobs.consumer.JobConsumer` sees it,
on a real ``redis-server``, without a model: what goes to the dead letters, what stays
held while a worker has it, what a fault leaves behind, and what the scale-to-zero
autoscaler reads from the stream while jobs are unfinished.

Each test runs in a few hundred milliseconds: reclaim timeouts are fractions of a second.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as redis_client
import yaml

from slipstream.jobs.consumer import Finished, JobConsumer
from slipstream.jobs.queue import DEAD, GROUP, STREAM, JobQueue, record_key
from slipstream.server.worker import _spent
from tests.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[2]
SCALE_TO_ZERO = ROOT / "deploy/kubernetes/optional/keda-worker-scale-to-zero.yaml"
RECLAIM_AFTER_S = 0.2


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("redis")) as running:
        yield running


@pytest.fixture
def store(redis: RedisServer) -> Iterator[redis_client.Redis]:
    """A synchronous client on an empty database, for looking at what the workers did."""
    client = redis_client.Redis.from_url(redis.url)
    client.flushdb()
    yield client
    client.close()


async def submit(url: str, *job_ids: str) -> None:
    queue = JobQueue(url)
    try:
        for job_id in job_ids:
            await queue.submit(job_id, "flaky", "", b"{}", 2)
    finally:
        await queue.close()


def delivery_counts(store: redis_client.Redis) -> dict[str, int]:
    pending = store.xpending_range(STREAM, GROUP, "-", "+", 100)
    return {entry["message_id"].decode(): entry["times_delivered"] for entry in pending}


async def test_a_malformed_entry_is_dead_lettered_and_the_jobs_read_with_it_run(
    redis: RedisServer, store: redis_client.Redis
) -> None:
    consumer = JobConsumer(redis.url, "w1", RECLAIM_AFTER_S)
    try:
        await consumer.ensure_group()
        await submit(redis.url, "good-1")
        bogus = store.xadd(STREAM, {"job": "bogus2", "model": "digits"})
        # Names its record, which a worker ends too: its client is not left waiting.
        half = store.xadd(STREAM, {"job": "half", "model": "digits", "version": "",
                                   "body": b"{}", "header_length": "x"})  # fmt: skip
        store.hset(record_key("half"), mapping={"state": "pending", "entry": half})
        await submit(redis.url, "good-2")
        jobs = await consumer.read(10, block_ms=100)
        assert [job.job_id for job in jobs] == ["good-1", "good-2"]
        assert consumer.held == {job.entry_id for job in jobs}
        dead = {fields[b"job"]: fields for _, fields in store.xrange(DEAD)}
        assert set(dead) == {b"bogus2", b"half"}
        assert b"missing version, body, header_length" in dead[b"bogus2"][b"error"]
        assert b"header_length must be an integer" in dead[b"half"][b"error"]
        assert store.hget(record_key("half"), "state") == b"failed"
        assert store.hget(record_key("half"), "error_status") == b"500"
        # Gone from the stream and the group; only the two jobs are left, and run.
        assert store.xlen(STREAM) == 2 and set(delivery_counts(store)) == {
            job.entry_id.decode() for job in jobs
        }
        assert bogus.decode() not in delivery_counts(store)
        done = [Finished(job, "done", result=b"{}") for job in jobs]
        assert await consumer.finish(done) == 2
        assert store.xlen(STREAM) == 0
    finally:
        await consumer.close()


async def test_a_malformed_entry_reclaimed_from_a_dead_worker_is_dead_lettered_too(
    redis: RedisServer, store: redis_client.Redis
) -> None:
    consumer = JobConsumer(redis.url, "w1", RECLAIM_AFTER_S)
    try:
        await consumer.ensure_group()
        await submit(redis.url, "good-1")
        store.xadd(STREAM, {"job": "bogus2", "model": "digits"})
        store.xreadgroup(GROUP, "died", {STREAM: ">"}, count=10)  # read, never finished
        await asyncio.sleep(RECLAIM_AFTER_S * 1.5)
        jobs = await consumer.reclaim(10)
        assert [job.job_id for job in jobs] == ["good-1"]
        assert [fields[b"job"] for _, fields in store.xrange(DEAD)] == [b"bogus2"]
    finally:
        await consumer.close()


async def test_jobs_a_worker_holds_are_not_reclaimed_by_it_nor_look_idle_to_others(
    redis: RedisServer, store: redis_client.Redis
) -> None:
    holder = JobConsumer(redis.url, "holder", RECLAIM_AFTER_S)
    other = JobConsumer(redis.url, "other", RECLAIM_AFTER_S)
    try:
        await holder.ensure_group()
        await submit(redis.url, "a", "b", "c")
        jobs = await holder.read(10, block_ms=100)
        assert len(jobs) == 3
        # Waiting in the holder's batcher past the reclaim timeout, kept fresh as the
        # worker's hold loop does: no other worker takes them.
        for _ in range(6):
            assert await holder.refresh_held() == 3
            await asyncio.sleep(RECLAIM_AFTER_S / 3)
        assert await other.reclaim(10) == []
        # Refreshing counted no delivery: an attempt is counted only by a real restart.
        assert set(delivery_counts(store).values()) == {1}
        # Nor does the holder take back its own, however long they wait.
        await asyncio.sleep(RECLAIM_AFTER_S * 1.5)
        assert await holder.reclaim(10) == []
        # Released after a fault: idle from then on, and another worker takes them over.
        holder.release(jobs)
        await holder.refresh_held()
        await asyncio.sleep(RECLAIM_AFTER_S * 1.5)
        assert sorted(job.job_id for job in await other.reclaim(10)) == ["a", "b", "c"]
        # The holder, stalled past the timeout, does not take back what another reclaimed.
        holder.held.update(job.entry_id for job in jobs)
        assert await holder.refresh_held() == 0
        owners = {e["consumer"] for e in store.xpending_range(STREAM, GROUP, "-", "+", 10)}
        assert owners == {b"other"}
    finally:
        await holder.close()
        await other.close()


async def test_a_spent_job_ends_with_the_status_of_its_last_fault(
    redis: RedisServer, store: redis_client.Redis
) -> None:
    consumer = JobConsumer(redis.url, "w1", RECLAIM_AFTER_S)
    try:
        await consumer.ensure_group()
        await submit(redis.url, "unready", "crashed")
        jobs = await consumer.read(10, block_ms=100)
        claims = await consumer.claim(jobs, max_attempts=1)
        assert [(c.attempts, c.last_error, c.last_error_status) for c in claims] == [
            (1, "", 0), (1, "", 0)
        ]  # fmt: skip
        # The first faulted (its model not ready: 503), the second's worker died.
        fault = Finished(jobs[0], "retry", error="model 'flaky' is not ready", error_status=503)
        await consumer.finish([fault])
        claims = await consumer.claim(jobs, max_attempts=1)
        assert [(c.attempts, c.last_error_status) for c in claims] == [(2, 503), (2, 0)]
        ends = [_spent(claim, 1) for claim in claims]
        assert [end.error_status for end in ends] == [503, 500]
        assert "model 'flaky' is not ready" in ends[0].error
        assert await consumer.finish(ends) == 2
        assert store.hget(record_key("unready"), "error_status") == b"503"
        assert store.hget(record_key("crashed"), "error_status") == b"500"
    finally:
        await consumer.close()


def keda_trigger_count(store: redis_client.Redis, metadata: dict[str, str]) -> int:
    """What KEDA's redis-streams scaler reads for one trigger (its rule is restated in
    tests/unit/test_deploy.py::keda_redis_streams_counts)."""
    if "consumerGroup" not in metadata:
        return int(store.xlen(metadata["stream"]))
    if int(metadata.get("lagCount", "0")):
        group = metadata["consumerGroup"].encode()
        return next(int(g["lag"]) for g in store.xinfo_groups(metadata["stream"])
                    if g["name"] == group)  # fmt: skip
    return int(store.xpending(metadata["stream"], metadata["consumerGroup"])["pending"])


def scale_to_zero_active(store: redis_client.Redis) -> bool:
    """Whether KEDA keeps (or starts) a worker: any trigger above its activation count."""
    spec = yaml.safe_load(SCALE_TO_ZERO.read_text())["spec"]
    return any(
        keda_trigger_count(store, t["metadata"]) > int(t["metadata"].get("activationLagCount", 0))
        for t in spec["triggers"]
    )


async def test_scale_to_zero_wakes_a_worker_for_jobs_a_killed_worker_held(
    redis: RedisServer, store: redis_client.Redis
) -> None:
    consumer = JobConsumer(redis.url, "killed", RECLAIM_AFTER_S)
    try:
        await consumer.ensure_group()
        await submit(redis.url, *(f"job-{i}" for i in range(5)))
        assert scale_to_zero_active(store)  # unread: the lag
        jobs = await consumer.read(10, block_ms=100)
        # Read by a worker that was then killed: lag 0, every job still unfinished.
        assert store.xinfo_groups(STREAM)[0]["lag"] == 0
        assert scale_to_zero_active(store)
        await consumer.finish([Finished(job, "done", result=b"{}") for job in jobs])
        assert not scale_to_zero_active(store)  # all done: down to zero
    finally:
        await consumer.close()
