"""``slipstream serve --frontends 2``: two front-end processes and one engine process, driven
as users drive a server: tritonclient over HTTP and gRPC, the openai SDK, curl-like
httpx, Prometheus' /metrics; then the engine killed with -9 under load.

Each test opens fresh connections, so with SO_REUSEPORT the kernel spreads them over both
front ends; what the engine counts (statistics, the index, regions) is one view whatever
front end is asked.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import psutil
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.llm_models import smollm2_gguf
from tests.models import (
    ADD_SUB_WIDTH,
    add_sub_region,
    add_sub_region_inputs,
    build_add_constant,
    build_add_sub,
)
from tests.utils import RemoteServer, posts_during

FRONTENDS = 2


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    tmp = tmp_path_factory.mktemp("split")
    repo = tmp / "models"
    build_add_sub(repo)
    build_add_constant(repo, "plus", 1, 1.0)
    (repo / "smollm2" / "1").mkdir(parents=True)
    os.link(smollm2_gguf(), repo / "smollm2" / "1" / "model.gguf")
    (repo / "smollm2" / "config.yaml").write_text(
        "backend: llama_cpp\ngeneration: {max_model_len: 512, max_num_seqs: 4, threads: 1}\n"
    )
    args = ["--frontends", str(FRONTENDS), "--model-control-mode", "explicit",
            "--load-model", "add_sub", "--load-model", "smollm2", "--allow-client-shm"]  # fmt: skip
    with RemoteServer(repo, args, log_dir=tmp) as remote:
        yield remote


def add_sub_inputs(
    mod: object, rows: int, seed: int
) -> tuple[list[object], np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a, b = (rng.standard_normal((rows, ADD_SUB_WIDTH)).astype(np.float32) for _ in range(2))
    inputs = [mod.InferInput("INPUT0", [rows, ADD_SUB_WIDTH], "FP32"),
              mod.InferInput("INPUT1", [rows, ADD_SUB_WIDTH], "FP32")]  # fmt: skip
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs, a, b


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
def test_every_thread_of_the_engine_and_the_front_ends_runs_under_sched_batch(
    server: RemoteServer,
) -> None:
    """--cpu-scheduling batch, the default: ONNX Runtime's and grpcio's threads
    included (tests/unit/test_cpu_scheduling.py has the other policies)."""
    assert server.proc is not None
    children = [  # the engine and the front ends, not multiprocessing's resource tracker
        child
        for child in psutil.Process(server.proc.pid).children()
        if "resource_tracker" not in " ".join(child.cmdline())
    ]
    assert len(children) == FRONTENDS + 1, children
    for child in children:
        tids = [thread.id for thread in child.threads()]
        assert len(tids) > 2, tids
        assert {os.sched_getscheduler(tid) for tid in tids} == {os.SCHED_BATCH}, child
    assert os.sched_getscheduler(server.proc.pid) == os.SCHED_OTHER  # the supervisor


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_batches_of_every_size_through_both_front_ends(server: RemoteServer, protocol: str) -> None:
    mod = httpclient if protocol == "http" else grpcclient
    address = server.http_address if protocol == "http" else server.grpc_address
    for rows in range(1, 9):
        client = mod.InferenceServerClient(address)  # a new connection each time
        inputs, a, b = add_sub_inputs(mod, rows, rows)
        result = client.infer("add_sub", inputs)
        np.testing.assert_allclose(result.as_numpy("OUTPUT0"), a + b, rtol=1e-6)
        np.testing.assert_allclose(result.as_numpy("OUTPUT1"), a - b, rtol=1e-6)
        client.close()


def test_the_engine_counts_every_request_and_metrics_show_every_front_end(
    server: RemoteServer,
) -> None:
    before = httpclient.InferenceServerClient(server.http_address).get_inference_statistics(
        "add_sub"
    )["model_stats"][0]["inference_stats"]["success"]["count"]
    sent = 40
    for i in range(sent):
        with httpx.Client() as http:  # fresh connections: the kernel picks a front end
            body = {"inputs": [
                {"name": n, "shape": [1, ADD_SUB_WIDTH], "datatype": "FP32",
                 "data": [float(i)] * ADD_SUB_WIDTH} for n in ("INPUT0", "INPUT1")]}  # fmt: skip
            answer = http.post(server.url("/v2/models/add_sub/infer"), json=body)
            assert answer.status_code == 200, answer.text
            assert answer.json()["outputs"][0]["data"][0] == 2 * i
    after = httpclient.InferenceServerClient(server.http_address).get_inference_statistics(
        "add_sub"
    )["model_stats"][0]["inference_stats"]["success"]["count"]
    assert after - before == sent
    # Every front end's own series are in one scrape, each under its label.
    text = httpx.get(server.url("/metrics")).text
    frontends = set(re.findall(r'slipstream_http_connections_open\{frontend="(\d+)"\}', text))
    assert frontends == {str(i) for i in range(FRONTENDS)}, text[:2000]
    # The engine's series come once, without a front-end label.
    success = re.findall(r"slipstream_request_success_total\{([^}]*)\} (\S+)", text)
    add_sub = [(labels, float(value)) for labels, value in success if 'model="add_sub"' in labels]
    assert len(add_sub) == 1 and "frontend" not in add_sub[0][0]
    assert add_sub[0][1] >= after


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_metadata_config_index_and_errors_as_in_one_process(
    server: RemoteServer, protocol: str
) -> None:
    mod = httpclient if protocol == "http" else grpcclient
    client = mod.InferenceServerClient(
        server.http_address if protocol == "http" else server.grpc_address
    )
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("add_sub")
    metadata = (
        client.get_model_metadata("add_sub", as_json=True)
        if protocol == "grpc"
        else (client.get_model_metadata("add_sub"))
    )
    assert metadata["name"] == "add_sub"
    config = client.get_model_config("add_sub")
    assert "add_sub" in str(config)
    index = client.get_model_repository_index(**({"as_json": True} if protocol == "grpc" else {}))
    names = {entry["name"] for entry in (index["models"] if protocol == "grpc" else index)}
    assert {"add_sub", "plus", "smollm2"} <= names
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("no_such_model")
    assert "no_such_model" in str(info.value.message())
    inputs, _, _ = add_sub_inputs(mod, 2, 0)
    with pytest.raises(InferenceServerException) as info:
        client.infer("add_sub", inputs[:1])
    assert "INPUT1" in str(info.value.message())
    client.close()


def test_explicit_load_and_unload_are_seen_by_every_front_end(server: RemoteServer) -> None:
    grpc = grpcclient.InferenceServerClient(server.grpc_address)
    assert not grpc.is_model_ready("plus")
    grpc.load_model("plus")
    for _ in range(FRONTENDS * 3):  # fresh HTTP connections land on either front end
        assert httpx.get(server.url("/v2/models/plus/ready")).status_code == 200
    grpc.unload_model("plus")
    for _ in range(FRONTENDS * 3):
        assert httpx.get(server.url("/v2/models/plus/ready")).status_code == 400


def test_openai_requests_run_in_the_engine_streamed_or_not(server: RemoteServer) -> None:
    client = server.openai()
    assert "smollm2" in [model.id for model in client.models.list().data]
    whole = client.completions.create(
        model="smollm2", prompt="The capital of France is", max_tokens=6, temperature=0
    )
    streamed = client.completions.create(
        model="smollm2", prompt="The capital of France is", max_tokens=6, temperature=0,
        stream=True,
    )  # fmt: skip
    text = "".join(chunk.choices[0].text for chunk in streamed)
    assert text == whole.choices[0].text and whole.usage.completion_tokens == 6
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="absent", prompt="x", max_tokens=2)
    assert "absent" in str(info.value)


def test_a_client_leaving_a_stream_stops_its_sequence_in_the_engine(
    server: RemoteServer,
) -> None:
    body = {"model": "smollm2", "prompt": "Tell me a long story about", "max_tokens": 300,
            "stream": True, "ignore_eos": True}  # fmt: skip
    before = _generated_tokens(server)
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", server.url("/v1/completions"), json=body) as answer,
    ):
        events = (line for line in answer.iter_lines() if line.startswith("data:"))
        for _ in range(3):
            next(events)
    # The engine ends the sequence when the relay is cancelled; its tokens are counted then.
    deadline = time.monotonic() + 10
    while _generated_tokens(server) == before:
        assert time.monotonic() < deadline, "the sequence never ended"
        time.sleep(0.05)
    time.sleep(1.0)  # a sequence still running would add ~100 tokens a second here
    assert 3 <= _generated_tokens(server) - before < 60


def _generated_tokens(server: RemoteServer) -> float:
    text = httpx.get(server.url("/metrics")).text
    found = re.search(r'slipstream_llm_generation_tokens_total\{model="smollm2"\} (\S+)', text)
    return float(found.group(1)) if found else 0.0


def test_a_killed_engine_fails_in_flight_requests_with_503_then_serves_again(
    server: RemoteServer,
) -> None:
    """kill -9 of the engine under load: every request is answered (200, or 503 with
    Retry-After while it is away), none hangs, and the restarted engine serves, with the
    shared-memory regions registered and the models loaded before it died."""
    with add_sub_region("split_in") as (key, a, b):
        http = httpclient.InferenceServerClient(server.http_address)
        http.register_system_shared_memory("split_in", key, a.nbytes + b.nbytes)
        http.load_model("plus")  # explicit mode: loaded at run time, not at start
        _kill_the_engine_under_load(server)
        assert http.is_model_ready("plus")
        grpc = grpcclient.InferenceServerClient(server.grpc_address)
        assert [r.name for r in grpc.get_system_shared_memory_status().regions.values()] == [
            "split_in"
        ]
        inputs = add_sub_region_inputs("split_in", a, b)
        np.testing.assert_array_equal(grpc.infer("add_sub", inputs).as_numpy("OUTPUT0"), a + b)
        http.unregister_system_shared_memory()


def _kill_the_engine_under_load(server: RemoteServer) -> None:
    body = {"inputs": [
        {"name": n, "shape": [1, ADD_SUB_WIDTH], "datatype": "FP32",
         "data": [1.0] * ADD_SUB_WIDTH} for n in ("INPUT0", "INPUT1")]}  # fmt: skip

    def kill_and_wait() -> None:
        os.kill(server.engine_pids()[-1], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not (len(server.engine_pids()) > 1 and _ready(server)):
            assert time.monotonic() < deadline, "the engine was not restarted"
            time.sleep(0.1)

    url = server.url("/v2/models/add_sub/infer")
    outcomes, retry_after = posts_during(url, body, kill_and_wait)
    assert set(outcomes) <= {200, 503}, outcomes
    assert outcomes[503] > 0 and retry_after == {"1"}, (outcomes, retry_after)
    # The restarted engine loaded what explicit mode had loaded at start.
    inputs, a, b = add_sub_inputs(httpclient, 3, 9)
    result = httpclient.InferenceServerClient(server.http_address).infer("add_sub", inputs)
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), a + b, rtol=1e-6)


def _ready(server: RemoteServer) -> bool:
    try:
        return httpx.get(server.url("/v2/health/ready"), timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
