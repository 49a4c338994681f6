"""The batcher's part of request tracing: a traced submission (RECORDING set) gets its
run's Triton TIMESTAMPS, in order, its wait behind a busy instance as queue time; an
untraced one, or one after its request was done, records nothing."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from slipstream.config import parse_model_config
from slipstream.observability.metrics import ServerMetrics
from slipstream.observability.stats import ModelStatsRecorder
from slipstream.observability.timestamps import RECORDING, Recording, RunTimes
from slipstream.runtime.base import Backend, ModelSignature
from slipstream.scheduling.batcher import Batcher

KEY = ((1,),)
HOLD_S = 0.05


class GatedBackend(Backend):
    """Doubles its input once its gate opens."""

    name = "gated"

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.running = threading.Event()

    @classmethod
    def load(cls, path: Path, parameters: dict[str, str], instance_count: int) -> GatedBackend:
        return cls()

    def signature(self) -> ModelSignature:
        return ModelSignature((), ())

    def run(self, inputs: dict[str, np.ndarray], output_names: Sequence[str]) -> dict[str, Any]:
        self.running.set()
        self.gate.wait(5)
        return {"y": inputs["x"] * 2}


def make_batcher(backend: GatedBackend) -> Batcher:
    config = parse_model_config(
        {"max_batch_size": 1, "dynamic_batching": {"inline_execution_max_microseconds": 0}},
        "test",
    )
    metrics = ServerMetrics().for_model("m", "1")
    return Batcher(config, [backend], ["y"], metrics, ModelStatsRecorder("m", "1"))


async def submit(batcher: Batcher, recording: Recording | None) -> Any:
    """One request's submission, traced under ``recording`` where one is given (in a task
    of its own, as a request is served)."""

    async def served() -> Any:
        RECORDING.set(recording)
        return await batcher.submit({"x": np.ones((1, 1), np.float32)}, 1, KEY)

    return await asyncio.create_task(served())


async def test_a_traced_request_queued_behind_a_busy_instance_records_its_wait() -> None:
    backend = GatedBackend()
    batcher = make_batcher(backend)
    recording = Recording()
    untraced = asyncio.create_task(submit(batcher, None))
    await asyncio.to_thread(backend.running.wait, 5)  # the instance is busy with it
    traced = asyncio.create_task(submit(batcher, recording))
    await asyncio.sleep(HOLD_S)
    backend.gate.set()
    await untraced
    np.testing.assert_array_equal((await traced)["y"], [[2.0]])
    (run,) = recording.finish().runs  # the untraced request recorded nothing
    assert (run.model_name, run.model_version) == ("m", "1")
    times = [getattr(run, name) for name in RunTimes.__slots__[2:]]
    assert all(times) and times == sorted(times), run
    assert run.compute_start_ns - run.queue_start_ns >= HOLD_S * 1e9 * 0.9
    await batcher.close(1)


async def test_a_request_done_records_no_more_runs() -> None:
    backend = GatedBackend()
    backend.gate.set()
    batcher = make_batcher(backend)
    recording = Recording()
    recording.finish()
    await submit(batcher, recording)  # work it left behind (a shadow copy, say)
    assert recording.finish().runs == ()
    await batcher.close(1)
