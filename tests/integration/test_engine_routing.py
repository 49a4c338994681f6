"""A front end in front of two engines (``--engines per-device``): each model's calls go to
the engine that serves it, what concerns the whole server is asked of every engine.

Two real serving cores, each behind a real engine host and serving its share of one
repository, and a front end's :class:`RemoteInferenceService` connected to both, in one
process. Which model lands on which engine is decided by device in
``repository/placement.py`` (tests/unit/test_placement.py); this host has no GPU, so here
the shares are given by name and both engines run their models on the CPU. A request
routed to the wrong engine would be a 404 there: each answer proves its route.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slipstream.config import ServerSettings
from slipstream.engine.client import EngineClient
from slipstream.engine.host import EngineHost
from slipstream.engine.remote import RemoteInferenceService, engine_calls, engine_gathered
from slipstream.errors import InvalidRequest, Unavailable
from slipstream.repository.layout import ModelDirectory
from slipstream.serving.core import ModelServer
from slipstream.types import InferRequest
from tests.models import ADD_SUB_WIDTH, build_add_sub, build_mean_embedding

TABLE = np.arange(40, dtype=np.float32).reshape(10, 4)
# Engine 0 serves the first models, engine 1 the second.
SHARES = (("add_sub", "plus"), ("twin", "embed"))


class ByName:
    """A share and a routing that place models by name."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        # Models moved to another engine since (their config changed): name -> engine.
        self.moved: dict[str, int] = {}

    def select(self, models: dict[str, ModelDirectory]) -> dict[str, ModelDirectory]:
        return {name: d for name, d in models.items() if name in self.names}

    def engine_of(self, name: str) -> int:
        if name in self.moved:
            return self.moved[name]
        return next((i for i, names in enumerate(SHARES) if name in names), 0)

    def refresh(self) -> None:
        """Nothing to read: the shares are fixed."""


class TwoEngines:
    def __init__(self, root: Path) -> None:
        repo = root / "repo"
        for name in ("add_sub", "plus", "twin"):
            build_add_sub(repo, name)
        build_mean_embedding(repo, "embed", TABLE)
        self.repo = repo
        self.loop = asyncio.new_event_loop()
        self.servers = [
            ModelServer(ServerSettings(model_repository=repo, allow_client_shm=True,
                                       model_control_mode="explicit", load_models=list(names)),
                        share=ByName(names))
            for names in SHARES
        ]  # fmt: skip
        self.hosts = [
            EngineHost(str(root / f"engine-{index}"), engine_calls(server),
                       gathered=engine_gathered(server))
            for index, server in enumerate(self.servers)
        ]  # fmt: skip
        self.clients = [EngineClient(str(root / f"engine-{i}")) for i in range(len(SHARES))]
        self.routing = ByName(())
        self.remote = RemoteInferenceService(self.clients, self.routing)
        self.run(self._start())

    async def _start(self) -> None:
        for server, host in zip(self.servers, self.hosts, strict=True):
            await server.start()
            await host.start()
        for client in self.clients:
            client.start()
            assert await client.wait_connected(10)

    def run(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(coroutine)

    def close(self) -> None:
        for client in self.clients:
            self.run(client.close())
        for host, server in zip(self.hosts, self.servers, strict=True):
            self.run(host.close())
            self.run(server.stop())
        self.loop.close()

    def successes(self, engine: int, model: str) -> int:
        stats = self.run(self.servers[engine].model_statistics(model))
        return int(stats[0].inference_stats.success.count)


@pytest.fixture(scope="module")
def engines() -> Iterator[TwoEngines]:
    root = Path(tempfile.mkdtemp(prefix="engine-routing-"))
    served = TwoEngines(root)
    try:
        yield served
    finally:
        served.close()
        shutil.rmtree(root, ignore_errors=True)


def _add_sub(model: str, rows: int, seed: int) -> InferRequest:
    rng = np.random.default_rng(seed)
    a, b = (rng.standard_normal((rows, ADD_SUB_WIDTH)).astype(np.float32) for _ in range(2))
    return InferRequest(model, "", {"INPUT0": a, "INPUT1": b})


def test_each_engine_serves_its_share_and_the_index_lists_every_model(
    engines: TwoEngines,
) -> None:
    for server, names in zip(engines.servers, SHARES, strict=True):
        assert [entry.name for entry in engines.run(server.repository_index())] == sorted(names)
    index = engines.run(engines.remote.repository_index())
    assert [(entry.name, entry.state) for entry in index] == [
        ("add_sub", "READY"), ("embed", "READY"), ("plus", "READY"), ("twin", "READY")
    ]  # fmt: skip
    assert engines.run(engines.remote.is_ready())
    metadata = engines.run(engines.remote.model_metadata("twin"))
    assert metadata.name == "twin"


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.tuples(st.sampled_from(["add_sub", "twin", "plus", "embed"]),
                          st.integers(1, 5)), min_size=1, max_size=12))  # fmt: skip
def test_one_turns_requests_to_both_engines_are_each_answered_by_their_model(
    engines: TwoEngines, mix: list[tuple[str, int]]
) -> None:
    """Requests to models on both engines made in one turn of the front end's loop (two
    groups, one per engine): each answer is its model's, counted by its engine."""
    requests = []
    for seed, (model, rows) in enumerate(mix):
        if model == "embed":
            ids = np.arange(rows * 3, dtype=np.int64).reshape(rows, 3) % len(TABLE)
            mask = np.ones_like(ids)
            requests.append(InferRequest("embed", "", {"input_ids": ids, "attention_mask": mask}))
        else:
            requests.append(_add_sub(model, rows, seed))
    before = {
        model: engines.successes(engine, model)
        for engine, names in enumerate(SHARES)
        for model in names
    }

    async def all_at_once() -> list[Any]:
        return await asyncio.gather(*(engines.remote.infer(r) for r in requests))

    answers = engines.run(all_at_once())
    for request, answer in zip(requests, answers, strict=True):
        assert answer.model_name == request.model_name
        if request.model_name == "embed":
            ids = request.inputs["input_ids"]
            expected = TABLE[ids].mean(axis=1)
            np.testing.assert_allclose(answer.outputs["embedding"], expected, rtol=1e-6)
        else:
            a, b = request.inputs["INPUT0"], request.inputs["INPUT1"]
            np.testing.assert_array_equal(answer.outputs["OUTPUT0"], a + b)
            np.testing.assert_array_equal(answer.outputs["OUTPUT1"], a - b)
    for engine, names in enumerate(SHARES):
        for model in names:
            served = sum(1 for name, _ in mix if name == model)
            assert engines.successes(engine, model) == before[model] + served


def test_statistics_of_every_model_come_from_both_engines(engines: TwoEngines) -> None:
    engines.run(engines.remote.infer(_add_sub("twin", 2, 1)))
    every = engines.run(engines.remote.model_statistics())
    assert sorted(stats.name for stats in every) == ["add_sub", "embed", "plus", "twin"]
    (twin,) = engines.run(engines.remote.model_statistics("twin"))
    assert twin.inference_stats.success.count == engines.successes(1, "twin") >= 1


def test_a_region_is_registered_in_every_engine_or_in_none(engines: TwoEngines) -> None:
    import tritonclient.utils.shared_memory as shm

    key = "/slipstream_routing_test"
    region = shm.create_shared_memory_region("routing", key, 64)
    try:
        engines.run(engines.remote.register_region("both", key, 0, 64))
        for server in engines.servers:
            assert [r.name for r in server.shared_memory.registered()] == ["both"]
        assert [r.name for r in engines.run(engines.remote.region_status())] == ["both"]
        # The second engine refuses a name it holds already: the first keeps nothing.
        engines.run(engines.servers[1].register_region("taken", key, 0, 64))
        with pytest.raises(InvalidRequest, match="taken"):
            engines.run(engines.remote.register_region("taken", key, 0, 64))
        assert [r.name for r in engines.servers[0].shared_memory.registered()] == ["both"]
        engines.run(engines.remote.unregister_region())
        for server in engines.servers:
            assert server.shared_memory.registered() == []
    finally:
        shm.destroy_shared_memory_region(region)


def test_loads_and_unloads_go_to_the_models_engine(engines: TwoEngines) -> None:
    engines.run(engines.remote.unload_model("plus"))
    assert not engines.run(engines.remote.model_ready("plus"))
    assert engines.run(engines.remote.model_ready("twin"))
    engines.run(engines.remote.load_model("plus"))
    assert engines.run(engines.servers[0].model_ready("plus"))


def test_a_model_loaded_in_its_new_engine_leaves_the_old_one(engines: TwoEngines) -> None:
    """Explicit mode, a model whose config now places it on the other engine: loaded
    there, unloaded where it was, its requests served by the new one."""
    assert engines.run(engines.servers[0].model_ready("plus"))
    engines.routing.moved["plus"] = 1
    try:
        engines.run(engines.remote.load_model("plus"))
        assert engines.run(engines.servers[1].model_ready("plus"))
        assert not engines.run(engines.servers[0].model_ready("plus"))
        before = engines.successes(1, "plus")
        engines.run(engines.remote.infer(_add_sub("plus", 2, 3)))
        assert engines.successes(1, "plus") == before + 1
        engines.run(engines.remote.unload_model("plus"))
        assert not engines.run(engines.remote.model_ready("plus"))
    finally:
        engines.routing.moved.clear()
        engines.run(engines.remote.load_model("plus"))
    assert engines.run(engines.servers[0].model_ready("plus"))
    assert not engines.run(engines.servers[1].model_ready("plus"))


def test_an_engine_gone_fails_only_its_models_requests(engines: TwoEngines) -> None:
    """Last in this module: engine 1's host is closed for good."""
    engines.run(engines.hosts[1].close())

    async def settle() -> None:
        while engines.clients[1].connected:
            await asyncio.sleep(0.01)

    engines.run(asyncio.wait_for(settle(), 10))
    with pytest.raises(Unavailable):
        engines.run(engines.remote.infer(_add_sub("twin", 1, 0)))
    answer = engines.run(engines.remote.infer(_add_sub("add_sub", 1, 0)))
    assert answer.model_name == "add_sub"
    assert not engines.run(engines.remote.is_ready())
