"""Triton's CUDA shared memory on a GPU, driven as Triton users drive it: regions made
with ``tritonclient.utils.cuda_shared_memory`` (device memory exported as CUDA IPC
handles), registered over HTTP and gRPC, inputs read from them and outputs written into
them, in one process, the split layout and one engine per device.

Skipped where torch sees no GPU (tests/gpu/conftest.py); ``make test-gpu`` runs them.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.cuda_shared_memory as cudashm
from tritonclient.utils import InferenceServerException

from tests.gpu.test_torch_cuda import export_positional, inputs, reference
from tests.utils import RemoteServer

ROWS = 3


@pytest.fixture(
    scope="module",
    params=[[], ["--frontends", "2"], ["--engines", "per-device"]],
    ids=["one-process", "split", "per-device"],
)
def served(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[tuple[RemoteServer, Any, str]]:
    """(the server, the model's reference module, its output's name)"""
    tmp = tmp_path_factory.mktemp("cuda_shm")
    path, module = export_positional(tmp)
    version = tmp / "repo" / "positional" / "1"
    version.mkdir(parents=True)
    path.rename(version / "model.pt2")
    (tmp / "repo" / "positional" / "config.yaml").write_text(
        "trust_pickle: true\nmax_batch_size: 64\nparameters: {device: 'cuda:0'}\n"
    )
    with RemoteServer(tmp / "repo", ["--allow-client-shm", *request.param], log_dir=tmp) as server:
        metadata = httpx.get(server.url("/v2/models/positional"), timeout=30).json()
        yield server, module, metadata["outputs"][0]["name"]


@pytest.fixture
def regions() -> Iterator[dict[str, Any]]:
    """Device memory on GPU 0: "in" holds ids then scale of ROWS rows, "out" the output."""
    data = inputs(ROWS, seed=11)
    made = {
        "in": cudashm.create_shared_memory_region(
            "in", data["ids"].nbytes + data["scale"].nbytes, 0
        ),
        "out": cudashm.create_shared_memory_region("out", ROWS * 4 * 4, 0),
    }
    cudashm.set_shared_memory_region(made["in"], [data["ids"], data["scale"]])
    yield {"data": data, **made}
    for handle in made.values():
        cudashm.destroy_shared_memory_region(handle)


def _raw(handle: Any) -> str:
    return str(cudashm.get_raw_handle(handle).decode())


def test_inputs_and_outputs_in_cuda_regions_over_http(
    served: tuple[RemoteServer, Any, str], regions: dict[str, Any]
) -> None:
    server, module, output = served
    data = regions["data"]
    ids_bytes, scale_bytes = data["ids"].nbytes, data["scale"].nbytes
    with httpx.Client(base_url=server.http_url, timeout=60) as http:
        extensions = http.get("/v2").json()["extensions"]
        assert "cuda_shared_memory" in extensions
        for name, size in (("in", ids_bytes + scale_bytes), ("out", ROWS * 16)):
            reply = http.post(
                f"/v2/cudasharedmemory/region/{name}/register",
                json={"raw_handle": {"b64": _raw(regions[name])}, "device_id": 0,
                      "byte_size": size},
            )  # fmt: skip
            assert reply.status_code == 200, reply.text
        # The same memory under a second name: CUDA maps a handle once per process.
        reply = http.post(
            "/v2/cudasharedmemory/region/in_again/register",
            json={"raw_handle": {"b64": _raw(regions["in"])}, "device_id": 0, "byte_size": 8},
        )
        assert reply.status_code == 200, reply.text
        assert sorted(r["name"] for r in http.get("/v2/cudasharedmemory/status").json()) == [
            "in", "in_again", "out"
        ]  # fmt: skip
        assert http.get("/v2/cudasharedmemory/region/out/status").json() == [
            {"name": "out", "device_id": 0, "byte_size": ROWS * 16}
        ]

        def shm(region: str, offset: int, size: int) -> dict[str, Any]:
            return {"shared_memory_region": region, "shared_memory_offset": offset,
                    "shared_memory_byte_size": size}  # fmt: skip

        body = {
            "inputs": [
                {"name": "ids", "datatype": "INT64", "shape": [ROWS, 8],
                 "parameters": shm("in", 0, ids_bytes)},
                {"name": "scale", "datatype": "FP32", "shape": [ROWS, 1],
                 "parameters": shm("in", ids_bytes, scale_bytes)},
            ],
            "outputs": [{"name": output, "parameters": shm("out", 0, ROWS * 16)}],
        }  # fmt: skip
        reply = http.post("/v2/models/positional/infer", json=body)
        assert reply.status_code == 200, reply.text
        assert "data" not in reply.json()["outputs"][0]
        got = cudashm.get_contents_as_numpy(regions["out"], np.float32, [ROWS, 4])
        np.testing.assert_allclose(got, reference(module, data), rtol=1e-4, atol=1e-4)

        # Past the region's end: 400, and the region still serves afterwards.
        body["outputs"] = [{"name": output, "parameters": shm("out", 8, ROWS * 16)}]
        reply = http.post("/v2/models/positional/infer", json=body)
        assert reply.status_code == 400 and "past the end of region 'out'" in reply.text

        assert http.post("/v2/cudasharedmemory/region/in_again/unregister").status_code == 200
        body["outputs"] = [{"name": output, "parameters": shm("out", 0, ROWS * 16)}]
        assert http.post("/v2/models/positional/infer", json=body).status_code == 200
        assert http.post("/v2/cudasharedmemory/unregister").status_code == 200
        assert http.get("/v2/cudasharedmemory/status").json() == []


def test_inputs_and_outputs_in_cuda_regions_over_grpc(
    served: tuple[RemoteServer, Any, str], regions: dict[str, Any]
) -> None:
    server, module, output = served
    data = regions["data"]
    ids_bytes, scale_bytes = data["ids"].nbytes, data["scale"].nbytes
    client = grpcclient.InferenceServerClient(server.grpc_address)
    try:
        raw_in = cudashm.get_raw_handle(regions["in"])
        client.register_cuda_shared_memory("in", raw_in, 0, ids_bytes + scale_bytes)
        client.register_cuda_shared_memory("out", cudashm.get_raw_handle(regions["out"]), 0,
                                           ROWS * 16)  # fmt: skip
        status = client.get_cuda_shared_memory_status(as_json=True)
        assert sorted(status["regions"]) == ["in", "out"]
        ids = grpcclient.InferInput("ids", [ROWS, 8], "INT64")
        ids.set_shared_memory("in", ids_bytes)
        scale = grpcclient.InferInput("scale", [ROWS, 1], "FP32")
        scale.set_shared_memory("in", scale_bytes, offset=ids_bytes)
        out = grpcclient.InferRequestedOutput(output)
        out.set_shared_memory("out", ROWS * 16)
        client.infer("positional", [ids, scale], outputs=[out])
        got = cudashm.get_contents_as_numpy(regions["out"], np.float32, [ROWS, 4])
        np.testing.assert_allclose(got, reference(module, data), rtol=1e-4, atol=1e-4)
        # A handle that is not CUDA's: 400 with the runtime's reason, nothing registered.
        with pytest.raises(InferenceServerException, match="raw_handle: CUDA cannot open it"):
            client.register_cuda_shared_memory("bogus", base64.b64encode(bytes(64)), 0, 8)
        with pytest.raises(InferenceServerException, match="device_id 99"):
            client.register_cuda_shared_memory("bogus", raw_in, 99, 8)
    finally:
        client.unregister_cuda_shared_memory()
        assert client.get_cuda_shared_memory_status(as_json=True) == {}
        client.close()


def test_a_system_region_name_is_not_a_cuda_one(
    served: tuple[RemoteServer, Any, str], regions: dict[str, Any]
) -> None:
    server = served[0]
    with httpx.Client(base_url=server.http_url, timeout=60) as http:
        body = {"raw_handle": {"b64": _raw(regions["out"])}, "device_id": 0, "byte_size": 16}
        assert http.post("/v2/cudasharedmemory/region/taken/register", json=body).is_success
        try:
            assert http.get("/v2/systemsharedmemory/region/taken/status").status_code == 404
            again = http.post("/v2/cudasharedmemory/region/taken/register", json=body)
            assert again.status_code == 400 and "already registered" in again.text
        finally:
            http.post("/v2/cudasharedmemory/region/taken/unregister")
