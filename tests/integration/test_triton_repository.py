"""A Triton model repository (config.pbtxt files) served as it is, seen through the stock
tritonclient over HTTP and gRPC: the config the file says, answers, a model whose file
asks for what Slipstream does not do listed UNAVAILABLE naming the field, and a changed
config.pbtxt reloaded in poll mode."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.gated import wait_until
from tests.models import ADD_SUB_WIDTH, build_add_sub
from tests.utils import RemoteServer

PBTXT = """
name: "add_sub"
backend: "onnxruntime"
max_batch_size: 8
input [
  { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] },
  { name: "INPUT1" data_type: TYPE_FP32 dims: [ 16 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] },
  { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 16 ] }
]
instance_group [ { count: 2 kind: KIND_CPU } ]
dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 200 }
"""


def test_a_triton_repository_is_served_as_its_config_pbtxt_says(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    build_add_sub(repo)
    (repo / "add_sub" / "config.pbtxt").write_text(PBTXT)
    build_add_sub(repo, "stateful")
    (repo / "stateful" / "config.pbtxt").write_text(
        'backend: "onnxruntime"\nmax_batch_size: 8\n'
        "sequence_batching { iterative_sequence: true }\n"
    )
    args = ["--repository-poll-secs", "0.2", "--model-control-mode", "poll"]
    with RemoteServer(repo, args, log_dir=tmp_path, wait_for="live") as server:
        wait_until(lambda: server.http.get("/v2/models/add_sub/ready").status_code == 200, "ready")
        http = httpclient.InferenceServerClient(server.http_address)
        grpc = grpcclient.InferenceServerClient(server.grpc_address)
        try:
            for config in (http.get_model_config("add_sub"),
                           grpc.get_model_config("add_sub", as_json=True)["config"]):  # fmt: skip
                assert int(config["max_batch_size"]) == 8
                assert [int(g["count"]) for g in config["instance_group"]] == [2]
                batching = config["dynamic_batching"]
                assert [int(n) for n in batching["preferred_batch_size"]] == [4]
                assert int(batching["max_queue_delay_microseconds"]) == 200

            x = np.arange(3 * ADD_SUB_WIDTH, dtype=np.float32).reshape(3, ADD_SUB_WIDTH)
            inputs = []
            for name in ("INPUT0", "INPUT1"):
                tensor = httpclient.InferInput(name, list(x.shape), "FP32")
                tensor.set_data_from_numpy(x, binary_data=True)
                inputs.append(tensor)
            result = http.infer("add_sub", inputs)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x + x)

            # What Slipstream does not do: refused with the field named, the rest served.
            index = {e["name"]: e for e in http.get_model_repository_index()}
            assert index["stateful"]["state"] == "UNAVAILABLE"
            assert "sequence_batching.iterative_sequence is not" in index["stateful"]["reason"]

            # A changed config.pbtxt is a changed config: poll mode reloads it.
            (repo / "add_sub" / "config.pbtxt").write_text(
                PBTXT.replace("max_batch_size: 8", "max_batch_size: 4")
            )
            wait_until(
                lambda: int(http.get_model_config("add_sub")["max_batch_size"]) == 4,
                "the changed config.pbtxt being loaded",
            )
        finally:
            http.close()
            grpc.close()


@pytest.mark.parametrize("layout", [[], ["--frontends", "1"]], ids=["one", "split"])
def test_load_model_star_loads_every_model_and_kind_gpu_is_not_run_on_the_cpu(
    tmp_path: Path, layout: list[str]
) -> None:
    """Triton's `--load-model=*` in explicit mode; an instance_group that asks for a GPU
    the backend cannot use is refused naming it, not run on the CPU without a word; a
    version directory Triton ignores (`007/`) is ignored."""
    repo = tmp_path / "repo"
    build_add_sub(repo, "plain")
    shutil.copytree(repo / "plain" / "1", repo / "plain" / "007")
    build_add_sub(repo, "on_gpu")
    (repo / "on_gpu" / "config.pbtxt").write_text(
        'backend: "onnxruntime"\ninstance_group [ { count: 1 kind: KIND_GPU } ]\n'
    )
    args = ["--model-control-mode", "explicit", "--load-model", "*", *layout]
    with RemoteServer(repo, args, log_dir=tmp_path, wait_for="live") as server:
        wait_until(lambda: server.http.get("/v2/models/plain/ready").status_code == 200, "ready")
        index = {e["name"]: e for e in server.http.post("/v2/repository/index", json={}).json()}
        assert (index["plain"]["state"], index["plain"]["version"]) == ("READY", "1")
        assert index["on_gpu"]["state"] == "UNAVAILABLE"
        assert (
            "instance_group kind KIND_GPU: the onnxruntime backend runs on the CPU"
            in (index["on_gpu"]["reason"])
        )
        # Explicit mode still: models unload and load on request.
        assert server.http.post("/v2/repository/models/plain/unload").status_code == 200
        assert server.http.get("/v2/models/plain/ready").status_code != 200
