"""ModelServer.infer_soon, the engine process's inference without a task per request:
the same answers, errors and statistics as infer, and a cancel that withdraws."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from slipstream.config import ServerSettings
from slipstream.errors import InvalidRequest, SlipstreamError
from slipstream.serving.core import ModelServer
from slipstream.types import InferRequest
from tests.models import ADD_SUB_WIDTH, build_add_sub, write_config


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[ModelServer]:
    build_add_sub(tmp_path)
    write_config(tmp_path, "add_sub", {"max_batch_size": 8})
    # A batcher that holds what it queues for a minute unless 8 rows fill a batch.
    build_add_sub(tmp_path, "slow")
    write_config(
        tmp_path,
        "slow",
        {"max_batch_size": 8, "dynamic_batching": {"max_queue_delay_microseconds": 60_000_000}},
    )
    served = ModelServer(ServerSettings(model_repository=tmp_path))
    await served.start()
    yield served
    await served.stop()


def request(model: str, rows: int, seed: int = 0) -> InferRequest:
    rng = np.random.default_rng(seed)
    inputs = {
        name: rng.standard_normal((rows, ADD_SUB_WIDTH)).astype(np.float32)
        for name in ("INPUT0", "INPUT1")
    }
    return InferRequest("add_sub" if model == "" else model, "", inputs, id=f"r{seed}")


def counts(server: ModelServer, model: str = "add_sub") -> tuple[int, int]:
    (stats,) = [s for s in server.models.all_loaded() if s.name == model]
    snapshot = stats.stats.snapshot().inference_stats
    return snapshot.success.count, snapshot.fail.count


async def test_it_answers_every_batch_size_as_infer_does(server: ModelServer) -> None:
    for rows in range(1, 9):
        one = request("", rows, seed=rows)
        future = server.infer_soon(one)
        assert future is not None
        soon, later = await asyncio.gather(future, server.infer(one))
        assert (soon.model_name, soon.model_version, soon.id) == ("add_sub", "1", f"r{rows}")
        assert soon.outputs.keys() == later.outputs.keys() == {"OUTPUT0", "OUTPUT1"}
        for name, array in soon.outputs.items():
            np.testing.assert_array_equal(array, later.outputs[name])
        np.testing.assert_allclose(
            soon.outputs["OUTPUT0"], one.inputs["INPUT0"] + one.inputs["INPUT1"], rtol=1e-6
        )
    assert counts(server) == (16, 0)


async def test_many_at_once_share_batches(server: ModelServer) -> None:
    futures = [server.infer_soon(request("", 1, seed=i)) for i in range(32)]
    answers = await asyncio.gather(*[f for f in futures if f is not None])
    assert [a.id for a in answers] == [f"r{i}" for i in range(32)]
    (stats,) = [s for s in server.models.all_loaded() if s.name == "add_sub"]
    assert stats.stats.snapshot().execution_count < 32


async def test_a_bad_request_raises_at_once_as_infer_does(server: ModelServer) -> None:
    bad = request("", 2)
    bad.inputs["INPUT1"] = bad.inputs["INPUT1"][:, :3]
    with pytest.raises(InvalidRequest) as later:
        await server.infer(bad)
    with pytest.raises(InvalidRequest) as soon:
        server.infer_soon(bad)
    assert soon.value.message == later.value.message
    assert "INPUT1" in soon.value.message
    assert counts(server) == (0, 2)


async def test_a_cancel_withdraws_a_queued_request(server: ModelServer) -> None:
    (slow,) = [m for m in server.models.all_loaded() if m.name == "slow"]
    waiting = server.infer_soon(request("slow", 1, seed=1))
    assert waiting is not None
    await asyncio.sleep(0.01)
    assert slow.batcher.num_pending == 1
    waiting.cancel()
    await asyncio.sleep(0)  # the future's callbacks run on the loop's next turn
    assert slow.batcher.num_pending == 0
    assert counts(server, "slow") == (0, 1)
    assert slow.metrics.request_failure["cancelled"] == 1
    # A full batch still runs at once, without the withdrawn request.
    eight = server.infer_soon(request("slow", 8, seed=2))
    assert eight is not None
    answer = await asyncio.wait_for(eight, 10)
    assert answer.outputs["OUTPUT0"].shape == (8, ADD_SUB_WIDTH)
    assert counts(server, "slow") == (1, 1)
    (stats,) = [s for s in server.models.all_loaded() if s.name == "slow"]
    assert stats.stats.snapshot().inference_count == 8


@pytest.mark.parametrize(
    ("model", "version"),
    [("nonexistent", ""), ("add_sub", "7")],
)
async def test_what_it_cannot_answer_is_left_to_infer(
    server: ModelServer, model: str, version: str
) -> None:
    one = request(model, 1)
    one.model_version = version
    assert server.infer_soon(one) is None
    with pytest.raises(SlipstreamError):
        await server.infer(one)


async def test_a_stopping_server_leaves_it_to_infer(tmp_path: Path) -> None:
    build_add_sub(tmp_path)
    served = ModelServer(ServerSettings(model_repository=tmp_path))
    await served.start()
    await served.stop()
    assert served.infer_soon(request("", 1)) is None
