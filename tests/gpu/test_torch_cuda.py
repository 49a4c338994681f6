"""The torch backend on a CUDA GPU: same answers as the CPU, in every layout it offers.

Skipped where torch sees no GPU (tests/gpu/conftest.py); ``make test-gpu`` runs them.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from slipstream.errors import Unavailable
from slipstream.runtime import get_backend
from slipstream.runtime.torch import TorchBackend
from tests.utils import RemoteServer


class Positional(torch.nn.Module):
    """Builds a tensor on the export device inside forward (arange), as attention
    models do for positions: the case that failed with 'Tensor device mismatch'."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.position = torch.nn.Embedding(32, 16)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        hidden = self.embed(ids) + self.position(positions)
        return self.head(torch.tanh(hidden.mean(dim=1))) * scale


class Allocates(torch.nn.Module):
    """Allocates as many floats as its input asks for: an out-of-memory on demand."""

    def forward(self, count: torch.Tensor) -> torch.Tensor:
        size = int(count.max().item())
        return torch.ones(size, device=count.device).sum().reshape(1, 1).expand(count.shape[0], 1)


def export_positional(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    module = Positional().eval()
    batch = torch.export.Dim("batch", min=1, max=512)
    program = torch.export.export(
        module,
        (torch.zeros(2, 8, dtype=torch.int64), torch.ones(2, 1)),
        dynamic_shapes={"ids": {0: batch}, "scale": {0: batch}},
    )
    path = tmp_path / "model.pt2"
    torch.export.save(program, str(path))  # exported on the CPU, as people do
    return path, module


def inputs(rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "ids": rng.integers(0, 50, (rows, 8), dtype=np.int64),
        "scale": rng.uniform(0.5, 2.0, (rows, 1)).astype(np.float32),
    }


def json_body(data: dict[str, np.ndarray]) -> dict[str, object]:
    """The V2 JSON request of :func:`inputs`' arrays."""
    return {
        "inputs": [
            {"name": name, "datatype": "INT64" if name == "ids" else "FP32",
             "shape": list(array.shape), "data": array.ravel().tolist()}
            for name, array in data.items()
        ]
    }  # fmt: skip


def reference(module: torch.nn.Module, data: dict[str, np.ndarray]) -> np.ndarray:
    with torch.no_grad():
        out = module(torch.from_numpy(data["ids"]), torch.from_numpy(data["scale"]))
    result: np.ndarray = out.numpy()
    return result


def load(path: Path, **parameters: str) -> TorchBackend:
    backend = get_backend("torch").load(path, {"device": "cuda", **parameters}, 1)
    assert isinstance(backend, TorchBackend)
    return backend


def test_a_pt2_exported_on_the_cpu_serves_on_the_gpu(tmp_path: Path) -> None:
    path, module = export_positional(tmp_path)
    backend = load(path)
    for rows in (1, 3, 64):
        data = inputs(rows, seed=rows)
        out = backend.run(data, ["output"])["output"]
        assert out.dtype == np.float32 and out.shape == (rows, 4)
        np.testing.assert_allclose(out, reference(module, data), rtol=1e-4, atol=1e-5)


@pytest.mark.filterwarnings(r"ignore:`torch\.jit\.\w+` is deprecated:DeprecationWarning")
def test_a_torchscript_file_serves_on_the_gpu(tmp_path: Path) -> None:
    _, module = export_positional(tmp_path)
    path = tmp_path / "model.pt"
    torch.jit.script(module).save(str(path))
    backend = get_backend("torch").load(path, {"device": "cuda"}, 1)
    data = inputs(5)
    out = backend.run({"ids": data["ids"], "scale": data["scale"]}, ["output"])["output"]
    np.testing.assert_allclose(out, reference(module, data), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("mode", ["cast", "autocast"])
def test_half_precisions_match_fp32_within_their_rounding(
    tmp_path: Path, precision: str, mode: str
) -> None:
    path, module = export_positional(tmp_path)
    backend = load(path, precision=precision, precision_mode=mode)
    data = inputs(32)
    out = backend.run(data, ["output"])["output"]
    # The declared datatype, not the compute one; within a half type's rounding
    # (fp16: 11 bits of mantissa, bf16: 8) over a few layers.
    assert out.dtype == np.float32
    tolerance = 2e-2 if precision == "fp16" else 6e-2
    np.testing.assert_allclose(out, reference(module, data), rtol=tolerance, atol=tolerance)


def test_cuda_graphs_match_eager_at_every_batch_size(tmp_path: Path) -> None:
    path, module = export_positional(tmp_path)
    backend = load(path, cuda_graph_batch_sizes="1,2,4,8")
    runner = backend._cuda
    assert runner is not None
    for rows in range(1, 11):  # 9 and 10 are past the largest graph: eager
        data = inputs(rows, seed=100 + rows)
        out = backend.run(data, ["output"])["output"]
        assert out.shape == (rows, 4)
        np.testing.assert_allclose(out, reference(module, data), rtol=1e-4, atol=1e-5)
    assert runner.graph_count == 4  # one per listed size, each captured once
    # A replay with new data answers for the new data, not the captured batch.
    data = inputs(3, seed=999)
    np.testing.assert_allclose(
        backend.run(data, ["output"])["output"], reference(module, data), rtol=1e-4, atol=1e-5
    )


def test_instances_on_their_own_streams_answer_their_own_batches(tmp_path: Path) -> None:
    path, module = export_positional(tmp_path)
    backends = [load(path, cuda_graph_batch_sizes="4,16") for _ in range(3)]
    failures: list[str] = []

    def work(index: int) -> None:
        for round_ in range(40):
            data = inputs(1 + (index * 7 + round_) % 16, seed=index * 1000 + round_)
            out = backends[index].run(data, ["output"])["output"]
            if not np.allclose(out, reference(module, data), rtol=1e-4, atol=1e-5):
                failures.append(f"instance {index} round {round_}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


@pytest.mark.filterwarnings(r"ignore:`torch\.jit\.\w+` is deprecated:DeprecationWarning")
def test_out_of_memory_fails_that_batch_and_the_next_one_runs(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"  # TorchScript: the allocation's size depends on the data
    torch.jit.script(Allocates()).save(str(path))
    backend = load(path)
    free, _ = torch.cuda.mem_get_info()
    with pytest.raises(Unavailable, match="ran out of memory"):
        backend.run({"count": np.array([[free]], dtype=np.int64)}, ["output"])
    out = backend.run({"count": np.array([[1000], [10]], dtype=np.int64)}, ["output"])["output"]
    np.testing.assert_array_equal(out, [[1000.0], [1000.0]])


def test_served_on_the_gpu_over_http(tmp_path: Path) -> None:
    path, module = export_positional(tmp_path)
    version = tmp_path / "repo" / "positional" / "1"
    version.mkdir(parents=True)
    path.rename(version / "model.pt2")
    (tmp_path / "repo" / "positional" / "config.yaml").write_text(
        "trust_pickle: true\nmax_batch_size: 64\n"
        "instance_group: [{count: 2, kind: KIND_GPU}]\n"
        'parameters: {device: cuda, precision: fp16, cuda_graph_batch_sizes: "1,2,4,8,16"}\n'
    )
    with RemoteServer(tmp_path / "repo", log_dir=tmp_path) as server:
        for rows in (1, 5, 16, 40):
            data = inputs(rows, seed=rows)
            body = json_body(data)
            reply = httpx.post(server.url("/v2/models/positional/infer"), json=body, timeout=60)
            assert reply.status_code == 200, reply.text
            output = reply.json()["outputs"][0]
            assert output["datatype"] == "FP32" and output["shape"] == [rows, 4]
            got = np.array(output["data"], dtype=np.float32).reshape(rows, 4)
            np.testing.assert_allclose(got, reference(module, data), rtol=2e-2, atol=2e-2)


def test_per_device_engines_serve_the_gpu_and_the_cpu_model(tmp_path: Path) -> None:
    """``--engines per-device``: the model on cuda:0 and the same model on the CPU, each
    in its own engine process, both answering through one front end."""
    path, module = export_positional(tmp_path)
    for name, device in (("on_gpu", "cuda:0"), ("on_cpu", "cpu")):
        version = tmp_path / "repo" / name / "1"
        version.mkdir(parents=True)
        (version / "model.pt2").write_bytes(path.read_bytes())
        (tmp_path / "repo" / name / "config.yaml").write_text(
            f"trust_pickle: true\nmax_batch_size: 64\nparameters: {{device: '{device}'}}\n"
        )
    args = ["--engines", "per-device", "--frontends", "1"]
    with RemoteServer(tmp_path / "repo", args, log_dir=tmp_path) as server:
        for name in ("on_gpu", "on_cpu"):
            for rows in (1, 7):
                data = inputs(rows, seed=rows)
                body = json_body(data)
                reply = httpx.post(server.url(f"/v2/models/{name}/infer"), json=body, timeout=60)
                assert reply.status_code == 200, reply.text
                got = np.array(reply.json()["outputs"][0]["data"], np.float32).reshape(rows, 4)
                np.testing.assert_allclose(got, reference(module, data), rtol=1e-4, atol=1e-4)
        log = Path(server.log_path).read_text()
        assert "engine cpu started" in log and "engine cuda:0 started" in log
        assert re.search(r"\[engine cuda:0\] \S+: model on_gpu version 1 is READY", log)
        assert re.search(r"\[engine cpu\] \S+: model on_cpu version 1 is READY", log)
        metrics = httpx.get(server.url("/metrics"), timeout=10).text
        assert set(re.findall(r'engine="([^"]+)"', metrics)) == {"cpu", "cuda:0"}
