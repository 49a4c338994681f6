"""Issue #24. Models idle past their idle_unload_seconds are unloaded, listed as
UNAVAILABLE (idle), and loaded again by their next request, which waits and is answered;
requests arriving together share one load; a load that fails answers 503 naming why and
is not retried before its back-off; a pinned model stays; other models are untouched.
The start-up trace names each stage, and a server of ONNX models never imports torch.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.llm_models import build_tiny_llama
from tests.models import ADD_SUB_WIDTH, build_add_sub, write_config
from tests.utils import RemoteServer

pytestmark = pytest.mark.timeout(120)

IDLE_S = 0.6


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    root = tmp_path_factory.mktemp("scale_to_zero")
    repo = root / "repo"
    for name in ("sleepy", "crowd", "fragile", "slow"):
        build_add_sub(repo, name)
    build_add_sub(repo, "pinned")
    write_config(repo, "pinned", {"pin": True})
    # Its warm-up runs 3,000 times: a load that takes a noticeable while.
    write_config(repo, "slow", {"model_warmup": [{
        "name": f"long{i}", "batch_size": 1, "count": 1000,
        "inputs": {name: {"data_type": "FP32", "dims": [ADD_SUB_WIDTH], "zero_data": True}
                   for name in ("INPUT0", "INPUT1")},
    } for i in range(3)]})  # fmt: skip
    args = ["--idle-unload-seconds", str(IDLE_S)]
    with RemoteServer(repo, args, log_dir=root) as running:
        yield running


def infer(server: RemoteServer, model: str, value: float, **parameters: object) -> httpx.Response:
    data = [value] * ADD_SUB_WIDTH
    body: dict[str, object] = {"inputs": [
        {"name": name, "datatype": "FP32", "shape": [1, ADD_SUB_WIDTH], "data": data}
        for name in ("INPUT0", "INPUT1")
    ]}  # fmt: skip
    if parameters:
        body["parameters"] = parameters
    return server.http.post(f"/v2/models/{model}/infer", json=body)


def index(server: RemoteServer) -> dict[str, tuple[str, str]]:
    entries = server.http.post("/v2/repository/index", json={}).json()
    return {entry["name"]: (entry.get("state", ""), entry.get("reason", "")) for entry in entries}


def metric(server: RemoteServer, pattern: str) -> float:
    text = server.http.get("/metrics").text
    found = re.search(pattern + r" ([0-9.e+]+)", text)
    return float(found.group(1)) if found else 0.0


def wait_asleep(server: RemoteServer, model: str) -> None:
    deadline = time.monotonic() + 15
    while index(server)[model] != ("UNAVAILABLE", "idle"):
        assert time.monotonic() < deadline, f"{model} never unloaded: {index(server)[model]}"
        time.sleep(0.1)


def loads(server: RemoteServer, model: str, outcome: str = "ready") -> float:
    return metric(server, rf'slipstream_model_loads_total\{{model="{model}",outcome="{outcome}"\}}')


def test_an_idle_model_unloads_and_its_next_request_loads_it_and_is_answered(
    server: RemoteServer,
) -> None:
    wait_asleep(server, "sleepy")
    assert index(server)["pinned"] == ("READY", "")
    # Asleep, it still answers metadata, and is ready: its next request loads it.
    assert server.http.get("/v2/models/sleepy").json()["inputs"][0]["name"] == "INPUT0"
    assert server.http.get("/v2/models/sleepy/ready").status_code == 200
    # IDLE, not UNAVAILABLE: the "model not ready" alert does not page for a sleeping model.
    assert metric(server, r'slipstream_model_ready\{model="sleepy",version="1",state="IDLE"\}') == 0
    assert 'model="sleepy",version="1",state="UNAVAILABLE"' not in server.http.get("/metrics").text
    before = loads(server, "sleepy")
    client = httpclient.InferenceServerClient(server.http_address)
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = httpclient.InferInput(name, [1, ADD_SUB_WIDTH], "FP32")
        tensor.set_data_from_numpy(np.full((1, ADD_SUB_WIDTH), 2.0, np.float32))
        inputs.append(tensor)
    result = client.infer("sleepy", inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full((1, ADD_SUB_WIDTH), 4.0))
    assert index(server)["sleepy"] == ("READY", "")
    assert loads(server, "sleepy") == before + 1
    assert metric(server, r'slipstream_model_unloads_total\{model="sleepy",reason="idle"\}') >= 1
    assert metric(server, r'slipstream_model_load_waits_total\{model="sleepy"\}') >= 1
    assert metric(server, r'slipstream_model_load_seconds_count\{model="sleepy"\}') >= 2
    assert index(server)["pinned"] == ("READY", "")  # pinned: never unloaded


def test_requests_arriving_together_share_one_load(server: RemoteServer) -> None:
    wait_asleep(server, "crowd")
    before = loads(server, "crowd")
    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(lambda i: infer(server, "crowd", float(i)), range(16)))
    assert [r.status_code for r in replies] == [200] * 16
    assert [r.json()["outputs"][0]["data"][0] for r in replies] == [2.0 * i for i in range(16)]
    assert loads(server, "crowd") == before + 1


def test_a_request_that_cannot_wait_for_the_load_gets_503_and_the_load_goes_on(
    server: RemoteServer,
) -> None:
    wait_asleep(server, "slow")
    hurried = infer(server, "slow", 1.0, timeout=1000)  # 1 ms: far shorter than the load
    assert hurried.status_code == 503 and "still loading" in hurried.json()["error"]
    assert hurried.headers["retry-after"] == "1"
    deadline = time.monotonic() + 30
    while index(server)["slow"] != ("READY", ""):
        assert time.monotonic() < deadline, index(server)["slow"]
        time.sleep(0.1)
    assert infer(server, "slow", 1.0).status_code == 200


def test_a_model_that_fails_to_load_on_demand_answers_503_naming_why_and_backs_off(
    server: RemoteServer,
) -> None:
    wait_asleep(server, "fragile")
    model_file = server.repository / "fragile" / "1" / "model.onnx"
    saved = model_file.with_suffix(".saved")
    shutil.copy(model_file, saved)
    model_file.write_bytes(b"not an onnx file")
    try:
        failed = infer(server, "fragile", 1.0)
        assert failed.status_code == 503, failed.text
        assert "fragile" in failed.json()["error"] and "load" in failed.json()["error"]
        assert loads(server, "fragile", "failed") == 1
        again = infer(server, "fragile", 1.0)  # within the back-off: no second load
        assert again.status_code == 503 and "next attempt" in again.json()["error"]
        assert int(again.headers["retry-after"]) >= 1
        assert loads(server, "fragile", "failed") == 1
        state, reason = index(server)["fragile"]
        assert state == "UNAVAILABLE" and reason and reason != "idle"
        assert infer(server, "pinned", 1.0).status_code == 200  # the others are untouched
        # and the server stays in its load balancer (strict readiness counts models that
        # failed to load, not an idle one that failed to wake)
        assert server.http.get("/v2/health/ready").status_code == 200
    finally:
        shutil.copy(saved, model_file)
    deadline = time.monotonic() + 15
    while (reply := infer(server, "fragile", 3.0)).status_code != 200:
        assert time.monotonic() < deadline, reply.text
        time.sleep(0.3)
    assert reply.json()["outputs"][0]["data"][0] == 6.0


def test_the_start_up_trace_names_each_stage_and_an_onnx_server_imports_no_torch(
    tmp_path: Path,
) -> None:
    build_add_sub(tmp_path / "repo", "onnx_only")
    trace = tmp_path / "trace.json"
    with RemoteServer(tmp_path / "repo", ["--trace-startup", str(trace)], log_dir=tmp_path) as s:
        deadline = time.monotonic() + 10
        while not trace.exists():
            assert time.monotonic() < deadline, s.log_tail()
            time.sleep(0.05)
        assert "start-up (seconds since the process started): imported" in s.log_text()
    doc = json.loads(trace.read_text())
    stages = doc["stages_s"]
    assert 0 < stages["imported"] <= stages["http_listening"] <= stages["ready"]
    assert set(doc["models"]) == {"onnx_only/1"} and doc["models"]["onnx_only/1"]["load_s"] > 0
    assert "onnxruntime" in doc["frameworks"]
    assert not {"torch", "transformers", "sklearn", "llama_cpp"} & set(doc["frameworks"])


def test_an_idle_generative_model_sleeps_and_its_next_generation_loads_it(
    tmp_path: Path,
) -> None:
    tiny = build_tiny_llama(tmp_path / "hf")
    shutil.copytree(tiny, tmp_path / "repo" / "tiny" / "1")
    write_config(tmp_path / "repo", "tiny", {
        "backend": "transformers", "generation": {"num_blocks": 32, "block_size": 16},
        "idle_unload_seconds": IDLE_S,
    })  # fmt: skip
    with RemoteServer(tmp_path / "repo", log_dir=tmp_path) as server:
        wait_asleep(server, "tiny")
        sdk = server.openai()
        assert [model.id for model in sdk.models.list()] == ["tiny"]  # still offered
        assert server.http.get("/v2/health/ready").status_code == 200
        for path in ("/v2/models/tiny/ready", "/v2/models/tiny/versions/1/ready"):
            assert server.http.get(path).status_code == 200, path  # its next request loads it
        assert server.http.get("/v2/models/tiny/versions/2/ready").status_code == 400
        reply = sdk.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=4,
            extra_body={"ignore_eos": True},  # a random tiny model may end sooner
        )  # fmt: skip
        assert reply.choices[0].message.content is not None
        assert reply.usage is not None and reply.usage.completion_tokens == 4
        assert index(server)["tiny"] == ("READY", "")
        assert server.http.get("/v2/models/tiny/ready").status_code == 200
        assert metric(server, r'slipstream_model_unloads_total\{model="tiny",reason="idle"\}') == 1
        assert metric(server, r'slipstream_model_load_waits_total\{model="tiny"\}') == 1
        assert loads(server, "tiny") == 2
        wait_asleep(server, "tiny")  # and back to sleep once idle again
