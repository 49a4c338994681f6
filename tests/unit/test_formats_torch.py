"""The torch backend holds a model to what its config and program declare: a TorchScript
output answered in the declared datatype (or the load refused naming the output), a
bfloat16 program served over the FP32 its metadata advertises, and a program's bounded
batch dim respected whatever max_batch_size the config allows."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from slipstream.config import ConfigError, parse_model_config
from slipstream.observability.metrics import ServerMetrics
from slipstream.repository.autocomplete import complete_config
from slipstream.runtime.base import TensorSpec
from slipstream.runtime.torch import TorchBackend
from slipstream.serving.model import ModelVersion

# torch 2.13 deprecates every torch.jit entry point; serving TorchScript is the point.
jit_deprecated = pytest.mark.filterwarnings(
    r"ignore:`torch\.jit\.\w+` is deprecated:DeprecationWarning"
)


class DoubleInFp64(torch.nn.Module):
    """Computes in float64, as a model ported from numpy often does: x [B, 3] -> [B, 3]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.double() * 2


@pytest.fixture(autouse=True)
def _restore_torch_threads() -> Iterator[None]:
    # TorchBackend.load sets torch's process-wide thread count.
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _script(module: torch.nn.Module, path: Path) -> Path:
    torch.jit.script(module).save(str(path))  # type: ignore[no-untyped-call]
    return path


def _config(output_type: str, output_dims: list[int]) -> dict[str, Any]:
    return {
        "backend": "torch",
        "max_batch_size": 4,
        "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [3]}],
        "output": [{"name": "y", "data_type": output_type, "dims": output_dims}],
    }


@jit_deprecated
def test_formats_torchscript_fp64_output_is_answered_in_the_declared_fp32(tmp_path: Path) -> None:
    backend = TorchBackend.load(_script(DoubleInFp64(), tmp_path / "model.pt"), {}, 1)
    backend.configure(_config("TYPE_FP32", [3]))
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    result = backend.run({"x": x}, ["y"])
    # The response encoder writes the array's own datatype: float64 bytes under an FP32
    # metadata is what clients decoded as garbage.
    assert result["y"].dtype == np.float32
    np.testing.assert_array_equal(result["y"], x * 2)


@jit_deprecated
def test_formats_torchscript_output_of_other_kind_or_dims_is_refused_naming_it(
    tmp_path: Path,
) -> None:
    backend = TorchBackend.load(_script(DoubleInFp64(), tmp_path / "model.pt"), {}, 1)
    x = np.zeros((2, 3), np.float32)
    backend.configure(_config("TYPE_INT32", [3]))
    with pytest.raises(RuntimeError, match=r"output 'y': the model returned float64 but the "):
        backend.run({"x": x}, ["y"])
    backend.configure(_config("TYPE_FP32", [4]))
    with pytest.raises(RuntimeError, match=r"output 'y': .*shape \[2, 3\].*dims \[4\]"):
        backend.run({"x": x}, ["y"])


@jit_deprecated
async def test_formats_torchscript_with_wrong_dims_fails_its_load_naming_the_output(
    tmp_path: Path,
) -> None:
    """The default warm-up runs the model once: a model whose every answer would be a 500
    never goes READY, and the load error says which output and what to fix."""
    path = _script(DoubleInFp64(), tmp_path / "model.pt")
    config = parse_model_config(_config("TYPE_FP32", [4]), "m")
    metrics = ServerMetrics().for_model("m", "1")
    with pytest.raises(ConfigError, match=r"default warm-up: .*output 'y'.*dims \[4\]"):
        await ModelVersion.load("m", 1, path, config, metrics)


class Bf16Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.linear(x)
        return result


def _export(module: torch.nn.Module, path: Path, example: torch.Tensor, **dim: int) -> Path:
    batch = torch.export.Dim("batch", **dim)
    program = torch.export.export(module, (example,), dynamic_shapes=({0: batch},))
    torch.export.save(program, str(path))
    return path


def test_formats_bf16_program_takes_the_fp32_its_signature_advertises(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = Bf16Linear().to(torch.bfloat16).eval()
    path = _export(module, tmp_path / "model.pt2", torch.zeros(2, 4, dtype=torch.bfloat16))
    backend = TorchBackend.load(path, {}, 1)
    # Declared, and served, in FP32 unless a config declares BF16 (clients without
    # bfloat16 arrays): BF16 is what a config may say instead.
    assert backend.signature().inputs == (TensorSpec("x", "FP32", (-1, 4), also=("BF16",)),)
    assert backend.signature().outputs == (TensorSpec("output", "FP32", (-1, 3), also=("BF16",)),)
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    result = backend.run({"x": x}, ["output"])
    with torch.no_grad():
        expected = module(torch.from_numpy(x).to(torch.bfloat16)).float().numpy()
    assert result["output"].dtype == np.float32
    np.testing.assert_array_equal(result["output"], expected)


def test_formats_bounded_batch_dim_runs_larger_batches_in_parts(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = Bf16Linear().eval()
    path = _export(module, tmp_path / "model.pt2", torch.zeros(2, 4), max=4)
    backend = TorchBackend.load(path, {}, 1)
    # The config allows 16 rows (say the auto-completed default): the program's guard
    # refuses more than 4 in one run.
    backend.configure({"name": "m", "max_batch_size": 16, "output": []})
    x = np.random.default_rng(1).standard_normal((10, 4)).astype(np.float32)
    result = backend.run({"x": x}, ["output"])
    with torch.no_grad():
        expected = module(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(result["output"], expected, rtol=1e-6, atol=1e-6)
    # The bound, which a config that sets no max_batch_size gets as its own.
    assert backend.signature().max_batch_size == 4
    completed = complete_config(parse_model_config({}, "m"), backend.signature(), "torch")
    assert completed.max_batch_size == 4


def test_formats_unbounded_batch_dim_declares_no_bound(tmp_path: Path) -> None:
    path = _export(Bf16Linear().eval(), tmp_path / "model.pt2", torch.zeros(2, 4))
    assert TorchBackend.load(path, {}, 1).signature().max_batch_size is None
