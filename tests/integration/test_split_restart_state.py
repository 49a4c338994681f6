"""``slipstream serve --frontends 1``: a killed engine's successor serves its models as the
killed one did, not as a fresh start would.

* Scale to zero outlives the restart: models asleep before it stay asleep (a memory
  budget sized for scale to zero does not see every model load at once), answer their
  metadata without loading, and load on their next request, as before.
* A failed reload still changes nothing: the version kept serving after a corrupt new
  version serves again after the restart, and the server stays ready.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.models import ADD_SUB_WIDTH, build_add_sub
from tests.utils import RemoteServer

pytestmark = pytest.mark.timeout(120)

BODY = {"inputs": [
    {"name": n, "shape": [1, ADD_SUB_WIDTH], "datatype": "FP32", "data": [1.0] * ADD_SUB_WIDTH}
    for n in ("INPUT0", "INPUT1")]}  # fmt: skip
# Longer than the engine's journal takes to notice a change of its models' states.
_JOURNALED_S = 1.5


@pytest.fixture(scope="module")
def idle(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    root = tmp_path_factory.mktemp("restart_idle")
    repo = root / "models"
    build_add_sub(repo, "napper")
    build_add_sub(repo, "dozer")
    args = ["--frontends", "1", "--idle-unload-seconds", "1"]
    with RemoteServer(repo, args, log_dir=root) as running:
        yield running


@pytest.fixture(scope="module")
def poll(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    root = tmp_path_factory.mktemp("restart_poll")
    build_add_sub(root / "models", "mlp", version=1)
    args = ["--frontends", "1", "--model-control-mode", "poll", "--repository-poll-secs", "0.25"]
    with RemoteServer(root / "models", args, log_dir=root) as running:
        yield running


def _index(server: RemoteServer) -> set[tuple[str, str, str, str]]:
    answer = server.http.post("/v2/repository/index", json={})
    if answer.status_code != 200:
        return set()
    return {(e["name"], e.get("version", ""), e.get("state", ""), e.get("reason", ""))
            for e in answer.json()}  # fmt: skip


def _until(check: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _restart_engine(server: RemoteServer) -> str:
    """Kill the engine with -9 once its journal is saved; the log from its successor on."""
    time.sleep(_JOURNALED_S)
    pids = server.engine_pids()
    os.kill(pids[-1], signal.SIGKILL)
    _until(lambda: len(server.engine_pids()) > len(pids), "the engine is started again")
    # Then until the new engine answers, every model settled (no LOADING).
    _until(lambda: _settled(server), "the new engine serves")
    return _since_restart(server)


def _settled(server: RemoteServer) -> bool:
    states = {e[2] for e in _index(server)}
    return bool(states) and states <= {"READY", "UNAVAILABLE"}


def _since_restart(server: RemoteServer) -> str:
    """The server's log since the last engine started."""
    return server.log_text().split(f"engine started (pid {server.engine_pids()[-1]})", 1)[1]


def test_models_asleep_before_an_engine_restart_stay_asleep_after_it(idle: RemoteServer) -> None:
    asleep = {("napper", "1", "UNAVAILABLE", "idle"), ("dozer", "1", "UNAVAILABLE", "idle")}
    _until(lambda: _index(idle) == asleep, "both models sleep")
    _restart_engine(idle)
    time.sleep(1)  # a restored model loaded at start would show READY (or its load) by now
    assert _index(idle) == asleep
    assert idle.http.get("/v2/models/napper").json()["inputs"][0]["name"] == "INPUT0"
    assert idle.http.get("/v2/models/napper/config").status_code == 200
    assert "is READY" not in _since_restart(idle)  # neither at start nor for the metadata
    assert idle.http.post("/v2/models/napper/infer", json=BODY).status_code == 200  # wakes
    assert "model napper version 1 is READY" in _since_restart(idle)


def test_a_version_kept_after_a_failed_reload_serves_after_an_engine_restart(
    poll: RemoteServer,
) -> None:
    version_2 = Path(poll.repository) / "mlp" / "2"
    version_2.mkdir()
    (version_2 / "model.onnx").write_bytes(b"not an onnx model")
    _until(lambda: ("mlp", "2", "UNAVAILABLE") in {e[:3] for e in _index(poll)}, "v2 fails")
    kept = {e[:3] for e in _index(poll)}
    assert kept == {("mlp", "1", "READY"), ("mlp", "2", "UNAVAILABLE")}
    _restart_engine(poll)
    assert {e[:3] for e in _index(poll)} == kept
    assert poll.http.get("/v2/health/ready").status_code == 200
    assert poll.http.post("/v2/models/mlp/infer", json=BODY).status_code == 200


def test_a_config_override_outlives_an_engine_restart(tmp_path: Path) -> None:
    """Explicit mode: a model loaded with a config override (Triton's load with config)
    is served with that config by the killed engine's successor too, not the repository's."""
    build_add_sub(tmp_path / "models", "tuned")
    args = ["--frontends", "1", "--model-control-mode", "explicit", "--load-model", "tuned"]
    with RemoteServer(tmp_path / "models", args, log_dir=tmp_path) as server:
        override = (
            '{"max_batch_size": 2, "dynamic_batching": {"default_queue_policy": '
            '{"max_queue_size": 7}}}'
        )
        load = server.http.post("/v2/repository/models/tuned/load",
                                json={"parameters": {"config": override}})  # fmt: skip
        assert load.status_code == 200, load.text

        def config() -> tuple[int, int]:
            got = server.http.get("/v2/models/tuned/config").json()
            return got["max_batch_size"], got["dynamic_batching"]["default_queue_policy"][
                "max_queue_size"
            ]

        assert config() == (2, 7)
        _restart_engine(server)
        assert config() == (2, 7)
        assert server.http.post("/v2/models/tuned/infer", json=BODY).status_code == 200
