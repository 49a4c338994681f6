"""The dynamic batcher with a fake backend: batching, queue policy, failure isolation."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import uvloop

from slipstream.config import ConfigError, parse_model_config
from slipstream.errors import InternalError, InvalidRequest, RequestTimeout, Unavailable
from slipstream.observability.metrics import ServerMetrics
from slipstream.observability.stats import ModelStatsRecorder
from slipstream.runtime.base import Backend, ModelSignature
from slipstream.scheduling.batcher import Batcher


class FakeBackend(Backend):
    """Doubles its input; records each batch; can be slowed down or made to fail."""

    name = "fake"

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.batches: list[np.ndarray] = []
        self.gate = threading.Event()
        self.gate.set()
        self.running = 0
        self.max_running = 0
        self._lock = threading.Lock()
        self.threads: set[str] = set()

    @classmethod
    def load(cls, path: Path, parameters: dict[str, str], instance_count: int) -> FakeBackend:
        return cls()

    def signature(self) -> ModelSignature:
        return ModelSignature((), ())

    def run(self, inputs: dict[str, np.ndarray], output_names: Sequence[str]) -> dict[str, Any]:
        with self._lock:
            self.running += 1
            self.max_running = max(self.max_running, self.running)
        try:
            self.threads.add(threading.current_thread().name)
            self.gate.wait(5)
            time.sleep(self.delay_s)
            x = inputs["x"]
            self.batches.append(x.copy())
            if np.any(x < 0):
                raise InvalidRequest("input 'x': negative values are not allowed")
            if np.any(x == 999):
                raise RuntimeError("boom")
            return {"y": x * 2}
        finally:
            with self._lock:
                self.running -= 1


def make_batcher(
    backends: list[FakeBackend], **batching: Any
) -> tuple[Batcher, ModelStatsRecorder, ServerMetrics]:
    # Tests that hold a batch at the gate need it on a thread, never inline on the loop.
    batching.setdefault("inline_execution_max_microseconds", 0)
    config = parse_model_config(
        {
            "max_batch_size": batching.pop("max_batch_size", 8),
            "dynamic_batching": batching,
        },
        "test",
    )
    metrics = ServerMetrics()
    stats = ModelStatsRecorder("m", "1")
    batcher = Batcher(config, backends, ["y"], metrics.for_model("m", "1"), stats)
    return batcher, stats, metrics


def rows(*values: float) -> np.ndarray:
    return np.array([[v] for v in values], dtype=np.float32)


KEY = ((1,),)


async def until(condition: Any, what: str, timeout_s: float = 10.0) -> None:
    """Yield to the loop (and the instance threads) until ``condition()`` holds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.001)


async def held(backend: FakeBackend) -> None:
    """Wait until a batch is running on ``backend`` (held at its closed gate)."""
    await until(lambda: backend.running == 1, "a batch held at the gate")


async def test_lone_request_runs_at_once_and_returns_its_rows() -> None:
    backend = FakeBackend()
    batcher, stats, _ = make_batcher([backend])
    out = await batcher.submit({"x": rows(1, 2)}, 2, KEY)
    np.testing.assert_array_equal(out["y"], rows(2, 4))
    assert stats.snapshot().execution_count == 1


async def test_concurrent_requests_are_batched_and_split_back_exactly() -> None:
    backend = FakeBackend()
    backend.gate.clear()  # hold the first batch so the rest queue up
    batcher, stats, _ = make_batcher([backend])
    first = asyncio.ensure_future(batcher.submit({"x": rows(0)}, 1, KEY))
    await held(backend)
    others = [
        asyncio.ensure_future(batcher.submit({"x": rows(*range(i, i + n))}, n, KEY))
        for i, n in ((10, 1), (20, 3), (30, 2))
    ]
    await until(lambda: batcher.num_pending == 3, "three queued requests")
    backend.gate.set()
    await first
    results = await asyncio.gather(*others)
    np.testing.assert_array_equal(results[0]["y"], rows(20))
    np.testing.assert_array_equal(results[1]["y"], rows(40, 42, 44))
    np.testing.assert_array_equal(results[2]["y"], rows(60, 62))
    # The three queued requests ran as one batch of 6 rows.
    assert [len(b) for b in backend.batches] == [1, 6]
    snapshot = stats.snapshot()
    assert (snapshot.execution_count, snapshot.inference_count) == (2, 7)
    assert [b.batch_size for b in snapshot.batch_stats] == [1, 6]
    # Triton's compute time per request: the batch of three counted three times.
    model = batcher._metrics
    batches_ns = model.compute_duration.total * 1e9  # each batch once
    assert batches_ns < model.compute_request_ns < 3 * batches_ns


async def test_batches_never_exceed_max_batch_size() -> None:
    backend = FakeBackend()
    backend.gate.clear()
    batcher, _, _ = make_batcher([backend], max_batch_size=4)
    tasks = [asyncio.ensure_future(batcher.submit({"x": rows(i)}, 1, KEY)) for i in range(11)]
    # The 11 arrive in one loop turn: a first batch of 4 is held, 7 wait behind it.
    await until(lambda: backend.running == 1 and batcher.num_pending == 7, "7 queued")
    backend.gate.set()
    results = await asyncio.gather(*tasks)
    assert [float(r["y"][0, 0]) for r in results] == [2.0 * i for i in range(11)]
    assert max(len(b) for b in backend.batches) <= 4
    assert sum(len(b) for b in backend.batches) == 11


async def test_requests_with_different_shapes_are_not_mixed() -> None:
    backend = FakeBackend()
    backend.gate.clear()
    batcher, _, _ = make_batcher([backend])
    first = asyncio.ensure_future(batcher.submit({"x": rows(0)}, 1, KEY))
    await held(backend)
    wide = np.ones((1, 3), dtype=np.float32)
    tasks = [
        asyncio.ensure_future(batcher.submit({"x": rows(1)}, 1, KEY)),
        asyncio.ensure_future(batcher.submit({"x": wide}, 1, ((3,),))),
        asyncio.ensure_future(batcher.submit({"x": rows(2)}, 1, KEY)),
    ]
    await until(lambda: batcher.num_pending == 3, "three queued requests")
    backend.gate.set()
    await first
    results = await asyncio.gather(*tasks)
    np.testing.assert_array_equal(results[1]["y"], wide * 2)
    assert sorted(b.shape for b in backend.batches) == [(1, 1), (1, 3), (2, 1)]


async def test_queue_delay_is_cut_short_by_a_preferred_batch() -> None:
    backend = FakeBackend()
    batcher, _, _ = make_batcher(
        [backend], max_queue_delay_microseconds=60_000_000, preferred_batch_size=[4]
    )
    tasks = [asyncio.ensure_future(batcher.submit({"x": rows(i)}, 1, KEY)) for i in range(4)]
    # Four requests form the preferred size at once: no need to wait out the minute.
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert [len(b) for b in backend.batches] == [4]


async def test_queue_delay_holds_a_lone_request_then_runs_it() -> None:
    backend = FakeBackend()
    batcher, _, _ = make_batcher(
        [backend], max_queue_delay_microseconds=100_000, preferred_batch_size=[4]
    )
    loop = asyncio.get_running_loop()
    started = loop.time()
    await batcher.submit({"x": rows(9)}, 1, KEY)
    # A lone request waits for the delay (never less), then runs anyway.
    assert loop.time() - started >= 0.1
    assert [len(b) for b in backend.batches] == [1]


async def test_full_queue_is_refused_at_once_with_retry_after() -> None:
    backend = FakeBackend()
    backend.gate.clear()
    batcher, _, metrics = make_batcher([backend], max_queue_size=2)
    running = asyncio.ensure_future(batcher.submit({"x": rows(0)}, 1, KEY))
    await held(backend)
    queued = [asyncio.ensure_future(batcher.submit({"x": rows(i)}, 1, KEY)) for i in (1, 2)]
    await until(lambda: batcher.num_pending == 2, "two queued requests")
    with pytest.raises(Unavailable) as refused:
        await batcher.submit({"x": rows(3)}, 1, KEY)
    assert refused.value.retry_after_s == 1
    assert "queue is full" in refused.value.message
    backend.gate.set()
    await asyncio.gather(running, *queued)
    sample = metrics.registry.get_sample_value(
        "slipstream_request_failure_total", {"model": "m", "version": "1", "reason": "queue_full"}
    )
    assert sample == 1


async def test_timed_out_request_fails_and_never_runs() -> None:
    backend = FakeBackend()
    backend.gate.clear()
    batcher, _, _ = make_batcher([backend])
    running = asyncio.ensure_future(batcher.submit({"x": rows(0)}, 1, KEY))
    await held(backend)
    with pytest.raises(RequestTimeout, match="timed out"):
        await batcher.submit({"x": rows(5)}, 1, KEY, timeout_us=30_000)
    backend.gate.set()
    await running
    await batcher.submit({"x": rows(6)}, 1, KEY)
    ran = np.concatenate(backend.batches).ravel().tolist()
    assert 5.0 not in ran and ran == [0.0, 6.0]


async def test_default_timeout_comes_from_config() -> None:
    backend = FakeBackend()
    backend.gate.clear()
    batcher, _, _ = make_batcher([backend], default_timeout_microseconds=20_000)
    running = asyncio.ensure_future(batcher.submit({"x": rows(0)}, 1, KEY))
    await held(backend)
    with pytest.raises(RequestTimeout):
        await batcher.submit({"x": rows(1)}, 1, KEY)
    backend.gate.set()
    # The first request left the queue before its deadline, so it ran and succeeded.
    np.testing.assert_array_equal((await running)["y"], rows(0))


@pytest.mark.parametrize(
    ("default_us", "override", "requested_us", "waits_us"),
    [
        (20_000, True, 10_000_000, 20_000),  # a request cannot lengthen the default
        (10_000_000, True, 20_000, 20_000),  # ...but may shorten it
        (20_000, False, 10_000_000, 20_000),  # no override: the default holds
        (10_000_000, False, 20_000, 10_000_000),  # ...even against a shorter one
        (0, False, 20_000, 0),  # no default, no override: no timeout (Triton's)
        (0, True, 20_000, 20_000),  # no default: the request's own (Slipstream's)
    ],
)
async def test_a_request_s_timeout_applies_as_the_queue_policy_allows(
    default_us: int, override: bool, requested_us: int, waits_us: int
) -> None:
    backend = FakeBackend()
    backend.gate.clear()
    batcher, _, _ = make_batcher(
        [backend], default_timeout_microseconds=default_us, allow_timeout_override=override
    )
    running = asyncio.ensure_future(batcher.submit({"x": rows(0)}, 1, KEY))
    await held(backend)
    queued = asyncio.ensure_future(batcher.submit({"x": rows(1)}, 1, KEY, timeout_us=requested_us))
    await asyncio.sleep(0.2)  # past 20 ms, well within 10 s
    assert queued.done() == (waits_us == 20_000)
    if waits_us == 20_000:
        with pytest.raises(RequestTimeout):
            queued.result()
    backend.gate.set()
    await running
    if waits_us != 20_000:
        np.testing.assert_array_equal((await queued)["y"], rows(2))  # y = 2x


async def test_a_priority_level_s_own_queue_policy_bounds_and_times_out_its_requests() -> None:
    backend = FakeBackend()
    backend.gate.clear()
    batcher, _, _ = make_batcher(
        [backend],
        priority_levels=2,
        default_priority_level=2,
        priority_queue_policy={1: {"max_queue_size": 1, "default_timeout_microseconds": 20_000}},
    )
    running = asyncio.ensure_future(batcher.submit({"x": rows(0)}, 1, KEY, priority=2))
    await held(backend)
    urgent = asyncio.ensure_future(batcher.submit({"x": rows(1)}, 1, KEY, priority=1))
    await asyncio.sleep(0)
    # Level 1 holds one request at most; level 2, on the default policy, takes more.
    with pytest.raises(Unavailable, match="queue of priority level 1 is full"):
        await batcher.submit({"x": rows(2)}, 1, KEY, priority=1)
    relaxed = asyncio.ensure_future(batcher.submit({"x": rows(3)}, 1, KEY, priority=2))
    await asyncio.sleep(0.2)  # past level 1's 20 ms; level 2 has no timeout
    with pytest.raises(RequestTimeout):
        urgent.result()
    assert not relaxed.done()
    backend.gate.set()
    await running
    np.testing.assert_array_equal((await relaxed)["y"], rows(6))


def test_priority_queue_policy_names_a_level_the_model_has() -> None:
    with pytest.raises(ConfigError, match=r"priority_queue_policy: level 3 is not one"):
        parse_model_config(
            {"dynamic_batching": {"priority_levels": 2, "priority_queue_policy": {3: {}}}}, "m"
        )


def test_a_sub_millisecond_timeout_holds_on_uvloop() -> None:
    """uvloop's timers count whole milliseconds: a 300 us queue timeout used to fire at
    the loop's next turn, before an idle batcher had dispatched the request, so every
    request failed. A timeout now fails a request only once it has waited that long."""

    def waited_us(timeout: RequestTimeout) -> int:
        found = re.search(r"waiting (\d+) us", str(timeout))
        assert found is not None, timeout
        return int(found[1])

    async def scenario() -> None:
        backend = FakeBackend()
        batcher, _, _ = make_batcher([backend], default_timeout_microseconds=300)
        served = 0
        for value in range(50):
            try:
                out = await batcher.submit({"x": rows(value)}, 1, KEY)
            except RequestTimeout as timeout:  # only if this process really was held up
                assert waited_us(timeout) >= 300
            else:
                np.testing.assert_array_equal(out["y"], rows(2 * value))
                served += 1
        assert served >= 40
        backend.gate.clear()
        running = asyncio.ensure_future(batcher.submit({"x": rows(0)}, 1, KEY))
        await held(backend)
        for timeout_us in (100, 300, 900):
            with pytest.raises(RequestTimeout) as raised:
                await batcher.submit({"x": rows(1)}, 1, KEY, timeout_us=timeout_us)
            assert waited_us(raised.value) >= timeout_us
        backend.gate.set()
        await running

    uvloop.run(scenario())


async def test_cancelled_request_is_dropped_from_the_queue() -> None:
    backend = FakeBackend()
    backend.gate.clear()
    batcher, _, metrics = make_batcher([backend])
    running = asyncio.ensure_future(batcher.submit({"x": rows(0)}, 1, KEY))
    await held(backend)
    abandoned = asyncio.ensure_future(batcher.submit({"x": rows(7)}, 1, KEY))
    await until(lambda: batcher.num_pending == 1, "the request queued")
    abandoned.cancel()
    await asyncio.sleep(0)
    assert batcher.num_pending == 0
    # The running one's client goes too: counted as cancelled like the queued one (its
    # statistics count both failed), though its batch runs on.
    running.cancel()
    await asyncio.sleep(0)
    backend.gate.set()
    await batcher.close(5.0)  # lets the running batch finish
    assert 7.0 not in np.concatenate(backend.batches).ravel().tolist()
    cancelled = metrics.registry.get_sample_value(
        "slipstream_request_failure_total", {"model": "m", "version": "1", "reason": "cancelled"}
    )
    assert cancelled == 2


async def test_higher_priority_runs_first() -> None:
    backend = FakeBackend()
    backend.gate.clear()
    batcher, _, _ = make_batcher([backend], max_batch_size=1, priority_levels=2)
    running = asyncio.ensure_future(batcher.submit({"x": rows(0)}, 1, KEY))
    await held(backend)
    low = [asyncio.ensure_future(batcher.submit({"x": rows(i)}, 1, KEY, 2)) for i in (1, 2)]
    high = [asyncio.ensure_future(batcher.submit({"x": rows(i)}, 1, KEY, 1)) for i in (3, 4)]
    await until(lambda: batcher.num_pending == 4, "four queued requests")
    backend.gate.set()
    await asyncio.gather(running, *low, *high)
    order = [float(b[0, 0]) for b in backend.batches]
    assert order == [0.0, 3.0, 4.0, 1.0, 2.0]


async def test_a_priority_beyond_the_levels_is_the_default_level_as_in_triton() -> None:
    """Triton runs a priority the model does not have at its default level: a client
    sending one priority to models with different levels (or none) is served by each."""
    backend = FakeBackend()
    backend.gate.clear()
    batcher, _, _ = make_batcher(
        [backend], max_batch_size=1, priority_levels=2, default_priority_level=2
    )
    running = asyncio.ensure_future(batcher.submit({"x": rows(0)}, 1, KEY))
    await held(backend)
    beyond = asyncio.ensure_future(batcher.submit({"x": rows(1)}, 1, KEY, 3))
    high = asyncio.ensure_future(batcher.submit({"x": rows(2)}, 1, KEY, 1))
    await until(lambda: batcher.num_pending == 2, "two queued requests")
    backend.gate.set()
    await asyncio.gather(running, beyond, high)
    assert [float(b[0, 0]) for b in backend.batches] == [0.0, 2.0, 1.0]
    alone, _, _ = make_batcher([FakeBackend()])  # no levels at all
    np.testing.assert_array_equal(
        (await alone.submit({"x": rows(3)}, 1, KEY, priority=3))["y"], rows(6)
    )


async def test_one_bad_request_does_not_fail_its_batch() -> None:
    backend = FakeBackend()
    backend.gate.clear()
    batcher, _, _ = make_batcher([backend])
    running = asyncio.ensure_future(batcher.submit({"x": rows(0)}, 1, KEY))
    await held(backend)
    good = asyncio.ensure_future(batcher.submit({"x": rows(1)}, 1, KEY))
    bad = asyncio.ensure_future(batcher.submit({"x": rows(-1)}, 1, KEY))
    broken = asyncio.ensure_future(batcher.submit({"x": rows(999)}, 1, KEY))
    await until(lambda: batcher.num_pending == 3, "three queued requests")
    backend.gate.set()
    await running
    np.testing.assert_array_equal((await good)["y"], rows(2))
    with pytest.raises(InvalidRequest, match="negative"):
        await bad
    with pytest.raises(InternalError) as internal:
        await broken
    assert "boom" not in internal.value.message  # internals are not leaked


async def test_instances_run_batches_in_parallel() -> None:
    backends = [FakeBackend(), FakeBackend()]
    for backend in backends:
        backend.gate.clear()
    batcher, _, _ = make_batcher(backends, max_batch_size=1)
    tasks = [asyncio.ensure_future(batcher.submit({"x": rows(i)}, 1, KEY)) for i in range(4)]
    # Both instances hold a batch at the same time, and the other two requests wait.
    await until(lambda: all(b.running == 1 for b in backends), "a batch on each instance")
    assert batcher.num_pending == 2
    for backend in backends:
        backend.gate.set()
    await asyncio.gather(*tasks)
    # Which instance frees first and takes the next request is up to the threads.
    assert sorted(float(b[0, 0]) for backend in backends for b in backend.batches) == [
        0.0,
        1.0,
        2.0,
        3.0,
    ]


async def test_close_finishes_queued_work_then_refuses() -> None:
    backend = FakeBackend()
    backend.gate.clear()
    batcher, _, _ = make_batcher([backend], max_batch_size=1)
    tasks = [asyncio.ensure_future(batcher.submit({"x": rows(i)}, 1, KEY)) for i in range(3)]
    await until(lambda: backend.running == 1 and batcher.num_pending == 2, "one run, two queued")
    closing = asyncio.ensure_future(batcher.close(timeout_s=30))
    await asyncio.sleep(0)
    with pytest.raises(Unavailable, match="unloading"):
        await batcher.submit({"x": rows(0)}, 1, KEY)
    backend.gate.set()
    await closing
    assert len(await asyncio.gather(*tasks)) == 3
    with pytest.raises(Unavailable):
        await batcher.submit({"x": rows(0)}, 1, KEY)


async def test_fast_lone_batches_run_inline_and_busy_ones_on_threads() -> None:
    backend = FakeBackend()
    batcher, _, _ = make_batcher([backend], inline_execution_max_microseconds=1_000_000)
    for i in range(3):
        out = await batcher.submit({"x": rows(i)}, 1, KEY)
        np.testing.assert_array_equal(out["y"], rows(2 * i))
    # The first batch measured the model on its thread; the next ones ran on the loop.
    assert backend.threads == {"slipstream-instance_0", threading.current_thread().name}
    assert len(backend.batches) == 3


async def test_preferred_size_caps_batches_without_a_delay() -> None:
    backend = FakeBackend()
    backend.gate.clear()
    batcher, _, _ = make_batcher([backend], preferred_batch_size=[2])
    running = asyncio.ensure_future(batcher.submit({"x": rows(0)}, 1, KEY))
    await held(backend)
    queued = [asyncio.ensure_future(batcher.submit({"x": rows(i)}, 1, KEY)) for i in range(5)]
    await until(lambda: batcher.num_pending == 5, "five queued requests")
    backend.gate.set()
    await asyncio.gather(running, *queued)
    assert [len(b) for b in backend.batches] == [1, 2, 2, 1]


async def test_a_request_larger_than_every_preferred_size_still_runs() -> None:
    # The make-run minilm config: preferred [4], max 64. A 5-row request used to be
    # skipped for ever, and every request behind it with it.
    backend = FakeBackend()
    batcher, _, _ = make_batcher([backend], max_batch_size=64, preferred_batch_size=[4])
    big = await asyncio.wait_for(batcher.submit({"x": rows(*range(5))}, 5, KEY), 10)
    np.testing.assert_array_equal(big["y"], rows(*range(0, 10, 2)))
    after = await asyncio.wait_for(batcher.submit({"x": rows(7)}, 1, KEY), 10)
    np.testing.assert_array_equal(after["y"], rows(14))


async def test_mixed_sizes_and_shapes_behind_a_busy_instance_all_run() -> None:
    # 60 requests of 1-16 rows and three widths queue behind a held batch, with preferred
    # sizes [2, 4] and max 16: every one is answered with its own rows.
    backend = FakeBackend()
    backend.gate.clear()
    batcher, _, _ = make_batcher([backend], max_batch_size=16, preferred_batch_size=[2, 4])
    first = asyncio.ensure_future(batcher.submit({"x": rows(0)}, 1, KEY))
    await held(backend)
    rng = np.random.default_rng(0)
    inputs = []
    for i in range(60):
        n, width = int(rng.integers(1, 17)), int(rng.integers(1, 4))
        inputs.append(np.full((n, width), float(i), np.float32))
    tasks = [
        asyncio.ensure_future(batcher.submit({"x": x}, len(x), ((x.shape[1],),))) for x in inputs
    ]
    await until(lambda: batcher.num_pending == 60, "sixty queued requests")
    backend.gate.set()
    results = await asyncio.wait_for(asyncio.gather(first, *tasks), 30)
    for x, result in zip(inputs, results[1:], strict=True):
        np.testing.assert_array_equal(result["y"], x * 2)
    assert max(len(b) for b in backend.batches) <= 16


async def test_an_instance_idle_while_requests_wait_is_timed() -> None:
    """slipstream_instance_idle_seconds: from one batch's end on the instance's thread to
    the next one's start, counted only when requests were queued at the end."""
    backend = FakeBackend(delay_s=0.02)
    batcher, _, metrics = make_batcher([backend], max_batch_size=2)
    (model,) = metrics.models()
    # A lone request, nothing queued behind it: no idle time to count.
    await batcher.submit({"x": rows(1)}, 1, KEY)
    assert sum(model.instance_idle.counts) == 0
    # Six one-row requests in batches of two: three batches back to back, two hand-offs.
    backend.gate.clear()
    first = asyncio.ensure_future(batcher.submit({"x": rows(0)}, 1, KEY))
    await held(backend)
    rest = [asyncio.ensure_future(batcher.submit({"x": rows(i)}, 1, KEY)) for i in range(1, 6)]
    await until(lambda: batcher.num_pending == 5, "five queued requests")
    backend.gate.set()
    await asyncio.gather(first, *rest)
    assert [len(b) for b in backend.batches] == [1, 1, 2, 2, 1]
    assert sum(model.instance_idle.counts) == 3
    # Each hand-off is the loop's turn, far less than a 20 ms run.
    assert 0 < model.instance_idle.total < 3 * 0.02
    # Then idle with an empty queue: still three.
    await asyncio.sleep(0.05)
    await batcher.submit({"x": rows(7)}, 1, KEY)
    assert sum(model.instance_idle.counts) == 3


class SummingBackend(FakeBackend):
    """Answers one row for the whole batch (a sum over it): no row per input row."""

    def run(self, inputs: dict[str, np.ndarray], output_names: Sequence[str]) -> dict[str, Any]:
        self.running += 1
        self.gate.wait(5)
        self.running -= 1
        self.batches.append(inputs["x"].copy())
        return {"y": inputs["x"].sum(axis=0, keepdims=True)}


async def test_an_output_without_a_row_per_row_never_carries_another_requests_data() -> None:
    """Split back by rows, a batch's one summed row went to the last request, with the
    other clients' data in it, and the first got nothing: each request runs alone."""
    backend = SummingBackend()
    backend.gate.clear()
    batcher, _, _ = make_batcher([backend])
    first = asyncio.ensure_future(batcher.submit({"x": rows(0)}, 1, KEY))
    await held(backend)
    a = asyncio.ensure_future(batcher.submit({"x": rows(1)}, 1, KEY))
    b = asyncio.ensure_future(batcher.submit({"x": rows(100)}, 1, KEY))
    await asyncio.sleep(0.05)
    backend.gate.set()
    results = await asyncio.gather(first, a, b)
    assert [r["y"].tolist() for r in results] == [[[0.0]], [[1.0]], [[100.0]]]
    assert any(len(batch) == 2 for batch in backend.batches)  # a and b were batched
