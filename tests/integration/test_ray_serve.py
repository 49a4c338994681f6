"""Issue #17, part 1: ``slipstream serve --ray`` on a local Ray cluster, driven by the
stock tritonclient through Ray Serve's HTTP proxy (V2 JSON and binary tensors).

The model's config.yaml asks for two replicas (``ray_serve:``): both answer. Slow (a Ray
cluster starts in ~5-10 s on two cores), so one server serves every case.
"""

from __future__ import annotations

import doctest
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.models import ADD_SUB_WIDTH, build_add_sub, run_onnx, write_config
from tests.utils import RemoteServer

pytest.importorskip("ray.serve")
httpclient = pytest.importorskip("tritonclient.http")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("ray_repo") / "models"
    path = build_add_sub(repo)
    write_config(repo, "add_sub", {"ray_serve": {"min_replicas": 2, "max_replicas": 2,
                                                 "num_cpus": 0.5}})  # fmt: skip
    return path


@pytest.fixture(scope="module")
def server(model_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    repo = model_file.parents[2]
    log_dir = tmp_path_factory.mktemp("ray_logs")
    with RemoteServer(repo, ["--ray"], log_dir=log_dir, startup_timeout_s=180) as running:
        yield running


def test_tritonclient_infers_through_ray_serve_as_through_slipstream(
    server: RemoteServer, model_file: Path
) -> None:
    client = httpclient.InferenceServerClient(server.http_address, network_timeout=60)
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("add_sub")
        assert client.get_model_metadata("add_sub")["versions"] == ["1"]
        a = np.random.default_rng(0).standard_normal((3, ADD_SUB_WIDTH)).astype(np.float32)
        b = np.ones_like(a)
        expected = run_onnx(model_file, {"INPUT0": a, "INPUT1": b})
        for binary in (False, True):
            inputs = [httpclient.InferInput(n, list(a.shape), "FP32") for n in ("INPUT0", "INPUT1")]
            inputs[0].set_data_from_numpy(a, binary_data=binary)
            inputs[1].set_data_from_numpy(b, binary_data=binary)
            outputs = [httpclient.InferRequestedOutput(n, binary_data=binary)
                       for n in ("OUTPUT0", "OUTPUT1")]  # fmt: skip
            result = client.infer("add_sub", inputs, outputs=outputs)
            for name in ("OUTPUT0", "OUTPUT1"):
                np.testing.assert_array_equal(result.as_numpy(name), expected[name])
    finally:
        client.close()


def test_the_models_replicas_share_its_requests(server: RemoteServer) -> None:
    seen = set()
    with httpx.Client(base_url=server.http_url, timeout=30) as client:
        for _ in range(40):
            reply = client.get("/v2/models/add_sub/ready")
            assert reply.status_code == 200
            seen.add(reply.headers["x-slipstream-replica"])
            if len(seen) == 2:
                break
    assert len(seen) == 2  # ray_serve: {min_replicas: 2, max_replicas: 2}


def test_the_deployment_options_follow_the_model_config() -> None:
    from slipstream.rayserve import app

    assert doctest.testmod(app).failed == 0
