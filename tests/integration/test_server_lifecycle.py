"""Model lifecycle and process lifecycle: control modes, version policies, shutdown, polling.

Each scenario runs a real ``slipstream serve`` (see tests/utils.py) and talks to it with
the stock tritonclient or raw httpx, as a deployment would.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from tests.gated import Gate, build_gated, gated_command, gated_input, wait_until
from tests.models import (
    ADD_SUB_WIDTH,
    build_add_constant,
    build_add_sub,
    build_identity,
    run_onnx,
    write_config,
)
from tests.utils import RemoteServer

CLIENT_TIMEOUT_S = 60.0
BROKEN_KEY = "dynamic_batchin"


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``condition`` every 0.1 s; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {timeout_s} s")
        time.sleep(0.1)


def assert_error(response: httpx.Response, status: int | tuple[int, ...], *fragments: str) -> str:
    statuses = status if isinstance(status, tuple) else (status,)
    assert response.status_code in statuses, response.text
    message = response.json()["error"]
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in error {message!r}"
    return str(message)


def fp32_body(name: str, array: np.ndarray) -> bytes:
    tensor = {"name": name, "shape": list(array.shape), "datatype": "FP32", "data": array.ravel()}
    return orjson.dumps({"inputs": [tensor]}, option=orjson.OPT_SERIALIZE_NUMPY)


def add_sub_body() -> bytes:
    row = np.ones((1, ADD_SUB_WIDTH), np.float32)
    tensors = [
        {"name": name, "shape": [1, ADD_SUB_WIDTH], "datatype": "FP32", "data": row.ravel()}
        for name in ("INPUT0", "INPUT1")
    ]
    return orjson.dumps({"inputs": tensors}, option=orjson.OPT_SERIALIZE_NUMPY)


def index_by_name(http: httpx.Client) -> dict[str, list[dict[str, Any]]]:
    response = http.post("/v2/repository/index")
    assert response.status_code == 200, response.text
    entries: dict[str, list[dict[str, Any]]] = {}
    for entry in response.json():
        entries.setdefault(entry["name"], []).append(entry)
    return entries


def states(http: httpx.Client, name: str) -> set[str]:
    return {entry.get("state", "") for entry in index_by_name(http).get(name, [])}


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


# ---------------------------------------------------------------------------- explicit mode


@pytest.fixture(scope="module")
def explicit_server(
    tmp_path_factory: pytest.TempPathFactory, log_dir: Path
) -> Iterator[RemoteServer]:
    repo = tmp_path_factory.mktemp("explicit")
    build_add_sub(repo)
    build_identity(repo, "FP32", name="identity")
    build_add_sub(repo, "broken")
    write_config(repo, "broken", {BROKEN_KEY: {}})
    args = ["--model-control-mode", "explicit", "--load-model", "add_sub"]
    with RemoteServer(repo, args, log_dir=log_dir) as server:
        yield server


@pytest.fixture(scope="module")
def explicit_http(explicit_server: RemoteServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=explicit_server.http_url, timeout=CLIENT_TIMEOUT_S) as session:
        yield session


def test_explicit_mode_loads_only_the_requested_models(explicit_http: httpx.Client) -> None:
    assert states(explicit_http, "add_sub") == {"READY"}
    assert "READY" not in states(explicit_http, "identity")
    assert "READY" not in states(explicit_http, "broken")
    assert explicit_http.post("/v2/models/add_sub/infer", content=add_sub_body()).status_code == 200
    response = explicit_http.post(
        "/v2/models/identity/infer", content=fp32_body("INPUT0", np.ones((1, 3), np.float32))
    )
    # The model is in the repository, just not loaded: the message says so.
    message = assert_error(response, (404, 503), "identity")
    assert "load" in message, message
    ready_only = explicit_http.post("/v2/repository/index", json={"ready": True}).json()
    assert [entry["name"] for entry in ready_only] == ["add_sub"]


def test_load_infer_unload_and_reload(explicit_server: RemoteServer) -> None:
    client = httpclient.InferenceServerClient(explicit_server.http_address)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    try:
        assert not client.is_model_ready("identity")
        client.load_model("identity")
        assert client.is_model_ready("identity")
        tensor = httpclient.InferInput("INPUT0", [2, 3], "FP32")
        tensor.set_data_from_numpy(x)
        np.testing.assert_array_equal(client.infer("identity", [tensor]).as_numpy("OUTPUT0"), x)
        index = {e["name"]: e for e in client.get_model_repository_index()}
        assert index["identity"]["state"] == "READY"

        client.unload_model("identity")
        assert not client.is_model_ready("identity")
        with pytest.raises(InferenceServerException) as info:
            client.infer("identity", [tensor])
        assert info.value.status() in ("404", "503")
        assert "identity" in str(info.value.message())
        # Listed as Triton lists an unloaded model, over HTTP and gRPC; its series in
        # /metrics says UNLOADED, which the "model not ready" alert leaves alone.
        unloaded = {
            "name": "identity",
            "version": "1",
            "state": "UNAVAILABLE",
            "reason": "unloaded",
        }
        index = {e["name"]: e for e in client.get_model_repository_index()}
        assert index["identity"] == unloaded
        with grpcclient.InferenceServerClient(explicit_server.grpc_address) as grpc:
            listed = grpc.get_model_repository_index(as_json=True)["models"]
            assert {e["name"]: e for e in listed}["identity"] == unloaded
        scraped = httpx.get(explicit_server.url("/metrics")).text
        assert 'slipstream_model_ready{model="identity",state="UNLOADED",version="1"} 0.0' in (
            scraped
        )
        # The other model was never touched.
        assert client.is_model_ready("add_sub")

        client.load_model("identity")
        np.testing.assert_array_equal(client.infer("identity", [tensor]).as_numpy("OUTPUT0"), x)
    finally:
        client.close()


def test_a_load_with_files_is_refused_not_done_from_disk(
    explicit_server: RemoteServer, explicit_http: httpx.Client
) -> None:
    """tritonclient's load_model(files=...): serving the repository's model instead of
    the one sent would pass for success; a 400 naming what it sent."""
    before = states(explicit_http, "identity")
    client = httpclient.InferenceServerClient(explicit_server.http_address)
    try:
        with pytest.raises(InferenceServerException) as refused:
            client.load_model("identity", files={"file:1/model.onnx": b"weights"})
        assert refused.value.status() == "400" and "file:1/model.onnx" in str(refused.value)
    finally:
        client.close()
    assert states(explicit_http, "identity") == before  # nothing loaded, or reloaded


def test_a_load_with_a_config_override_serves_that_config_until_a_load_without_one(
    explicit_server: RemoteServer,
) -> None:
    """Triton's load_model(config=...) (Model Analyzer's way of trying configurations):
    the JSON config is used instead of the repository's, over HTTP and gRPC; what
    Slipstream does not do is refused naming the field, and the model keeps serving."""
    http = httpclient.InferenceServerClient(explicit_server.http_address)
    grpc = grpcclient.InferenceServerClient(explicit_server.grpc_address)
    x = np.ones((5, 3), np.float32)
    try:
        http.load_model("identity", config='{"max_batch_size": 4, "instance_group": '
                                           '[{"count": 2, "kind": "KIND_CPU"}]}')  # fmt: skip
        config = http.get_model_config("identity")
        assert config["max_batch_size"] == 4
        assert [g["count"] for g in config["instance_group"]] == [2]
        tensor = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        with pytest.raises(InferenceServerException, match="max_batch_size"):
            http.infer("identity", [tensor])  # 5 rows over the override's 4

        with pytest.raises(InferenceServerException, match="iterative_sequence is not"):
            grpc.load_model(
                "identity", config='{"sequence_batching": {"iterative_sequence": true}}'
            )
        assert http.get_model_config("identity")["max_batch_size"] == 4  # still serving
        grpc.load_model("identity", config='{"max_batch_size": 8}')
        assert grpc.get_model_config("identity", as_json=True)["config"]["max_batch_size"] == 8

        http.load_model("identity")  # without one: the repository's config again
        assert http.get_model_config("identity")["max_batch_size"] == 64  # from its file
        np.testing.assert_array_equal(http.infer("identity", [tensor]).as_numpy("OUTPUT0"), x)
    finally:
        http.unload_model("identity")  # as the module's other tests expect it
        http.close()
        grpc.close()


def test_load_and_unload_of_a_missing_model_are_404(explicit_http: httpx.Client) -> None:
    assert_error(explicit_http.post("/v2/repository/models/no_such/load"), 404, "no_such")
    assert_error(explicit_http.post("/v2/repository/models/no_such/unload"), 404, "no_such")


def test_failed_load_names_the_key_and_strict_readiness_follows_it(
    explicit_http: httpx.Client,
) -> None:
    assert explicit_http.get("/v2/health/ready").status_code == 200
    response = explicit_http.post("/v2/repository/models/broken/load")
    assert_error(response, 400, "broken", BROKEN_KEY)
    (entry,) = index_by_name(explicit_http)["broken"]
    assert entry["state"] == "UNAVAILABLE"
    assert BROKEN_KEY in entry["reason"]
    try:
        # Strict readiness (the default): a model that failed to load makes the server
        # not ready, while it stays live and the other models keep serving.
        assert explicit_http.get("/v2/health/ready").status_code == 503
        assert explicit_http.get("/v2/health/live").status_code == 200
        # vLLM's and llama-server's probe follows readiness.
        health = explicit_http.get("/health")
        assert (health.status_code, health.json()) == (503, {"status": "not ready"})
        # The "model not ready" alert's series.
        scraped = explicit_http.get("/metrics").text
        assert 'slipstream_model_ready{model="broken",state="UNAVAILABLE",version=""} 0.0' in (
            scraped
        )
        assert 'slipstream_model_ready{model="add_sub",state="READY",version="1"} 1.0' in scraped
        assert (
            explicit_http.post("/v2/models/add_sub/infer", content=add_sub_body()).status_code
            == 200
        )
    finally:
        assert explicit_http.post("/v2/repository/models/broken/unload").status_code == 200
    assert explicit_http.get("/v2/health/ready").status_code == 200
    health = explicit_http.get("/health")
    assert (health.status_code, health.json()) == (200, {"status": "ok"})


def test_load_model_that_does_not_exist_at_startup_is_reported(
    tmp_path: Path, log_dir: Path
) -> None:
    repo = tmp_path / "repo"
    build_add_sub(repo)
    args = ["--model-control-mode", "explicit", "--load-model", "no_such_model"]
    server = RemoteServer(repo, args, log_dir=log_dir, wait_for=None)
    server.start()
    proc = server.proc
    assert proc is not None
    try:
        # Either the process fails fast (Triton's behaviour) or it keeps running, not
        # ready; in both cases the log must say which model could not be loaded.
        wait_for(
            lambda: proc.poll() is not None or "no_such_model" in server.log_text(),
            10.0,
            "a startup error naming no_such_model",
        )
        try:
            exit_code: int | None = proc.wait(3.0)  # a failing-fast server is exiting now
        except subprocess.TimeoutExpired:
            exit_code = None
        if exit_code is None:
            assert httpx.get(server.url("/v2/health/ready"), timeout=5).status_code == 503
        else:
            assert exit_code != 0, server.log_tail()
        assert "no_such_model" in server.log_text(), server.log_tail()
    finally:
        server.stop()


def test_explicit_start_up_loads_its_models_side_by_side(tmp_path: Path, log_dir: Path) -> None:
    """--load-model a --load-model b: both warm up at once (each warm-up is a run held
    at the gate), as poll mode loads them; one after the other, start-up took the sum."""
    repo = tmp_path / "repo"
    gate = Gate(tmp_path / "gate")
    for name in ("first", "second"):
        build_gated(repo, name, gate, {"max_batch_size": 1})
    args = ["--model-control-mode", "explicit", "--load-model", "first", "--load-model", "second"]
    server = RemoteServer(repo, args, log_dir=log_dir, wait_for=None, command=gated_command())
    try:
        with gate.closed():
            server.start()
            gate.wait_runs(2)  # both warm-ups held at once
        wait_for(lambda: "Slipstream is ready" in server.log_text(), 30.0, "the start-up line")
        assert httpx.get(server.url("/v2/models/second/ready"), timeout=5).status_code == 200
    finally:
        server.stop()


def test_a_server_not_ready_at_start_does_not_log_that_it_is(tmp_path: Path, log_dir: Path) -> None:
    """Strict readiness with a model that failed to load: the start-up line says the
    server is serving but not ready, as /v2/health/ready answers."""
    repo = tmp_path / "repo"
    build_add_sub(repo)
    build_add_sub(repo, "broken")
    write_config(repo, "broken", {BROKEN_KEY: {}})
    server = RemoteServer(repo, log_dir=log_dir, wait_for="live")
    with server:
        wait_for(lambda: "Slipstream is" in server.log_text(), 30.0, "the start-up line")
        assert httpx.get(server.url("/v2/health/ready"), timeout=5).status_code == 503
        log = server.log_text()
        assert "but not ready: a model failed to load" in log and "Slipstream is ready" not in log


# ---------------------------------------------------------------------------- mode none, versions


@pytest.fixture(scope="module")
def versions_server(
    tmp_path_factory: pytest.TempPathFactory, log_dir: Path
) -> Iterator[RemoteServer]:
    repo = tmp_path_factory.mktemp("versions")
    build_add_sub(repo)
    policies: dict[str, dict[str, Any] | None] = {
        "latest": None,  # no config: Triton's default, the latest version only
        "latest_two": {"version_policy": {"latest": {"num_versions": 2}}},
        "all": {"version_policy": {"all": {}}},
        "specific": {"version_policy": {"specific": {"versions": [1, 3]}}},
    }
    for name, config in policies.items():
        for version in (1, 2, 3):
            # Version v adds 10 * v: every answer says which version computed it.
            build_add_constant(repo, name, version, 10.0 * version)
        if config is not None:
            write_config(repo, name, config)
    with RemoteServer(repo, log_dir=log_dir) as server:
        yield server


@pytest.fixture(scope="module")
def versions_http(versions_server: RemoteServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=versions_server.http_url, timeout=CLIENT_TIMEOUT_S) as session:
        yield session


def test_load_and_unload_are_refused_in_mode_none(versions_http: httpx.Client) -> None:
    for action in ("load", "unload"):
        response = versions_http.post(f"/v2/repository/models/add_sub/{action}")
        assert_error(response, 400, "--model-control-mode")
    assert versions_http.post("/v2/models/add_sub/infer", content=add_sub_body()).status_code == 200


@pytest.mark.parametrize(
    ("model", "served"),
    [("latest", [3]), ("latest_two", [2, 3]), ("all", [1, 2, 3]), ("specific", [1, 3])],
)
def test_version_policy_selects_the_served_versions(
    versions_http: httpx.Client, model: str, served: list[int]
) -> None:
    metadata = versions_http.get(f"/v2/models/{model}").json()
    assert metadata["versions"] == [str(v) for v in served]
    x = np.array([[0.0, 1.0, 2.0, 3.0]], np.float32)
    body = fp32_body("INPUT0", x)
    for version in (1, 2, 3):
        response = versions_http.post(f"/v2/models/{model}/versions/{version}/infer", content=body)
        if version not in served:
            assert_error(response, 404, model, str(version))
            continue
        assert response.status_code == 200, response.text
        doc = response.json()
        assert doc["model_version"] == str(version)
        np.testing.assert_array_equal(doc["outputs"][0]["data"], (x + 10.0 * version).ravel())
        assert versions_http.get(f"/v2/models/{model}/versions/{version}/ready").status_code == 200
    # Without a version, the newest served one answers.
    default = versions_http.post(f"/v2/models/{model}/infer", content=body).json()
    assert default["model_version"] == str(max(served))
    index = index_by_name(versions_http)[model]
    assert sorted(int(e["version"]) for e in index if e["state"] == "READY") == served


def test_versions_match_onnxruntime(versions_http: httpx.Client, tmp_path: Path) -> None:
    x = np.array([[0.5, -1.0, 2.0, 8.0]], np.float32)
    reference = build_add_constant(tmp_path, "ref", 2, 20.0)
    response = versions_http.post("/v2/models/all/versions/2/infer", content=fp32_body("INPUT0", x))
    served = np.array(response.json()["outputs"][0]["data"], np.float32).reshape(1, 4)
    np.testing.assert_array_equal(served, run_onnx(reference, {"INPUT0": x})["OUTPUT0"])


# ---------------------------------------------------------------------------- shutdown


# In one process, and in the split layout (the front ends drain while the engine still
# runs their requests; the engine is given the launcher's registered gated backend).
@pytest.mark.parametrize("layout", [[], ["--frontends", "2"]], ids=["one-process", "split"])
def test_sigterm_lets_running_and_queued_requests_finish_and_exits_0(
    tmp_path: Path, log_dir: Path, layout: list[str]
) -> None:
    repo = tmp_path / "repo"
    gate = Gate(tmp_path / "gate")
    build_gated(repo, "held", gate, {"max_batch_size": 1})
    xs = [gated_input(float(tag)) for tag in (1, 2)]
    server = RemoteServer(
        repo, ["--shutdown-timeout-s", "30", *layout], log_dir=log_dir, command=gated_command()
    )
    with server, ThreadPoolExecutor(2) as pool:
        clients = [httpx.Client(base_url=server.http_url, timeout=CLIENT_TIMEOUT_S) for _ in xs]
        for session in clients:  # connect now: a new connection after SIGTERM is refused
            assert session.get("/v2/health/live").status_code == 200
        first_run = len(gate.runs())  # after the warm-up run

        def infer(session: httpx.Client, x: np.ndarray) -> httpx.Response:
            return session.post("/v2/models/held/infer", content=fp32_body("INPUT0", x))

        with gate.closed():
            # The first request runs (held at the gate), the second waits in the queue
            # (max_batch_size 1) when SIGTERM arrives.
            in_flight = [pool.submit(infer, clients[0], xs[0])]
            gate.wait_runs(first_run + 1)
            in_flight.append(pool.submit(infer, clients[1], xs[1]))
            wait_until(lambda: _pending(clients[0], "held") == 1, "the second request queued")
            server.terminate()
            wait_until(lambda: "shutting down" in server.log_text(), "the server to start draining")
        responses = [future.result() for future in in_flight]
        for session in clients:
            session.close()
        for response, want in zip(responses, xs, strict=True):
            assert response.status_code == 200, response.text
            served = np.array(response.json()["outputs"][0]["data"], np.float32).reshape(1, -1)
            np.testing.assert_array_equal(served, want)
        assert server.wait() == 0, server.log_tail()
        assert gate.runs()[first_run:] == [[1.0], [2.0]]
    assert "shutdown complete" in server.log_text()


def _pending(http: httpx.Client, model: str) -> float:
    """slipstream_pending_requests of version 1 of ``model``, from /metrics."""
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "slipstream_pending_requests" and sample.labels["model"] == model:
                return float(sample.value)
    raise AssertionError(f"no slipstream_pending_requests series for {model}")


# ---------------------------------------------------------------------------- poll mode


def test_poll_mode_loads_added_models_and_unloads_removed_ones(
    tmp_path: Path, log_dir: Path
) -> None:
    repo = tmp_path / "repo"
    build_add_sub(repo)
    args = ["--model-control-mode", "poll", "--repository-poll-secs", "0.25"]
    with (
        RemoteServer(repo, args, log_dir=log_dir) as server,
        httpx.Client(base_url=server.http_url, timeout=CLIENT_TIMEOUT_S) as http,
    ):

        def ready(model: str) -> bool:
            return http.get(f"/v2/models/{model}/ready").status_code == 200

        assert ready("add_sub")
        assert not ready("identity")
        # Build outside the repository, then move in at once: no half-written model.
        staging = tmp_path / "staging"
        build_identity(staging, "INT32", name="identity")
        os.rename(staging / "identity", repo / "identity")
        wait_for(lambda: ready("identity"), 10.0, "the added model becoming ready")
        x = np.array([[1, -2, 3]], np.int32)
        body = {
            "inputs": [{"name": "INPUT0", "shape": [1, 3], "datatype": "INT32", "data": [1, -2, 3]}]
        }
        response = http.post("/v2/models/identity/infer", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["outputs"][0]["data"] == x.ravel().tolist()

        # A new version directory replaces the served one (default policy: latest only).
        build_add_sub(staging, version=2)
        os.rename(staging / "add_sub" / "2", repo / "add_sub" / "2")
        wait_for(
            lambda: http.get("/v2/models/add_sub").json().get("versions") == ["2"],
            10.0,
            "version 2 of add_sub being served",
        )

        shutil.rmtree(repo / "identity")
        wait_for(lambda: not ready("identity"), 10.0, "the removed model being unloaded")
        assert ready("add_sub")
