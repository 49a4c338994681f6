"""Bundles and OpenVINO models served by a real `slipstream serve`, asked with tritonclient.

One repository holds a bundle of each target (copied in as `slipstream export` wrote
them), an ONNX model served by `backend: openvino` with two instances, and an ONNX
Runtime model. A second server runs it where `import openvino` fails, as on a host
without the extra: the OpenVINO models are not ready and say why, the rest serve.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from slipstream.edge.export import ExportRequest, export_bundle
from slipstream.edge.targets import TargetOptions
from tests.models import build_add_sub, build_tiny_encoder, run_onnx, tiny_encoder_rows
from tests.models import write_config as write_model_config
from tests.utils import RemoteServer

pytest.importorskip("openvino")

TARGETS = ("edge", "mobile", "openvino")
# Modules that stand in for a missing package: importing them fails as a missing one does.
_NO_OPENVINO = 'raise ModuleNotFoundError("No module named \'openvino\'", name="openvino")\n'


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("edge_serving")
    source = build_tiny_encoder(root / "source")
    np.savez(root / "val.npz", **tiny_encoder_rows(40))  # type: ignore[arg-type]
    repo = root / "repo"
    for target in TARGETS:
        export_bundle(
            ExportRequest(
                model_dir=source.parent.parent,
                target=target,  # type: ignore[arg-type]
                out=repo / f"encoder_{target}",
                options=TargetOptions(validation=root / "val.npz"),
            )
        )
    build_tiny_encoder(repo, "encoder_ov")
    write_model_config(
        repo,
        "encoder_ov",
        {"backend": "openvino", "max_batch_size": 8, "instance_group": [{"count": 2}]},
    )
    build_add_sub(repo)
    return repo


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[RemoteServer]:
    with RemoteServer(repository, log_dir=repository.parent) as running:
        yield running


def _samples(bundle: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    with (
        np.load(bundle / "sample_inputs.npz") as inputs,
        np.load(bundle / "sample_outputs.npz") as outputs,
    ):
        return dict(inputs), dict(outputs)


def _infer_http(server: RemoteServer, model: str, inputs: dict[str, np.ndarray]) -> np.ndarray:
    client = httpclient.InferenceServerClient(server.http_address)
    tensors = []
    for name, array in inputs.items():
        tensor = httpclient.InferInput(name, list(array.shape), "INT64")
        tensor.set_data_from_numpy(array, binary_data=True)
        tensors.append(tensor)
    result: np.ndarray = client.infer(model, tensors).as_numpy("embedding")
    return result


@pytest.mark.parametrize("target", TARGETS)
def test_a_bundle_served_as_it_is_answers_its_samples(
    server: RemoteServer, repository: Path, target: str
) -> None:
    model = f"encoder_{target}"
    inputs, expected = _samples(repository / model)
    # The samples as one request: a dynamic INT8 model's scales are per batch, so the
    # shipped outputs hold for these rows batched together.
    served = _infer_http(server, model, inputs)
    np.testing.assert_allclose(served, expected["embedding"], rtol=1e-5, atol=1e-6)
    platform = "openvino" if target == "openvino" else "onnxruntime_onnx"
    metadata = httpx.get(server.url(f"/v2/models/{model}")).json()
    assert metadata["platform"] == platform and metadata["versions"] == ["1"]


def test_openvino_answers_as_onnx_runtime_over_grpc(server: RemoteServer, repository: Path) -> None:
    inputs = tiny_encoder_rows(5)
    client = grpcclient.InferenceServerClient(server.grpc_address)
    tensors = []
    for name, array in inputs.items():
        tensor = grpcclient.InferInput(name, list(array.shape), "INT64")
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    served = client.infer("encoder_ov", tensors).as_numpy("embedding")
    expected = run_onnx(repository / "encoder_ov" / "1" / "model.onnx", inputs)["embedding"]
    np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-6)
    config = httpx.get(server.url("/v2/models/encoder_ov/config")).json()
    assert config["backend"] == "openvino" and config["max_batch_size"] == 8
    assert config["instance_group"][0]["count"] == 2
    # The start-up line names the frameworks the models made it import.
    imported = re.search(r"frameworks imported: (.*)", server.log_text())
    assert imported is not None and "openvino" in imported[1].split(", ")


def test_without_openvino_its_models_say_how_to_install_it_and_the_rest_serve(
    repository: Path, tmp_path: Path
) -> None:
    blocker = tmp_path / "no_openvino" / "openvino"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text(_NO_OPENVINO)
    # First on the server's path, before whatever the test run has there.
    paths = [str(blocker.parent), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {"PYTHONPATH": os.pathsep.join(paths)}
    # Ready once loading is done: by default (Triton's strict readiness) a server with a
    # failed model reports not ready, and still serves the others.
    args = ["--no-strict-readiness"]
    with RemoteServer(repository, args, log_dir=tmp_path, env=env) as server:
        index = httpx.post(server.url("/v2/repository/index")).json()
        states = {entry["name"]: entry for entry in index}
        for name in ("encoder_openvino", "encoder_ov"):
            assert states[name]["state"] == "UNAVAILABLE"
            assert "pip install 'slipstream[openvino]'" in states[name]["reason"]
            assert httpx.get(server.url(f"/v2/models/{name}/ready")).status_code != 200
        assert states["encoder_mobile"]["state"] == states["add_sub"]["state"] == "READY"
        inputs, expected = _samples(repository / "encoder_mobile")
        served = _infer_http(server, "encoder_mobile", inputs)
        np.testing.assert_allclose(served, expected["embedding"], rtol=1e-5, atol=1e-6)
