"""The V2 REST API as clients see it: one real server for the module, stock tritonclient.

Every served output is compared with ONNX Runtime running the same model file in-process.
Bad requests go through raw httpx so each can assert both the status and that the error
message names the offending field. Queue behaviour (batching, timeouts, backpressure,
priorities, cancellation) is observed from outside through the statistics extension
and /metrics, with the ``slow_*`` models (the test-only gated backend, tests/gated.py)
holding a run for as long as the test keeps their gate closed, so requests queue behind
it whatever the speed of the machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import ml_dtypes
import numpy as np
import orjson
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException, triton_to_np_dtype

from tests.gated import GATED_WIDTH, Gate, build_gated, gated_command, gated_input, wait_until
from tests.models import (
    ADD_SUB_WIDTH,
    FIXED_SHAPE,
    NUMERIC_DATATYPES,
    V2_TO_ONNX,
    build_add_sub,
    build_fixed,
    build_identity,
    identity_name,
    run_onnx,
    write_config,
)
from tests.utils import RemoteServer

MAX_REQUEST_BYTES = 1024 * 1024
# Client-side bound on any single request: nothing in this module may hang.
CLIENT_TIMEOUT_S = 60.0
# Queue timeout of the request stuck behind a held run in the timeout tests.
QUEUE_TIMEOUT_US = 10_000

# One gated model per queue behaviour, so that no test's queue sees another's requests.
SLOW_MODELS: dict[str, dict[str, Any]] = {
    "slow_batch": {"max_batch_size": 8},
    "slow_timeout": {"max_batch_size": 1},
    "slow_deadline": {
        "max_batch_size": 1,
        "dynamic_batching": {"default_timeout_microseconds": QUEUE_TIMEOUT_US},
    },
    "slow_queue": {"max_batch_size": 1, "dynamic_batching": {"max_queue_size": 2}},
    "slow_priority": {
        "max_batch_size": 1,
        "dynamic_batching": {"priority_levels": 2},
        "parameters": {"hold_note": "parameters reach the backend as strings"},
    },
    "slow_cancel": {"max_batch_size": 1},
}
BROKEN_KEY = "max_batch_sizes"


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def gates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Gate]:
    root = tmp_path_factory.mktemp("gates")
    return {name: Gate(root / name) for name in SLOW_MODELS}


@pytest.fixture(scope="module")
def model_files(
    tmp_path_factory: pytest.TempPathFactory, gates: dict[str, Gate]
) -> dict[str, Path]:
    repo = tmp_path_factory.mktemp("repo")
    files = {"add_sub": build_add_sub(repo), "fixed": build_fixed(repo)}
    for datatype in V2_TO_ONNX:
        files[identity_name(datatype)] = build_identity(repo, datatype)
    for name, config in SLOW_MODELS.items():
        files[name] = build_gated(repo, name, gates[name], config)
    # A typo'd key: the model fails to load, the others serve.
    build_add_sub(repo, "broken")
    write_config(repo, "broken", {BROKEN_KEY: 8})
    return files


@pytest.fixture(scope="module")
def server(
    model_files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RemoteServer]:
    repo = model_files["add_sub"].parents[2]
    args = ["--no-strict-readiness", "--max-request-bytes", str(MAX_REQUEST_BYTES)]
    log_dir = tmp_path_factory.mktemp("logs")
    with RemoteServer(repo, args, log_dir=log_dir, command=gated_command()) as remote:
        yield remote


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> Iterator[httpclient.InferenceServerClient]:
    triton = httpclient.InferenceServerClient(
        server.http_address, connection_timeout=CLIENT_TIMEOUT_S, network_timeout=CLIENT_TIMEOUT_S
    )
    yield triton
    triton.close()


@pytest.fixture(scope="module")
def http(server: RemoteServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.http_url, timeout=CLIENT_TIMEOUT_S) as session:
        yield session


# ---------------------------------------------------------------------------- helpers


def tensor_json(name: str, array: np.ndarray, datatype: str = "FP32") -> dict[str, Any]:
    return {"name": name, "shape": list(array.shape), "datatype": datatype, "data": array.ravel()}


def infer_body(inputs: dict[str, np.ndarray], **extra: Any) -> bytes:
    body = {"inputs": [tensor_json(name, array) for name, array in inputs.items()], **extra}
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def add_sub_inputs(rows: int = 1, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "INPUT0": rng.standard_normal((rows, ADD_SUB_WIDTH), dtype=np.float32),
        "INPUT1": rng.standard_normal((rows, ADD_SUB_WIDTH), dtype=np.float32),
    }


def slow_input(tag: int, rows: int = 1) -> np.ndarray:
    """Input of a gated model whose rows carry ``tag``, to find them in Gate.runs()."""
    return gated_input(float(tag), rows)


def triton_inputs(
    inputs: dict[str, np.ndarray], datatype: str = "FP32", binary: bool = True
) -> list[httpclient.InferInput]:
    result = []
    for name, array in inputs.items():
        tensor = httpclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array, binary_data=binary)
        result.append(tensor)
    return result


def assert_error(response: httpx.Response, status: int, *fragments: str) -> str:
    """The response has ``status`` and a V2 error body whose message holds every fragment."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    message = response.json()["error"]
    assert isinstance(message, str)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in error {message!r}"
    return message


def model_stats(http: httpx.Client, model: str) -> dict[str, Any]:
    response = http.get(f"/v2/models/{model}/stats")
    assert response.status_code == 200, response.text
    (stats,) = response.json()["model_stats"]
    return dict(stats)


def metric_samples(http: httpx.Client, sample_name: str, **labels: str) -> list[Any]:
    response = http.get("/metrics")
    assert response.status_code == 200
    return [
        sample
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
        if sample.name == sample_name
        and all(sample.labels.get(key) == value for key, value in labels.items())
    ]


def metric(http: httpx.Client, sample_name: str, **labels: str) -> float:
    """The value of one sample of /metrics; fails when the series does not exist."""
    samples = metric_samples(http, sample_name, **labels)
    assert len(samples) == 1, f"{sample_name}{labels}: {samples}"
    return float(samples[0].value)


@contextlib.contextmanager
def sessions(server: RemoteServer, count: int) -> Iterator[list[httpx.Client]]:
    """``count`` HTTP clients with open connections, made before any timing matters.

    Making an httpx.Client takes tens of milliseconds (it builds an SSL context), which
    would scramble the arrival order of requests sent a few milliseconds apart.
    """
    with contextlib.ExitStack() as stack:
        made = []
        for _ in range(count):
            session = httpx.Client(base_url=server.http_url, timeout=CLIENT_TIMEOUT_S)
            stack.enter_context(session)
            assert session.get("/v2/health/live").status_code == 200
            made.append(session)
        yield made


def post_infer(session: httpx.Client, model: str, body: bytes) -> httpx.Response:
    return session.post(f"/v2/models/{model}/infer", content=body)


# ---------------------------------------------------------------------------- health and metadata


def test_server_live_ready_and_metadata(client: httpclient.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()  # --no-strict-readiness: the broken model does not count
    metadata = client.get_server_metadata()
    assert metadata["name"] == "slipstream"
    assert metadata["version"]
    for extension in ("binary_tensor_data", "model_repository", "statistics"):
        assert extension in metadata["extensions"]


def test_model_metadata_and_config(client: httpclient.InferenceServerClient) -> None:
    assert client.is_model_ready("add_sub")
    assert client.is_model_ready("add_sub", "1")
    assert not client.is_model_ready("add_sub", "2")
    metadata = client.get_model_metadata("add_sub")
    assert metadata["name"] == "add_sub"
    assert metadata["versions"] == ["1"]
    assert metadata["platform"] == "onnxruntime_onnx"
    expected = [
        {"name": n, "datatype": "FP32", "shape": [-1, ADD_SUB_WIDTH]} for n in ("INPUT0", "INPUT1")
    ]
    assert metadata["inputs"] == expected
    assert [t["name"] for t in metadata["outputs"]] == ["OUTPUT0", "OUTPUT1"]

    config = client.get_model_config("add_sub")
    # Completed from the file: a dynamic first dim means batching with the default size.
    assert config["max_batch_size"] == 64
    assert config["input"][0] == {"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [16]}

    slow = client.get_model_config("slow_priority")
    assert slow["max_batch_size"] == 1
    assert slow["dynamic_batching"]["priority_levels"] == 2
    assert slow["parameters"]["hold_note"] == {
        "string_value": "parameters reach the backend as strings"
    }


def test_non_batching_model(
    client: httpclient.InferenceServerClient, model_files: dict[str, Path]
) -> None:
    config = client.get_model_config("fixed")
    assert config["max_batch_size"] == 0
    assert client.get_model_metadata("fixed")["inputs"][0]["shape"] == list(FIXED_SHAPE)
    x = np.arange(8, dtype=np.float32).reshape(FIXED_SHAPE)
    result = client.infer("fixed", triton_inputs({"INPUT0": x}))
    expected = run_onnx(model_files["fixed"], {"INPUT0": x})["OUTPUT0"]
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), expected)


# ---------------------------------------------------------------------------- inference


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_add_sub_matches_onnxruntime(
    client: httpclient.InferenceServerClient, model_files: dict[str, Path], binary: bool
) -> None:
    inputs = add_sub_inputs(rows=3, seed=1)
    outputs = [
        httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("OUTPUT0", "OUTPUT1")
    ]
    result = client.infer("add_sub", triton_inputs(inputs, binary=binary), outputs=outputs)
    expected = run_onnx(model_files["add_sub"], inputs)
    for name, array in expected.items():
        served = result.as_numpy(name)
        assert served.dtype == np.float32
        np.testing.assert_array_equal(served, array)
    response = result.get_response()
    assert response["model_name"] == "add_sub"
    assert response["model_version"] == "1"


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_requests_of_tritonclient_are_served(
    client: httpclient.InferenceServerClient,
    model_files: dict[str, Path],
    binary: bool,
    algorithm: str,
) -> None:
    """tritonclient's request_compression_algorithm: its Inference-Header-Content-Length
    counts the decompressed JSON, as Triton reads it; and response_compression_algorithm
    (64 rows: an answer large enough to be compressed)."""
    inputs = add_sub_inputs(rows=64, seed=3)
    result = client.infer(
        "add_sub", triton_inputs(inputs, binary=binary),
        request_compression_algorithm=algorithm, response_compression_algorithm=algorithm,
    )  # fmt: skip
    for name, array in run_onnx(model_files["add_sub"], inputs).items():
        np.testing.assert_array_equal(result.as_numpy(name), array)


@pytest.mark.parametrize(
    ("accept", "coding"),
    [("gzip", "gzip"), ("deflate", "deflate"), ("gzip;q=0, deflate", "deflate"),
     ("br", None), ("identity", None)],
)  # fmt: skip
def test_an_answer_is_compressed_as_the_client_accepts(
    server: RemoteServer, model_files: dict[str, Path], accept: str, coding: str | None
) -> None:
    inputs = add_sub_inputs(rows=64, seed=4)
    body = infer_body(inputs, outputs=[{"name": "OUTPUT0", "parameters": {"binary_data": True}}])
    # httpx decodes what the server names, so the arrays read back prove the encoding.
    with httpx.Client(base_url=server.http_url, timeout=CLIENT_TIMEOUT_S) as session:
        reply = session.post(
            "/v2/models/add_sub/infer", content=body, headers={"Accept-Encoding": accept}
        )
        assert reply.status_code == 200, reply.text
        assert reply.headers.get("content-encoding") == coding
        if coding is not None:
            assert int(reply.headers["content-length"]) < len(reply.content)
        json_length = int(reply.headers["inference-header-content-length"])
        served = np.frombuffer(reply.content[json_length:], np.float32)
        expected = run_onnx(model_files["add_sub"], inputs)["OUTPUT0"]
        np.testing.assert_array_equal(served.reshape(expected.shape), expected)
        small = session.post(
            "/v2/models/add_sub/infer", content=infer_body(add_sub_inputs(rows=1)),
            headers={"Accept-Encoding": accept},
        )  # fmt: skip
        assert "content-encoding" not in small.headers  # too small to gain


def test_binary_inputs_with_binary_and_json_outputs(
    http: httpx.Client, model_files: dict[str, Path]
) -> None:
    inputs = add_sub_inputs(rows=2, seed=2)
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": name,
                    "shape": list(array.shape),
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": array.nbytes},
                }
                for name, array in inputs.items()
            ],
            "outputs": [
                {"name": "OUTPUT0", "parameters": {"binary_data": True}},
                {"name": "OUTPUT1", "parameters": {"binary_data": False}},
            ],
        }
    )
    body = header + b"".join(array.tobytes() for array in inputs.values())
    response = http.post(
        "/v2/models/add_sub/infer",
        content=body,
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    assert response.status_code == 200, response.text
    json_length = int(response.headers["Inference-Header-Content-Length"])
    doc = orjson.loads(response.content[:json_length])
    binary_out, json_out = doc["outputs"]
    assert binary_out["name"] == "OUTPUT0"
    assert binary_out["parameters"]["binary_data_size"] == 2 * ADD_SUB_WIDTH * 4
    assert "data" not in binary_out
    assert json_out["name"] == "OUTPUT1"
    assert "binary_data_size" not in json_out.get("parameters", {})
    expected = run_onnx(model_files["add_sub"], inputs)
    raw = response.content[json_length:]
    assert len(raw) == binary_out["parameters"]["binary_data_size"]
    served0 = np.frombuffer(raw, dtype=np.float32).reshape(binary_out["shape"])
    np.testing.assert_array_equal(served0, expected["OUTPUT0"])
    served1 = np.array(json_out["data"], dtype=np.float32).reshape(json_out["shape"])
    np.testing.assert_array_equal(served1, expected["OUTPUT1"])


def _dtype_sample(datatype: str, binary: bool) -> np.ndarray:
    """[2, 3] values at the edges of the datatype's range."""
    dtype = np.dtype(triton_to_np_dtype(datatype))
    if datatype == "BOOL":
        return np.array([[True, False, True], [False, False, True]])
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return np.array([[info.min, 0, 1], [info.max, info.max - 1, 7]], dtype=dtype)
    info_f = ml_dtypes.finfo(dtype)  # numpy's finfo knows no bfloat16
    values = [info_f.min, -0.0, info_f.tiny, info_f.max, 0.1, -2.5]
    if binary:  # NaN and infinity have no JSON spelling; binary data carries them
        values[1:3] = [np.nan, -np.inf]
    return np.array(values, dtype=dtype).reshape(2, 3)


# tritonclient sends BF16 as binary data only (r26.06+: ml_dtypes.bfloat16 arrays);
# test_bf16_as_json_numbers sends it as JSON.
@pytest.mark.parametrize(
    ("datatype", "binary"),
    [
        (datatype, binary)
        for datatype in NUMERIC_DATATYPES
        for binary in (False, True)
        if binary or datatype != "BF16"
    ],
    ids=lambda value: {False: "json", True: "binary"}.get(value, value),
)
def test_every_datatype_round_trips(
    client: httpclient.InferenceServerClient,
    model_files: dict[str, Path],
    datatype: str,
    binary: bool,
) -> None:
    model = identity_name(datatype)
    x = _dtype_sample(datatype, binary)
    metadata = client.get_model_metadata(model)
    assert metadata["inputs"][0]["datatype"] == datatype
    result = client.infer(
        model,
        triton_inputs({"INPUT0": x}, datatype, binary=binary),
        outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)],
    )
    assert result.get_output("OUTPUT0")["datatype"] == datatype
    served = result.as_numpy("OUTPUT0")
    assert served.dtype == x.dtype
    assert_same(served, x)
    assert_same(served, run_onnx(model_files[model], {"INPUT0": x})["OUTPUT0"])


def assert_same(served: np.ndarray, expected: np.ndarray) -> None:
    """Equal arrays, NaN at the same places; bfloat16 compared bit for bit (numpy's
    comparison finds no NaN in it)."""
    if expected.dtype == ml_dtypes.bfloat16:
        served, expected = served.view(np.uint16), expected.view(np.uint16)
    np.testing.assert_array_equal(served, expected)


def test_bf16_as_json_numbers(http: httpx.Client, model_files: dict[str, Path]) -> None:
    """BF16 data as JSON numbers (curl's way; tritonclient sends BF16 binary only): each
    rounded to the nearest bfloat16 and answered as JSON numbers; bad values a 400."""
    model = identity_name("BF16")
    sent = [[0.1, -2.5, 3.0e38], [1.0, 65504.0, 1e-3]]
    body = {"inputs": [{"name": "INPUT0", "shape": [2, 3], "datatype": "BF16", "data": sent}]}
    response = http.post(f"/v2/models/{model}/infer", json=body)
    assert response.status_code == 200, response.text
    (output,) = response.json()["outputs"]
    assert (output["datatype"], output["shape"]) == ("BF16", [2, 3])
    expected = np.array(sent, np.float32).astype(ml_dtypes.bfloat16)
    assert output["data"] == expected.astype(np.float32).ravel().tolist()
    assert output["data"][0] != 0.1  # rounded: 0.1 has no bfloat16 of its own
    body["inputs"][0]["data"] = [[0.1, "x", 1.0], [1.0, 2.0, 3.0]]
    assert_error(http.post(f"/v2/models/{model}/infer", json=body), 400, "INPUT0", "BF16")
    body["inputs"][0]["data"] = [[1e39, 0.0, 1.0], [1.0, 2.0, 3.0]]
    assert_error(http.post(f"/v2/models/{model}/infer", json=body), 400, "out of range", "BF16")


def test_bf16_over_grpc(server: RemoteServer, model_files: dict[str, Path]) -> None:
    """tritonclient.grpc's BF16 (ml_dtypes.bfloat16 arrays) in raw contents, both ways;
    the config reads back TYPE_BF16."""
    model = identity_name("BF16")
    x = _dtype_sample("BF16", binary=True)
    client = grpcclient.InferenceServerClient(server.grpc_address)
    try:
        config = client.get_model_config(model, as_json=True)["config"]
        assert config["input"][0]["data_type"] == "TYPE_BF16"
        tensor = grpcclient.InferInput("INPUT0", list(x.shape), "BF16")
        tensor.set_data_from_numpy(x)
        served = client.infer(model, [tensor]).as_numpy("OUTPUT0")
    finally:
        client.close()
    assert served.dtype == ml_dtypes.bfloat16
    assert_same(served, x)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_bytes_round_trip(
    client: httpclient.InferenceServerClient, model_files: dict[str, Path], binary: bool
) -> None:
    x = np.array([["hello", "", "naïve ☃"], ["a b", "0", "x" * 300]], dtype=object)
    x_bytes = np.vectorize(lambda s: s.encode(), otypes=[object])(x)
    result = client.infer(
        "identity_bytes",
        triton_inputs({"INPUT0": x_bytes}, "BYTES", binary=binary),
        outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)],
    )
    assert result.get_output("OUTPUT0")["datatype"] == "BYTES"
    served = result.as_numpy("OUTPUT0")
    as_bytes = [item if isinstance(item, bytes) else item.encode() for item in served.ravel()]
    assert served.shape == x.shape
    assert as_bytes == list(x_bytes.ravel())
    expected = run_onnx(model_files["identity_bytes"], {"INPUT0": x_bytes})["OUTPUT0"]
    assert [item.encode() for item in expected.ravel()] == as_bytes


def test_request_id_is_echoed(client: httpclient.InferenceServerClient) -> None:
    result = client.infer("add_sub", triton_inputs(add_sub_inputs()), request_id="req-42")
    assert result.get_response()["id"] == "req-42"
    plain = client.infer("add_sub", triton_inputs(add_sub_inputs()))
    assert "id" not in plain.get_response()


def test_requested_output_subset(
    client: httpclient.InferenceServerClient, model_files: dict[str, Path]
) -> None:
    inputs = add_sub_inputs(rows=2, seed=3)
    result = client.infer(
        "add_sub", triton_inputs(inputs), outputs=[httpclient.InferRequestedOutput("OUTPUT1")]
    )
    names = [output["name"] for output in result.get_response()["outputs"]]
    assert names == ["OUTPUT1"]
    assert result.as_numpy("OUTPUT0") is None
    expected = run_onnx(model_files["add_sub"], inputs)["OUTPUT1"]
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), expected)


def test_explicit_version_route(http: httpx.Client) -> None:
    inputs = add_sub_inputs()
    response = http.post("/v2/models/add_sub/versions/1/infer", content=infer_body(inputs))
    assert response.status_code == 200, response.text
    assert response.json()["model_version"] == "1"


# ---------------------------------------------------------------------------- broken model


def test_broken_model_is_unavailable_and_others_serve(
    client: httpclient.InferenceServerClient, http: httpx.Client
) -> None:
    index = {entry["name"]: entry for entry in client.get_model_repository_index()}
    broken = index["broken"]
    assert broken["state"] == "UNAVAILABLE"
    assert BROKEN_KEY in broken["reason"]
    expected_ready = {"add_sub", "fixed", *SLOW_MODELS, *map(identity_name, V2_TO_ONNX)}
    for name in expected_ready:
        assert index[name]["state"] == "READY", index[name]
    assert not client.is_model_ready("broken")

    response = http.post("/v2/models/broken/infer", content=infer_body(add_sub_inputs()))
    assert_error(response, 503, "broken", BROKEN_KEY)
    assert_error(http.get("/v2/models/broken"), 404, "broken")
    # The rest of the repository is unaffected.
    inputs = add_sub_inputs()
    served = client.infer("add_sub", triton_inputs(inputs)).as_numpy("OUTPUT0")
    np.testing.assert_array_equal(served, inputs["INPUT0"] + inputs["INPUT1"])


# ---------------------------------------------------------------------------- statistics, metrics


def test_statistics_count_requests(
    client: httpclient.InferenceServerClient, http: httpx.Client
) -> None:
    before = client.get_inference_statistics("identity_int16")["model_stats"][0]
    x = np.ones((2, 5), np.int16)
    for _ in range(3):
        client.infer("identity_int16", triton_inputs({"INPUT0": x}, "INT16"))
    after = client.get_inference_statistics("identity_int16")["model_stats"][0]
    assert after["name"] == "identity_int16"
    assert after["version"] == "1"
    assert after["inference_count"] == before["inference_count"] + 6
    assert 1 <= after["execution_count"] - before["execution_count"] <= 3
    success = after["inference_stats"]["success"]
    assert success["count"] == before["inference_stats"]["success"]["count"] + 3
    assert success["ns"] > before["inference_stats"]["success"]["ns"]
    assert after["last_inference"] >= before["last_inference"]
    assert any(b["batch_size"] == 2 for b in after["batch_stats"])
    # The server-wide form lists every loaded model version.
    every = http.get("/v2/models/stats").json()["model_stats"]
    assert {"identity_int16", "add_sub"} <= {s["name"] for s in every}
    assert "broken" not in {s["name"] for s in every}


def test_metrics_count_successes_and_bucket_latencies(
    client: httpclient.InferenceServerClient, http: httpx.Client
) -> None:
    labels = {"model": "identity_uint16", "version": "1"}
    success_before = metric(http, "slipstream_request_success_total", **labels)
    count_before = metric(http, "slipstream_request_duration_seconds_count", **labels)
    x = np.arange(6, dtype=np.uint16).reshape(2, 3)
    for _ in range(4):
        client.infer("identity_uint16", triton_inputs({"INPUT0": x}, "UINT16"))
    assert metric(http, "slipstream_request_success_total", **labels) == success_before + 4
    count = metric(http, "slipstream_request_duration_seconds_count", **labels)
    assert count == count_before + 4
    buckets = metric_samples(http, "slipstream_request_duration_seconds_bucket", **labels)
    assert len(buckets) > 5
    by_bound = sorted((float(b.labels["le"]), b.value) for b in buckets)
    values = [value for _, value in by_bound]
    assert values == sorted(values), "histogram buckets must be cumulative"
    assert by_bound[-1] == (float("inf"), count)
    assert metric(http, "slipstream_inference_count_total", **labels) >= 8
    assert metric(http, "slipstream_execution_count_total", **labels) >= 1


def test_metrics_count_bad_requests(http: httpx.Client) -> None:
    labels = {"model": "identity_int8", "version": "1", "reason": "bad_request"}
    before = metric(http, "slipstream_request_failure_total", **labels)
    body = orjson.dumps(
        {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "INT16", "data": [1]}]}
    )
    assert_error(http.post("/v2/models/identity_int8/infer", content=body), 400, "INPUT0")
    assert metric(http, "slipstream_request_failure_total", **labels) == before + 1


# ---------------------------------------------------------------------------- bad requests


@dataclass(frozen=True)
class BadRequest:
    """One malformed inference request and how the server must answer it."""

    # Path after /v2/models/, e.g. "add_sub" or "add_sub/versions/7".
    path: str
    body: bytes
    status: int
    # Each must appear in the error message: the field, the value, what was expected.
    fragments: tuple[str, ...]
    headers: dict[str, str] = field(default_factory=dict)


def _tensor(name: str, shape: list[int], data: list[Any], datatype: str = "FP32") -> dict[str, Any]:
    return {"name": name, "shape": shape, "datatype": datatype, "data": data}


def _binary_tensor(name: str, size: int, datatype: str = "FP32") -> dict[str, Any]:
    shape = [1, ADD_SUB_WIDTH] if datatype == "FP32" else [1, 1]
    return {
        "name": name,
        "shape": shape,
        "datatype": datatype,
        "parameters": {"binary_data_size": size},
    }


_ROW = [0.5] * ADD_SUB_WIDTH
_ROW_BYTES = np.full(ADD_SUB_WIDTH, 0.5, np.float32).tobytes()
_INPUT0 = _tensor("INPUT0", [1, ADD_SUB_WIDTH], _ROW)
_INPUT1 = _tensor("INPUT1", [1, ADD_SUB_WIDTH], _ROW)


def _add_sub(*inputs: dict[str, Any], **fields: Any) -> bytes:
    return orjson.dumps({"inputs": list(inputs or (_INPUT0, _INPUT1)), **fields})


def _bad(path: str, body: bytes, status: int, *fragments: str) -> BadRequest:
    return BadRequest(path, body, status, fragments)


def _bad_binary(
    path: str,
    inputs: list[dict[str, Any]],
    payload: bytes,
    status: int,
    *fragments: str,
    header_length: int | None = None,
) -> BadRequest:
    header = orjson.dumps({"inputs": inputs})
    length = len(header) if header_length is None else header_length
    headers = {"Inference-Header-Content-Length": str(length)}
    return BadRequest(path, header + payload, status, fragments, headers)


BAD_REQUESTS: dict[str, BadRequest] = {
    "invalid_json": _bad("add_sub", b'{"inputs": [', 400, "not valid JSON"),
    "not_an_object": _bad("add_sub", b"[1, 2]", 400, "JSON object"),
    "no_inputs": _bad("add_sub", b"{}", 400, "inputs"),
    "id_not_a_string": _bad("add_sub", _add_sub(id=5), 400, "id", "5"),
    "unknown_model": _bad("no_such_model", _add_sub(), 404, "no_such_model"),
    "unknown_version": _bad("add_sub/versions/7", _add_sub(), 404, "add_sub", "7"),
    "non_numeric_version": _bad("add_sub/versions/latest", _add_sub(), 404, "latest"),
    "unknown_input": _bad(
        "add_sub",
        _add_sub(_INPUT0, _INPUT1, _tensor("BOGUS", [1, 1], [1.0])),
        400, "BOGUS", "INPUT0",
    ),
    "missing_input": _bad("add_sub", _add_sub(_INPUT0), 400, "INPUT1", "missing"),
    "duplicate_input": _bad("add_sub", _add_sub(_INPUT0, _INPUT0, _INPUT1), 400, "INPUT0"),
    "unsupported_datatype": _bad(
        "add_sub",
        _add_sub(_tensor("INPUT0", [1, 16], _ROW, "FLOAT32"), _INPUT1),
        400, "INPUT0", "FLOAT32",
    ),
    "wrong_datatype": _bad(
        "add_sub",
        _add_sub(_tensor("INPUT0", [1, 16], [1] * 16, "INT32"), _INPUT1),
        400, "INPUT0", "INT32", "FP32",
    ),
    "json_values_of_wrong_kind": _bad(
        "identity_int32",
        _add_sub(_tensor("INPUT0", [1, 2], [1.5, 2], "INT32")),
        400, "INPUT0", "INT32",
    ),
    "json_value_out_of_range": _bad(
        "identity_uint8",
        _add_sub(_tensor("INPUT0", [1, 2], [300, 2], "UINT8")),
        400, "INPUT0", "300", "UINT8",
    ),
    "wrong_shape": _bad(
        "add_sub",
        _add_sub(_tensor("INPUT0", [1, 8], [0.5] * 8), _INPUT1),
        400, "INPUT0", "[1, 8]", "[-1, 16]",
    ),
    "wrong_shape_non_batching": _bad(
        "fixed",
        _add_sub(_tensor("INPUT0", [1, 4], [0.5] * 4)),
        400, "INPUT0", "[1, 4]", "[2, 4]",
    ),
    "element_count_mismatch": _bad(
        "add_sub",
        _add_sub(_tensor("INPUT0", [1, 16], [0.5] * 3), _INPUT1),
        400, "INPUT0", "16 elements", "got 3",
    ),
    "batch_over_max_batch_size": _bad(
        "add_sub",
        _add_sub(*(_tensor(n, [65, 16], _ROW * 65) for n in ("INPUT0", "INPUT1"))),
        400, "INPUT0", "65", "max_batch_size",
    ),
    "batch_sizes_differ": _bad(
        "add_sub",
        _add_sub(_INPUT0, _tensor("INPUT1", [2, 16], _ROW * 2)),
        400, "INPUT1", "batch size 2",
    ),
    "header_length_beyond_body": _bad_binary(
        "add_sub", [_INPUT0, _INPUT1], b"", 400,
        "Inference-Header-Content-Length", "100000",
        header_length=100_000,
    ),
    "header_length_not_a_number": BadRequest(
        "add_sub", _add_sub(), 400, ("Inference-Header-Content-Length", "ten"),
        {"Inference-Header-Content-Length": "ten"},
    ),
    "binary_size_beyond_body": _bad_binary(
        "add_sub",
        [_binary_tensor("INPUT0", 64), _binary_tensor("INPUT1", 64)],
        _ROW_BYTES + _ROW_BYTES[:60],
        400, "INPUT1", "binary_data_size is 64", "60",
    ),
    "binary_size_wrong_for_shape": _bad_binary(
        "add_sub",
        [_binary_tensor("INPUT0", 32), _binary_tensor("INPUT1", 64)],
        _ROW_BYTES[:32] + _ROW_BYTES,
        400, "INPUT0", "binary_data_size is 32", "64 bytes",
    ),
    "binary_trailing_bytes": _bad_binary(
        "add_sub",
        [_binary_tensor("INPUT0", 64), _binary_tensor("INPUT1", 64)],
        _ROW_BYTES * 3,
        400, "binary", "192", "128",
    ),
    "binary_size_without_header": _bad(
        "add_sub",
        _add_sub(_binary_tensor("INPUT0", 64), _INPUT1),
        400, "INPUT0", "Inference-Header-Content-Length",
    ),
    "bytes_element_runs_past_its_tensor": _bad_binary(
        "identity_bytes",
        [_binary_tensor("INPUT0", 6, "BYTES")],
        struct.pack("<I", 10) + b"ab",
        400, "INPUT0", "BYTES",
    ),
    # ONNX string tensors hold text: bytes that are not UTF-8 are the client's error.
    "bytes_not_utf8_for_a_string_model": _bad_binary(
        "identity_bytes",
        [_binary_tensor("INPUT0", 6, "BYTES")],
        struct.pack("<I", 2) + b"\xff\xfe",
        400, "INPUT0", "UTF-8",
    ),
    "unknown_output": _bad(
        "add_sub", _add_sub(outputs=[{"name": "OUTPUT9"}]), 400, "OUTPUT9", "OUTPUT0"
    ),
    "duplicate_output": _bad(
        "add_sub", _add_sub(outputs=[{"name": "OUTPUT0"}] * 2), 400, "OUTPUT0", "more than once"
    ),
    "negative_priority": _bad(
        "add_sub", _add_sub(parameters={"priority": -1}), 400, "parameters.priority", "-1"
    ),
    "priority_not_an_integer": _bad(
        "add_sub", _add_sub(parameters={"priority": "high"}), 400, "parameters.priority", "high"
    ),
    "negative_timeout": _bad(
        "add_sub", _add_sub(parameters={"timeout": -5}), 400, "parameters.timeout", "-5"
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_refused_with_a_message_naming_the_field(
    http: httpx.Client, case: str
) -> None:
    bad = BAD_REQUESTS[case]
    response = http.post(f"/v2/models/{bad.path}/infer", content=bad.body, headers=bad.headers)
    assert_error(response, bad.status, *bad.fragments)
    # The server keeps serving after any bad request.
    good = http.post("/v2/models/add_sub/infer", content=_add_sub())
    assert good.status_code == 200, good.text


def test_unknown_model_metadata_is_404(http: httpx.Client) -> None:
    assert_error(http.get("/v2/models/no_such_model"), 404, "no_such_model")
    assert_error(http.get("/v2/models/no_such_model/config"), 404, "no_such_model")
    assert_error(http.get("/v2/models/add_sub/versions/9"), 404, "9")
    assert http.get("/v2/models/no_such_model/ready").status_code in (400, 404)


def test_body_over_limit_is_refused_from_content_length(http: httpx.Client) -> None:
    body = b"x" * (MAX_REQUEST_BYTES + 1)
    response = http.post("/v2/models/add_sub/infer", content=body)
    assert_error(response, 413, str(MAX_REQUEST_BYTES), "--max-request-bytes")
    # The connection and the server carry on.
    assert (
        http.post("/v2/models/add_sub/infer", content=infer_body(add_sub_inputs())).status_code
        == 200
    )


def test_oversized_content_length_is_refused_before_the_body_is_sent(
    server: RemoteServer,
) -> None:
    # Only the headers go out: a server that waited for the 100 MB body would never answer.
    head = (
        f"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: {server.http_address}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {100 * 1024 * 1024}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as sock:
        sock.sendall(head.encode())
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    status_line = reply.split(b"\r\n", 1)[0]
    assert status_line.startswith(b"HTTP/1.1 413"), reply[:500]


def test_chunked_body_over_limit_is_refused(http: httpx.Client) -> None:
    chunk = b"x" * (64 * 1024)

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit applies while reading
        for _ in range(MAX_REQUEST_BYTES // len(chunk) + 2):
            yield chunk

    response = http.post("/v2/models/add_sub/infer", content=chunks())
    assert_error(response, 413, str(MAX_REQUEST_BYTES), "--max-request-bytes")


def test_body_just_under_limit_is_served(http: httpx.Client) -> None:
    inputs = add_sub_inputs(rows=64, seed=4)
    tensors = [_binary_tensor(name, array.nbytes) for name, array in inputs.items()]
    for tensor, array in zip(tensors, inputs.values(), strict=True):
        tensor["shape"] = list(array.shape)
    header = orjson.dumps({"inputs": tensors})
    payload = b"".join(array.tobytes() for array in inputs.values())
    # Whitespace is valid JSON: pad the header so the body is 16 bytes under the limit.
    header += b" " * (MAX_REQUEST_BYTES - 16 - len(header) - len(payload))
    response = http.post(
        "/v2/models/add_sub/infer",
        content=header + payload,
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    assert response.status_code == 200, response.text


# ---------------------------------------------------------------------------- concurrency


def test_concurrent_good_and_bad_requests(server: RemoteServer) -> None:
    num_good = 64
    bad_requests = [
        bad for bad in BAD_REQUESTS.values() if bad.path in ("add_sub", "no_such_model")
    ]
    # In sending order: a good request's seed, or a bad request after every other good one.
    plan: list[int | BadRequest] = []
    for seed in range(num_good):
        plan.append(seed)
        if seed % 2 == 0 and seed // 2 < len(bad_requests):
            plan.append(bad_requests[seed // 2])
    assert len(plan) == num_good + len(bad_requests)

    async def run_all() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
        async with httpx.AsyncClient(
            base_url=server.http_url, timeout=CLIENT_TIMEOUT_S, limits=limits
        ) as session:
            requests = []
            for item in plan:
                if isinstance(item, BadRequest):
                    path, body, headers = item.path, item.body, item.headers
                else:
                    path, body, headers = "add_sub", infer_body(_seeded(item)), {}
                url = f"/v2/models/{path}/infer"
                requests.append(session.post(url, content=body, headers=headers))
            return await asyncio.gather(*requests)

    for item, response in zip(plan, asyncio.run(run_all()), strict=True):
        if isinstance(item, BadRequest):
            assert_error(response, item.status, *item.fragments)
            continue
        assert response.status_code == 200, response.text
        inputs = _seeded(item)
        outputs = {
            o["name"]: np.array(o["data"], np.float32).reshape(o["shape"])
            for o in response.json()["outputs"]
        }
        np.testing.assert_array_equal(outputs["OUTPUT0"], inputs["INPUT0"] + inputs["INPUT1"])
        np.testing.assert_array_equal(outputs["OUTPUT1"], inputs["INPUT0"] - inputs["INPUT1"])


def _seeded(seed: int) -> dict[str, np.ndarray]:
    """Good request ``seed`` of the concurrency test: 1 to 3 rows, so batches mix sizes."""
    return add_sub_inputs(rows=1 + seed % 3, seed=100 + seed)


# ---------------------------------------------------------------------------- queue behaviour


def pending_requests(http: httpx.Client, model: str) -> float:
    return metric(http, "slipstream_pending_requests", model=model, version="1")


def wait_pending(http: httpx.Client, model: str, count: int) -> None:
    """Wait until ``count`` requests of ``model`` wait in its queue."""
    wait_until(lambda: pending_requests(http, model) == count, f"{count} queued on {model}")


def test_dynamic_batching_forms_batches(
    server: RemoteServer, http: httpx.Client, gates: dict[str, Gate]
) -> None:
    model = "slow_batch"  # max_batch_size 8, no queue delay
    gate = gates[model]
    before = model_stats(http, model)
    dispatches_before = metric(http, "slipstream_batch_dispatch_total", model=model, version="1")
    first_run = len(gate.runs())
    xs = [slow_input(tag) for tag in range(8)]
    with sessions(server, len(xs)) as clients, ThreadPoolExecutor(len(xs)) as pool:
        with gate.closed():
            futures = [pool.submit(post_infer, clients[0], model, infer_body({"INPUT0": xs[0]}))]
            gate.wait_runs(first_run + 1)
            # Seven requests arrive while the first one runs: they wait, then share a batch.
            for session, x in zip(clients[1:], xs[1:], strict=True):
                futures.append(pool.submit(post_infer, session, model, infer_body({"INPUT0": x})))
            wait_pending(http, model, 7)
            # A queue that does not move shows as the age of its oldest request growing.
            age = metric(http, "slipstream_queue_oldest_age_seconds", model=model, version="1")
            assert age > 0
            wait_until(
                lambda: metric(http, "slipstream_queue_oldest_age_seconds", model=model,
                               version="1") > age,
                "the oldest queued request to age",
            )  # fmt: skip
        responses = [f.result() for f in futures]
    for x, response in zip(xs, responses, strict=True):
        assert response.status_code == 200, response.text
        (output,) = response.json()["outputs"]
        served = np.array(output["data"], np.float32).reshape(output["shape"])
        np.testing.assert_array_equal(served, x)
    first, second = gate.runs()[first_run:]
    assert first == [0.0]
    assert sorted(second) == [float(tag) for tag in range(1, 8)]
    after = model_stats(http, model)
    assert after["inference_count"] - before["inference_count"] == 8
    assert after["execution_count"] - before["execution_count"] == 2
    assert max(b["batch_size"] for b in after["batch_stats"]) == 7
    dispatches = metric(http, "slipstream_batch_dispatch_total", model=model, version="1")
    assert dispatches == dispatches_before + 2
    assert metric(http, "slipstream_queue_oldest_age_seconds", model=model, version="1") == 0


@pytest.mark.parametrize("source", ["request", "config"])
def test_queue_timeout_fails_a_request_that_never_runs(
    server: RemoteServer,
    client: httpclient.InferenceServerClient,
    http: httpx.Client,
    gates: dict[str, Gate],
    source: str,
) -> None:
    # slow_timeout has no default timeout (the request sets one); slow_deadline's
    # config.yaml sets default_timeout_microseconds.
    model = "slow_timeout" if source == "request" else "slow_deadline"
    gate = gates[model]
    labels = {"model": model, "version": "1", "reason": "timeout"}
    before = model_stats(http, model)
    timeouts_before = metric(http, "slipstream_request_failure_total", **labels)
    first_run = len(gate.runs())
    stuck = triton_inputs({"INPUT0": slow_input(1)})
    with sessions(server, 2) as (blocking, later), ThreadPoolExecutor(1) as pool:
        with gate.closed():
            body = infer_body({"INPUT0": slow_input(0)})
            blocker = pool.submit(post_infer, blocking, model, body)
            gate.wait_runs(first_run + 1)
            with pytest.raises(InferenceServerException) as info:
                client.infer(
                    model, stuck, timeout=QUEUE_TIMEOUT_US if source == "request" else None
                )
            # Failed while waiting, not after its turn came: the instance is still held.
            assert not blocker.done()
        assert blocker.result().status_code == 200
        # Requests run in arrival order: had the timed-out one stayed queued, it would run
        # before this one.
        assert post_infer(later, model, infer_body({"INPUT0": slow_input(2)})).status_code == 200
    assert info.value.status() == "503"
    assert "timed out" in str(info.value.message())
    assert gate.runs()[first_run:] == [[0.0], [2.0]]
    after = model_stats(http, model)
    assert after["inference_count"] == before["inference_count"] + 2
    assert after["execution_count"] == before["execution_count"] + 2
    failures = after["inference_stats"]["fail"]["count"]
    assert failures == before["inference_stats"]["fail"]["count"] + 1
    assert metric(http, "slipstream_request_failure_total", **labels) == timeouts_before + 1


def test_a_queue_timeout_over_grpc_is_unavailable_as_tritons(
    server: RemoteServer, gates: dict[str, Gate]
) -> None:
    """Triton answers a request that timed out in its queue UNAVAILABLE (its clients retry
    on that code); DEADLINE_EXCEEDED would read as the client's own deadline."""
    model = "slow_timeout"
    gate = gates[model]
    first_run = len(gate.runs())
    stuck = [grpcclient.InferInput("INPUT0", [1, GATED_WIDTH], "FP32")]
    stuck[0].set_data_from_numpy(slow_input(1))
    client = grpcclient.InferenceServerClient(server.grpc_address)
    with sessions(server, 1) as (blocking,), ThreadPoolExecutor(1) as pool:
        with gate.closed():
            blocker = pool.submit(
                post_infer, blocking, model, infer_body({"INPUT0": slow_input(0)})
            )
            gate.wait_runs(first_run + 1)
            with pytest.raises(InferenceServerException) as info:
                client.infer(model, stuck, timeout=QUEUE_TIMEOUT_US)
        assert blocker.result().status_code == 200
    client.close()
    assert info.value.status() == "StatusCode.UNAVAILABLE", info.value
    assert "timed out" in str(info.value.message())
    assert gate.runs()[first_run:] == [[0.0]]


def test_full_queue_refuses_with_retry_after(
    server: RemoteServer, http: httpx.Client, gates: dict[str, Gate]
) -> None:
    model = "slow_queue"  # max_batch_size 1, max_queue_size 2
    gate = gates[model]
    labels = {"model": model, "version": "1", "reason": "queue_full"}
    refused_before = metric(http, "slipstream_request_failure_total", **labels)
    first_run = len(gate.runs())
    with sessions(server, 3) as clients, ThreadPoolExecutor(3) as pool:
        with gate.closed():
            body = infer_body({"INPUT0": slow_input(0)})
            admitted = [pool.submit(post_infer, clients[0], model, body)]
            gate.wait_runs(first_run + 1)
            for tag in (1, 2):  # fill the queue, in a known order
                body = infer_body({"INPUT0": slow_input(tag)})
                admitted.append(pool.submit(post_infer, clients[tag], model, body))
                wait_pending(http, model, tag)
            # The queue is full: refused at once, while the gate still holds the instance
            # (a refusal that waited for a slot would hang here).
            refused = [
                post_infer(http, model, infer_body({"INPUT0": slow_input(tag)})) for tag in (3, 4)
            ]
            for response in refused:
                assert_error(response, 503, "queue is full", "2 requests waiting")
                assert int(response.headers["Retry-After"]) >= 1
        assert [f.result().status_code for f in admitted] == [200, 200, 200]
    assert gate.runs()[first_run:] == [[0.0], [1.0], [2.0]]
    refused_after = metric(http, "slipstream_request_failure_total", **labels)
    assert refused_after == refused_before + len(refused)


def test_a_priority_the_model_does_not_have_is_served_at_its_default_level(
    http: httpx.Client,
) -> None:
    """As Triton: one client's priority reaches models with other levels, or none (the
    batcher's tests show where in the queue it goes)."""
    assert post_infer(http, "add_sub", _add_sub(parameters={"priority": 5})).status_code == 200


def test_high_priority_requests_overtake_queued_low_priority_ones(
    server: RemoteServer, http: httpx.Client, gates: dict[str, Gate]
) -> None:
    model = "slow_priority"  # max_batch_size 1, priority_levels 2 (1 is the highest)
    gate = gates[model]
    first_run = len(gate.runs())
    # (tag, priority), in sending order: lows 11-13 are queued before highs 1-3.
    plan = [(11, 2), (12, 2), (13, 2), (1, 1), (2, 1), (3, 1)]

    def send(session: httpx.Client, tag: int, priority: int) -> int:
        body = infer_body({"INPUT0": slow_input(tag)}, parameters={"priority": priority})
        return post_infer(session, model, body).status_code

    with sessions(server, len(plan) + 1) as clients, ThreadPoolExecutor(len(plan) + 1) as pool:
        with gate.closed():
            futures = [pool.submit(send, clients[0], 0, 1)]
            gate.wait_runs(first_run + 1)
            for queued, (tag, priority) in enumerate(plan, 1):
                futures.append(pool.submit(send, clients[queued], tag, priority))
                wait_pending(http, model, queued)
        assert [f.result() for f in futures] == [200] * (len(plan) + 1)
    # Every high-priority request ran before any queued low-priority one; each level in
    # arrival order.
    runs = gate.runs()[first_run:]
    assert runs == [[0.0], [1.0], [2.0], [3.0], [11.0], [12.0], [13.0]], runs


def test_disconnected_client_request_is_never_run(
    server: RemoteServer, http: httpx.Client, gates: dict[str, Gate]
) -> None:
    model = "slow_cancel"  # max_batch_size 1: the second request must wait for the first
    gate = gates[model]
    labels = {"model": model, "version": "1", "reason": "cancelled"}
    before = model_stats(http, model)
    cancelled_before = metric(http, "slipstream_request_failure_total", **labels)
    first_run = len(gate.runs())
    body = infer_body({"INPUT0": slow_input(1)})
    raw = (
        f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: {server.http_address}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with sessions(server, 1) as (session,), ThreadPoolExecutor(1) as pool:
        with gate.closed():
            blocker = pool.submit(post_infer, session, model, infer_body({"INPUT0": slow_input(0)}))
            gate.wait_runs(first_run + 1)
            with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as sock:
                sock.sendall(raw)
                wait_pending(http, model, 1)
            # The client went away while its request waited: it leaves the queue.
            wait_until(
                lambda: (
                    metric(http, "slipstream_request_failure_total", **labels)
                    == cancelled_before + 1
                ),
                "the disconnected request to be counted as cancelled",
            )
            assert pending_requests(http, model) == 0
        assert blocker.result().status_code == 200
    # The model goes on serving, and only the blocker and this request ever ran.
    response = http.post(f"/v2/models/{model}/infer", content=infer_body({"INPUT0": slow_input(2)}))
    assert response.status_code == 200, response.text
    assert gate.runs()[first_run:] == [[0.0], [2.0]]
    after = model_stats(http, model)
    assert after["inference_count"] == before["inference_count"] + 2
    assert after["execution_count"] == before["execution_count"] + 2


def test_without_a_job_stream_prefer_async_is_answered_at_once_and_jobs_are_404(
    http: httpx.Client,
) -> None:
    # RFC 7240: a preference the server does not apply is ignored (no Preference-Applied).
    body = infer_body(add_sub_inputs())
    reply = http.post("/v2/models/add_sub/infer", content=body,
                      headers={"Prefer": "respond-async"})  # fmt: skip
    assert reply.status_code == 200 and "preference-applied" not in reply.headers
    for method, path in (("POST", "/v2/jobs"), ("GET", "/v2/jobs/any")):
        reply = http.request(method, path, content=body if method == "POST" else None)
        assert reply.status_code == 404, reply.text
        assert "--jobs-redis" in reply.json()["error"]
