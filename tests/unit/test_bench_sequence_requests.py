"""A stateful model's sequences in ``slipstream bench``: the plan read from the model's
config, the request parameters as the server decodes them in every protocol, and a
worker's users each driving whole sequences (a fake client, no sockets)."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from typing import Any

import numpy as np
import pytest

from slipstream.bench.core.endpoint import Endpoint
from slipstream.bench.v2.clients import InferClient
from slipstream.bench.v2.inputs import RequestInputs
from slipstream.bench.v2.loadgen import Worker
from slipstream.bench.v2.messages import (
    EncodedRequest,
    LevelDone,
    RunLevel,
    SequencePlan,
    WorkerPlan,
)
from slipstream.bench.v2.payloads import encode_request
from slipstream.bench.v2.runner import _run_warnings
from slipstream.bench.v2.sequences import in_sequence, sequence_plan
from slipstream.bench.v2.settings import BenchSettings
from slipstream.protocol import grpc_codec, v2
from slipstream.protocol.proto import inference_pb2 as pb


def _config(corrid: str | None) -> dict[str, Any]:
    controls: list[dict[str, Any]] = [
        {"name": "START", "control": [{"kind": "CONTROL_SEQUENCE_START",
                                       "int32_false_true": [0, 1]}]},
    ]  # fmt: skip
    if corrid is not None:
        controls.append(
            {"name": "ID", "control": [{"kind": "CONTROL_SEQUENCE_CORRID", "data_type": corrid}]}
        )
    return {"max_batch_size": 8, "sequence_batching": {"control_input": controls}}


def test_a_stateless_model_has_no_plan() -> None:
    assert sequence_plan({"max_batch_size": 8, "dynamic_batching": {}}, 20, "auto", 8) is None
    assert sequence_plan(None, 20, "auto", 8) is None


@pytest.mark.parametrize(
    ("corrid", "ids", "kind", "max_id"),
    [
        ("TYPE_STRING", "auto", "string", 2**63 - 1),
        ("TYPE_INT32", "auto", "int", 2**31 - 1),
        ("TYPE_UINT32", "auto", "int", 2**32 - 1),
        ("TYPE_UINT64", "auto", "int", 2**63 - 1),
        (None, "auto", "int", 2**63 - 1),
        ("TYPE_UINT64", "string", "string", 2**63 - 1),
    ],
)
def test_the_plan_follows_the_corrid_control(
    corrid: str | None, ids: str, kind: str, max_id: int
) -> None:
    plan = sequence_plan(_config(corrid), 7, ids, 4)
    assert plan is not None
    assert (plan.length, plan.id_kind, plan.max_id, plan.stride) == (7, kind, max_id, 4)


def test_ids_are_unique_across_workers_and_fit_the_corrid() -> None:
    plan = SequencePlan(length=3, id_kind="int", max_id=2**31 - 1, run_tag=2**31 - 5, stride=4)
    ids = [plan.sequence_id(worker, n) for worker in range(4) for n in range(100)]
    assert len(set(ids)) == len(ids)
    assert all(isinstance(i, int) and 0 < i <= 2**31 - 1 for i in ids)
    strings = SequencePlan(3, "string", 2**63 - 1, 255, 4)
    assert strings.sequence_id(2, 9) == "ff-2-9"
    # Two runs draw different tags, so their ids differ.
    first, second = (sequence_plan(_config("TYPE_UINT64"), 3, "auto", 1) for _ in range(2))
    assert first is not None and second is not None and first.run_tag != second.run_tag


def _request(protocol: Any) -> EncodedRequest:
    tensors = {"x": np.arange(4, dtype=np.float32).reshape(1, 4)}
    return encode_request(protocol, "m", "", RequestInputs(tensors, batch_size=1))


@pytest.mark.parametrize("protocol", ["http", "http-binary", "grpc"])
@pytest.mark.parametrize("sequence_id", [12345678901, "run-1-2"])
def test_the_server_decodes_the_sequence_parameters(protocol: Any, sequence_id: Any) -> None:
    request = in_sequence(protocol, _request(protocol), sequence_id, start=True, end=False)
    if protocol == "grpc":
        decoded = grpc_codec.decode_infer_request(pb.ModelInferRequest.FromString(request.body))
    else:
        decoded = v2.decode_infer_request(request.body, request.header_length, "m", "")
    assert decoded.parameters["sequence_id"] == sequence_id
    assert decoded.parameters["sequence_start"] is True
    assert decoded.parameters["sequence_end"] is False
    np.testing.assert_array_equal(decoded.inputs["x"], [[0, 1, 2, 3]])
    assert request.batch_size == 1
    if protocol == "http-binary":  # the binary outputs asked for are kept
        assert decoded.binary_data_output


class _Outbox:
    """Stands in for the worker's pipe."""

    def __init__(self) -> None:
        self.messages: list[Any] = []

    def send(self, obj: Any) -> None:
        self.messages.append(obj)


class _SequenceServer(InferClient):
    """Answers in 1 ms; remembers each sequence's flags in order."""

    def __init__(self) -> None:
        super().__init__()
        self.flags: dict[int | str, list[tuple[bool, bool]]] = defaultdict(list)

    async def infer(self, index: int) -> str | None:
        raise AssertionError("a stateful model's requests go in sequences")

    async def infer_in_sequence(
        self, index: int, sequence_id: int | str, start: bool, end: bool
    ) -> str | None:
        self.flags[sequence_id].append((start, end))
        await asyncio.sleep(0.001)
        return None

    async def close(self) -> None:
        pass


@pytest.mark.parametrize(("concurrency", "rate"), [(1, 0.0), (3, 0.0), (0, 300.0)])
async def test_each_sequence_starts_ends_and_is_ended_when_the_level_stops(
    concurrency: int, rate: float
) -> None:
    server = _SequenceServer()
    plan = WorkerPlan(
        worker_id=1,
        endpoint=Endpoint(protocol="http", host="127.0.0.1", port=1, tls=False),
        model="m",
        version="",
        requests=[EncodedRequest(b"{}", None, batch_size=1)],
        timeout_s=5.0,
        distribution="constant",
        seed=0,
        sequences=SequencePlan(length=4, id_kind="int", max_id=2**63 - 1, run_tag=0, stride=2),
    )
    outbox = _Outbox()
    worker = Worker(outbox, plan, client_factory=lambda plan, outstanding: server)  # type: ignore[arg-type]
    level = RunLevel(
        level_id=0, concurrency=concurrency, request_rate=rate, phase_s=0.0, max_inflight=4,
        first_user=0, start_at=time.monotonic() + 0.02, warmup_s=0.0, window_s=0.15,
        max_windows=1,
    )  # fmt: skip

    await worker.run_level(level)

    assert isinstance(outbox.messages[-1], LevelDone)
    assert len(server.flags) >= 3
    for flags in server.flags.values():
        assert flags[0][0] and flags[-1][1], flags
        assert not any(start for start, _ in flags[1:]) and not any(e for _, e in flags[:-1])
        assert len(flags) <= 4
    # Worker 1's ids with stride 2: 2, 4, 6, ... (1 + run_tag + worker + k * stride).
    assert sorted(server.flags)[:3] == [2, 4, 6]
    if concurrency:
        # At most one open sequence per user, each ended when the level stopped.
        assert sum(len(flags) < 4 for flags in server.flags.values()) <= concurrency


class _Api:
    """The coordinator's server calls _run_warnings makes."""

    def __init__(self, config: dict[str, Any] | None) -> None:
        self.config = config

    def model_config(self) -> dict[str, Any] | None:
        return self.config

    def stats_snapshot(self) -> None:
        return None


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"max_batch_size": 8}, "--sequence-length: not used; the model's config has no"),
        (None, "--sequence-length: not used; the server publishes no model config"),
        (_config("TYPE_UINT64"), None),
    ],
)
def test_a_sequence_option_the_model_cannot_use_is_said_unused(
    config: dict[str, Any] | None, expected: str | None
) -> None:
    given = BenchSettings(url="http://127.0.0.1:1", model="m", sequence_length=5)
    said = [w for w in _run_warnings(_Api(config), None, given) if "--sequence" in w]  # type: ignore[arg-type]
    if expected is None:
        assert said == []
    else:
        assert len(said) == 1 and said[0].startswith(expected), said
    defaults = BenchSettings(url="http://127.0.0.1:1", model="m")
    assert not [w for w in _run_warnings(_Api(config), None, defaults) if "--sequence" in w]  # type: ignore[arg-type]
