"""Drift monitoring in a real server (#16): traffic sent with the stock tritonclient, the
reference captured from a version's first requests, a shift found in a later window, and
the result in /v2/models/{m}/drift and in /metrics."""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
import yaml
from prometheus_client.parser import text_string_to_metric_families

from slipstream.config import ModelConfig
from tests.models import ADD_SUB_WIDTH, build_add_sub, build_identity, write_config
from tests.utils import RemoteServer, slipstream_command

ROWS_PER_REQUEST = 20
DRIFT = {"enable": True, "window": 200, "reference_samples": 400, "min_interval_s": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    repo = tmp_path_factory.mktemp("drift-repo")
    build_add_sub(repo, "watched")
    write_config(repo, "watched", {"max_batch_size": 64, "monitoring": {"drift": DRIFT}})
    build_add_sub(repo, "unwatched")
    write_config(repo, "unwatched", {"max_batch_size": 64})
    args = ["--price-per-hour", "3.6", "--cost-window-s", "10"]
    with RemoteServer(repo, args, log_dir=repo) as running:
        yield running


def send(server: RemoteServer, model: str, rng: np.random.Generator, shift: float) -> None:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    for _ in range(10):  # 200 rows
        first = rng.normal(size=(ROWS_PER_REQUEST, ADD_SUB_WIDTH)).astype(np.float32)
        first[:, 5] += shift
        second = rng.normal(size=(ROWS_PER_REQUEST, ADD_SUB_WIDTH)).astype(np.float32)
        inputs = []
        for name, data in (("INPUT0", first), ("INPUT1", second)):
            tensor = httpclient.InferInput(name, list(data.shape), "FP32")
            tensor.set_data_from_numpy(data, binary_data=True)
            inputs.append(tensor)
        client.infer(model, inputs)
    client.close()


def drift(server: RemoteServer, model: str) -> httpx.Response:
    return server.http.get(f"/v2/models/{model}/drift", timeout=10)


def send_until(
    server: RemoteServer, rng: np.random.Generator, shift: float, windows: int
) -> dict[str, object]:
    for _ in range(10):
        send(server, "watched", rng, shift)
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            doc = drift(server, "watched").json()
            if doc["windows"] >= windows:
                return dict(doc)
            time.sleep(0.05)
    raise AssertionError(f"not {windows} windows tested: {doc}")


def test_a_reference_is_captured_and_a_shifted_input_is_found(
    server: RemoteServer, tmp_path: Path
) -> None:
    rng = np.random.default_rng(0)
    send(server, "watched", rng, 0.0)
    send(server, "watched", rng, 0.0)  # 400 rows: the reference
    # Requests that come while a window is being tested are not sampled, so send until
    # the next one is tested. A window of 4 tensors (2 inputs, 2 outputs) counts once.
    calm = send_until(server, rng, 0.0, windows=1)
    assert calm["reference"] == "captured" and calm["reference_rows"] == 400
    assert calm["detected"] is False
    assert (calm["windows"], calm["tensor_tests"]) == (1, 4)
    shifted = send_until(server, rng, 1.0, windows=2)  # feature 5 of INPUT0: +1 sigma
    assert shifted["detected"] is True and shifted["windows"] == 2
    tensors = shifted["tensors"]
    assert isinstance(tensors, dict)
    flagged = [f["feature"] for f in tensors["INPUT0"]["features"] if f["drifted"]]
    assert "5" in flagged
    assert tensors["INPUT1"]["detected"] is False
    # The sum and the difference carry INPUT0's shift: prediction drift shows it too.
    assert tensors["OUTPUT0"]["detected"] is True

    # The page a user opens: the drifted feature drawn, the tests tabled.
    page = tmp_path / "drift.html"
    command = [*slipstream_command(), "monitor", "report", "watched", "--url",
               server.url(""), "--out", str(page)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    html = page.read_text()
    assert "Drift detected" in html and "<h2>INPUT0: drifted" in html
    assert html.count("data:image/png;base64,") >= 1
    # A page that cannot be written: a usage error naming --out, no traceback.
    missing = [*command[:-1], str(tmp_path / "no-such-dir" / "drift.html")]
    done = subprocess.run(missing, capture_output=True, text=True, check=False)
    assert done.returncode == 2 and "--out" in done.stderr and "no-such-dir" in done.stderr
    assert "Traceback" not in done.stderr
    samples = scrape(server)
    watched = {"model": "watched", "version": "1"}
    assert (
        samples[("slipstream_drift_detected", frozenset({**watched, "tensor": "INPUT0"}.items()))]
        == 1
    )
    assert (
        samples[("slipstream_drift_detected", frozenset({**watched, "tensor": "INPUT1"}.items()))]
        == 0
    )
    assert samples[("slipstream_drift_samples_total", frozenset(watched.items()))] >= 40
    windows = samples[("slipstream_drift_windows_total", frozenset(watched.items()))]
    assert windows == drift(server, "watched").json()["windows"] >= 2
    feature_5 = frozenset({**watched, "tensor": "INPUT0", "feature": "5"}.items())
    assert samples[("slipstream_drift_p_value", feature_5)] < 1e-6
    assert samples[("slipstream_drift_score", feature_5)] > 0.2


def scrape(server: RemoteServer) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = server.http.get("/metrics", timeout=10).text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_a_model_without_monitoring_answers_404_naming_the_setting(server: RemoteServer) -> None:
    reply = drift(server, "unwatched")
    assert reply.status_code == 404
    assert "monitoring.drift.enable" in reply.json()["error"]
    reply = drift(server, "no_such_model")
    assert reply.status_code == 404 and "no_such_model" in reply.json()["error"]
    reply = server.http.get("/v2/models/watched/versions/7/drift", timeout=10)
    assert reply.status_code in (400, 404) and "7" in reply.json()["error"]


def test_a_bad_monitoring_setting_is_a_load_error_naming_it(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    build_identity(repo, "FP32", "bad")
    write_config(repo, "bad", {"monitoring": {"drift": {"enable": True, "window": 3}}})
    with RemoteServer(repo, ["--no-strict-readiness"], log_dir=tmp_path) as running:
        index = running.http.post("/v2/repository/index", timeout=10).json()
        (entry,) = [e for e in index if e["name"] == "bad"]
        assert entry["state"] == "UNAVAILABLE"
        assert "monitoring.drift.window" in entry["reason"]


def test_a_reference_written_by_the_cli_is_the_one_the_server_tests_against(
    tmp_path: Path,
) -> None:
    repo = tmp_path / "repo"
    build_add_sub(repo, "ref")
    write_config(repo, "ref", {"max_batch_size": 64, "monitoring": {"drift": DRIFT}})
    rng = np.random.default_rng(3)
    data = tmp_path / "validation.npz"
    np.savez(data, INPUT0=rng.normal(size=(300, ADD_SUB_WIDTH)).astype(np.float32))
    command = [*slipstream_command(), "monitor", "reference", "ref", "--data", str(data),
               "--model-repository", str(repo)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert "INPUT0 300 rows" in done.stdout
    assert (repo / "ref" / "1" / "drift_reference.npz").is_file()
    with RemoteServer(repo, log_dir=tmp_path) as running:
        send(running, "ref", rng, 0.0)
        deadline = time.monotonic() + 30
        while (doc := drift(running, "ref").json())["windows"] < 1:
            assert time.monotonic() < deadline, doc
            time.sleep(0.05)
    # Only INPUT0 has a reference: the other tensors are not tested.
    assert doc["reference"] == "file" and doc["reference_rows"] == 300
    assert list(doc["tensors"]) == ["INPUT0"] and doc["detected"] is False
    bad = subprocess.run([*command[:-2], "--model-repository", str(tmp_path / "none")],
                         capture_output=True, text=True, check=False)  # fmt: skip
    assert bad.returncode != 0 and "ref" in bad.stderr
    # Arrays the model has no tensor for, whose rows it would not take, fewer rows than
    # a window, or none at all: refused, and the good reference stays.
    written = (repo / "ref" / "1" / "drift_reference.npz").read_bytes()
    wrong = {
        "foo": ({"foo": np.zeros((20, 3), np.float32)}, "'foo': not an input or output of ref"),
        "rows": (
            {"INPUT0": np.zeros((20, ADD_SUB_WIDTH + 1), np.float32)},
            f"'INPUT0' has rows of shape [{ADD_SUB_WIDTH + 1}]; ref's INPUT0 takes "
            f"[-1, {ADD_SUB_WIDTH}]",
        ),
        "one_row": (
            {"INPUT0": np.zeros((1, ADD_SUB_WIDTH), np.float32)},
            "'INPUT0' has 1 rows (samples along axis 0); a drift reference needs at least "
            "200, ref's monitoring.drift.window",
        ),
        "no_rows": ({"INPUT0": np.zeros((0, ADD_SUB_WIDTH), np.float32)}, "has 0 rows"),
        "empty": ({}, "no arrays; save one per tensor to monitor"),
    }
    for name, (arrays, error) in wrong.items():
        np.savez(tmp_path / f"{name}.npz", **arrays)  # type: ignore[arg-type]
        at = command.index("--data") + 1
        other = [*command[:at], str(tmp_path / f"{name}.npz"), *command[at + 1 :]]
        refused = subprocess.run(other, capture_output=True, text=True, check=False)
        assert refused.returncode != 0 and error in refused.stderr, refused.stderr
        assert "OUTPUT0" in refused.stderr or name not in ("foo", "empty")  # its tensors
    assert (repo / "ref" / "1" / "drift_reference.npz").read_bytes() == written


def test_a_reference_file_it_cannot_use_turns_monitoring_off_not_the_model(
    tmp_path: Path,
) -> None:
    """A one-row reference (written by hand, or by an older CLI): the model loads and
    serves; /drift and the log say why it is not monitored."""
    repo = tmp_path / "repo"
    build_add_sub(repo, "tiny")
    write_config(repo, "tiny", {"max_batch_size": 64, "monitoring": {"drift": DRIFT}})
    np.savez(repo / "tiny" / "1" / "drift_reference.npz", INPUT0=np.zeros((1, ADD_SUB_WIDTH)))
    with RemoteServer(repo, log_dir=tmp_path) as running:
        assert running.http.get("/v2/models/tiny/ready", timeout=10).status_code == 200
        send(running, "tiny", np.random.default_rng(6), 0.0)
        doc = drift(running, "tiny").json()
    assert "a reference needs at least 2 samples, got 1" in doc["disabled"]
    assert doc["sampled"] == 0 and doc["tensors"] == {}
    assert "drift monitoring of tiny:1 is off" in running.log_path.read_text()


def test_the_readme_s_monitoring_block_is_a_valid_config() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", readme, re.S) if "monitoring:" in b]
    config = ModelConfig.model_validate(yaml.safe_load(block))
    assert config.monitoring.drift.enable and config.monitoring.drift.window == 500


def test_the_cost_per_inference_is_the_price_shared_by_compute_time(server: RemoteServer) -> None:
    rng = np.random.default_rng(5)
    send(server, "unwatched", rng, 0.0)
    send(server, "watched", rng, 0.0)
    # The gauges follow the tracker's next snapshot (one per 10 s / 12 here).
    deadline = time.monotonic() + 10
    while True:
        samples = scrape(server)
        costs = {
            dict(labels)["model"]: value
            for (name, labels), value in samples.items()
            if name == "slipstream_cost_per_million_inferences"
        }
        if costs or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert samples[("slipstream_price_per_hour", frozenset())] == 3.6
    shares = [v for (n, _), v in samples.items() if n == "slipstream_compute_share"]
    assert set(costs) <= {"watched", "unwatched"} and costs and all(c > 0 for c in costs.values())
    assert sum(shares) == pytest.approx(1.0)
