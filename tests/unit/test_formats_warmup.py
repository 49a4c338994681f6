"""A model that fails its default warm-up with a fault is not served: its load fails with
the warm-up's error (every request would have been a 500), while a model that only
refuses the warm-up's zero-filled guess as data still loads."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from slipstream.config import ConfigError, parse_model_config
from slipstream.errors import InvalidRequest
from slipstream.observability.metrics import ServerMetrics
from slipstream.runtime.base import Backend, ModelSignature, TensorSpec
from slipstream.serving import model as model_module
from slipstream.serving.model import ModelVersion


class Failing(Backend):
    """Every run raises ``error``; records whether it was closed."""

    name = "failing"
    error: ClassVar[Exception] = RuntimeError("kernel fault: no such op")
    closed: ClassVar[int] = 0

    @classmethod
    def load(cls, path: Path, parameters: dict[str, str], instance_count: int) -> Backend:
        return cls()

    def signature(self) -> ModelSignature:
        return ModelSignature(
            (TensorSpec("x", "FP32", (-1, 2)),), (TensorSpec("y", "FP32", (-1, 2)),)
        )

    def run(self, inputs: dict[str, np.ndarray], output_names: Sequence[str]) -> dict[str, Any]:
        raise type(self).error

    def close(self) -> None:
        type(self).closed += 1


async def _load(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, error: Exception, dims: int = 2
) -> ModelVersion:
    monkeypatch.setattr(model_module, "get_backend", lambda name: Failing)
    monkeypatch.setattr(Failing, "error", error)
    monkeypatch.setattr(Failing, "closed", 0)
    tensors = {"input": [{"name": "x", "data_type": "FP32", "dims": [dims]}],
               "output": [{"name": "y", "data_type": "FP32", "dims": [dims]}]}  # fmt: skip
    config = parse_model_config({"backend": "failing", "max_batch_size": 4, **tensors}, "m")
    metrics = ServerMetrics().for_model("m", "1")
    return await ModelVersion.load("m", 1, tmp_path / "model.bin", config, metrics)


async def test_formats_a_fault_in_the_default_warm_up_fails_the_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigError, match=r"default warm-up: .*kernel fault: no such op"):
        await _load(monkeypatch, tmp_path, RuntimeError("kernel fault: no such op"))
    assert Failing.closed == 1  # the instance is freed, as any failed load's


async def test_formats_zero_inputs_refused_as_data_only_skip_the_default_warm_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refused = InvalidRequest("the model refused the request's data: ids must be > 0")
    model = await _load(monkeypatch, tmp_path, refused)
    assert model.name == "m"
    assert Failing.closed == 0


async def test_formats_a_fault_where_the_warm_up_guessed_a_size_only_skips_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A variable dim is run as 1: a convolution wider than that faults on the guess and
    # serves real lengths, so the load goes on.
    model = await _load(monkeypatch, tmp_path, RuntimeError("kernel size > input size"), dims=-1)
    assert model.name == "m" and Failing.closed == 0


async def test_formats_a_python_models_warm_up_fault_only_skips_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Failing, "warm_up_faults_are_fatal", False)
    model = await _load(monkeypatch, tmp_path, RuntimeError("execute: no such token"))
    assert model.name == "m" and Failing.closed == 0
