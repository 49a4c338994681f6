"""``slipstream worker``: runs the jobs of the Redis stream through the serving core.

A worker is a front end whose transport is the job stream instead of a socket: it loads
the repository into the same :class:`~slipstream.serving.core.ModelServer` the HTTP
server uses (config, batcher, instances, metrics), and each round is three steps:

    jobs = read()                  # XREADGROUP (or XAUTOCLAIM: jobs idle too long)
    runs = claim(jobs)             # count an attempt; skip ended jobs, dead-letter spent ones
    finish(await infer_all(runs))  # every request at once into the batcher, then one
                                   # pipeline of results (written once) + XACK + XDEL

Several rounds are in flight (``--rounds``), so one reads while another computes, and
any number of workers on any hosts share the stream (see :mod:`slipstream.jobs.consumer`).
While a round's jobs wait in the batcher, the worker keeps them from looking idle
(``hold_loop``), so that no worker, itself included, reclaims and runs them twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from slipstream.config import ServerSettings
from slipstream.errors import ClientError, RequestTimeout, SlipstreamError, Unavailable
from slipstream.jobs.consumer import Claim, Finished, JobConsumer, StoredJob
from slipstream.jobs.settings import WorkerSettings
from slipstream.observability.metrics import ServerMetrics
from slipstream.protocol import v2
from slipstream.server.runner import stop_on_signals
from slipstream.serving.core import ModelServer
from slipstream.types import InferRequest, InferResponse

logger = logging.getLogger(__name__)

# How long a round backs off after Redis failed, before it reads again.
_REDIS_RETRY_S = 1.0
# A model queue full (its max_queue_size below --prefetch x --rounds): how long a job
# waits for room, and how often it asks.
_QUEUE_FULL_WAIT_S = 30.0
_QUEUE_FULL_BACKOFF_S = 0.05


async def run_worker(settings: WorkerSettings, stop: asyncio.Event | None = None) -> int:
    """Process jobs until ``stop`` is set or SIGTERM/SIGINT arrives; the exit code."""
    stop = stop_on_signals(stop)
    metrics = ServerMetrics()
    service = ModelServer(
        ServerSettings(model_repository=settings.model_repository, http_port=0, grpc_port=0,
                       shutdown_timeout_s=settings.shutdown_timeout_s,
                       trust_pickle=settings.trust_pickle),
        metrics,
    )  # fmt: skip
    if settings.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(settings.metrics_port, registry=metrics.registry)
    consumer = JobConsumer(settings.redis, settings.consumer, settings.reclaim_after_s,
                           settings.result_ttl_s)  # fmt: skip
    try:
        await service.start()
        await consumer.ensure_group()
    except Exception as exc:
        logger.error("worker could not start: %s: %s", type(exc).__name__, exc)
        await service.stop()
        await consumer.close()
        return 1
    worker = Worker(service, consumer, settings)
    logger.info("worker %s ready: jobs from %s", settings.consumer,
                settings.redis.split("@")[-1])  # fmt: skip
    rounds = [asyncio.create_task(worker.read_loop(stop)) for _ in range(settings.rounds)]
    rounds.append(asyncio.create_task(worker.reclaim_loop(stop)))
    # Until the last round is over: the jobs of a round finishing on SIGTERM stay held.
    holding = asyncio.create_task(worker.hold_loop())
    await stop.wait()
    logger.info("worker stopping: finishing its rounds (up to %.0f s)", settings.shutdown_timeout_s)
    _, unfinished = await asyncio.wait(rounds, timeout=settings.shutdown_timeout_s + 2)
    for task in [*unfinished, holding]:
        task.cancel()
    await service.stop()
    await consumer.close()
    return 0


class Worker:
    """The rounds of one worker process; see the module docstring."""

    def __init__(
        self, service: ModelServer, consumer: JobConsumer, settings: WorkerSettings
    ) -> None:
        self._service = service
        self._consumer = consumer
        self._settings = settings
        # Ends written by this worker (a job run twice is written once, by one of them).
        self.finished = 0

    async def read_loop(self, stop: asyncio.Event) -> None:
        """Rounds of new jobs until ``stop``; a round under way is finished first."""
        while not stop.is_set():
            try:
                jobs = await self._consumer.read(self._settings.prefetch)
                if jobs:
                    await self.run_round(jobs)
            except Exception as exc:
                await _redis_failed(exc)
                if "NOGROUP" in str(exc):
                    # A Redis restarted without persistence lost the group: a new one
                    # reads the stream from its start.
                    with contextlib.suppress(Exception):
                        await self._consumer.ensure_group()

    async def reclaim_loop(self, stop: asyncio.Event) -> None:
        """Take over jobs idle past the reclaim timeout, a few times per timeout."""
        interval_s = min(self._settings.reclaim_after_s / 4, 5.0)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
            if stop.is_set():
                return
            try:
                while jobs := await self._consumer.reclaim(self._settings.prefetch):
                    logger.info("reclaimed %d jobs idle over %.1f s", len(jobs),
                                self._settings.reclaim_after_s)  # fmt: skip
                    await self.run_round(jobs)
            except Exception as exc:
                await _redis_failed(exc)

    async def hold_loop(self) -> None:
        """Until cancelled, zero the idle time of the jobs this worker holds, a few times
        per reclaim timeout: Redis counts idle time from the read, and a job waiting in
        the batcher behind a long prefetch would otherwise be reclaimed (by this worker or
        another) and run again, an attempt counted against a job nothing went wrong with."""
        interval_s = self._settings.reclaim_after_s / 4
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self._consumer.refresh_held()
            except Exception as exc:
                await _redis_failed(exc)

    async def run_round(self, jobs: list[StoredJob]) -> None:
        try:
            claims = await self._consumer.claim(jobs, self._settings.max_attempts)
            finished: list[Finished] = []
            runs: list[StoredJob] = []
            for claim in claims:
                if claim.attempts < 0:  # ended elsewhere, or its record expired: drop it
                    finished.append(Finished(claim.job, "ack"))
                elif claim.attempts > self._settings.max_attempts:
                    finished.append(_spent(claim, self._settings.max_attempts))
                else:
                    runs.append(claim.job)
            finished += await asyncio.gather(*(self._run(job) for job in runs))
            self.finished += await self._consumer.finish(finished)
        finally:
            # Finished, or left pending (a fault, Redis down): idle from now, reclaimable.
            self._consumer.release(jobs)

    async def _run(self, job: StoredJob) -> Finished:
        request: InferRequest | None = None
        try:
            request = v2.decode_infer_request(
                job.body, job.header_length, job.model_name, job.model_version
            )
            response = await self._infer(request)
            body, _ = v2.encode_infer_response(response, request)
        except ClientError as exc:
            # The request itself is wrong: no attempt can succeed.
            return Finished(job, "failed", error=exc.message, error_status=exc.http_status)
        except SlipstreamError as exc:  # a fault, a full queue, a model not ready: again
            if isinstance(exc, RequestTimeout) and request is not None and request.timeout_us:
                # The client's own timeout ran out: the synchronous route answers 503 at
                # that point, and a retry would run the job long after the time it set.
                return Finished(job, "failed", error=exc.message, error_status=exc.http_status)
            return Finished(job, "retry", error=exc.message, error_status=exc.http_status)
        except Exception as exc:
            logger.exception("job %s failed unexpectedly", job.job_id)
            return Finished(job, "retry", error=f"internal error: {type(exc).__name__}",
                            error_status=500)  # fmt: skip
        return Finished(job, "done", result=body)

    async def _infer(self, request: InferRequest) -> InferResponse:
        """The request's response; a full model queue (503) is waited out here, briefly,
        rather than left for a reclaim (``--reclaim-after-s``) and counted as an attempt."""
        deadline = time.monotonic() + _QUEUE_FULL_WAIT_S
        while True:
            try:
                return await self._service.infer(request)
            except RequestTimeout:
                raise
            except Unavailable:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(_QUEUE_FULL_BACKOFF_S)


def _spent(claim: Claim, max_attempts: int) -> Finished:
    error = f"gave up after {max_attempts} attempts"
    if claim.last_error:
        error += f"; the last one: {claim.last_error}"
    else:
        error += " (each worker stopped before finishing it)"
    logger.warning("job %s: %s", claim.job.job_id, error)
    # The last fault's status, as the synchronous route answers it (503 for a model not
    # ready); 500 when workers died (or a worker older than last_error_status) left none.
    status = claim.last_error_status or 500
    return Finished(claim.job, "failed", error=error, error_status=status)


async def _redis_failed(exc: Exception) -> None:
    logger.warning("job stream: %s: %s; trying again in %.0f s", type(exc).__name__, exc,
                   _REDIS_RETRY_S)  # fmt: skip
    await asyncio.sleep(_REDIS_RETRY_S)
