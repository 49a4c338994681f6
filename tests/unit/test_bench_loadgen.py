"""The load loops of a bench worker, driven in-process against fake clients (no sockets).

The open-loop case is the coordinated-omission check: a server that stalls for half a
second while the client can only have one request outstanding. Counted from when each
request was actually sent, the stall would show as one slow request; counted from when
it was scheduled, every request due during the stall shows its wait.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from slipstream.bench.core.endpoint import Endpoint
from slipstream.bench.v2.clients import InferClient
from slipstream.bench.v2.loadgen import Worker
from slipstream.bench.v2.messages import (
    EncodedRequest,
    LevelDone,
    RunLevel,
    WindowSample,
    WorkerPlan,
)
from slipstream.bench.v2.results import merge_samples

RATE_PER_S = 100.0
STALL_START_S = 0.3  # after the level starts
STALL_S = 0.5
SERVICE_S = 0.001


class _Outbox:
    """Stands in for the worker's pipe: keeps what the worker sends."""

    def __init__(self) -> None:
        self.messages: list[Any] = []

    def send(self, obj: Any) -> None:
        self.messages.append(obj)

    def samples(self) -> list[WindowSample]:
        return [m for m in self.messages if isinstance(m, WindowSample)]


class _StallingServer(InferClient):
    """Answers in ~1 ms, except that nothing is answered during [stall_from, stall_until)."""

    def __init__(self, stall_from: float, stall_until: float) -> None:
        super().__init__()
        self.stall_from, self.stall_until = stall_from, stall_until
        self.service_times_s: list[float] = []

    async def infer(self, index: int) -> str | None:
        started = time.monotonic()
        if self.stall_from <= started < self.stall_until:
            await asyncio.sleep(self.stall_until - started)
        await asyncio.sleep(SERVICE_S)
        self.service_times_s.append(time.monotonic() - started)
        return None

    async def close(self) -> None:
        pass


class _FlakyServer(InferClient):
    """Every 4th request (request index 3 of 4) fails with 503; each takes ``service_s``."""

    def __init__(self, service_s: float) -> None:
        super().__init__()
        self.service_s = service_s

    async def infer(self, index: int) -> str | None:
        await asyncio.sleep(self.service_s)
        if index == 3:
            return self.error_examples.note("http 503", "queue full")
        return None

    async def close(self) -> None:
        pass


def _plan(requests: int = 1) -> WorkerPlan:
    return WorkerPlan(
        worker_id=0,
        endpoint=Endpoint(protocol="http", host="127.0.0.1", port=1, tls=False),
        model="m",
        version="",
        requests=[EncodedRequest(b"", None, batch_size=2) for _ in range(requests)],
        timeout_s=5.0,
        distribution="constant",
        seed=0,
    )


def _level(**overrides: Any) -> RunLevel:
    fields: dict[str, Any] = {
        "level_id": 0,
        "concurrency": 0,
        "request_rate": 0.0,
        "phase_s": 0.0,
        "max_inflight": 1,
        "first_user": 0,
        "start_at": time.monotonic() + 0.05,
        "warmup_s": 0.0,
        "window_s": 1.5,
        "max_windows": 1,
    }
    fields.update(overrides)
    return RunLevel(**fields)


async def test_open_loop_latency_shows_a_stall_for_every_request_due_during_it() -> None:
    level = _level(request_rate=RATE_PER_S)
    stall_from = level.start_at + STALL_START_S
    server = _StallingServer(stall_from, stall_from + STALL_S)
    outbox = _Outbox()
    worker = Worker(outbox, _plan(), client_factory=lambda plan, outstanding: server)  # type: ignore[arg-type]

    await worker.run_level(level)

    [sample] = outbox.samples()
    assert isinstance(outbox.messages[-1], LevelDone)
    due_in_stall = RATE_PER_S * STALL_S  # 50 requests
    latency = sample.latency
    # The server itself was slow once: one call took the stall, the rest ~1 ms.
    slow_calls = sum(t > 0.1 for t in server.service_times_s)
    assert slow_calls == 1
    # Counted from the schedule, most requests due during the stall waited > 100 ms
    # (those due in its last 100 ms waited less): at least 35 of ~150 requests.
    slow_share = 35 / sample.ok_requests
    assert latency.percentile_s(100 * (1 - slow_share)) > 0.1
    assert latency.max_s > STALL_S * 0.9
    # Due before the stall (the first 30 of ~150): ~1-2 ms. (Not the median: those due
    # after it wait while one connection drains the backlog, longer on a loaded host.)
    assert latency.percentile_s(15) < 0.05
    # The worker says it fell behind, and why: the one connection was busy.
    assert sample.sends.late_sends >= due_in_stall * 0.7
    assert sample.sends.inflight_cap_waits >= 1
    assert sample.sends.max_send_lag_s > STALL_S * 0.9
    # ... and caught up after it: the schedule, not the server, set the send count.
    assert abs(sample.sends.sent - RATE_PER_S * 1.5) <= 3


async def test_open_loop_keeps_the_rate_when_the_server_keeps_up() -> None:
    server = _StallingServer(stall_from=0.0, stall_until=0.0)
    outbox = _Outbox()
    worker = Worker(outbox, _plan(), client_factory=lambda plan, outstanding: server)  # type: ignore[arg-type]

    await worker.run_level(_level(request_rate=200.0, max_inflight=8, window_s=1.0))

    [sample] = outbox.samples()
    assert abs(sample.sends.sent - 200) <= 3
    assert sample.ok_requests >= 195
    assert sample.latency.percentile_s(50) < 0.01
    # Almost never capped: a pause of the loop on a loaded host (~40 ms, the 8 slots'
    # worth at 200/s) can fill the slots for a moment; it failed once at 3 of 200 in a
    # `make test` whose other half ran beside it. A stalled server fills them for
    # STALL_S (the test above).
    assert sample.sends.inflight_cap_waits <= 5


async def test_closed_loop_keeps_n_requests_outstanding_and_counts_errors_by_key() -> None:
    service_s = 0.01
    server = _FlakyServer(service_s)
    outbox = _Outbox()
    worker = Worker(outbox, _plan(requests=4), client_factory=lambda plan, outstanding: server)  # type: ignore[arg-type]

    await worker.run_level(_level(concurrency=4, warmup_s=0.1, window_s=0.5, max_windows=2))

    samples = outbox.samples()
    assert [s.window_index for s in samples] == [-1, 0, 1]
    for sample in samples[1:]:
        window = merge_samples([sample])  # one worker's window
        completed = window.ok_requests + sum(window.errors.values())
        # Little's law: 4 outstanding / ~10 ms each (timers may add a little).
        assert 4 / service_s * 0.5 < completed / window.duration_s <= 4 / service_s * 1.05
        # Each user walks the 4 requests in turn: one in four fails.
        assert window.errors.keys() == {"http 503"}
        assert abs(window.errors["http 503"] / completed - 0.25) < 0.05
        assert window.error_examples == {"http 503": "queue full"}
        # Every request carries a batch of 2.
        assert window.ok_inferences == 2 * window.ok_requests
        assert np.isclose(window.latency.mean_s, service_s, rtol=0.5)
