"""Loading a model version: an instance that fails to load frees the ones before it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from slipstream.config import parse_model_config
from slipstream.observability.metrics import ServerMetrics
from slipstream.runtime.base import Backend, ModelSignature, TensorSpec
from slipstream.serving import model as model_module
from slipstream.serving.model import ModelVersion


class SecondLoadFails(Backend):
    """Loads once; the second load raises. Records which instances were closed."""

    name = "second_load_fails"
    loads: ClassVar[int] = 0
    closed: ClassVar[list[int]] = []

    def __init__(self, number: int) -> None:
        self.number = number

    @classmethod
    def load(cls, path: Path, parameters: dict[str, str], instance_count: int) -> Backend:
        cls.loads += 1
        if cls.loads == 2:
            raise MemoryError("no room for a second instance")
        return cls(cls.loads)

    def signature(self) -> ModelSignature:
        spec = TensorSpec("x", "FP32", (-1, 2))
        return ModelSignature((spec,), (TensorSpec("y", "FP32", (-1, 2)),))

    def run(self, inputs: dict[str, np.ndarray], output_names: Sequence[str]) -> dict[str, Any]:
        return {"y": inputs["x"]}

    def close(self) -> None:
        type(self).closed.append(self.number)


async def test_a_failed_instance_load_closes_the_instances_already_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(model_module, "get_backend", lambda name: SecondLoadFails)
    config = parse_model_config(
        {"backend": "second_load_fails", "max_batch_size": 4, "instance_group": [{"count": 3}]},
        "test",
    )
    metrics = ServerMetrics().for_model("m", "1")
    with pytest.raises(MemoryError):
        await ModelVersion.load("m", 1, tmp_path / "model.bin", config, metrics)
    assert SecondLoadFails.loads == 2
    assert SecondLoadFails.closed == [1]
