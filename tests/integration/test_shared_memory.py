"""Triton's system shared-memory extension, driven by the stock tritonclient over HTTP and
gRPC: regions made with ``tritonclient.utils.shared_memory``, inputs read from them and
outputs written into them, and every bad region access answered 400 naming the cause.
"""

from __future__ import annotations

import base64
import os
import queue
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import (
    InferenceServerException,
    serialize_byte_tensor,
    serialized_byte_size,
)

from slipstream.security.keys import KeyRing
from tests.models import ADD_SUB_WIDTH, build_add_sub, build_identity
from tests.utils import RemoteServer

# Bytes of one add_sub tensor of one row: [1, 16] FP32.
TENSOR_BYTES = ADD_SUB_WIDTH * 4

Client = httpclient.InferenceServerClient | grpcclient.InferenceServerClient


# One process, and the split layout (--frontends 2), where the regions are registered in
# the engine process, which reads and writes them, whichever front end is asked.
@pytest.fixture(scope="module", params=[[], ["--frontends", "2"]], ids=["one-process", "split"])
def server(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[RemoteServer]:
    tmp = tmp_path_factory.mktemp("shared_memory")
    repo = tmp / "models"
    build_add_sub(repo)
    build_identity(repo, "BYTES")
    build_identity(repo, "BF16")
    with RemoteServer(repo, ["--allow-client-shm", *request.param], log_dir=tmp) as remote:
        yield remote


@pytest.fixture(params=["http", "grpc"])
def client(request: pytest.FixtureRequest, server: RemoteServer) -> Iterator[Client]:
    made: Client
    if request.param == "http":
        made = httpclient.InferenceServerClient(server.http_address)
    else:
        made = grpcclient.InferenceServerClient(server.grpc_address)
    made.unregister_system_shared_memory()  # each test starts with no region
    yield made
    made.unregister_system_shared_memory()
    made.close()


@pytest.fixture
def make_region() -> Iterator[Callable[[int], tuple[str, Any]]]:
    """Makes POSIX shared-memory objects (key, handle), destroyed after the test."""
    handles: list[Any] = []

    def make(byte_size: int) -> tuple[str, Any]:
        key = f"/slipstream_test_{uuid.uuid4().hex[:12]}"
        handle = shm.create_shared_memory_region(key[1:], key, byte_size)
        handles.append(handle)
        return key, handle

    yield make
    for handle in handles:
        shm.destroy_shared_memory_region(handle)


def _module(client: Client) -> Any:
    return httpclient if isinstance(client, httpclient.InferenceServerClient) else grpcclient


def _refused(call: Callable[[], object], *fragments: str) -> str:
    with pytest.raises(InferenceServerException) as info:
        call()
    message = str(info.value.message())
    for fragment in fragments:
        assert fragment in message, message
    if info.value.status() is not None:
        assert str(info.value.status()) in ("400", "StatusCode.INVALID_ARGUMENT")
    return message


def test_metadata_lists_the_extension(client: Client) -> None:
    metadata = client.get_server_metadata()
    extensions = metadata["extensions"] if isinstance(metadata, dict) else metadata.extensions
    assert "system_shared_memory" in extensions
    # Listed only where a client's device memory can be opened: not on a host without a GPU.
    assert "cuda_shared_memory" not in extensions


def test_inputs_and_outputs_through_regions(
    client: Client, make_region: Callable[[int], tuple[str, Any]]
) -> None:
    mod = _module(client)
    rng = np.random.default_rng(7)
    a, b = (rng.standard_normal((1, ADD_SUB_WIDTH)).astype(np.float32) for _ in range(2))
    # Both inputs in one object, at two offsets of one region; the outputs in another.
    in_key, in_handle = make_region(2 * TENSOR_BYTES)
    out_key, out_handle = make_region(2 * TENSOR_BYTES)
    shm.set_shared_memory_region(in_handle, [a, b])
    client.register_system_shared_memory("in", in_key, 2 * TENSOR_BYTES)
    client.register_system_shared_memory("out", out_key, 2 * TENSOR_BYTES)

    inputs = [mod.InferInput("INPUT0", [1, ADD_SUB_WIDTH], "FP32"),
              mod.InferInput("INPUT1", [1, ADD_SUB_WIDTH], "FP32")]  # fmt: skip
    inputs[0].set_shared_memory("in", TENSOR_BYTES)
    inputs[1].set_shared_memory("in", TENSOR_BYTES, offset=TENSOR_BYTES)
    outputs = [mod.InferRequestedOutput("OUTPUT0"), mod.InferRequestedOutput("OUTPUT1")]
    outputs[0].set_shared_memory("out", TENSOR_BYTES, offset=TENSOR_BYTES)
    result = client.infer("add_sub", inputs, outputs=outputs)

    total = shm.get_contents_as_numpy(out_handle, np.float32, [1, ADD_SUB_WIDTH], TENSOR_BYTES)
    np.testing.assert_allclose(total, a + b, rtol=1e-6)
    # The output in the region is listed without data; the other comes in the response.
    listed = result.get_output("OUTPUT0")
    shape = listed["shape"] if isinstance(listed, dict) else list(listed.shape)
    assert shape == [1, ADD_SUB_WIDTH]
    np.testing.assert_allclose(result.as_numpy("OUTPUT1"), a - b, rtol=1e-6)


def test_bytes_tensor_through_a_region(
    client: Client, make_region: Callable[[int], tuple[str, Any]]
) -> None:
    mod = _module(client)
    words = np.array([[b"shared", b"", b"memory \xe2\x9c\x93"]], dtype=np.object_)
    serialized = serialize_byte_tensor(words)
    size = serialized_byte_size(serialized)
    key, handle = make_region(256)
    shm.set_shared_memory_region(handle, [serialized])
    client.register_system_shared_memory("words", key, 256)
    tensor = mod.InferInput("INPUT0", [1, 3], "BYTES")
    tensor.set_shared_memory("words", size)
    result = client.infer("identity_bytes", [tensor])
    assert result.as_numpy("OUTPUT0").tolist() == words.tolist()
    tensor.set_shared_memory("words", size - 1)  # the last element cut short
    _refused(lambda: client.infer("identity_bytes", [tensor]), "in region 'words'")


def test_bf16_tensor_through_regions(
    client: Client, make_region: Callable[[int], tuple[str, Any]]
) -> None:
    """tritonclient's bfloat16 (ml_dtypes) read from a region and answered into another
    and in the response, bit for bit (in the split layout the engine reads the region)."""
    mod = _module(client)
    x = np.array([[0.1, -2.5, np.nan, 3.0e38]], np.float32).astype(ml_dtypes.bfloat16)
    in_key, in_handle = make_region(x.nbytes)
    out_key, out_handle = make_region(x.nbytes)
    shm.set_shared_memory_region(in_handle, [x.view(np.uint16)])
    client.register_system_shared_memory("bf16_in", in_key, x.nbytes)
    client.register_system_shared_memory("bf16_out", out_key, x.nbytes)
    tensor = mod.InferInput("INPUT0", list(x.shape), "BF16")
    tensor.set_shared_memory("bf16_in", x.nbytes)
    answered = client.infer("identity_bf16", [tensor]).as_numpy("OUTPUT0")
    np.testing.assert_array_equal(answered.view(np.uint16), x.view(np.uint16))
    output = mod.InferRequestedOutput("OUTPUT0")
    output.set_shared_memory("bf16_out", x.nbytes)
    client.infer("identity_bf16", [tensor], outputs=[output])
    region = shm.get_contents_as_numpy(out_handle, np.uint16, list(x.shape))
    np.testing.assert_array_equal(region, x.view(np.uint16))


def test_status_and_unregister_by_name_and_all(
    client: Client, make_region: Callable[[int], tuple[str, Any]]
) -> None:
    key, _ = make_region(8192)
    client.register_system_shared_memory("r0", key, 4096)
    client.register_system_shared_memory("r1", key, 100, offset=5000)
    status = (
        client.get_system_shared_memory_status(as_json=True)
        if _is_grpc(client)
        else (client.get_system_shared_memory_status())
    )
    assert _regions(status) == {("r0", key, 0, 4096), ("r1", key, 5000, 100)}
    one = client.get_system_shared_memory_status("r1")
    assert {name for name, *_ in _regions(one)} == {"r1"}
    client.unregister_system_shared_memory("r0")
    client.unregister_system_shared_memory("r0")  # already gone: a no-op, as in Triton
    assert {name for name, *_ in _regions(client.get_system_shared_memory_status())} == {"r1"}
    client.unregister_system_shared_memory()
    assert _regions(client.get_system_shared_memory_status()) == set()


def _is_grpc(client: Client) -> bool:
    return isinstance(client, grpcclient.InferenceServerClient)


def _regions(status: Any) -> set[tuple[str, str, int, int]]:
    if isinstance(status, list):  # HTTP: a JSON list
        return {(r["name"], r["key"], int(r["offset"]), int(r["byte_size"])) for r in status}
    if isinstance(status, dict):  # gRPC as JSON
        return {
            (r["name"], r["key"], int(r.get("offset", 0)), int(r["byte_size"]))
            for r in status.get("regions", {}).values()
        }
    return {(r.name, r.key, r.offset, r.byte_size) for r in status.regions.values()}


def test_bad_registrations_are_refused_naming_the_cause(
    client: Client, make_region: Callable[[int], tuple[str, Any]]
) -> None:
    key, _ = make_region(1024)
    register = client.register_system_shared_memory
    _refused(lambda: register("r", key, 1024, offset=1), "past the end", "(1024 bytes)")
    _refused(lambda: register("r", key, 2048), "past the end")
    _refused(lambda: register("r", "/slipstream_no_such_object", 8), "cannot open")
    _refused(lambda: register("r", "/" + "k" * 256, 8), "at most 255")
    _refused(lambda: register("r", "/../etc/passwd", 8), "POSIX shared memory name")
    register("r", key, 512)
    _refused(lambda: register("r", key, 512, offset=512), "'r' is already registered")
    with pytest.raises(InferenceServerException) as unknown:
        client.get_system_shared_memory_status("nothing")
    assert "'nothing' is not registered" in str(unknown.value.message())
    assert str(unknown.value.status()) in ("404", "StatusCode.NOT_FOUND")


def test_bad_region_accesses_are_refused_and_touch_nothing(
    client: Client, make_region: Callable[[int], tuple[str, Any]]
) -> None:
    mod = _module(client)
    key, handle = make_region(4 * TENSOR_BYTES)
    client.register_system_shared_memory("r", key, 2 * TENSOR_BYTES, offset=TENSOR_BYTES)
    # Bytes around the region: never written by any of the refused requests.
    shm.set_shared_memory_region(handle, [np.full(4 * ADD_SUB_WIDTH, 5.0, np.float32)])

    def infer(in_region: str, in_offset: int, out: list[tuple[str, int, int]]) -> object:
        inputs = [mod.InferInput(f"INPUT{i}", [1, ADD_SUB_WIDTH], "FP32") for i in (0, 1)]
        inputs[0].set_shared_memory(in_region, TENSOR_BYTES, offset=in_offset)
        inputs[1].set_data_from_numpy(np.ones((1, ADD_SUB_WIDTH), np.float32))
        outputs = []
        for index, (region, size, offset) in enumerate(out):
            output = mod.InferRequestedOutput(f"OUTPUT{index}")
            output.set_shared_memory(region, size, offset=offset)
            outputs.append(output)
        return client.infer("add_sub", inputs, outputs=outputs or None)

    _refused(lambda: infer("unknown", 0, []), "region 'unknown' is not registered")
    _refused(lambda: infer("r", TENSOR_BYTES + 4, []), "past the end of region 'r'")
    _refused(lambda: infer("r", 0, [("r", TENSOR_BYTES, TENSOR_BYTES + 1)]), "past the end")
    _refused(
        lambda: infer("r", 0, [("r", TENSOR_BYTES, 0), ("r", TENSOR_BYTES, TENSOR_BYTES - 4)]),
        "overlap those of output 'OUTPUT0'",
    )
    _refused(lambda: infer("r", 0, [("r", TENSOR_BYTES - 4, 0)]), "do not fit")
    whole = shm.get_contents_as_numpy(handle, np.float32, [4 * ADD_SUB_WIDTH])
    assert (whole[:ADD_SUB_WIDTH] == 5.0).all() and (whole[3 * ADD_SUB_WIDTH :] == 5.0).all()
    # After all that, the region serves: 5 + 1 written into its second tensor's bytes.
    infer("r", 0, [("r", TENSOR_BYTES, TENSOR_BYTES)])
    total = shm.get_contents_as_numpy(handle, np.float32, [ADD_SUB_WIDTH], 2 * TENSOR_BYTES)
    np.testing.assert_array_equal(total, np.full(ADD_SUB_WIDTH, 6.0, np.float32))


def test_cuda_shared_memory_is_refused_with_its_reason(server: RemoteServer) -> None:
    """This host has no GPU: a well-formed CUDA registration is refused with the CUDA
    runtime's reason (tests/gpu/test_cuda_shared_memory.py serves them on a GPU)."""
    handle = base64.b64encode(bytes(64)).decode()
    with httpx.Client(base_url=server.http_url, timeout=30) as http:
        _cuda_over_http(http, handle)
    grpc = grpcclient.InferenceServerClient(server.grpc_address)
    _refused(
        lambda: grpc.register_cuda_shared_memory("gpu0", handle.encode(), 0, 8),
        "device_id 0: this server has no usable CUDA device (cudaError",
    )
    _refused(lambda: grpc.register_cuda_shared_memory("gpu0", b"", 0, 8), "raw_handle: 0 bytes")
    _refused(lambda: grpc.register_cuda_shared_memory("gpu0", handle.encode(), -1, 8), "device_id")
    assert grpc.get_cuda_shared_memory_status(as_json=True) == {}
    grpc.unregister_cuda_shared_memory()
    grpc.close()


def _cuda_over_http(http: httpx.Client, handle: str) -> None:
    assert http.get("/v2/cudasharedmemory/status").json() == []
    path = "/v2/cudasharedmemory/region/gpu0/register"
    refused = http.post(path, json={"raw_handle": {"b64": handle}, "device_id": 0, "byte_size": 8})
    assert refused.status_code == 400
    assert "this server has no usable CUDA device (cudaError" in refused.json()["error"]
    assert "use system shared memory" in refused.json()["error"]
    for body, fragment in (
        (b"[]", "expected a JSON object with raw_handle"),
        (b'{"device_id": 0, "byte_size": 8}', "raw_handle: expected"),
        (b'{"raw_handle": "abc", "device_id": 0, "byte_size": 8}', "raw_handle: expected"),
        (b'{"raw_handle": {"b64": "@@"}, "device_id": 0, "byte_size": 8}', "not valid base64"),
        # Not ASCII: base64 has no such character.
        ('{"raw_handle": {"b64": "\u00e9"}, "device_id": 0, "byte_size": 8}'.encode(), "base64"),
        (b'{"raw_handle": {"b64": ""}, "byte_size": 8}', "device_id: required"),
        (b'{"raw_handle": {"b64": ""}, "device_id": -1, "byte_size": 8}', "device_id: expected"),
        (b'{"raw_handle": {"b64": ""}, "device_id": 0}', "byte_size: required"),
        (b'{"raw_handle": {"b64": ""}, "device_id": 0, "byte_size": 8}', "raw_handle: 0 bytes"),
    ):
        response = http.post(path, content=body)
        assert response.status_code == 400, body
        assert fragment in response.json()["error"], (body, response.text)
    assert http.get("/v2/cudasharedmemory/region/gpu0/status").status_code == 404
    assert http.post("/v2/cudasharedmemory/unregister").status_code == 200


def test_http_register_body_is_validated(server: RemoteServer) -> None:
    with httpx.Client(base_url=server.http_url, timeout=30) as http:
        _bad_register_bodies(http)


def _bad_register_bodies(http: httpx.Client) -> None:
    path = "/v2/systemsharedmemory/region/r/register"
    for body, fragment in (
        (b"[]", "expected a JSON object"),
        (b'{"byte_size": 8}', "key: expected"),
        (b'{"key": "/k"}', "byte_size: required"),
        (b'{"key": "/k", "byte_size": -1}', "byte_size: expected a non-negative integer"),
        (b'{"key": "/k", "byte_size": 8, "offset": "0"}', "offset: expected"),
    ):
        response = http.post(path, content=body)
        assert response.status_code == 400, body
        assert fragment in response.json()["error"]
    assert http.get(path).status_code == 405
    assert http.post("/v2/systemsharedmemory/register").status_code == 404


@pytest.fixture(scope="module", params=[[], ["--frontends", "2"]], ids=["one-process", "split"])
def keyed_server(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[tuple[RemoteServer, dict[str, str]]]:
    """A server with API keys: "a" and "b" of the infer role."""
    tmp = tmp_path_factory.mktemp("shared_memory_keys")
    build_add_sub(tmp / "models")
    ring = KeyRing.load(tmp / "keys.json", missing_ok=True)
    headers = {name: {"authorization": f"Bearer {ring.create(name, 'infer')[0]}"}
               for name in ("a", "b")}  # fmt: skip
    ring.save()
    args = ["--allow-client-shm", "--auth-file", str(tmp / "keys.json"), *request.param]
    with RemoteServer(tmp / "models", args, log_dir=tmp) as remote:
        yield remote, headers


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_each_key_has_regions_of_its_own(
    keyed_server: tuple[RemoteServer, dict[str, str]],
    protocol: str,
    make_region: Callable[[int], tuple[str, Any]],
) -> None:
    """Two keys register a region of the same name, each over its own tensors; neither
    sees, uses, writes into or unregisters the other's regions."""
    server, headers = keyed_server
    a, b = headers["a"], headers["b"]
    client: Client = (
        httpclient.InferenceServerClient(server.http_address)
        if protocol == "http"
        else grpcclient.InferenceServerClient(server.grpc_address)
    )
    mod = _module(client)
    rng = np.random.default_rng(11)
    x, y = (rng.standard_normal((2, 1, ADD_SUB_WIDTH)).astype(np.float32) for _ in range(2))
    key_a, handle_a = make_region(2 * TENSOR_BYTES)
    key_b, handle_b = make_region(2 * TENSOR_BYTES)
    out_key, out_handle = make_region(TENSOR_BYTES)
    shm.set_shared_memory_region(handle_a, [x[0], x[1]])
    shm.set_shared_memory_region(handle_b, [y[0], y[1]])
    try:
        client.register_system_shared_memory("in", key_a, 2 * TENSOR_BYTES, headers=a)
        client.register_system_shared_memory("out", out_key, TENSOR_BYTES, headers=a)
        client.register_system_shared_memory("in", key_b, 2 * TENSOR_BYTES, headers=b)
        names = {key: {name for name, *_ in _regions(
            client.get_system_shared_memory_status(headers=header))}
            for key, header in headers.items()}  # fmt: skip
        assert names == {"a": {"in", "out"}, "b": {"in"}}
        with pytest.raises(InferenceServerException, match="'out' is not registered"):
            client.get_system_shared_memory_status("out", headers=b)

        def infer(header: dict[str, str], output_region: str = "") -> Any:
            inputs = [mod.InferInput(f"INPUT{i}", [1, ADD_SUB_WIDTH], "FP32") for i in (0, 1)]
            inputs[0].set_shared_memory("in", TENSOR_BYTES)
            inputs[1].set_shared_memory("in", TENSOR_BYTES, offset=TENSOR_BYTES)
            output = mod.InferRequestedOutput("OUTPUT0")
            if output_region:
                output.set_shared_memory(output_region, TENSOR_BYTES)
            return client.infer("add_sub", inputs, outputs=[output], headers=header)

        # The same region name reads each key's own tensors.
        infer(a, "out")
        written = shm.get_contents_as_numpy(out_handle, np.float32, [1, ADD_SUB_WIDTH])
        np.testing.assert_allclose(written, x[0] + x[1], rtol=1e-6)
        np.testing.assert_allclose(infer(b).as_numpy("OUTPUT0"), y[0] + y[1], rtol=1e-6)
        _refused(lambda: infer(b, "out"), "region 'out' is not registered")
        if isinstance(client, grpcclient.InferenceServerClient):
            _stream_reads_the_keys_own_region(client, b, y[0] + y[1])

        client.unregister_system_shared_memory("out", headers=b)
        client.unregister_system_shared_memory(headers=b)
        assert {name for name, *_ in _regions(
            client.get_system_shared_memory_status(headers=a))} == {"in", "out"}  # fmt: skip
        assert _regions(client.get_system_shared_memory_status(headers=b)) == set()
    finally:
        client.unregister_system_shared_memory(headers=a)
        client.unregister_system_shared_memory(headers=b)
        client.close()


def test_a_revoked_key_s_regions_go_with_it(
    keyed_server: tuple[RemoteServer, dict[str, str]],
    make_region: Callable[[int], tuple[str, Any]],
) -> None:
    """`slipstream keys revoke` on a running server unregisters the key's regions: a new
    key given the same name finds none of them, and other keys keep theirs."""
    server, headers = keyed_server
    keys_file = server.repository.parent / "keys.json"
    http = httpx.Client(base_url=server.http_url, timeout=10)
    region, _ = make_region(TENSOR_BYTES)
    body = {"key": region, "offset": 0, "byte_size": TENSOR_BYTES}
    register = "/v2/systemsharedmemory/region/{}/register"
    status = "/v2/systemsharedmemory/status"

    def new_key() -> dict[str, str]:
        ring = KeyRing.load(keys_file)
        if any(key.name == "c" for key in ring.keys):
            ring.revoke("c")
        header = {"authorization": f"Bearer {ring.create('c', 'infer')[0]}"}
        ring.save()
        deadline = time.monotonic() + 10
        while http.get(status, headers=header).status_code != 200:  # until it is read
            assert time.monotonic() < deadline, "the new key was not taken up"
            time.sleep(0.05)
        return header

    try:
        assert http.post(register.format("kept"), json=body, headers=headers["a"]).is_success
        first = new_key()
        assert http.post(register.format("c-in"), json=body, headers=first).is_success
        assert [r["name"] for r in http.get(status, headers=first).json()] == ["c-in"]
        second = new_key()  # "c" revoked and made again, in one write of the file
        assert http.get(status, headers=first).status_code == 401
        deadline = time.monotonic() + 10
        while http.get(status, headers=second).json():  # released right after the reload
            assert time.monotonic() < deadline, "the revoked key's region is still there"
            time.sleep(0.05)
        assert [r["name"] for r in http.get(status, headers=headers["a"]).json()] == ["kept"]
    finally:
        http.post("/v2/systemsharedmemory/unregister", headers=headers["a"])
        http.close()


def _stream_reads_the_keys_own_region(
    client: grpcclient.InferenceServerClient, header: dict[str, str], expected: np.ndarray
) -> None:
    """ModelStreamInfer: the stream's key (its metadata) picks the region too."""
    answers: queue.Queue[Any] = queue.Queue()
    client.start_stream(lambda result, error: answers.put(error or result), headers=header)
    try:
        inputs = [grpcclient.InferInput(f"INPUT{i}", [1, ADD_SUB_WIDTH], "FP32") for i in (0, 1)]
        inputs[0].set_shared_memory("in", TENSOR_BYTES)
        inputs[1].set_shared_memory("in", TENSOR_BYTES, offset=TENSOR_BYTES)
        client.async_stream_infer("add_sub", inputs)
        answer = answers.get(timeout=30)
        assert not isinstance(answer, Exception), answer
        np.testing.assert_allclose(answer.as_numpy("OUTPUT0"), expected, rtol=1e-6)
    finally:
        client.stop_stream()


def test_refused_without_allow_client_shm(tmp_path: Path) -> None:
    build_add_sub(tmp_path / "models")
    key = f"/slipstream_test_{uuid.uuid4().hex[:12]}"
    handle = shm.create_shared_memory_region(key[1:], key, 64)
    try:
        with RemoteServer(tmp_path / "models", log_dir=tmp_path) as remote:
            client = httpclient.InferenceServerClient(remote.http_address)
            _refused(
                lambda: client.register_system_shared_memory("r", key, 64), "--allow-client-shm"
            )
            assert client.get_system_shared_memory_status() == []
    finally:
        shm.destroy_shared_memory_region(handle)
    assert not os.path.exists("/dev/shm" + key)
