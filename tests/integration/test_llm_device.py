"""generation.device, dtype and load_format against a real server.

One server holds four transformers models: a Llama shape with random weights
(``load_format: dummy``, no weight file in its directory) in bfloat16, the same on
``device: cuda``, one whose KV cache cannot fit the host, and one on a CUDA device
index no host has. The dummy model must answer /v1/completions end to end; the models
that cannot load must each fail alone, with a reason that names the fix, while the
server stays ready and the others serve.

On a host with CUDA, ``on_cuda`` loads instead; tests/gpu/test_llm_cuda.py checks the
GPU path itself.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.llm_models import write_tiny_llama_shape
from tests.models import write_config
from tests.utils import RemoteServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

CUDA = torch.cuda.is_available()
SHAPE = {"load_format": "dummy", "num_blocks": 64, "block_size": 16}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    shape = tmp_path_factory.mktemp("shape")
    write_tiny_llama_shape(shape)
    repo = tmp_path_factory.mktemp("device-repo")
    generation: dict[str, dict[str, Any]] = {
        "dummy": {**SHAPE, "dtype": "bfloat16"},
        "on_cuda": {**SHAPE, "dtype": "bfloat16", "device": "cuda"},
        # 8 KiB a block (see test_llm_hf_device): 2**31 blocks are 16 TiB.
        "too_big": {**SHAPE, "num_blocks": 2**31},
        "no_such_gpu": {**SHAPE, "device": "cuda:99"},
    }
    for name, settings in generation.items():
        shutil.copytree(shape, repo / name / "1")
        write_config(repo, name, {"backend": "transformers", "generation": settings})
    with RemoteServer(repo, log_dir=repo) as running:
        yield running


def index(server: RemoteServer) -> dict[str, tuple[str, str, str]]:
    reply = server.http.post("/v2/repository/index", json={})
    assert reply.status_code == 200, reply.text
    entries = reply.json()
    return {e["name"]: (e.get("version", ""), e["state"], e.get("reason", "")) for e in entries}


def complete(server: RemoteServer, model: str, prompt: Any, **extra: Any) -> Any:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, **extra}  # fmt: skip
    return server.http.post("/v1/completions", json=body, timeout=60)


def test_the_dummy_model_is_ready_and_listed(server: RemoteServer) -> None:
    assert index(server)["dummy"][:2] == ("1", "READY")
    served = [m["id"] for m in server.http.get("/v1/models").json()["data"]]
    assert "dummy" in served and "too_big" not in served


def test_the_dummy_model_completes_a_text_prompt(server: RemoteServer) -> None:
    reply = complete(server, "dummy", "The capital of France is")
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert answer["usage"]["completion_tokens"] == 8
    assert answer["choices"][0]["finish_reason"] == "length"
    assert isinstance(answer["choices"][0]["text"], str)


def test_the_dummy_model_streams_a_token_id_prompt(server: RemoteServer) -> None:
    usage = None
    with server.http.stream(
        "POST", "/v1/completions",
        json={"model": "dummy", "prompt": [5, 17, 42, 99], "max_tokens": 6, "temperature": 0,
              "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}},
        timeout=60,
    ) as reply:  # fmt: skip
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    assert usage == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}


def test_greedy_dummy_completions_are_deterministic_within_a_load(server: RemoteServer) -> None:
    first = complete(server, "dummy", [1, 2, 3, 4, 5]).json()["choices"][0]["text"]
    again = complete(server, "dummy", [1, 2, 3, 4, 5]).json()["choices"][0]["text"]
    assert first == again


def test_the_dummy_model_follows_a_grammar(server: RemoteServer) -> None:
    reply = complete(server, "dummy", "Pick", guided_choice=["Paris", "Rome"], max_tokens=16,
                     ignore_eos=False)  # fmt: skip
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] in ("Paris", "Rome")


@pytest.mark.skipif(CUDA, reason="this host has CUDA: on_cuda loads (tests/gpu/test_llm_cuda.py)")
def test_cuda_on_a_host_without_it_fails_that_model_alone(server: RemoteServer) -> None:
    _version, state, reason = index(server)["on_cuda"]
    assert state == "UNAVAILABLE"
    assert "generation.device: 'cuda'" in reason and "sees no CUDA device" in reason
    assert "set device: cpu" in reason
    refused = complete(server, "on_cuda", "Hello")
    assert refused.status_code == 503
    assert "sees no CUDA device" in refused.json()["error"]["message"]
    assert server.http.get("/v2/health/ready").status_code == 200
    assert complete(server, "dummy", "Hello").status_code == 200


def test_a_cache_too_large_for_the_host_fails_that_model_alone(server: RemoteServer) -> None:
    _version, state, reason = index(server)["too_big"]
    assert state == "UNAVAILABLE"
    assert reason.startswith("OutOfDeviceMemory: the model does not fit cpu in float32")
    assert "lower generation.num_blocks (2147483648 blocks of 16 tokens)" in reason
    assert complete(server, "too_big", "Hello").status_code == 503
    assert complete(server, "dummy", "Hello").status_code == 200


def test_a_cuda_index_no_host_has_fails_that_model_alone(server: RemoteServer) -> None:
    _version, state, reason = index(server)["no_such_gpu"]
    assert state == "UNAVAILABLE" and "generation.device: 'cuda:99'" in reason
    assert server.http.get("/v2/health/ready").status_code == 200
