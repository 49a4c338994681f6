"""Issue #28: model names cannot walk out of the repository, and pickles are opt-in.

One real ``slipstream serve`` in explicit control mode, attacked through every entry
point a model name arrives by: V2 HTTP paths (sent as raw bytes where a client would
normalise them), gRPC (tritonclient), and the OpenAI ``model`` field. Every attempt must
be a 400 / INVALID_ARGUMENT that names the rule, and must leave the repository index as
it was. Outside the repository sits a valid model that nothing may ever load.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import joblib
import numpy as np
import orjson
import pytest
import tritonclient.grpc as grpcclient
from sklearn.linear_model import LogisticRegression
from tritonclient.utils import InferenceServerException

from slipstream.names import MODEL_NAME_RULE
from tests.models import ADD_SUB_WIDTH, build_add_sub, write_config
from tests.utils import HOST, RemoteServer

TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def outside(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A valid model directory outside the repository: ``<tmp>/evilrepo/evil``."""
    evilrepo = tmp_path_factory.mktemp("outside") / "evilrepo"
    build_add_sub(evilrepo, "evil")
    return evilrepo / "evil"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, outside: Path) -> Iterator[RemoteServer]:
    root = tmp_path_factory.mktemp("security")
    repo = root / "repo"
    build_add_sub(repo)
    # A symlink inside the repository to the model outside it.
    (repo / "linked").symlink_to(outside)
    # Configs naming files outside their model's directory.
    build_add_sub(repo, "bad_tokenizer")
    write_config(repo, "bad_tokenizer", {"tokenizer": "../../etc/passwd"})
    build_add_sub(repo, "bad_filename")
    write_config(repo, "bad_filename", {"default_model_filename": f"../../../{outside.name}"})
    # A pickled scikit-learn estimator, without trust_pickle.
    (repo / "pickled" / "1").mkdir(parents=True)
    features = np.arange(12, dtype=np.float32).reshape(6, 2)
    joblib.dump(
        LogisticRegression().fit(features, [0, 0, 0, 1, 1, 1]),
        repo / "pickled" / "1" / "model.joblib",
    )
    args = ["--model-control-mode", "explicit", "--load-model", "add_sub"]
    with RemoteServer(repo, args, log_dir=root) as running:
        yield running


@pytest.fixture(scope="module")
def http(server: RemoteServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.http_url, timeout=TIMEOUT_S) as client:
        yield client


@pytest.fixture(scope="module")
def grpc(server: RemoteServer) -> Iterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(server.grpc_address)
    yield client
    client.close()


def index(http: httpx.Client) -> list[dict[str, Any]]:
    response = http.post("/v2/repository/index")
    assert response.status_code == 200, response.text
    entries: list[dict[str, Any]] = response.json()
    return entries


def raw_request(
    server: RemoteServer, method: str, path: bytes, body: bytes = b""
) -> tuple[int, str]:
    """Send ``path`` byte for byte (no client normalises it); (status, error message)."""
    head = b"%s %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n\r\n"
    with socket.create_connection((HOST, server.http_port), timeout=TIMEOUT_S) as sock:
        sock.sendall(head % (method.encode(), path, len(body)) + body)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    status_line, _, rest = reply.partition(b"\r\n")
    payload = rest.split(b"\r\n\r\n", 1)[1]
    return int(status_line.split()[1]), str(orjson.loads(payload)["error"])


def infer_body() -> bytes:
    row = np.ones((1, ADD_SUB_WIDTH), np.float32).ravel().tolist()
    tensors = [
        {"name": name, "shape": [1, ADD_SUB_WIDTH], "datatype": "FP32", "data": row}
        for name in ("INPUT0", "INPUT1")
    ]
    return orjson.dumps({"inputs": tensors})


# Path segments that must each be refused as a model name, and a piece of the reason.
BAD_SEGMENTS = [
    ("..%2Fevilrepo%2Fevil", "path separator"),  # %2F, decoded once
    ("..%252Fevilrepo%252Fevil", "contains '%'"),  # double-encoded stays '%2F'
    ("a%5C..%5C..%5Cb", "path separator"),  # encoded backslash
    ("a\\..\\..\\b", "path separator"),  # raw backslash
    ("evil%00", "control character U+0000"),
    ("x" * 300, "more than 128"),
    ("%EF%BC%8Fetc%EF%BC%8Fpasswd", "U+FF0F"),  # fullwidth solidus
    ("add_sub%D0%B0", "U+0430"),  # Cyrillic a
    ("%2E%2E", "relative directory reference"),
]


def v2_routes(segment: str) -> list[tuple[str, str]]:
    """(method, path) of every V2 route that takes a model name."""
    return [
        ("GET", f"/v2/models/{segment}"),
        ("GET", f"/v2/models/{segment}/ready"),
        ("GET", f"/v2/models/{segment}/config"),
        ("GET", f"/v2/models/{segment}/stats"),
        ("GET", f"/v2/models/{segment}/versions/1"),
        ("POST", f"/v2/models/{segment}/infer"),
        ("POST", f"/v2/models/{segment}/versions/1/infer"),
        ("POST", f"/v2/repository/models/{segment}/load"),
        ("POST", f"/v2/repository/models/{segment}/unload"),
    ]


@pytest.mark.parametrize(("segment", "reason"), BAD_SEGMENTS, ids=lambda v: v[:24])
def test_http_refuses_bad_names_on_every_route(
    server: RemoteServer, http: httpx.Client, segment: str, reason: str
) -> None:
    before = index(http)
    for method, path in v2_routes(segment):
        body = infer_body() if path.endswith("infer") else b""
        status, message = raw_request(server, method, path.encode(), body)
        assert status == 400, (method, path, message)
        assert reason in message and MODEL_NAME_RULE in message, (path, message)
    assert index(http) == before


def test_http_refuses_absolute_paths_and_dot_segments(
    server: RemoteServer, http: httpx.Client, outside: Path
) -> None:
    before = index(http)
    absolute = quote(str(outside), safe="")  # %2Ftmp%2F...%2Fevilrepo%2Fevil
    status, message = raw_request(server, "POST", f"/v2/repository/models/{absolute}/load".encode())
    assert status == 400 and "path separator" in message
    # Unencoded: the name spans segments, and is refused for its '/' as well.
    status, message = raw_request(server, "POST", f"/v2/repository/models/{outside}/load".encode())
    assert status == 400 and "path separator" in message
    for path in (
        b"/v2/repository/models/../evilrepo/evil/load",
        b"/v2/models/add_sub/../../../evilrepo/evil/ready",
        b"/v2/models/./add_sub/ready",
    ):
        status, message = raw_request(server, "POST" if b"load" in path else "GET", path)
        assert status == 400 and "'.' and '..' segments are not allowed" in message
    # UTF-8 bytes of a fullwidth solidus, sent unencoded: the HTTP parser refuses them.
    status, message = raw_request(server, "GET", "/v2/models/..\uff0fetc/ready".encode())
    assert status == 400 and "Invalid char in url path" in message
    assert index(http) == before


def test_httpx_encoded_names_are_refused(http: httpx.Client) -> None:
    before = index(http)
    for name in ("../evilrepo/evil", "/etc", "a\\b", "a\x00b", "add_sub\u0430", "\uff0fetc"):
        response = http.post(f"/v2/repository/models/{quote(name, safe='')}/load")
        assert response.status_code == 400, (name, response.text)
        assert MODEL_NAME_RULE in response.json()["error"]
    assert index(http) == before


def test_grpc_refuses_bad_names(
    http: httpx.Client, grpc: grpcclient.InferenceServerClient, outside: Path
) -> None:
    before = index(http)
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = grpcclient.InferInput(name, [1, ADD_SUB_WIDTH], "FP32")
        tensor.set_data_from_numpy(np.ones((1, ADD_SUB_WIDTH), np.float32))
        inputs.append(tensor)
    for name in ("../evilrepo/evil", str(outside), "a\\..\\b", "evil\x00", "x" * 300, "\uff0f"):
        calls = [
            lambda n=name: grpc.load_model(n),
            lambda n=name: grpc.unload_model(n),
            lambda n=name: grpc.infer(n, inputs),
            lambda n=name: grpc.get_model_metadata(n),
            lambda n=name: grpc.get_model_config(n),
            lambda n=name: grpc.is_model_ready(n),
            lambda n=name: grpc.get_inference_statistics(n),
        ]
        for call in calls:
            with pytest.raises(InferenceServerException) as error:
                call()
            assert error.value.status() == "StatusCode.INVALID_ARGUMENT", (name, error.value)
            assert MODEL_NAME_RULE in str(error.value.message())
    assert index(http) == before


def test_openai_model_field_is_checked(http: httpx.Client) -> None:
    before = index(http)
    bodies = [
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/embeddings", {"input": "hi"}),
    ]
    for route, body in bodies:
        for name in ("../evilrepo/evil", "/etc/passwd", "add_sub\u0430"):
            response = http.post(route, json={"model": name, **body})
            assert response.status_code == 400, (route, name, response.text)
            error = response.json()["error"]
            assert error["message"].startswith("model: ") and MODEL_NAME_RULE in error["message"]
            assert error["param"] == "model"
    response = http.get("/v1/models/..%2Fevilrepo%2Fevil")
    assert response.status_code == 400 and "path separator" in response.json()["error"]["message"]
    assert index(http) == before


def test_a_model_outside_the_repository_is_never_loaded(
    server: RemoteServer, http: httpx.Client, grpc: grpcclient.InferenceServerClient
) -> None:
    names = {entry["name"] for entry in index(http)}
    assert "linked" not in names and "evil" not in names
    response = http.post("/v2/repository/models/linked/load")
    assert response.status_code == 400
    assert "outside the model repository" in response.json()["error"]
    with pytest.raises(InferenceServerException) as error:
        grpc.load_model("linked")
    assert error.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert http.get("/v2/models/linked/ready").status_code != 200
    ready = {entry["name"] for entry in index(http) if entry.get("state") == "READY"}
    assert "linked" not in ready and "evil" not in ready
    log = server.log_text()
    # The listing says why it is left out, once, however often the repository is read.
    assert len(re.findall(r"skipping \S*linked", log)) == 1, log
    assert "model evil" not in log and "model linked version" not in log


def test_configs_naming_files_outside_fail_to_load(http: httpx.Client) -> None:
    response = http.post("/v2/repository/models/bad_tokenizer/load")
    assert response.status_code == 400
    assert "tokenizer: '../../etc/passwd' resolves to" in response.json()["error"]
    assert "outside the model's directory" in response.json()["error"]
    response = http.post("/v2/repository/models/bad_filename/load")
    assert response.status_code == 400
    assert "default_model_filename" in response.json()["error"]
    assert "outside the model's directory" in response.json()["error"]


def test_a_pickle_loads_only_after_its_config_opts_in(
    server: RemoteServer, http: httpx.Client
) -> None:
    response = http.post("/v2/repository/models/pickled/load")
    assert response.status_code == 400
    message = response.json()["error"]
    assert "model.joblib is a pickle" in message
    assert "`trust_pickle: true` to pickled/config.yaml" in message and "skl2onnx" in message
    assert http.get("/v2/models/pickled/ready").status_code == 400

    write_config(server.repository, "pickled", {"backend": "sklearn", "trust_pickle": True})
    response = http.post("/v2/repository/models/pickled/load")
    assert response.status_code == 200, response.text
    body = {"inputs": [{"name": "input", "shape": [2, 2], "datatype": "FP32",
                        "data": [0.0, 1.0, 10.0, 11.0]}]}  # fmt: skip
    response = http.post("/v2/models/pickled/infer", json=body)
    assert response.status_code == 200, response.text
    predicted = {o["name"]: o["data"] for o in response.json()["outputs"]}["predict"]
    assert predicted == [0, 1]
    assert "model pickled: loading the pickle" in server.log_text()
