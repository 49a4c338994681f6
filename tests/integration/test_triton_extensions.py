"""Triton's metrics, logging and trace extensions on one real server, with the stock clients.

``/metrics`` carries Triton's per-model series (``nv_inference_*``) beside Slipstream's,
and, parsed with prometheus_client's parser, they count the requests sent, run, queued
and failed. tritonclient's get/update_log_settings (HTTP and gRPC) change the server's log
as it is written; get/update_trace_settings answer Triton's shape with tracing off, keep
the settings a client may set, and refuse turning tracing on. With API keys, changing
them takes an admin key.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from slipstream.security.keys import KeyRing
from tests.gated import Gate, build_gated, gated_command, gated_input, wait_until
from tests.models import ADD_SUB_WIDTH, build_add_sub
from tests.utils import RemoteServer

# What the logging extension answers for a server started with the default --log-level.
LOG_DEFAULTS: dict[str, Any] = {
    "log_file": "",
    "log_info": True,
    "log_warning": True,
    "log_error": True,
    "log_verbose_level": 0,
    "log_format": "default",
}
# What the trace extension answers where nothing was set: Triton's shape, tracing off.
TRACE_OFF: dict[str, Any] = {
    "trace_level": ["OFF"],
    "trace_rate": "1000",
    "trace_count": "-1",
    "log_frequency": "0",
    "trace_file": "",
    "trace_mode": "triton",
}
# The serving core's DEBUG line of each request it answers.
REQUEST_DEBUG = re.compile(r"^(\S+ \S+|\S+) DEBUG slipstream\.serving\.core: request id=", re.M)
ISO8601_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ DEBUG ")
DEFAULT_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} DEBUG ")


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("triton_extensions") / "repo"
    build_add_sub(root)
    return root


@pytest.fixture(scope="module")
def gate(tmp_path_factory: pytest.TempPathFactory, repo: Path) -> Gate:
    """The gate of ``held``: one instance, one request may wait, the next is refused."""
    held = Gate(tmp_path_factory.mktemp("gate"))
    config = {"max_batch_size": 1, "dynamic_batching": {"max_queue_size": 1}}
    build_gated(repo, "held", held, config)
    return held


@pytest.fixture(scope="module")
def server(
    repo: Path, gate: Gate, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RemoteServer]:
    log_dir = tmp_path_factory.mktemp("logs")
    with RemoteServer(repo, log_dir=log_dir, command=gated_command()) as running:
        yield running


@pytest.fixture(scope="module")
def http_client(server: RemoteServer) -> Iterator[httpclient.InferenceServerClient]:
    client = httpclient.InferenceServerClient(server.http_address)
    yield client
    client.close()


@pytest.fixture(scope="module")
def grpc_client(server: RemoteServer) -> Iterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(server.grpc_address)
    yield client
    client.close()


@pytest.fixture
def restore_settings(http_client: httpclient.InferenceServerClient) -> Iterator[None]:
    """The server's log and trace settings as they started, after the test."""
    yield
    http_client.update_log_settings(LOG_DEFAULTS)
    http_client.update_trace_settings(settings=dict.fromkeys(TRACE_OFF))
    http_client.update_trace_settings("add_sub", settings=dict.fromkeys(TRACE_OFF))


def series(server: RemoteServer, model: str) -> dict[str, float]:
    """Every sample of ``model`` version 1 on /metrics, by sample name (those with a
    ``reason`` label as ``name:reason``), parsed as Prometheus does."""
    found = {}
    for family in text_string_to_metric_families(server.http.get("/metrics").text):
        for sample in family.samples:
            if sample.labels.get("model") == model and sample.labels.get("version") == "1":
                reason = sample.labels.get("reason")
                found[f"{sample.name}:{reason}" if reason else sample.name] = sample.value
    return found


def infer_add_sub(client: Any, module: Any, rows: int = 1) -> None:
    data = np.ones((rows, ADD_SUB_WIDTH), np.float32)
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = module.InferInput(name, [rows, ADD_SUB_WIDTH], "FP32")
        tensor.set_data_from_numpy(data)
        inputs.append(tensor)
    result = client.infer("add_sub", inputs)
    assert np.all(result.as_numpy("OUTPUT0") == 2.0)


def held_body(tag: float) -> bytes:
    x = gated_input(tag)
    tensor = {"name": "INPUT0", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel()}
    return orjson.dumps({"inputs": [tensor]}, option=orjson.OPT_SERIALIZE_NUMPY)


# ---------------------------------------------------------------------------- metrics


def test_tritons_series_count_the_requests_sent_run_and_failed(
    server: RemoteServer,
    http_client: httpclient.InferenceServerClient,
    grpc_client: grpcclient.InferenceServerClient,
) -> None:
    before = series(server, "add_sub")
    for rows in (1, 3, 1):
        infer_add_sub(http_client, httpclient, rows)
    for rows in (2, 1):
        infer_add_sub(grpc_client, grpcclient, rows)
    narrow = np.ones((1, ADD_SUB_WIDTH // 2), np.float32).tolist()
    for _ in range(2):  # a wrong width: the request's own mistake
        body = {"inputs": [{"name": n, "shape": [1, ADD_SUB_WIDTH // 2], "datatype": "FP32",
                            "data": narrow} for n in ("INPUT0", "INPUT1")]}  # fmt: skip
        assert server.http.post("/v2/models/add_sub/infer", json=body).status_code == 400
    after = series(server, "add_sub")

    def sent(name: str) -> float:
        return after[name] - before[name]

    assert sent("nv_inference_request_success") == 5
    assert sent("nv_inference_count") == 8  # rows
    assert sent("nv_inference_exec_count") == 5  # one at a time: a batch each
    assert sent("nv_inference_request_failure:OTHER") == 2
    for reason in ("REJECTED", "CANCELED", "BACKEND"):
        assert sent(f"nv_inference_request_failure:{reason}") == 0
    assert after["nv_inference_pending_request_count"] == 0
    assert sent("nv_inference_request_duration_us") > 0
    assert sent("nv_inference_compute_infer_duration_us") > 0
    assert sent("nv_inference_queue_duration_us") >= 0
    # The same counts as Slipstream's own series, in Triton's unit.
    assert after["nv_inference_request_success"] == after["slipstream_request_success_total"]
    assert after["nv_inference_exec_count"] == after["slipstream_execution_count_total"]
    total_s = after["slipstream_request_duration_seconds_sum"]
    assert after["nv_inference_request_duration_us"] == pytest.approx(total_s * 1e6, abs=1)
    # Written under Triton's bare names, which its dashboards and autoscalers query.
    text = server.http.get("/metrics").text
    for name in ("nv_inference_request_success", "nv_inference_queue_duration_us"):
        assert re.search(rf'^{name}{{model="add_sub",version="1"}} \d', text, re.M), name
    assert "nv_inference_request_success_total" not in text


def test_a_refused_request_is_rejected_and_a_waiting_one_pending(
    server: RemoteServer, gate: Gate
) -> None:
    before = series(server, "held")
    first_run = len(gate.runs())
    url = "/v2/models/held/infer"
    with ThreadPoolExecutor(2) as pool:
        with gate.closed():
            running = pool.submit(server.http.post, url, content=held_body(0))
            gate.wait_runs(first_run + 1)
            waiting = pool.submit(server.http.post, url, content=held_body(1))
            wait_until(
                lambda: series(server, "held")["nv_inference_pending_request_count"] == 1,
                "one request pending on held",
            )
            refused = server.http.post(url, content=held_body(2))
            assert refused.status_code == 503 and "queue is full" in refused.text
        assert running.result().status_code == 200
        assert waiting.result().status_code == 200
    after = series(server, "held")
    assert after["nv_inference_request_success"] - before["nv_inference_request_success"] == 2
    rejected = "nv_inference_request_failure:REJECTED"
    assert after[rejected] - before[rejected] == 1
    assert after["nv_inference_exec_count"] - before["nv_inference_exec_count"] == 2
    # The waiting request's time in the queue (at least the wait for its pending count).
    assert after["nv_inference_queue_duration_us"] > before["nv_inference_queue_duration_us"]
    assert after["nv_inference_pending_request_count"] == 0


# ---------------------------------------------------------------------------- logging


def debug_lines(server: RemoteServer) -> list[str]:
    return [match.group(0) for match in REQUEST_DEBUG.finditer(server.log_text())]


def test_the_logging_extension_is_listed(http_client: httpclient.InferenceServerClient) -> None:
    extensions = http_client.get_server_metadata()["extensions"]
    assert "logging" in extensions
    assert "trace" not in extensions  # no request tracing: only its settings answer


@pytest.mark.usefixtures("restore_settings")
def test_log_settings_over_http_change_the_servers_log(
    server: RemoteServer, http_client: httpclient.InferenceServerClient
) -> None:
    assert http_client.get_log_settings() == LOG_DEFAULTS
    verbose = http_client.update_log_settings({"log_verbose_level": 1})
    assert verbose == {**LOG_DEFAULTS, "log_verbose_level": 1}
    assert http_client.get_log_settings() == verbose
    logged = len(debug_lines(server))
    infer_add_sub(http_client, httpclient)  # its DEBUG line is written before the answer
    assert len(debug_lines(server)) == logged + 1
    assert DEFAULT_LINE.match(debug_lines(server)[-1]), debug_lines(server)[-1]

    http_client.update_log_settings({"log_format": "ISO8601"})
    infer_add_sub(http_client, httpclient)
    assert ISO8601_LINE.match(debug_lines(server)[-1]), debug_lines(server)[-1]

    http_client.update_log_settings({"log_verbose_level": 0, "log_format": "default"})
    logged = len(debug_lines(server))
    infer_add_sub(http_client, httpclient)
    assert len(debug_lines(server)) == logged

    # Info off: the server's INFO lines stop (its note of each settings change is one).
    changes = server.log_text().count("log settings changed")
    assert http_client.update_log_settings({"log_info": False})["log_info"] is False
    http_client.update_log_settings({"log_format": "ISO8601"})
    http_client.update_log_settings({"log_info": True})  # noted with info still off
    assert server.log_text().count("log settings changed") == changes + 1
    http_client.update_log_settings({"log_format": "default"})
    assert server.log_text().count("log settings changed") == changes + 2


@pytest.mark.usefixtures("restore_settings")
def test_a_wrong_log_setting_is_refused_naming_it_and_changes_nothing(
    http_client: httpclient.InferenceServerClient,
) -> None:
    for settings, fragment in (
        ({"log_file": "/tmp/server.log"}, "redirect the server's stderr"),
        ({"log_info": "yes"}, "log_info: expected true or false"),
        ({"log_verbose_level": -1}, "log_verbose_level: expected an integer"),
        ({"log_verbose_level": 1, "log_format": "json"}, "log_format: expected 'default'"),
        ({"log_warnings": False}, "'log_warnings' is not a log setting"),
    ):
        with pytest.raises(InferenceServerException) as info:
            http_client.update_log_settings(settings)
        assert info.value.status() == "400", info.value
        assert fragment in str(info.value.message()), info.value
    assert http_client.get_log_settings() == LOG_DEFAULTS
    # An empty log_file (the log on stderr, as it is) is no change.
    assert http_client.update_log_settings({"log_file": ""}) == LOG_DEFAULTS


@pytest.mark.usefixtures("restore_settings")
def test_log_settings_over_grpc(
    http_client: httpclient.InferenceServerClient, grpc_client: grpcclient.InferenceServerClient
) -> None:
    assert grpc_client.get_log_settings(as_json=True)["settings"] == {
        "log_file": {"string_param": ""},
        "log_info": {"bool_param": True},
        "log_warning": {"bool_param": True},
        "log_error": {"bool_param": True},
        "log_verbose_level": {"uint32_param": 0},
        "log_format": {"string_param": "default"},
    }
    answer = grpc_client.update_log_settings({"log_verbose_level": 2, "log_warning": False})
    assert answer.settings["log_verbose_level"].uint32_param == 2
    assert answer.settings["log_warning"].bool_param is False
    # One process, one log: HTTP reads what gRPC set.
    expected = {**LOG_DEFAULTS, "log_verbose_level": 2, "log_warning": False}
    assert http_client.get_log_settings() == expected
    with pytest.raises(InferenceServerException) as info:
        grpc_client.update_log_settings({"log_file": "/tmp/server.log"})
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT", info.value
    assert "stderr" in str(info.value.message())
    assert http_client.get_log_settings() == expected


# ---------------------------------------------------------------------------- trace


@pytest.mark.usefixtures("restore_settings")
def test_trace_settings_say_off_keep_what_may_be_set_and_refuse_tracing(
    http_client: httpclient.InferenceServerClient, grpc_client: grpcclient.InferenceServerClient
) -> None:
    assert http_client.get_trace_settings() == TRACE_OFF
    assert http_client.get_trace_settings(model_name="add_sub") == TRACE_OFF
    rate = http_client.update_trace_settings(settings={"trace_level": ["OFF"], "trace_rate": "50"})
    assert rate == {**TRACE_OFF, "trace_rate": "50"}
    # A model's own setting wins over the global one until cleared; the rest follow it.
    count = http_client.update_trace_settings("add_sub", {"trace_count": "10"})
    assert count == {**TRACE_OFF, "trace_rate": "50", "trace_count": "10"}
    assert http_client.get_trace_settings()["trace_count"] == "-1"
    # gRPC reads and sets the same settings.
    answer = grpc_client.get_trace_settings(model_name="add_sub", as_json=True)["settings"]
    assert answer == {name: {"value": value if isinstance(value, list) else [value]}
                      for name, value in count.items()}  # fmt: skip
    grpc_client.update_trace_settings("add_sub", {"trace_count": None})  # cleared
    assert http_client.get_trace_settings(model_name="add_sub")["trace_count"] == "-1"

    for level in (["TIMESTAMPS"], ["TENSORS"], ["OFF", "TIMESTAMPS"]):
        with pytest.raises(InferenceServerException) as info:
            http_client.update_trace_settings(settings={"trace_level": level})
        assert info.value.status() == "400", info.value
        assert "--trace-config mode=opentelemetry" in str(info.value.message())
        with pytest.raises(InferenceServerException) as info:
            grpc_client.update_trace_settings("add_sub", {"trace_level": level})
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT", info.value
    with pytest.raises(InferenceServerException) as info:
        http_client.update_trace_settings(settings={"trace_file": "/tmp/trace.json"})
    assert info.value.status() == "400"
    with pytest.raises(InferenceServerException) as info:
        http_client.update_trace_settings(settings={"trace_rate": "often"})
    assert "trace_rate: expected an integer" in str(info.value.message())
    assert http_client.get_trace_settings() == {**TRACE_OFF, "trace_rate": "50"}
    with pytest.raises(InferenceServerException) as info:
        http_client.get_trace_settings(model_name="nope")
    assert info.value.status() == "404"
    with pytest.raises(InferenceServerException) as info:
        grpc_client.get_trace_settings(model_name="nope")
    assert info.value.status() == "StatusCode.NOT_FOUND"


# ---------------------------------------------------------------------------- API keys


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("keys")
    ring = KeyRing.load(root / "keys.json", missing_ok=True)
    made = {"admin": ring.create("ops", "admin")[0], "infer": ring.create("app", "infer")[0]}
    ring.save()
    return {**made, "file": str(root / "keys.json")}


@pytest.fixture(scope="module")
def keyed_server(
    repo: Path, keys: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RemoteServer]:
    args = ["--auth-file", keys["file"]]
    log_dir = tmp_path_factory.mktemp("keyed_logs")
    with RemoteServer(repo, args, log_dir=log_dir, command=gated_command()) as running:
        yield running


def bearer(secret: str) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}"}


def test_log_and_trace_settings_over_grpc_need_an_admin_key(
    keyed_server: RemoteServer, keys: dict[str, str]
) -> None:
    client = grpcclient.InferenceServerClient(keyed_server.grpc_address)
    try:
        for call in (
            lambda key: client.update_log_settings({"log_verbose_level": 0}, headers=bearer(key)),
            lambda key: client.get_log_settings(headers=bearer(key)),
            lambda key: client.get_trace_settings(headers=bearer(key)),
        ):
            with pytest.raises(InferenceServerException) as info:
                call(keys["infer"])
            assert info.value.status() == "StatusCode.PERMISSION_DENIED", info.value
            call(keys["admin"])
    finally:
        client.close()


def test_log_and_trace_settings_over_http_need_an_admin_key(
    keyed_server: RemoteServer, keys: dict[str, str]
) -> None:
    for path in ("/v2/logging", "/v2/trace/setting", "/v2/models/add_sub/trace/setting"):
        assert keyed_server.http.get(path, headers=bearer(keys["infer"])).status_code == 403
        assert keyed_server.http.get(path, headers=bearer(keys["admin"])).status_code == 200
        body = b"{}"
        reply = keyed_server.http.post(path, content=body, headers=bearer(keys["infer"]))
        assert reply.status_code == 403
        reply = keyed_server.http.post(path, content=body, headers=bearer(keys["admin"]))
        assert reply.status_code == 200
