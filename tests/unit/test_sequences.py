"""The live sequences of a stateful model (serving/sequences.py), against a model that
sums its sequence's inputs: any interleaving of starts, steps and ends of several
sequences (a hypothesis state machine) answers each request as the sum so far of its
own sequence, or refuses it naming why; one sequence's concurrent requests run in the
order they arrived."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from slipstream.config import ConfigError, parse_model_config
from slipstream.errors import InvalidRequest
from slipstream.serving.sequences import Sequences
from slipstream.types import InferRequest

CONFIG = {
    "max_batch_size": 4,
    "input": [{"name": "INPUT", "data_type": "FP32", "dims": [1]}],
    "output": [{"name": "OUTPUT", "data_type": "FP32", "dims": [1]}],
    "sequence_batching": {
        "control_input": [
            {"name": "START", "control": [{"kind": "CONTROL_SEQUENCE_START",
                                           "fp32_false_true": [0, 1]}]},
            {"name": "ID", "control": [{"kind": "CONTROL_SEQUENCE_CORRID",
                                        "data_type": "TYPE_STRING"}]},
        ],
        "state": [{"input_name": "S_IN", "output_name": "S_OUT", "data_type": "TYPE_FP32",
                   "dims": [1]}],
    },
}  # fmt: skip


def _sequences() -> Sequences:
    config = parse_model_config(CONFIG, "t").sequence_batching
    assert config is not None
    return Sequences("sum", config, batching=True)


async def _sum(inputs: dict[str, np.ndarray], shapes: tuple[Any, ...]) -> dict[str, np.ndarray]:
    await asyncio.sleep(random.random() / 1000)
    assert inputs["ID"].dtype == object and inputs["ID"].shape == (1, 1)
    total = inputs["S_IN"] * (1 - inputs["START"]) + inputs["INPUT"]
    return {"OUTPUT": total, "S_OUT": total}


def _request(key: int | str, **flags: bool) -> InferRequest:
    return InferRequest("sum", "", {}, parameters={"sequence_id": key, **flags})


async def _step(sequences: Sequences, key: int | str, value: float, **flags: bool) -> float:
    inputs = {"INPUT": np.array([[value]], dtype=np.float32)}
    outputs = await sequences.run(_request(key, **flags), inputs, 1, _sum)
    return float(outputs["OUTPUT"][0, 0])


class SequenceMachine(RuleBasedStateMachine):
    """The sums each id's running sequence should hold (absent: none runs)."""

    @initialize()
    def start_empty(self) -> None:
        self.sequences = _sequences()
        self.sums: dict[int | str, float] = {}

    @rule(key=st.sampled_from([1, 2, "a", "b"]), value=st.integers(-5, 5), end=st.booleans())
    def start(self, key: int | str, value: int, end: bool) -> None:
        got = asyncio.run(_step(self.sequences, key, value, sequence_start=True, sequence_end=end))
        assert got == value  # a START restarts a running id
        self.sums[key] = float(value)
        if end:
            del self.sums[key]

    @rule(key=st.sampled_from([1, 2, "a", "b"]), value=st.integers(-5, 5), end=st.booleans())
    def step(self, key: int | str, value: int, end: bool) -> None:
        if key not in self.sums:
            with pytest.raises(InvalidRequest, match="must set sequence_start"):
                asyncio.run(_step(self.sequences, key, value, sequence_end=end))
            return
        got = asyncio.run(_step(self.sequences, key, value, sequence_end=end))
        self.sums[key] += value
        assert got == self.sums[key]
        if end:
            del self.sums[key]
        assert len(self.sequences) == len(self.sums)


TestSequenceMachine = SequenceMachine.TestCase
TestSequenceMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_one_sequence_s_concurrent_requests_run_in_arrival_order() -> None:
    async def main() -> list[float]:
        sequences = _sequences()
        first = await _step(sequences, "s", 1.0, sequence_start=True)
        rest = [_step(sequences, "s", float(n)) for n in range(2, 12)]
        return [first, *await asyncio.gather(*rest)]

    assert asyncio.run(main()) == list(np.cumsum(range(1, 12), dtype=float))


@pytest.mark.parametrize(
    ("parameters", "expected"),
    [
        ({}, "parameters.sequence_id: model 'sum' is stateful"),
        ({"sequence_id": 0}, "non-zero integer or a non-empty string, got 0"),
        ({"sequence_id": True}, "got True"),
        ({"sequence_id": 3, "sequence_end": 1}, "parameters.sequence_end: expected true or"),
    ],
)
def test_requests_that_name_no_sequence_are_refused(
    parameters: dict[str, Any], expected: str
) -> None:
    request = InferRequest("sum", "", {}, parameters=parameters)
    inputs = {"INPUT": np.zeros((1, 1), np.float32)}
    with pytest.raises(InvalidRequest, match=expected):
        asyncio.run(_sequences().run(request, inputs, 1, _sum))


def test_a_stateful_model_keeps_to_one_ray_replica() -> None:
    with pytest.raises(ConfigError, match=r"ray_serve\.max_replicas: a stateful model"):
        parse_model_config({**CONFIG, "ray_serve": {"max_replicas": 2}}, "t")


def test_the_config_as_served_reads_back_as_it_was() -> None:
    """What GET .../config answers is what a load with that config override reads."""
    import json

    from slipstream.protocol.v2_meta import model_config_json
    from slipstream.repository.triton_config import parse_triton_json

    raw = {**CONFIG}
    raw["sequence_batching"] = {
        **CONFIG["sequence_batching"],  # type: ignore[dict-item]
        "state": [{"input_name": "S_IN", "output_name": "S_OUT", "data_type": "TYPE_FP32",
                   "dims": [-1], "initial_state": [{"data_type": "TYPE_FP32", "dims": [2],
                                                    "zero_data": True, "name": "z"}]}],
    }  # fmt: skip
    config = parse_model_config(raw, "t")
    served = model_config_json(config)
    assert served["sequence_batching"]["state"][0]["initial_state"][0]["data_type"] == "TYPE_FP32"
    again = parse_model_config(parse_triton_json(json.dumps(served), "override"), "t")
    assert again.sequence_batching == config.sequence_batching
