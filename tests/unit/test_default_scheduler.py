"""Triton's default scheduler (a config without dynamic_batching): a Python model's
execute gets one request per run; a model that batches rows still runs requests queued
together as one batch, as its outputs are the same."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from slipstream.config import parse_model_config
from slipstream.observability.metrics import ServerMetrics
from slipstream.observability.stats import ModelStatsRecorder
from slipstream.repository.autocomplete import complete_config
from slipstream.repository.layout import read_config, read_model_directory
from slipstream.runtime.base import Backend, ModelSignature, RequestContext
from slipstream.runtime.python_model import PythonBackend
from slipstream.scheduling.batcher import Batcher
from tests.models import build_add_sub

KEY = ((1,),)


class _Held(Backend):
    """Doubles its input; records the requests of each run; the first run waits at
    its gate, so the requests after it queue up."""

    name = "held"

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()  # a run has started (and waits at the gate)
        self.runs: list[int] = []  # requests per run

    @classmethod
    def load(cls, path: Path, parameters: dict[str, str], instance_count: int) -> Backend:
        return cls()

    def signature(self) -> ModelSignature:
        return ModelSignature((), ())

    def run(self, inputs: dict[str, np.ndarray], output_names: Sequence[str]) -> dict[str, Any]:
        self.entered.set()
        self.gate.wait(5)
        self.runs.append(len(inputs["x"]))  # one row per request here
        return {"y": inputs["x"] * 2}


class _Requests(_Held):
    """As a Python model is run: the batch as its requests."""

    takes_requests: ClassVar[bool] = True

    def run_requests(
        self,
        requests: Sequence[tuple[dict[str, np.ndarray], RequestContext]],
        output_names: Sequence[str],
    ) -> list[dict[str, np.ndarray] | BaseException]:
        self.entered.set()
        self.gate.wait(5)
        self.runs.append(len(requests))
        return [{"y": inputs["x"] * 2} for inputs, _ in requests]


async def _runs(backend: _Held, config: dict[str, Any]) -> list[int]:
    """Requests per run of 1 request, then 3 queued behind it."""
    model = parse_model_config({"max_batch_size": 8, **config}, "m")
    metrics = ServerMetrics().for_model("m", "1")
    batcher = Batcher(model, [backend], ["y"], metrics, ModelStatsRecorder("m", "1"))
    first = asyncio.ensure_future(batcher.submit({"x": np.ones((1, 1), np.float32)}, 1, KEY))
    await _until(backend.entered.is_set)  # the first runs, held at the gate
    rest = [
        asyncio.ensure_future(batcher.submit({"x": np.full((1, 1), i, np.float32)}, 1, KEY))
        for i in range(3)
    ]
    await _until(lambda: batcher.num_pending == 3)
    backend.gate.set()
    answers = await asyncio.gather(first, *rest)
    assert [a["y"].tolist() for a in answers[1:]] == [[[0.0]], [[2.0]], [[4.0]]]
    await batcher.close(1)
    return backend.runs


async def _until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 5
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.001)


async def test_a_python_model_without_dynamic_batching_runs_one_request_at_a_time() -> None:
    assert await _runs(_Requests(), {}) == [1, 1, 1, 1]


async def test_a_python_model_with_dynamic_batching_gets_the_queued_requests_at_once() -> None:
    assert await _runs(_Requests(), {"dynamic_batching": {}}) == [1, 3]


async def test_a_model_that_batches_rows_runs_queued_requests_together_regardless() -> None:
    assert await _runs(_Held(), {}) == [1, 3]


@pytest.mark.parametrize(
    ("pbtxt", "default_scheduler"),
    [
        ("max_batch_size: 8", True),
        ("max_batch_size: 8\ndynamic_batching { }", False),
        ("max_batch_size: 8\ndynamic_batching { max_queue_delay_microseconds: 100 }", False),
    ],
)
def test_a_config_pbtxt_without_dynamic_batching_is_the_default_scheduler(
    tmp_path: Path, pbtxt: str, default_scheduler: bool
) -> None:
    build_add_sub(tmp_path, "m")
    (tmp_path / "m" / "config.pbtxt").write_text(f'platform: "onnxruntime_onnx"\n{pbtxt}\n')
    config = read_config(read_model_directory(tmp_path / "m"))
    assert config.default_scheduler is default_scheduler
    # Requests' own timeouts stay ignored, as in Triton, with or without the section.
    assert config.dynamic_batching.allow_timeout_override is False
    assert config.dynamic_batching.max_queue_delay_microseconds in (0, 100)


def test_a_config_yaml_without_dynamic_batching_is_the_default_scheduler() -> None:
    assert parse_model_config({}, "m").default_scheduler
    assert not parse_model_config({"dynamic_batching": {}}, "m").default_scheduler


AUTO_BATCHING = """
class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.set_max_batch_size(8)
        config.add_input({"name": "X", "data_type": "TYPE_FP32", "dims": [1]})
        config.add_output({"name": "Y", "data_type": "TYPE_FP32", "dims": [1]})
        config.set_dynamic_batching()
        return config

    def execute(self, requests):
        return []
"""


def test_auto_complete_config_may_ask_for_dynamic_batching(tmp_path: Path) -> None:
    path = tmp_path / "m" / "1" / "model.py"
    path.parent.mkdir(parents=True)
    path.write_text(AUTO_BATCHING)
    backend = PythonBackend.load(path, {}, 1)
    config = parse_model_config({}, "m")
    assert config.default_scheduler
    completed = complete_config(config, backend.signature(), "python")
    assert not completed.default_scheduler and completed.max_batch_size == 8
