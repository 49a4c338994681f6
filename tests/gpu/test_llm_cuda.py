"""The transformers engine on a CUDA GPU: weights, paged cache and batching on the
device, the same greedy tokens as the CPU, every sampling feature on device logits, and
a model too large for the GPU failing alone.

Skipped where torch sees no GPU (tests/gpu/conftest.py); ``make test-gpu`` runs them.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from slipstream.config import GenerationSettings
from slipstream.llm.engine import SamplingParams
from slipstream.llm.hf import TransformersEngine, load_transformers_engine
from tests.llm_models import build_tiny_llama, write_tiny_llama_shape
from tests.models import write_config
from tests.utils import RemoteServer

pytestmark = [pytest.mark.timeout(300)]

CACHE = {"num_blocks": 64, "block_size": 16}
# A Llama far beyond any GPU (200 layers of 16384: ~1.3 TB in bfloat16).
HUGE = {"hidden_size": 16384, "intermediate_size": 65536, "num_hidden_layers": 200,
        "num_attention_heads": 128, "num_key_value_heads": 8}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "hf")


async def greedy(engine: TransformersEngine, prompt: list[int], tokens: int) -> list[int]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    out: list[int] = []
    async for step in engine.generate(prompt, params):
        out.extend(step.token_ids)
    return out


async def test_weights_and_cache_sit_on_the_gpu_and_greedy_tokens_match_the_cpu(
    tiny_dir: Path,
) -> None:
    prompt = list(range(3, 40))
    answers = {}
    for device in ("cpu", "cuda"):
        settings = GenerationSettings(device=device, **CACHE)
        engine = load_transformers_engine(tiny_dir, settings)
        try:
            if device == "cuda":
                assert engine._model.device == torch.device("cuda", 0)
                processor = engine._manager.batch_processor
                assert processor.cache.cache_tensor.device == torch.device("cuda", 0)
            answers[device] = await greedy(engine, prompt, 8)
        finally:
            await engine.close()
    assert answers["cuda"] == answers["cpu"]


async def test_dummy_weights_are_built_on_the_gpu_in_bfloat16(tmp_path: Path) -> None:
    write_tiny_llama_shape(tmp_path)
    settings = GenerationSettings(device="cuda", dtype="bfloat16", load_format="dummy", **CACHE)
    engine = load_transformers_engine(tmp_path, settings)
    try:
        parameters = list(engine._model.parameters())
        assert {p.device for p in parameters} == {torch.device("cuda", 0)}
        assert {p.dtype for p in parameters} == {torch.bfloat16}
        assert len(await greedy(engine, [5, 6, 7], 10)) == 10
    finally:
        await engine.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    shape = tmp_path_factory.mktemp("shape")
    write_tiny_llama_shape(shape)
    repo = tmp_path_factory.mktemp("cuda-repo")
    for name in ("small", "huge"):
        shutil.copytree(shape, repo / name / "1")
        generation = {"device": "cuda", "dtype": "bfloat16", "load_format": "dummy", **CACHE}
        write_config(repo, name, {"backend": "transformers", "generation": generation})
    config = json.loads((repo / "huge" / "1" / "config.json").read_text())
    (repo / "huge" / "1" / "config.json").write_text(json.dumps({**config, **HUGE}))
    with RemoteServer(repo, log_dir=repo, startup_timeout_s=240) as running:
        yield running


def complete(server: RemoteServer, model: str, prompt: Any, **extra: Any) -> Any:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra}
    return server.http.post("/v1/completions", json=body, timeout=60)


@pytest.mark.parametrize(
    "extra",
    [{"ignore_eos": True},
     {"ignore_eos": True, "temperature": 0.8, "top_k": 20, "top_p": 0.9},
     {"ignore_eos": True, "temperature": 0.8, "seed": 7},
     {"ignore_eos": True, "frequency_penalty": 0.5, "presence_penalty": 0.3,
      "repetition_penalty": 1.2, "logit_bias": {"5": 3.0}},
     {"ignore_eos": True, "logprobs": 2}],
    ids=["greedy", "top-k-top-p", "seeded", "penalties", "logprobs"],
)  # fmt: skip
def test_every_sampling_feature_runs_on_gpu_logits(
    server: RemoteServer, extra: dict[str, Any]
) -> None:
    reply = complete(server, "small", [5, 17, 42, 99], **extra)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 8


def test_a_seed_gives_the_same_text_on_the_gpu(server: RemoteServer) -> None:
    extra = {"ignore_eos": True, "temperature": 0.9, "seed": 11}
    first = complete(server, "small", [5, 17, 42, 99], **extra).json()["choices"][0]["text"]
    again = complete(server, "small", [5, 17, 42, 99], **extra).json()["choices"][0]["text"]
    assert first == again


def test_a_grammar_constrains_gpu_generation(server: RemoteServer) -> None:
    reply = complete(server, "small", "Pick", guided_choice=["Paris", "Rome"], max_tokens=16)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] in ("Paris", "Rome")


def test_a_model_larger_than_the_gpu_fails_alone_and_the_other_serves(
    server: RemoteServer,
) -> None:
    entries = {e["name"]: e for e in server.http.post("/v2/repository/index", json={}).json()}
    assert entries["small"]["state"] == "READY"
    assert entries["huge"]["state"] == "UNAVAILABLE"
    assert entries["huge"]["reason"].startswith(
        "OutOfDeviceMemory: the model does not fit cuda:0 in bfloat16 (CUDA out of memory"
    )
    assert complete(server, "huge", "Hello").status_code == 503
    assert complete(server, "small", "Hello", ignore_eos=True).status_code == 200
