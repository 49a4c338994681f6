"""Issue #17, part 3: asynchronous inference on a Redis stream (a real ``redis-server``).

A server started with ``--jobs-redis`` answers ``Prefer: respond-async`` and
``POST /v2/jobs`` with 202 and a job id; ``slipstream worker`` processes run the jobs
through their own serving core and ``GET /v2/jobs/{id}`` returns the result. The test
that matters most: 1,000 jobs, a worker killed with SIGKILL in the middle of its
batches, and every job ends exactly once (one result each, none lost), with only the
jobs made to fail on purpose in the dead-letter stream.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import redis as redis_client

from slipstream.jobs.codec import encode_stored_request
from slipstream.jobs.queue import DEAD, GROUP, STREAM, JobQueue, record_key
from slipstream.types import InferRequest
from tests.flaky import build_flaky, flaky_command, flaky_input, logged_runs
from tests.models import ADD_SUB_WIDTH, build_add_sub
from tests.redis_server import RedisServer
from tests.utils import RemoteServer, free_ports

pytestmark = pytest.mark.slow

# Short timeouts keep the retries and reclaims of these tests within seconds.
WORKER_ARGS = ["--reclaim-after-s", "1", "--max-attempts", "3", "--prefetch", "32"]
# A model queue shorter than a worker's rounds (2 x 32 jobs): the worker waits for room.
FLAKY_CONFIG = {"max_batch_size": 16, "dynamic_batching": {"max_queue_size": 8}}
MAX_PENDING = 20
WAIT_S = 60.0


class Worker:
    """``slipstream worker`` (with the flaky backend) in a subprocess."""

    def __init__(self, redis_url: str, repo: Path, log_dir: Path, name: str, *args: str) -> None:
        self.name = name
        self.log_path = log_dir / f"worker-{name}.log"
        argv = [*flaky_command(), "worker", "--redis", redis_url, "--repository", str(repo),
                "--consumer", name, *WORKER_ARGS, *args]  # fmt: skip
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )  # fmt: skip

    metrics_url = ""

    def wait_ready(self) -> None:
        wait_for(lambda: "ready: jobs from" in self.log(), f"worker {self.name} ready", self)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


def wait_for(condition: Callable[[], bool], what: str, worker: Worker | None = None) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if worker is not None and worker.proc.poll() is not None:
            raise AssertionError(f"worker {worker.name} exited:\n{worker.log()[-4000:]}")
        if time.monotonic() > deadline:
            tail = worker.log()[-4000:] if worker else ""
            raise AssertionError(f"timed out waiting for {what}\n{tail}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("redis")) as running:
        yield running


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("jobs_repo")
    build_add_sub(root / "models")
    build_flaky(root / "models", root / "runs.jsonl", delay_ms=5, config=FLAKY_CONFIG)
    # One request at a time, each 300 ms: a job behind another waits in the queue.
    build_flaky(root / "models", root / "slow_runs.jsonl", delay_ms=300,
                config={"max_batch_size": 1}, name="slow")  # fmt: skip
    return root / "models"


@pytest.fixture(scope="module")
def server(
    repo: Path, redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RemoteServer]:
    args = ["--jobs-redis", redis.url, "--jobs-max-pending", str(MAX_PENDING)]
    log_dir = tmp_path_factory.mktemp("jobs_server")
    with RemoteServer(repo, args, log_dir=log_dir, command=flaky_command()) as running:
        yield running


@pytest.fixture(scope="module")
def worker(
    repo: Path, redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Worker]:
    metrics_port = free_ports(1)[0]
    running = Worker(redis.url, repo, tmp_path_factory.mktemp("worker"), "w0",
                     "--metrics-port", str(metrics_port))  # fmt: skip
    running.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        running.wait_ready()
        yield running
    finally:
        code = running.stop()
    assert code == 0, running.log()[-4000:]


@pytest.fixture
def client(server: RemoteServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.http_url, timeout=30) as http:
        yield http


def add_sub_body(a: np.ndarray, b: np.ndarray, **extra: Any) -> bytes:
    inputs = [{"name": name, "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}
              for name, x in (("INPUT0", a), ("INPUT1", b))]  # fmt: skip
    return orjson.dumps({"inputs": inputs, **extra})


def wait_done(client: httpx.Client, job_id: str) -> dict[str, Any]:
    result: dict[str, Any] = {}

    def ended() -> bool:
        nonlocal result
        reply = client.get(f"/v2/jobs/{job_id}")
        assert reply.status_code == 200, reply.text
        result = reply.json()
        return bool(result["status"] != "pending")

    wait_for(ended, f"job {job_id}")
    return result


def test_prefer_respond_async_answers_202_and_the_job_the_same_response(
    client: httpx.Client, worker: Worker
) -> None:
    a = np.arange(2 * ADD_SUB_WIDTH, dtype=np.float32).reshape(2, ADD_SUB_WIDTH)
    body = add_sub_body(a, a / 2, id="req-1")
    sync = client.post("/v2/models/add_sub/infer", content=body)
    reply = client.post("/v2/models/add_sub/infer", content=body,
                        headers={"Prefer": "respond-async, wait=0"})  # fmt: skip
    assert reply.status_code == 202, reply.text
    job = reply.json()
    assert reply.headers["location"] == f"/v2/jobs/{job['job_id']}"
    assert reply.headers["preference-applied"] == "respond-async"
    assert job["status"] in ("pending", "done") and job["model_name"] == "add_sub"
    done = wait_done(client, job["job_id"])
    assert done["status"] == "done" and done["attempts"] == 1
    assert done["result"] == sync.json()  # the same V2 response, id included


def test_post_jobs_names_the_model_in_the_body_and_takes_binary_tensors(
    client: httpx.Client, worker: Worker
) -> None:
    a = np.full((1, ADD_SUB_WIDTH), 3.0, np.float32)
    reply = client.post("/v2/jobs", content=add_sub_body(a, a, model="add_sub"))
    assert reply.status_code == 202, reply.text
    done = wait_done(client, reply.json()["job_id"])
    assert done["result"]["outputs"][0]["data"] == [6.0] * ADD_SUB_WIDTH
    # Triton's binary tensor extension on the model's route.
    header = orjson.dumps({"inputs": [
        {"name": name, "datatype": "FP32", "shape": [1, ADD_SUB_WIDTH],
         "parameters": {"binary_data_size": 4 * ADD_SUB_WIDTH}} for name in ("INPUT0", "INPUT1")
    ]})  # fmt: skip
    binary = header + a.tobytes() + (a * 2).tobytes()
    headers = {"Prefer": "respond-async", "Inference-Header-Content-Length": str(len(header))}
    reply = client.post("/v2/models/add_sub/infer", content=binary, headers=headers)
    assert reply.status_code == 202, reply.text
    done = wait_done(client, reply.json()["job_id"])
    assert done["result"]["outputs"][1]["data"] == [-3.0] * ADD_SUB_WIDTH


def test_a_job_id_submitted_twice_is_one_job_run_once(
    client: httpx.Client, worker: Worker, redis: RedisServer, repo: Path
) -> None:
    body = orjson.dumps({"model": "flaky", "inputs": [{"name": "INPUT0", "datatype": "FP32",
                         "shape": [1, 4], "data": [7001.0, 1.0, 2.0, 3.0]}]})  # fmt: skip
    headers = {"Idempotency-Key": "order-7001"}
    first = client.post("/v2/jobs", content=body, headers=headers)
    second = client.post("/v2/jobs", content=body, headers=headers)
    assert first.status_code == second.status_code == 202
    assert first.json()["job_id"] == second.json()["job_id"] == "order-7001"
    wait_done(client, "order-7001")
    third = client.post("/v2/jobs", content=body, headers=headers)  # after it ended
    assert third.json()["status"] == "done" and "result" in third.json()
    assert logged_runs(repo.parent / "runs.jsonl").count(7001.0) == 1
    store = redis_client.Redis.from_url(redis.url)
    assert store.hget(record_key("order-7001"), "results") == b"1"


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "named"),
    [
        ("/v2/jobs", {"inputs": []}, {}, 400, "model:"),
        ("/v2/jobs", {"model": "nope", "inputs": []}, {}, 404, "nope"),
        ("/v2/jobs", {"model": "add_sub", "model_version": "x", "inputs": []}, {}, 400,
         "model_version"),
        ("/v2/models/add_sub/infer", {"inputs": [{"name": "INPUT9", "datatype": "FP32",
         "shape": [1, 16], "data": [0] * 16}]}, {"Prefer": "respond-async"}, 400, "INPUT9"),
        ("/v2/models/add_sub/infer", {"inputs": [{"name": "INPUT0", "datatype": "INT32",
         "shape": [1, 16], "data": [0] * 16}]}, {"Prefer": "respond-async"}, 400, "INT32"),
        ("/v2/models/add_sub/infer", {"inputs": "x"}, {"Prefer": "respond-async"}, 400, "inputs"),
        ("/v2/jobs", {"model": "add_sub", "inputs": []}, {"Idempotency-Key": "a/b"}, 400,
         "Idempotency-Key"),
    ],
)  # fmt: skip
def test_a_bad_submission_is_answered_at_once_naming_the_field(
    client: httpx.Client, path: str, body: Any, headers: dict[str, str], status: int, named: str
) -> None:
    reply = client.post(path, content=orjson.dumps(body), headers=headers)
    assert reply.status_code == status, reply.text
    assert named in reply.json()["error"]


def test_a_job_whose_own_timeout_expires_fails_at_once_with_the_synchronous_status(
    client: httpx.Client, worker: Worker
) -> None:
    """A request's ``timeout`` parameter bounds its wait in the model's queue; the
    synchronous route answers 503 when it runs out, and so does the job, on its first
    attempt, instead of being retried through reclaim timeouts and ending as a 500."""

    def body(tag: float, **extra: Any) -> bytes:
        return orjson.dumps({"model": "slow", "inputs": [{"name": "INPUT0", "datatype": "FP32",
                             "shape": [1, 4], "data": [tag, 1.0, 2.0, 3.0]}], **extra})  # fmt: skip

    ahead = [client.post("/v2/jobs", content=body(9100.0 + i)).json()["job_id"] for i in range(2)]
    # Both claimed: in the model's queue, 600 ms of work that the next job waits behind.
    wait_for(lambda: all(client.get(f"/v2/jobs/{job_id}").json()["attempts"] == 1
                         for job_id in ahead), "the jobs ahead to start", worker)  # fmt: skip
    reply = client.post("/v2/jobs", content=body(9110.0, parameters={"timeout": 1000}))
    assert reply.status_code == 202, reply.text
    started = time.monotonic()
    failed = wait_done(client, reply.json()["job_id"])
    assert failed["status"] == "failed" and failed["error_status"] == 503, failed
    assert failed["attempts"] == 1 and "timed out" in failed["error"]
    assert time.monotonic() - started < 1.0  # not after a reclaim (--reclaim-after-s 1)
    assert all(wait_done(client, job_id)["status"] == "done" for job_id in ahead)


def test_jobs_waiting_in_a_workers_batcher_past_the_reclaim_timeout_run_once(
    redis: RedisServer, tmp_path: Path
) -> None:
    """A worker reads the 20 jobs at once and runs them one by one for 2 s, with
    --reclaim-after-s 1: the last ones wait in its batcher past the timeout, and neither
    it nor the other worker (which reclaims every 0.25 s) may take them as abandoned, run
    them again and count an attempt (three such and a healthy job is dead-lettered)."""
    url = redis.url + "/3"  # a database of its own: no other test's worker reads it
    repo = tmp_path / "models"
    runs = tmp_path / "runs.jsonl"
    build_flaky(repo, runs, delay_ms=100, config={"max_batch_size": 1})
    asyncio.run(submit_jobs(url, [(f"held-{i}", i + 1.0) for i in range(20)]))
    store = redis_client.Redis.from_url(url)
    workers = [Worker(url, repo, tmp_path, name) for name in ("first", "second")]
    try:
        workers[0].wait_ready()
        wait_for(lambda: store.xlen(STREAM) == 0, "every job to end", workers[0])
    finally:
        logs = ""
        for worker in workers:
            assert worker.stop() == 0, worker.log()[-4000:]
            logs += worker.log()
    attempts = [int(store.hget(record_key(f"held-{i}"), "attempts") or 0) for i in range(20)]
    assert attempts == [1] * 20
    tags = sorted(tag for tag in logged_runs(runs) if tag > 0)  # 0: the warm-up's
    assert tags == [i + 1.0 for i in range(20)]  # each ran once
    assert "reclaimed" not in logs
    assert store.xlen(DEAD) == 0


def test_a_worker_serves_the_servers_metrics_names(client: httpx.Client, worker: Worker) -> None:
    a = np.zeros((1, ADD_SUB_WIDTH), np.float32)
    reply = client.post("/v2/jobs", content=add_sub_body(a, a, model="add_sub"))
    wait_done(client, reply.json()["job_id"])
    text = httpx.get(worker.metrics_url, timeout=10).text
    assert re.search(r'slipstream_request_success_total\{model="add_sub",version="1"\} [1-9]', text)


def test_unknown_jobs_are_404_and_the_routes_answer_405_for_other_methods(
    client: httpx.Client,
) -> None:
    reply = client.get("/v2/jobs/never-submitted")
    assert reply.status_code == 404 and "never-submitted" in reply.json()["error"]
    assert client.get("/v2/jobs").status_code == 405
    assert client.post("/v2/jobs/x").status_code == 405


def test_a_full_stream_answers_503_with_retry_after_and_drains_after(
    client: httpx.Client, worker: Worker
) -> None:
    body = orjson.dumps({"model": "flaky", "inputs": [{"name": "INPUT0", "datatype": "FP32",
                         "shape": [1, 4], "data": [8000.0, 1.0, 2.0, 3.0]}]})  # fmt: skip
    worker.proc.send_signal(signal.SIGSTOP)  # no worker reads: the stream fills up
    try:
        accepted = []
        for _ in range(MAX_PENDING + 1):
            reply = client.post("/v2/jobs", content=body)
            if reply.status_code != 202:
                break
            accepted.append(reply.json()["job_id"])
        assert reply.status_code == 503, reply.text
        assert reply.headers["retry-after"] == "5"
        assert "job queue is full" in reply.json()["error"]
        assert "--jobs-max-pending" in reply.json()["error"]
        assert len(accepted) == MAX_PENDING
    finally:
        worker.proc.send_signal(signal.SIGCONT)
    for job_id in accepted:
        assert wait_done(client, job_id)["status"] == "done"


def test_1000_jobs_survive_a_worker_killed_mid_batch_exactly_once(
    redis: RedisServer, tmp_path: Path
) -> None:
    url = redis.url + "/2"  # a database of its own: no other test's worker reads it
    repo = tmp_path / "models"
    runs = tmp_path / "runs.jsonl"
    build_flaky(repo, runs, delay_ms=4, config=FLAKY_CONFIG)
    poisoned = {f"job-{i}" for i in range(0, 1000, 100)}  # 10 fail on purpose
    asyncio.run(submit_jobs(url, [(f"job-{i}", -i - 1.0 if f"job-{i}" in poisoned else i + 1.0)
                                  for i in range(1000)]))  # fmt: skip
    store = redis_client.Redis.from_url(url)
    doomed = Worker(url, repo, tmp_path, "doomed")
    survivor = Worker(url, repo, tmp_path, "survivor")
    try:
        doomed.wait_ready()
        # Killed while it holds jobs read and not finished, after it finished some.
        wait_for(lambda: consumer_pending(store, "doomed") > 0 and ended(store) >= 100,
                 "the doomed worker in the middle of its batches", doomed)  # fmt: skip
        held = consumer_pending(store, "doomed")
        doomed.proc.kill()
        doomed.proc.wait(10)
        survivor.wait_ready()
        wait_for(lambda: ended(store) == 1000, "every job to end", survivor)
    finally:
        doomed.stop()
        assert survivor.stop() == 0, survivor.log()[-4000:]
    records = {f"job-{i}": store.hgetall(record_key(f"job-{i}")) for i in range(1000)}
    states = {job: record[b"state"] for job, record in records.items()}
    assert {job for job, state in states.items() if state == b"failed"} == poisoned
    assert all(record[b"results"] == b"1" for record in records.values())  # written once
    for i in range(1000):
        job = f"job-{i}"
        if job not in poisoned:
            result = orjson.loads(records[job][b"result"])
            assert result["outputs"][0]["data"][0] == i + 1.0, job
    # The killed worker's jobs were taken over and run again (a second attempt).
    assert held > 0 and any(int(r[b"attempts"]) >= 2 for j, r in records.items()
                            if j not in poisoned)  # fmt: skip
    dead = store.xrange(DEAD)
    assert {fields[b"job"].decode() for _, fields in dead} == poisoned
    assert all(b"failing on purpose" not in fields[b"error"] for _, fields in dead)
    assert all(b"gave up after 3 attempts" in fields[b"error"] for _, fields in dead)
    assert all(fields[b"attempts"] == b"3" for _, fields in dead)
    assert store.xlen(STREAM) == 0 and store.xpending(STREAM, GROUP)["pending"] == 0
    # A row run twice (its worker died before writing) still has one result.
    tags = logged_runs(runs)
    assert {tag for tag in tags if tag > 0} == {i + 1.0 for i in range(1000)
                                               if f"job-{i}" not in poisoned}  # fmt: skip


async def submit_jobs(url: str, jobs: list[tuple[str, float]]) -> None:
    queue = JobQueue(url)
    try:
        for job_id, tag in jobs:
            request = InferRequest("flaky", "", {"INPUT0": flaky_input(tag)})
            body, header_length = encode_stored_request(request)
            await queue.submit(job_id, "flaky", "", body, header_length)
    finally:
        await queue.close()


def consumer_pending(store: redis_client.Redis, name: str) -> int:
    for consumer in store.xinfo_consumers(STREAM, GROUP):
        if consumer["name"] == name.encode() or consumer["name"] == name:
            return int(consumer["pending"])
    return 0


def ended(store: redis_client.Redis) -> int:
    """Jobs ended (done or failed) of the 1,000."""
    with store.pipeline(transaction=False) as pipe:
        for i in range(1000):
            pipe.hget(record_key(f"job-{i}"), "state")
        states = pipe.execute()
    return sum(state in (b"done", b"failed") for state in states)


def test_a_redis_outage_is_a_clear_503_and_jobs_run_again_once_it_is_back(
    client: httpx.Client, worker: Worker, redis: RedisServer
) -> None:
    body = orjson.dumps({"model": "flaky", "inputs": [{"name": "INPUT0", "datatype": "FP32",
                         "shape": [1, 4], "data": [9000.0, 1.0, 2.0, 3.0]}]})  # fmt: skip
    redis.kill()
    try:
        reply = client.post("/v2/jobs", content=body)
        assert reply.status_code == 503, reply.text
        assert "job queue (Redis) is unreachable" in reply.json()["error"]
        assert client.get("/v2/jobs/order-7001").status_code == 503
    finally:
        redis.start()  # empty: no persistence, the consumer group is gone too
    reply = client.post("/v2/jobs", content=body)
    assert reply.status_code == 202, reply.text
    assert wait_done(client, reply.json()["job_id"])["status"] == "done"
