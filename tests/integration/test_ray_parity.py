"""``slipstream serve --ray`` answering as ``slipstream serve`` does, on a repository with
no generative model: HTTPS from ``--tls-cert/--tls-key`` (Ray Serve's proxy serves it),
``GET /v1/models`` (with KServe's ``models``), KServe V1's readiness and ``:predict``
(run by the model's replicas) and ``GET /v2`` as the plain server answers them (less the
extensions Ray refuses), vLLM's scoring routes refused naming why, and drift monitored
in each replica of a model, its windows in ``/drift`` and in ``/metrics`` per replica.
One Ray cluster serves every case (~10 s to start); a stateful model on more than one
replica is refused before Ray starts.
"""

from __future__ import annotations

import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.models import ADD_SUB_WIDTH, build_add_sub, write_config
from tests.utils import HOST, RemoteServer

pytest.importorskip("ray.serve")
pytestmark = pytest.mark.slow

ROWS = 20
# Each replica captures its own reference from the first rows it answers, then tests
# every window of 20 rows.
DRIFT = {"enable": True, "window": ROWS, "reference_samples": ROWS, "min_interval_s": 0}


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """server.pem (self-signed, for 127.0.0.1) and server.key."""
    root = tmp_path_factory.mktemp("ray_tls")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-subj", f"/CN={HOST}", "-addext", f"subjectAltName=IP:{HOST}",
         "-keyout", "server.key", "-out", "server.pem"],
        cwd=root, check=True, capture_output=True,
    )  # fmt: skip
    return root


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ray_parity") / "models"
    build_add_sub(root, "watched")
    # num_cpus 0: the test cluster's 2 CPUs would not hold two replicas of 1.
    write_config(root, "watched", {"max_batch_size": 64, "monitoring": {"drift": DRIFT},
                                   "ray_serve": {"min_replicas": 2, "max_replicas": 2,
                                                 "num_cpus": 0}})  # fmt: skip
    return root


@pytest.fixture(scope="module")
def https(
    repo: Path, certs: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[httpx.Client]:
    """A client of ``serve --ray --tls-cert ... --tls-key ...``, once it answers ready."""
    tls = ["--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key")]
    log_dir = tmp_path_factory.mktemp("ray_parity_logs")
    with RemoteServer(repo, ["--ray", *tls], log_dir=log_dir, wait_for=None) as running:
        verify = ssl.create_default_context(cafile=certs / "server.pem")
        with httpx.Client(base_url=f"https://{running.http_address}", verify=verify,
                          timeout=30) as client:  # fmt: skip
            deadline = time.monotonic() + 180
            while True:
                try:
                    if client.get("/v2/health/ready").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert running.proc is not None and running.proc.poll() is None, running.log_tail()
                assert time.monotonic() < deadline, running.log_tail()
                time.sleep(0.2)
            yield client


@pytest.fixture(scope="module")
def plain(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    """``slipstream serve`` on the same repository: what --ray must answer."""
    with RemoteServer(repo, log_dir=tmp_path_factory.mktemp("plain_logs")) as running:
        yield running


def test_the_proxy_serves_https_from_tls_cert_and_key(https: httpx.Client) -> None:
    row = {"datatype": "FP32", "shape": [1, ADD_SUB_WIDTH], "data": [1.0] * ADD_SUB_WIDTH}
    body = {"inputs": [{"name": name, **row} for name in ("INPUT0", "INPUT1")]}
    reply = https.post("/v2/models/watched/infer", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["outputs"][0]["data"] == [2.0] * ADD_SUB_WIDTH
    with pytest.raises(httpx.TransportError):  # plain HTTP on the port: no answer
        httpx.get(str(https.base_url).replace("https:", "http:") + "/v2/health/ready", timeout=5)


def test_v1_models_and_v2_answer_as_on_the_plain_server(
    https: httpx.Client, plain: RemoteServer
) -> None:
    for path in ("/v1/models", "/v1/models/watched", "/v1/models/nothing"):
        mine, theirs = https.get(path), plain.http.get(path)
        assert (mine.status_code, mine.json()) == (theirs.status_code, theirs.json()), path
    assert https.get("/v1/models").json() == {"object": "list", "data": [], "models": ["watched"]}
    assert https.get("/v1/models/watched").json() == {"name": "watched", "ready": True}
    completion = {"model": "watched", "prompt": "hi"}
    mine = https.post("/v1/completions", json=completion)
    theirs = plain.http.post("/v1/completions", json=completion)
    assert (mine.status_code, mine.json()) == (theirs.status_code, theirs.json())
    served = https.get("/v2").json()["extensions"]
    # The plain server's, less the routes Ray answers 400 (unload, shared memory).
    refused = {"model_repository(unload_dependents)", "system_shared_memory",
               "cuda_shared_memory"}  # fmt: skip
    assert served == [e for e in plain.http.get("/v2").json()["extensions"] if e not in refused]
    assert "model_repository" in served and "model_repository(unload_dependents)" not in served


def test_kserve_v1_predictions_run_on_the_models_replicas_as_on_the_plain_server(
    https: httpx.Client, plain: RemoteServer
) -> None:
    rows = [[float(i + j) for j in range(ADD_SUB_WIDTH)] for i in range(3)]
    row = {"instances": [{"INPUT0": r, "INPUT1": r} for r in rows]}
    columnar = {"inputs": {"INPUT0": rows, "INPUT1": rows}}
    before = _inference_count(https)
    for path, body in [("/v1/models/watched:predict", row),
                       ("/v1/models/watched/versions/1:predict", columnar),
                       ("/v1/models/watched:predict", {"instances": [[1.0]]}),  # 400
                       ("/v1/models/nothing:predict", row),  # 404
                       ("/v1/models/watched:explain", row)]:  # fmt: skip
        mine, theirs = https.post(path, json=body), plain.http.post(path, json=body)
        assert (mine.status_code, mine.json()) == (theirs.status_code, theirs.json()), path
    predicted = https.post("/v1/models/watched:predict", json=row)
    assert predicted.json()["predictions"][1]["OUTPUT0"] == [2 * x for x in rows[1]]
    # Answered by a replica of the model's application, whose statistics count the rows.
    root = https.get("/v2").headers["x-slipstream-replica"]
    assert predicted.headers["x-slipstream-replica"] != root
    deadline = time.monotonic() + 30
    while _inference_count(https) < before + 3 * len(rows):
        assert time.monotonic() < deadline, _inference_count(https)
        time.sleep(0.5)


def _inference_count(https: httpx.Client) -> int:
    stats = https.get("/v2/models/stats").json()["model_stats"]
    return sum(entry["inference_count"] for entry in stats if entry["name"] == "watched")


@pytest.mark.parametrize("route", ["/v1/score", "/v1/rerank", "/rerank", "/v2/rerank", "/classify"])
def test_scoring_routes_answer_404_naming_why(https: httpx.Client, route: str) -> None:
    body = {"model": "watched", "query": "q", "documents": ["d"], "text_1": "a", "text_2": "b",
            "input": "a"}  # fmt: skip
    reply = https.post(route, json=body)
    assert reply.status_code == 404, reply.text
    message = reply.json()["error"]["message"]
    assert message.startswith(f"{route} is not served under serve --ray"), message
    assert "without --ray" in message


@pytest.mark.parametrize(("method", "route"), [("POST", "/v1/files"), ("GET", "/v1/batches"),
                                              ("POST", "/v1/batches/batch-1/cancel")])  # fmt: skip
def test_files_and_batches_answer_404_naming_why(
    https: httpx.Client, method: str, route: str
) -> None:
    reply = https.request(method, route, json={})
    assert reply.status_code == 404, reply.text
    message = reply.json()["error"]["message"]
    assert " is not served under serve --ray" in message and "without --ray" in message


def _send(https: httpx.Client, rng: np.random.Generator) -> None:
    rows = rng.normal(size=(ROWS, ADD_SUB_WIDTH)).round(3).tolist()
    body = {"inputs": [{"name": name, "datatype": "FP32", "shape": [ROWS, ADD_SUB_WIDTH],
                        "data": rows} for name in ("INPUT0", "INPUT1")]}  # fmt: skip
    assert https.post("/v2/models/watched/infer", json=body).status_code == 200


def test_each_replica_monitors_drift_and_both_are_reported(https: httpx.Client) -> None:
    rng = np.random.default_rng(0)
    deadline = time.monotonic() + 60
    while True:  # until both replicas have a reference and a tested window
        doc: dict[str, Any] = https.get("/v2/models/watched/drift").json()
        reports = {doc["replica"]: doc, **doc["other_replicas"]}
        if len(reports) == 2 and all(r["windows"] >= 1 for r in reports.values()):
            break
        assert time.monotonic() < deadline, doc
        _send(https, rng)
        time.sleep(0.1)
    for report in reports.values():
        assert (report["model"], report["version"]) == ("watched", "1")
        assert report["reference"] == "captured" and report["reference_rows"] >= ROWS
        assert report["tensor_tests"] >= 4  # INPUT0, INPUT1, OUTPUT0, OUTPUT1
    # /metrics: each replica's monitor, labelled with the replica /drift names.
    deadline = time.monotonic() + 30
    while True:
        windows = {
            sample.labels["replica"]: sample.value
            for family in text_string_to_metric_families(https.get("/metrics").text)
            for sample in family.samples
            if sample.name == "slipstream_drift_windows_total"
            and sample.labels["model"] == "watched"
        }
        if set(windows) == set(reports) and min(windows.values()) >= 1:
            break
        assert time.monotonic() < deadline, windows
        time.sleep(0.5)
    unknown = https.get("/v2/models/watched/versions/7/drift")
    assert unknown.status_code == 404, unknown.text


def test_a_stateful_model_on_more_than_one_replica_stops_the_start_before_ray(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    from slipstream.config import ServerSettings
    from slipstream.rayserve.app import run

    def no_cluster(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("Ray was started for a stateful model on two replicas")

    monkeypatch.setattr(ray, "init", no_cluster)
    build_add_sub(tmp_path, "counter")
    replicas = {"min_replicas": 1, "max_replicas": 2}
    write_config(tmp_path, "counter", {"max_batch_size": 8, "sequence_batching": {},
                                       "ray_serve": replicas})  # fmt: skip
    build_add_sub(tmp_path, "fine")
    assert run(ServerSettings(model_repository=tmp_path)) == 1
    [problem] = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert problem.startswith("model 'counter' cannot be deployed: "), problem
    assert "a stateful model's sequences live in one replica" in problem
    assert "keep it at 1" in problem


def test_tls_files_that_do_not_load_stop_the_start_naming_them(
    certs: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    from slipstream.config import ServerSettings
    from slipstream.rayserve.app import run

    def no_cluster(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("Ray was started with TLS files that do not load")

    monkeypatch.setattr(ray, "init", no_cluster)
    missing = tmp_path / "missing.key"
    settings = ServerSettings(model_repository=tmp_path, tls_cert=certs / "server.pem",
                              tls_key=missing)  # fmt: skip
    assert run(settings) == 1
    assert f"--tls-key {missing}: no such file" in caplog.text
    # A key that is not the certificate's: named with the certificate, as serve names them.
    (tmp_path / "other.key").write_bytes((certs / "server.pem").read_bytes())
    settings = ServerSettings(model_repository=tmp_path, tls_cert=certs / "server.pem",
                              tls_key=tmp_path / "other.key")  # fmt: skip
    assert run(settings) == 1
    assert f"--tls-key {tmp_path / 'other.key'}" in caplog.text
