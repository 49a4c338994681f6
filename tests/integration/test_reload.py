"""Reloads under load: a good one swaps without a failed request, a bad one changes nothing.

Each test runs a real ``slipstream serve`` and, where it says so, client threads that
send requests throughout (bounded in count and time) and record every answer that is not
a 200 with the right version's numbers. Model ``m`` version v adds 10 * v to its input,
so every answer says which version computed it. Waits are on observed states (an answer
from a version, an index entry, a log line), never on time.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.gated import Gate, build_gated, gated_command, gated_input, wait_until
from tests.models import build_add_constant, write_config
from tests.utils import RemoteServer

# Slow: the whole module runs in `make test`, not in `make test-fast`.
pytestmark = pytest.mark.slow

CLIENT_TIMEOUT_S = 60.0
# Bounds of one test's traffic: it stops at whichever comes first (or when told).
MAX_REQUESTS = 200_000
MAX_TRAFFIC_S = 240.0
# Answers a client must see after a reload before the test moves on.
AFTER_EACH_STEP = 300
X = np.array([[0.0, 1.0, 2.0, 3.0]], np.float32)
BODY = orjson.dumps(
    {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": X.ravel()}]},
    option=orjson.OPT_SERIALIZE_NUMPY,
)


class Traffic:
    """Client threads sending ``m`` requests until stopped; counts answers by version."""

    def __init__(self, url: str, clients: int = 2) -> None:
        self._url = url
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.versions: Counter[str] = Counter()
        self.failures: list[str] = []
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def __enter__(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(CLIENT_TIMEOUT_S)

    @property
    def sent(self) -> int:
        with self._lock:
            return sum(self.versions.values()) + len(self.failures)

    def _run(self) -> None:
        deadline = time.monotonic() + MAX_TRAFFIC_S
        with httpx.Client(base_url=self._url, timeout=CLIENT_TIMEOUT_S) as http:
            while not self._stop.is_set() and time.monotonic() < deadline:
                if self.sent >= MAX_REQUESTS:
                    return
                self._record(http.post("/v2/models/m/infer", content=BODY))

    def _record(self, response: httpx.Response) -> None:
        problem = ""
        if response.status_code != 200:
            problem = f"{response.status_code}: {response.text}"
        else:
            doc = response.json()
            version = doc["model_version"]
            want = (X + 10.0 * int(version)).ravel().tolist()
            if doc["outputs"][0]["data"] != want:
                problem = f"version {version} answered {doc['outputs'][0]['data']}"
        with self._lock:
            if problem:
                self.failures.append(problem)
            else:
                self.versions[response.json()["model_version"]] += 1

    def wait_for_version(self, version: str) -> None:
        wait_until(lambda: self.versions[version] > 0, f"an answer from version {version}")

    def wait_for_more(self, count: int = AFTER_EACH_STEP) -> int:
        """Wait until ``count`` more answers came; return the total sent by then."""
        target = self.sent + count
        wait_until(lambda: self.sent >= target or self._stop.is_set(), f"{count} more answers")
        assert self.sent >= target, "the traffic stopped early (MAX_REQUESTS / MAX_TRAFFIC_S)"
        return self.sent


class Phases:
    """Prints the requests sent and failed during each step of a scenario, for the record."""

    def __init__(self, traffic: Traffic) -> None:
        self._traffic = traffic
        self._sent = 0
        self._failed = 0

    def end(self, step: str) -> None:
        sent, failed = self._traffic.sent, len(self._traffic.failures)
        print(f"{step}: {sent - self._sent} requests, {failed - self._failed} failed")
        self._sent, self._failed = sent, failed


# Version 2 serving; version 1, replaced, listed as unloaded (as Triton lists it).
SERVING_2 = {("2", "READY"): "", ("1", "UNAVAILABLE"): "unloaded"}


def index(http: httpx.Client) -> dict[tuple[str, str], str]:
    """(version, state) -> reason for model ``m``."""
    response = http.post("/v2/repository/index")
    assert response.status_code == 200, response.text
    return {
        (e.get("version", ""), e.get("state", "")): e.get("reason", "")
        for e in response.json()
        if e["name"] == "m"
    }


def move_in(staging: Path, repo: Path, version: int, constant: float | None = None) -> None:
    """Build version ``version`` of m outside the repository and move it in at once."""
    build_add_constant(staging, "m", version, 10.0 * version if constant is None else constant)
    os.rename(staging / "m" / str(version), repo / "m" / str(version))


def write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    build_add_constant(tmp_path / "repo", "m", 1, 10.0)
    return tmp_path / "repo"


# ---------------------------------------------------------------------------- explicit mode


def test_explicit_reloads_under_load(repo: Path, tmp_path: Path) -> None:
    args = ["--model-control-mode", "explicit", "--load-model", "m"]
    with (
        RemoteServer(repo, args, log_dir=tmp_path) as server,
        httpx.Client(base_url=server.http_url, timeout=CLIENT_TIMEOUT_S) as http,
        Traffic(server.http_url) as traffic,
    ):
        phases = Phases(traffic)
        traffic.wait_for_more()
        phases.end("explicit: version 1 serving")

        move_in(tmp_path / "staging", repo, 2)
        assert http.post("/v2/repository/models/m/load").status_code == 200
        traffic.wait_for_version("2")
        traffic.wait_for_more()
        assert index(http) == SERVING_2
        phases.end("explicit: good reload to version 2")

        write(repo / "m" / "3" / "model.onnx", b"this is not an ONNX file")
        response = http.post("/v2/repository/models/m/load")
        assert response.status_code == 400, response.text
        assert "version 3" in response.json()["error"]
        assert "keep serving" in response.json()["error"]
        entries = index(http)
        assert entries[("2", "READY")] == "" and entries[("3", "UNAVAILABLE")]
        served = traffic.versions["2"]
        traffic.wait_for_more()
        assert traffic.versions["2"] > served and traffic.versions["3"] == 0
        phases.end("explicit: failed reload (broken model file)")

        # The same failure through gRPC: an error status, and still nothing changes.
        client = grpcclient.InferenceServerClient(server.grpc_address)
        try:
            write(repo / "m" / "3" / "model.onnx", b"still not an ONNX file")
            with pytest.raises(InferenceServerException) as info:
                client.load_model("m")
            assert "version 3" in str(info.value.message())
            assert client.is_model_ready("m")
        finally:
            client.close()

        write_config(repo, "m", {"max_batch_sizes": 8})
        response = http.post("/v2/repository/models/m/load")
        assert response.status_code == 400, response.text
        assert "max_batch_sizes" in response.json()["error"]
        entries = index(http)
        assert ("2", "READY") in entries and "max_batch_sizes" in entries[("", "UNAVAILABLE")]
        traffic.wait_for_more()
        phases.end("explicit: failed reload (bad config.yaml)")

        # Fixed: the config changed, so version 2 reloads in place, without a failure.
        write_config(repo, "m", {"max_batch_size": 8})
        shutil.rmtree(repo / "m" / "3")
        assert http.post("/v2/repository/models/m/load").status_code == 200
        assert index(http) == SERVING_2
        traffic.wait_for_more()
        phases.end("explicit: good reload of version 2 (config changed)")
    assert traffic.failures == [], traffic.failures[:5]
    # Loaded by the good reload and by the config change; the failed reloads reused it.
    assert server.log_text().count("model m version 2 is READY") == 2


# ---------------------------------------------------------------------------- poll mode


def test_poll_reloads_under_load(repo: Path, tmp_path: Path) -> None:
    args = ["--model-control-mode", "poll", "--repository-poll-secs", "0.25"]
    staging = tmp_path / "staging"
    with (
        RemoteServer(repo, args, log_dir=tmp_path) as server,
        httpx.Client(base_url=server.http_url, timeout=CLIENT_TIMEOUT_S) as http,
        Traffic(server.http_url) as traffic,
    ):
        phases = Phases(traffic)
        traffic.wait_for_more()
        phases.end("poll: version 1 serving")

        move_in(staging, repo, 2)
        traffic.wait_for_version("2")
        traffic.wait_for_more()
        phases.end("poll: good version 2 appears")

        write(repo / "m" / "3" / "model.onnx", b"this is not an ONNX file")
        wait_until(lambda: ("3", "UNAVAILABLE") in index(http), "version 3 failing to load")
        assert ("2", "READY") in index(http)
        # A marker model added now loads two polls later at the earliest: by then the
        # broken version has been seen on later polls and must not have been retried.
        build_add_constant(staging, "marker", 1, 0.0)
        os.rename(staging / "marker", repo / "marker")
        wait_until(lambda: http.get("/v2/models/marker/ready").status_code == 200, "marker")
        assert server.log_text().count("model m: version 3 failed to load") == 1
        traffic.wait_for_more()
        phases.end("poll: broken version 3 appears")

        write_config(repo, "m", "max_batch_size: [this is not a number\n")
        wait_until(lambda: ("", "UNAVAILABLE") in index(http), "the bad config being refused")
        assert "YAML" in index(http)[("", "UNAVAILABLE")]
        traffic.wait_for_more()
        phases.end("poll: bad config.yaml appears")

        (repo / "m" / "config.yaml").unlink()
        shutil.rmtree(repo / "m" / "3")
        wait_until(lambda: index(http) == SERVING_2, "the repaired model serving")
        traffic.wait_for_more()
        phases.end("poll: config and version 3 removed")
    assert traffic.failures == [], traffic.failures[:5]
    assert traffic.versions["3"] == 0


def test_poll_waits_for_a_copy_in_progress(repo: Path, tmp_path: Path) -> None:
    # The test appends the second half within one poll interval of seeing the server
    # notice the first (it looks every 5 ms): 1 s leaves room for a loaded machine. The
    # exact rule runs without any timing in tests/unit/test_reload_rules.py.
    args = ["--model-control-mode", "poll", "--repository-poll-secs", "1"]
    staging = tmp_path / "staging"
    build_add_constant(staging, "m", 2, 20.0)
    data = (staging / "m" / "2" / "model.onnx").read_bytes()
    (staging / "m" / "2" / "model.onnx").write_bytes(data[: len(data) // 2])
    with (
        RemoteServer(repo, args, log_dir=tmp_path) as server,
        Traffic(server.http_url, clients=1) as traffic,
    ):
        os.rename(staging / "m" / "2", repo / "m" / "2")
        wait_until(lambda: "model m: files changed (2)" in server.log_text(), "the half copy seen")
        with (repo / "m" / "2" / "model.onnx").open("ab") as file:
            file.write(data[len(data) // 2 :])
        traffic.wait_for_version("2")
        print(f"poll: copy in two halves: {traffic.sent} requests, "
              f"{len(traffic.failures)} failed")  # fmt: skip
    log = server.log_text()
    assert "failed to load" not in log, log
    assert log.count("model m version 2 is READY") == 1
    assert traffic.failures == [], traffic.failures[:5]


# ---------------------------------------------------------------------------- control calls


@pytest.fixture
def gated(tmp_path: Path) -> Iterator[tuple[RemoteServer, Gate, httpx.Client]]:
    repo = tmp_path / "repo"
    gate = Gate(tmp_path / "gate")
    build_gated(repo, "held", gate, {"max_batch_size": 1})
    args = ["--model-control-mode", "explicit"]
    server = RemoteServer(repo, args, log_dir=tmp_path, command=gated_command())
    with server, httpx.Client(base_url=server.http_url, timeout=CLIENT_TIMEOUT_S) as http:
        yield server, gate, http


def _call(http: httpx.Client, action: str) -> httpx.Response:
    return http.post(f"/v2/repository/models/held/{action}")


def _infer(http: httpx.Client, tag: float) -> httpx.Response:
    x = gated_input(tag)
    body = {"inputs": [{"name": "INPUT0", "shape": list(x.shape), "datatype": "FP32",
                        "data": x.ravel().tolist()}]}  # fmt: skip
    return http.post("/v2/models/held/infer", json=body)


def _waiting(server: RemoteServer) -> int:
    return server.log_text().count("model held: waiting for the load or unload in progress")


def test_concurrent_loads_of_one_model_load_it_once(
    gated: tuple[RemoteServer, Gate, httpx.Client],
) -> None:
    server, gate, http = gated
    with ThreadPoolExecutor(2) as pool:
        with gate.closed():
            first = pool.submit(_call, http, "load")
            gate.wait_runs(1)  # its warm-up run is held: the load is in progress
            second = pool.submit(_call, http, "load")
            wait_until(lambda: _waiting(server) == 1, "the second load waiting for the first")
        assert first.result().status_code == 200, first.result().text
        assert second.result().status_code == 200, second.result().text
    assert len(gate.runs()) == 1  # one warm-up: one load
    assert server.log_text().count("model held version 1 is READY") == 1
    assert http.get("/v2/models/held/ready").status_code == 200


def test_unload_during_a_load_and_load_during_an_unload(
    gated: tuple[RemoteServer, Gate, httpx.Client],
) -> None:
    server, gate, http = gated
    with ThreadPoolExecutor(3) as pool:
        with gate.closed():
            load = pool.submit(_call, http, "load")
            gate.wait_runs(1)
            unload = pool.submit(_call, http, "unload")
            wait_until(lambda: _waiting(server) == 1, "the unload waiting for the load")
        assert load.result().status_code == 200 and unload.result().status_code == 200
        # Serialized in arrival order: the unload came last.
        assert http.get("/v2/models/held/ready").status_code != 200

        assert _call(http, "load").status_code == 200
        runs = len(gate.runs())
        with gate.closed():
            held: Future[httpx.Response] = pool.submit(_infer, http, 7.0)
            gate.wait_runs(runs + 1)
            unload = pool.submit(_call, http, "unload")  # drains the held request
            wait_until(lambda: _state(http) == "UNLOADING", "the unload draining")
            load = pool.submit(_call, http, "load")
            wait_until(lambda: _waiting(server) == 2, "the load waiting for the unload")
        assert held.result().status_code == 200, held.result().text
        assert unload.result().status_code == 200 and load.result().status_code == 200
        # The load came last: the model ends loaded.
        assert http.get("/v2/models/held/ready").status_code == 200


def _state(http: httpx.Client) -> str:
    """The state of the newest version of ``held`` the index lists."""
    entries: list[dict[str, Any]] = http.post("/v2/repository/index").json()
    return next((e.get("state", "") for e in reversed(entries) if e["name"] == "held"), "")


def test_a_swap_lets_requests_on_the_old_version_finish(
    gated: tuple[RemoteServer, Gate, httpx.Client], tmp_path: Path
) -> None:
    server, gate, http = gated
    assert _call(http, "load").status_code == 200
    runs = len(gate.runs())
    new_gate = Gate(tmp_path / "gate2")  # version 2 runs at its own, open gate
    with ThreadPoolExecutor(2) as pool:
        with gate.closed():
            held = pool.submit(_infer, http, 1.0)
            gate.wait_runs(runs + 1)  # running on version 1
            build_gated(server.repository, "held", new_gate, {"max_batch_size": 1}, version=2)
            load = pool.submit(_call, http, "load")
            wait_until(lambda: _state(http) == "READY" and _versions(http) == ["2"], "the swap")
            during = _infer(http, 2.0)
            assert during.status_code == 200 and during.json()["model_version"] == "2"
        assert held.result().status_code == 200, held.result().text
        assert held.result().json()["model_version"] == "1"
        assert load.result().status_code == 200, load.result().text
    assert "model held version 1 unloaded" in server.log_text()


def _versions(http: httpx.Client) -> list[str]:
    entries: list[dict[str, Any]] = http.post("/v2/repository/index").json()
    return [e["version"] for e in entries if e["name"] == "held" and e.get("state") == "READY"]
