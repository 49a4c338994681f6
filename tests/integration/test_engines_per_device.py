"""``slipstream serve --engines per-device``: one engine process per device the models run
on, driven as users drive a server (tritonclient over HTTP and gRPC, the openai SDK,
/metrics), then the GPU's engine killed with -9 while the CPU's models are under load.

The repository holds CPU models (ONNX, a GGUF LLM) and two that ask for ``cuda:0`` (a
torch program, a transformers LLM). On this host, which has no GPU, the ``cuda:0``
engine is started all the same and reports its models' load errors; what its failures
and its death must not do is touch the CPU engine's models. On a GPU host the torch
model serves.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.llm_models import smollm2_gguf, write_tiny_llama_shape
from tests.models import (
    ADD_SUB_WIDTH,
    add_sub_region,
    add_sub_region_inputs,
    build_add_sub,
    write_config,
)
from tests.utils import RemoteServer, posts_during

GPU_CONFIG = {"backend": "torch", "trust_pickle": True, "max_batch_size": 8,
              "parameters": {"device": "cuda:0"}}  # fmt: skip


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _torch_program(path: Path) -> None:
    import torch

    class Double(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    batch = torch.export.Dim("batch", max=8)
    program = torch.export.export(Double(), (torch.ones(2, 4),), dynamic_shapes=({0: batch},))
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(program, str(path))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    tmp = tmp_path_factory.mktemp("per-device")
    repo = tmp / "models"
    build_add_sub(repo)
    (repo / "smollm2" / "1").mkdir(parents=True)
    os.link(smollm2_gguf(), repo / "smollm2" / "1" / "model.gguf")
    write_config(repo, "smollm2", {"backend": "llama_cpp", "generation": {
        "max_model_len": 512, "max_num_seqs": 4, "threads": 1}})  # fmt: skip
    _torch_program(repo / "double" / "1" / "model.pt2")
    write_config(repo, "double", GPU_CONFIG)
    write_tiny_llama_shape(repo / "gpu_llm" / "1")
    generation = {"device": "cuda:0", "load_format": "dummy"}
    write_config(repo, "gpu_llm", {"backend": "transformers", "generation": generation})
    args = ["--engines", "per-device", "--frontends", "2", "--allow-client-shm",
            "--no-strict-readiness", "--model-control-mode", "explicit",
            "--load-model", "add_sub", "--load-model", "smollm2", "--load-model", "double",
            "--load-model", "gpu_llm"]  # fmt: skip
    with RemoteServer(repo, args, log_dir=tmp) as remote:
        yield remote


def _engine_pids(server: RemoteServer, device: str) -> list[int]:
    log = Path(server.log_path).read_text()
    return [int(pid) for pid in re.findall(rf"engine {device} started \(pid (\d+)\)", log)]


def _add_sub(mod: object, rows: int, seed: int) -> tuple[list[object], np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a, b = (rng.standard_normal((rows, ADD_SUB_WIDTH)).astype(np.float32) for _ in range(2))
    inputs = [mod.InferInput("INPUT0", [rows, ADD_SUB_WIDTH], "FP32"),
              mod.InferInput("INPUT1", [rows, ADD_SUB_WIDTH], "FP32")]  # fmt: skip
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs, a, b


def test_one_engine_per_device_each_loading_its_models(server: RemoteServer) -> None:
    assert len(_engine_pids(server, "cpu")) == 1 and len(_engine_pids(server, "cuda:0")) == 1
    index = {
        entry["name"]: entry for entry in httpx.post(server.url("/v2/repository/index")).json()
    }
    assert {name: index[name]["state"] for name in ("add_sub", "smollm2")} == {
        "add_sub": "READY", "smollm2": "READY"
    }  # fmt: skip
    if _cuda():
        assert index["double"]["state"] == "READY"
    else:
        # Loaded (and refused) by the cuda:0 engine, whose log line says so.
        assert index["double"]["state"] == "UNAVAILABLE"
        assert "CUDA" in index["double"]["reason"]
        log = Path(server.log_path).read_text()
        assert re.search(r"\[engine cuda:0\] \S+: model double: version 1 failed to load", log)
        assert not re.search(r"\[engine cpu\] \S+: model double", log)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_batches_of_every_size_reach_the_cpu_engine(server: RemoteServer, protocol: str) -> None:
    mod = httpclient if protocol == "http" else grpcclient
    address = server.http_address if protocol == "http" else server.grpc_address
    for rows in range(1, 9):
        client = mod.InferenceServerClient(address)  # a new connection: either front end
        inputs, a, b = _add_sub(mod, rows, rows)
        result = client.infer("add_sub", inputs)
        np.testing.assert_allclose(result.as_numpy("OUTPUT0"), a + b, rtol=1e-6)
        np.testing.assert_allclose(result.as_numpy("OUTPUT1"), a - b, rtol=1e-6)
        client.close()


def test_metrics_show_each_engines_series_under_its_device(server: RemoteServer) -> None:
    httpclient.InferenceServerClient(server.http_address).infer(
        "add_sub", _add_sub(httpclient, 2, 0)[0]
    )
    text = httpx.get(server.url("/metrics")).text
    success = re.findall(r"slipstream_request_success_total\{([^}]*)\} (\S+)", text)
    add_sub = [labels for labels, _ in success if 'model="add_sub"' in labels]
    assert len(add_sub) == 1 and 'engine="cpu"' in add_sub[0], add_sub
    # The cuda:0 engine's own series are there too, under its label.
    engines = set(re.findall(r'engine="([^"]+)"', text))
    assert engines == {"cpu", "cuda:0"}, engines
    frontends = set(re.findall(r'slipstream_http_connections_open\{frontend="(\d+)"\}', text))
    assert frontends == {"0", "1"}


def test_a_region_registered_once_serves_the_engines_models(server: RemoteServer) -> None:
    with add_sub_region("per_device_in") as (key, a, b):
        http = httpclient.InferenceServerClient(server.http_address)
        http.register_system_shared_memory("per_device_in", key, a.nbytes + b.nbytes)
        grpc = grpcclient.InferenceServerClient(server.grpc_address)
        status = grpc.get_system_shared_memory_status().regions
        assert [r.name for r in status.values()] == ["per_device_in"]
        inputs = add_sub_region_inputs("per_device_in", a, b)
        np.testing.assert_array_equal(grpc.infer("add_sub", inputs).as_numpy("OUTPUT0"), a + b)
        http.unregister_system_shared_memory()
        assert http.get_system_shared_memory_status() == []


def test_a_model_added_at_run_time_loads_in_its_devices_engine(server: RemoteServer) -> None:
    build_add_sub(server.repository, "late")
    shutil.copytree(server.repository / "double", server.repository / "late_gpu")
    grpc = grpcclient.InferenceServerClient(server.grpc_address)
    grpc.load_model("late")
    inputs, a, b = _add_sub(grpcclient, 3, 5)
    np.testing.assert_allclose(grpc.infer("late", inputs).as_numpy("OUTPUT0"), a + b, rtol=1e-6)
    if _cuda():
        grpc.load_model("late_gpu")
        return
    with pytest.raises(InferenceServerException, match="CUDA"):
        grpc.load_model("late_gpu")
    log = Path(server.log_path).read_text()
    assert re.search(r"\[engine cuda:0\] \S+: model late_gpu: version 1 failed to load", log)
    assert re.search(r"\[engine cpu\] \S+: model late version 1 is READY", log)


def test_openai_requests_go_to_the_engine_of_the_model_they_name(server: RemoteServer) -> None:
    client = server.openai()
    assert [model.id for model in client.models.list().data] == ["smollm2"]
    whole = client.completions.create(
        model="smollm2", prompt="The capital of France is", max_tokens=4, temperature=0
    )
    assert whole.usage.completion_tokens == 4
    if _cuda():
        return
    # The cuda:0 engine holds gpu_llm's load error; the CPU engine has never heard of it.
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model="gpu_llm", prompt="x", max_tokens=2)
    assert "CUDA" in str(info.value), info.value


def test_the_gpu_engine_killed_leaves_the_cpu_models_serving(server: RemoteServer) -> None:
    """kill -9 of the cuda:0 engine while add_sub is under load: every add_sub request is
    answered 200, and the engine is started again."""
    body = {"inputs": [
        {"name": n, "shape": [1, ADD_SUB_WIDTH], "datatype": "FP32",
         "data": [1.0] * ADD_SUB_WIDTH} for n in ("INPUT0", "INPUT1")]}  # fmt: skip

    def kill_and_wait() -> None:
        os.kill(_engine_pids(server, "cuda:0")[-1], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not (len(_engine_pids(server, "cuda:0")) > 1 and _ready(server)):
            assert time.monotonic() < deadline, "the cuda:0 engine was not started again"
            time.sleep(0.1)

    outcomes, _ = posts_during(server.url("/v2/models/add_sub/infer"), body, kill_and_wait)
    assert set(outcomes) == {200} and outcomes[200] > 20, outcomes
    assert len(_engine_pids(server, "cpu")) == 1


def _ready(server: RemoteServer) -> bool:
    try:
        return httpx.get(server.url("/v2/health/ready"), timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
