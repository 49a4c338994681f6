"""Issue #23: cascades. A small model answers; unsure rows go on to a larger one, local or
behind another server's V2 endpoint (a real second Slipstream, with an API key).

Two servers per module: the remote one (``--frontends 1``: the split layout, serving a
cascade of its own) and the main one (one process) with cascades over local and remote
stages, a cascade naming an unknown model and one whose remote stage is down at start.
The last test stops the remote server to see the first stage's answer stand in for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from slipstream.security.keys import KeyRing
from tests.models import CLASSIFIER_CLASSES, build_classifier, write_config
from tests.utils import RemoteServer, free_ports

# The large model's labels are its argmax + 100: which stage answered a row shows.
LARGE_OFFSET = 100
THRESHOLD = 0.9
KEY_ENV = "CASCADE_TEST_REMOTE_KEY"
ADMIN_KEY_ENV = "CASCADE_TEST_REMOTE_ADMIN_KEY"


def cascade_config(second: dict[str, Any], **extra: Any) -> dict[str, Any]:
    first = {"model": "small",
             "confidence": {"output": "probabilities", "threshold": THRESHOLD}}  # fmt: skip
    return {"cascade": {"stages": [first, second], **extra}}


def rows(*confident: bool) -> np.ndarray:
    """One row per flag: confident ([9, 0, 0, 0] rolled to its index) or unsure (zeros)."""
    found = np.zeros((len(confident), CLASSIFIER_CLASSES), np.float32)
    for index, sure in enumerate(confident):
        if sure:
            found[index, index % CLASSIFIER_CLASSES] = 9.0
    return found


def infer(server: RemoteServer, model: str, x: np.ndarray) -> httpx.Response:
    body = {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                        "data": x.ravel().tolist()}]}  # fmt: skip
    return httpx.post(server.url(f"/v2/models/{model}/infer"), json=body, timeout=30)


def labels(reply: httpx.Response) -> list[int]:
    (label,) = [o for o in reply.json()["outputs"] if o["name"] == "label"]
    return [int(v) for v in label["data"]]


@pytest.fixture(scope="module")
def remote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    root = tmp_path_factory.mktemp("cascade_remote")
    repo = root / "models"
    build_classifier(repo, "small")
    build_classifier(repo, "large", LARGE_OFFSET)
    write_config(repo, "local_cascade", cascade_config({"model": "large"}))
    ring = KeyRing.load(root / "keys.json", missing_ok=True)
    secret, _ = ring.create("cascade", "infer")
    admin_secret, _ = ring.create("cascade_admin", "admin")
    ring.save()
    args = ["--frontends", "1", "--auth-file", str(root / "keys.json")]
    with RemoteServer(repo, args, log_dir=root) as server:
        server.api_key = secret  # type: ignore[attr-defined]
        server.admin_key = admin_secret  # type: ignore[attr-defined]
        yield server


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, remote: RemoteServer
) -> Iterator[RemoteServer]:
    root = tmp_path_factory.mktemp("cascade")
    repo = root / "models"
    build_classifier(repo, "small")
    build_classifier(repo, "large", LARGE_OFFSET)
    write_config(repo, "digits_cascade", cascade_config({"model": "large"}))
    over_remote = {"model": "large", "url": remote.http_url, "api_key_env": KEY_ENV}
    write_config(repo, "remote_cascade", cascade_config(over_remote))
    write_config(repo, "strict_cascade", cascade_config(over_remote, on_stage_failure="fail"))
    # First stages on the remote server, one whose key may read its config (admin), one
    # whose key may not.
    for name, key_env in (("remote_first", ADMIN_KEY_ENV), ("remote_first_infer", KEY_ENV)):
        small = {"model": "small", "url": remote.http_url, "api_key_env": key_env,
                 "confidence": {"output": "probabilities", "threshold": THRESHOLD}}  # fmt: skip
        write_config(repo, name, {"cascade": {"stages": [small, {"model": "large"}]}})
    write_config(repo, "unknown_cascade", cascade_config({"model": "nope"}))
    (closed_port,) = free_ports(1)
    down = {"model": "large", "url": f"http://127.0.0.1:{closed_port}"}
    write_config(repo, "down_cascade", cascade_config(down))
    env = {KEY_ENV: remote.api_key, ADMIN_KEY_ENV: remote.admin_key}  # type: ignore[attr-defined]
    # Two cascades fail at start on purpose: ready means every other model loaded.
    args = ["--no-strict-readiness"]
    with RemoteServer(repo, args, log_dir=root, env=env) as running:
        yield running


def test_confident_rows_stay_on_the_first_stage_unsure_ones_go_on(server: RemoteServer) -> None:
    sure = [True, False, True, False, False]
    x = rows(*sure)
    reply = infer(server, "digits_cascade", x)
    assert reply.status_code == 200, reply.text
    offsets = np.where(sure, 0, LARGE_OFFSET)
    expected = (x.argmax(axis=1) + offsets).tolist()
    assert labels(reply) == expected
    assert reply.json()["parameters"] == {"cascade_stage": "large", "cascade_escalated_rows": 3}
    assert reply.headers["x-slipstream-cascade-stage"] == "large"
    confident = infer(server, "digits_cascade", rows(True, True))
    assert confident.headers["x-slipstream-cascade-stage"] == "small"
    assert confident.json()["parameters"]["cascade_escalated_rows"] == 0
    assert labels(confident) == [0, 1]


def test_tritonclient_http_and_grpc_see_a_model(server: RemoteServer) -> None:
    http = httpclient.InferenceServerClient(server.http_address)
    grpc = grpcclient.InferenceServerClient(server.grpc_address)
    metadata = http.get_model_metadata("digits_cascade")
    assert [t["name"] for t in metadata["inputs"]] == ["x"]
    # Its config is a batching model's, as its metadata: the first stage's limit, dims
    # without the batch dim (tools such as perf_analyzer build requests from it).
    small = http.get_model_config("small")["max_batch_size"]
    assert small > 0
    # A remote first stage's limit is read from its config; 1 where its key may not.
    for name, limit in (("digits_cascade", small), ("remote_first", small),
                        ("remote_first_infer", 1)):  # fmt: skip
        config = http.get_model_config(name)
        assert config["max_batch_size"] == limit, name
        (x_config,) = config["input"]
        assert [-1, *[int(d) for d in x_config["dims"]]] == metadata["inputs"][0]["shape"]
    assert {t["name"] for t in metadata["outputs"]} == {"probabilities", "label"}
    assert grpc.is_model_ready("digits_cascade")
    x = rows(False, True)
    for mod, client in ((httpclient, http), (grpcclient, grpc)):
        item = mod.InferInput("x", list(x.shape), "FP32")
        item.set_data_from_numpy(x)
        result = client.infer("digits_cascade", [item], outputs=[mod.InferRequestedOutput("label")])
        assert result.as_numpy("label").tolist() == [LARGE_OFFSET, 1]
        assert result.as_numpy("probabilities") is None  # only what was asked for
        parameters = result.get_response()
        if mod is grpcclient:
            assert parameters.parameters["cascade_stage"].string_param == "large"
        else:
            assert parameters["parameters"]["cascade_stage"] == "large"


def test_metrics_count_requests_per_stage_and_escalations(server: RemoteServer) -> None:
    def scrape() -> str:
        return httpx.get(server.url("/metrics")).text

    def value(text: str, name: str, stage: str) -> float:
        prefix = f'{name}_total{{model="digits_cascade",stage="{stage}"}} '
        (line,) = [line for line in text.splitlines() if line.startswith(prefix)]
        return float(line.split()[-1])

    before = scrape()
    infer(server, "digits_cascade", rows(True, False, False))
    after = scrape()
    assert value(after, "slipstream_cascade_requests", "large") - value(
        before, "slipstream_cascade_requests", "large") == 1  # fmt: skip
    assert value(after, "slipstream_cascade_rows", "small") - value(
        before, "slipstream_cascade_rows", "small") == 1  # fmt: skip
    assert value(after, "slipstream_cascade_escalated_rows", "large") - value(
        before, "slipstream_cascade_escalated_rows", "large") == 2  # fmt: skip
    assert value(after, "slipstream_cascade_escalations", "large") - value(
        before, "slipstream_cascade_escalations", "large") == 1  # fmt: skip


def test_a_bad_request_is_answered_400_naming_the_field(server: RemoteServer) -> None:
    body = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0] * 4}],
            "outputs": [{"name": "nope"}]}  # fmt: skip
    reply = httpx.post(server.url("/v2/models/digits_cascade/infer"), json=body)
    assert reply.status_code == 400
    assert "'nope'" in reply.json()["error"] and "label" in reply.json()["error"]
    reply = infer(server, "digits_cascade", np.zeros((1, 3), np.float32))
    assert reply.status_code == 400 and "shape" in reply.json()["error"]


def test_bad_cascades_fail_alone_naming_the_cause(server: RemoteServer) -> None:
    index = httpx.post(server.url("/v2/repository/index"), json={}).json()
    states = {entry["name"]: entry for entry in index}
    assert states["unknown_cascade"]["state"] == "UNAVAILABLE"
    assert "'nope' is not in the repository" in states["unknown_cascade"]["reason"]
    assert states["down_cascade"]["state"] == "UNAVAILABLE"
    assert "unreachable" in states["down_cascade"]["reason"]
    for name in ("digits_cascade", "remote_cascade", "small", "large"):
        assert states[name]["state"] == "READY", states[name]
    reply = infer(server, "down_cascade", rows(True))
    assert reply.status_code == 503 and "unreachable" in reply.json()["error"]
    assert infer(server, "digits_cascade", rows(True)).status_code == 200


def test_the_split_layout_serves_a_cascade_and_checks_the_key(remote: RemoteServer) -> None:
    reply = httpx.post(
        remote.url("/v2/models/local_cascade/infer"),
        headers={"Authorization": f"Bearer {remote.api_key}"},  # type: ignore[attr-defined]
        json={"inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32",
                          "data": rows(False, True).ravel().tolist()}]},
    )  # fmt: skip
    assert reply.status_code == 200, reply.text
    assert labels(reply) == [LARGE_OFFSET, 1]
    assert reply.headers["x-slipstream-cascade-stage"] == "large"
    assert infer(remote, "local_cascade", rows(True)).status_code == 401


def test_a_remote_stage_answers_then_its_outage_falls_back(
    server: RemoteServer, remote: RemoteServer
) -> None:
    x = rows(False, True)
    reply = infer(server, "remote_cascade", x)
    assert reply.status_code == 200, reply.text
    assert labels(reply) == [LARGE_OFFSET, 1]
    assert reply.headers["x-slipstream-cascade-stage"] == "large@" + remote.http_address
    remote.stop()  # the remote server goes away for the rest of the module
    reply = infer(server, "remote_cascade", x)
    assert reply.status_code == 200, reply.text
    assert labels(reply) == [0, 1]  # the first stage's answer, marked as such
    assert reply.json()["parameters"]["cascade_fallback"] is True
    assert reply.headers["x-slipstream-cascade-fallback"] == "large@" + remote.http_address
    assert reply.headers["x-slipstream-cascade-stage"] == "small"
    strict = infer(server, "strict_cascade", x)
    assert strict.status_code == 503
    assert "large@" in strict.json()["error"] and "failed" in strict.json()["error"]
    # Rows the first stage settles never need the remote one.
    assert infer(server, "strict_cascade", rows(True)).status_code == 200
