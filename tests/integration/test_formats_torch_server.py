"""Torch models in a real server: answers carry the datatypes the metadata advertises, a
model that would answer every request 500 never goes READY (its load error names why)
while the others serve, a bf16 program takes FP32, and a bounded batch dim takes the
batches its config allows."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ml_dtypes
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.models import build_add_sub, write_config
from tests.utils import RemoteServer

X = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]


class DoubleInFp64(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.double() * 2


class Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.linear(x)
        return result


class Faulty(torch.nn.Module):
    """Fails whatever the data: a fault of the model, not of a request."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to("meta").cpu()


def _torchscript(repo: Path, name: str, module: torch.nn.Module, dims: list[int]) -> None:
    (repo / name / "1").mkdir(parents=True)
    torch.jit.script(module).save(str(repo / name / "1" / "model.pt"))  # type: ignore[no-untyped-call]
    write_config(repo, name, {
        "backend": "torch", "max_batch_size": 8,
        "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [3]}],
        "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": dims}],
    })  # fmt: skip


def _program(repo: Path, name: str, module: torch.nn.Module, example: torch.Tensor,
             config: dict[str, Any], **dim: int) -> None:  # fmt: skip
    batch = torch.export.Dim("batch", **dim)
    program = torch.export.export(module.eval(), (example,), dynamic_shapes=({0: batch},))
    (repo / name / "1").mkdir(parents=True)
    torch.export.save(program, str(repo / name / "1" / "model.pt2"))
    write_config(repo, name, {"trust_pickle": True, **config})


torch.manual_seed(1)
# A bf16 program whose config declares BF16 on the wire (the reference for its answers).
BF16_LINEAR = Linear().to(torch.bfloat16).eval()


# BF16 as Triton's Python models handle it: through DLPack, in torch.
BF16_PYTHON = """
from torch.utils.dlpack import from_dlpack, to_dlpack
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        answers = []
        for request in requests:
            x = from_dlpack(pb_utils.get_input_tensor_by_name(request, "x").to_dlpack())
            y = pb_utils.Tensor.from_dlpack("output", to_dlpack(x * 2))
            answers.append(pb_utils.InferenceResponse([y]))
        return answers
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    tmp = tmp_path_factory.mktemp("formats_torch")
    repo = tmp / "models"
    with pytest.warns(DeprecationWarning):  # torch 2.13 deprecates torch.jit
        _torchscript(repo, "fp64_out", DoubleInFp64(), [3])
        _torchscript(repo, "wrong_dims", DoubleInFp64(), [4])
        _torchscript(repo, "faulty", Faulty(), [3])
    torch.manual_seed(0)
    _program(repo, "bf16", Linear().to(torch.bfloat16),
             torch.zeros(2, 3, dtype=torch.bfloat16), {})  # fmt: skip
    _program(repo, "bounded", Linear(), torch.zeros(2, 3),
             {"max_batch_size": 16}, max=4)  # fmt: skip
    torch.manual_seed(1)
    _program(repo, "bf16_wire", BF16_LINEAR, torch.zeros(2, 3, dtype=torch.bfloat16), {
        "max_batch_size": 8,
        "input": [{"name": "x", "data_type": "TYPE_BF16", "dims": [3]}],
        "output": [{"name": "output", "data_type": "TYPE_BF16", "dims": [2]}],
    })  # fmt: skip
    (repo / "bf16_python" / "1").mkdir(parents=True)
    (repo / "bf16_python" / "1" / "model.py").write_text(BF16_PYTHON)
    write_config(repo, "bf16_python", {
        "backend": "python", "trust_pickle": True, "max_batch_size": 4,
        "input": [{"name": "x", "data_type": "TYPE_BF16", "dims": [3]}],
        "output": [{"name": "output", "data_type": "TYPE_BF16", "dims": [3]}],
    })  # fmt: skip
    build_add_sub(repo)
    with RemoteServer(repo, ["--no-strict-readiness"], log_dir=tmp) as remote:
        yield remote


def _infer(server: RemoteServer, model: str, rows: list[list[float]]) -> httpx.Response:
    body = {"inputs": [{"name": "x", "shape": [len(rows), 3], "datatype": "FP32",
                        "data": [v for row in rows for v in row]}]}  # fmt: skip
    return server.http.post(f"/v2/models/{model}/infer", json=body, timeout=60)


def test_formats_fp64_computing_model_answers_the_fp32_it_declares(server: RemoteServer) -> None:
    answer = _infer(server, "fp64_out", X)
    assert answer.status_code == 200, answer.text
    output = answer.json()["outputs"][0]
    assert output["datatype"] == "FP32"
    assert output["data"] == [2 * v for row in X for v in row]


def test_formats_models_every_request_would_fail_are_not_ready_and_say_why(
    server: RemoteServer,
) -> None:
    index = {e["name"]: e for e in server.http.post("/v2/repository/index", json={}).json()}
    assert index["wrong_dims"]["state"] == "UNAVAILABLE"
    assert "output 'y'" in index["wrong_dims"]["reason"]
    assert "dims [4]" in index["wrong_dims"]["reason"]
    assert index["faulty"]["state"] == "UNAVAILABLE"
    assert "default warm-up" in index["faulty"]["reason"]
    assert index["add_sub"]["state"] == index["fp64_out"]["state"] == "READY"
    assert _infer(server, "faulty", X).status_code == 503
    assert server.http.get("/v2/health/live").status_code == 200


def test_formats_bf16_program_is_served_over_fp32(server: RemoteServer) -> None:
    metadata = server.http.get("/v2/models/bf16").json()
    assert metadata["inputs"][0]["datatype"] == "FP32"
    answer = _infer(server, "bf16", X)
    assert answer.status_code == 200, answer.text
    assert answer.json()["outputs"][0]["datatype"] == "FP32"


def test_formats_bounded_program_takes_the_batches_its_config_allows(server: RemoteServer) -> None:
    rows = np.arange(30, dtype=np.float32).reshape(10, 3).tolist()
    answer = _infer(server, "bounded", rows)
    assert answer.status_code == 200, answer.text
    assert answer.json()["outputs"][0]["shape"] == [10, 2]


def test_formats_bf16_tensors_cross_the_wire_as_bf16(server: RemoteServer) -> None:
    """A config declaring TYPE_BF16 takes and answers bfloat16 as it is (tritonclient's
    ml_dtypes arrays, binary over HTTP, raw over gRPC): the program's own bf16 result,
    bit for bit, no FP32 on the way."""
    x = np.array([[0.1, -2.5, 3.0], [1.0, 2.0, 1e-3]], dtype=ml_dtypes.bfloat16)
    with torch.inference_mode():
        reference = BF16_LINEAR(torch.from_numpy(x.view(np.int16)).view(torch.bfloat16))
    expected = reference.view(torch.int16).numpy()
    http_client = httpclient.InferenceServerClient(server.http_address)
    grpc_client = grpcclient.InferenceServerClient(server.grpc_address)
    try:
        for module, client in ((httpclient, http_client), (grpcclient, grpc_client)):
            tensor = module.InferInput("x", list(x.shape), "BF16")
            tensor.set_data_from_numpy(x)
            served = client.infer("bf16_wire", [tensor]).as_numpy("output")
            assert served.dtype == ml_dtypes.bfloat16
            np.testing.assert_array_equal(served.view(np.int16), expected)
            # A Python model reads and answers BF16 through DLPack, in torch.
            doubled = client.infer("bf16_python", [tensor]).as_numpy("output")
            twice = (2 * x.astype(np.float32)).astype(ml_dtypes.bfloat16)
            np.testing.assert_array_equal(doubled.view(np.uint16), twice.view(np.uint16))
    finally:
        http_client.close()
        grpc_client.close()
