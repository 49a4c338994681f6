"""The transformers engine's device, dtype and load format: where a model runs, what its
weights are, and how a load or a step that runs out of memory fails that model alone."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from slipstream.config import ConfigError, GenerationSettings
from slipstream.errors import InternalError, Unavailable
from slipstream.llm import hf
from slipstream.llm.api import Job
from slipstream.llm.engine import SamplingParams
from slipstream.llm.hf import OutOfDeviceMemory, TransformersEngine, load_transformers_engine
from slipstream.llm.service import LlmModels
from tests.llm_models import write_tiny_llama_shape
from tests.models import write_config

DUMMY = {"load_format": "dummy", "num_blocks": 16, "block_size": 16}


@pytest.fixture(scope="module")
def shape_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """config.json and tokenizer files of a 2-layer Llama; no weights."""
    directory = tmp_path_factory.mktemp("shape")
    write_tiny_llama_shape(directory)
    return directory


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# -- settings ----------------------------------------------------------------------------


def test_device_dtype_and_load_format_default_to_the_cpu_in_float32_from_the_weights() -> None:
    settings = GenerationSettings()
    assert (settings.device, settings.dtype, settings.load_format) == ("cpu", "float32", "auto")


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:0", "cuda:3"])
def test_cpu_cuda_and_numbered_cuda_devices_are_accepted(device: str) -> None:
    assert GenerationSettings(device=device).device == device


@pytest.mark.parametrize(
    ("field", "value"),
    [("device", "gpu"), ("device", "cuda:x"), ("device", "mps"), ("device", "cuda:"),
     ("dtype", "int8"), ("dtype", "half"), ("load_format", "pt")],
)  # fmt: skip
def test_unknown_devices_dtypes_and_load_formats_are_refused_naming_the_field(
    field: str, value: str
) -> None:
    with pytest.raises(ValidationError) as caught:
        GenerationSettings(**{field: value})
    assert caught.value.errors()[0]["loc"] == (field,)


# -- devices -----------------------------------------------------------------------------


def test_cpu_resolves_to_the_cpu() -> None:
    assert hf.resolve_device("cpu") == torch.device("cpu")


def test_cuda_on_a_host_without_cuda_fails_naming_the_setting_and_the_fix(no_cuda: None) -> None:
    with pytest.raises(ConfigError, match=r"generation\.device: 'cuda'.*sees no CUDA device.*"
                                          r"set device: cpu"):  # fmt: skip
        hf.resolve_device("cuda")


def test_a_cuda_index_beyond_the_host_s_devices_fails_listing_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"'cuda:2', but this host has 2 CUDA device\(s\): "
                                          r"cuda:0 to cuda:1"):  # fmt: skip
        hf.resolve_device("cuda:2")
    assert hf.resolve_device("cuda") == torch.device("cuda", 0)
    assert hf.resolve_device("cuda:1") == torch.device("cuda", 1)


def test_a_cuda_model_fails_before_its_tokenizer_or_weights_load(
    shape_dir: Path, no_cuda: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("loaded something for a device that is not there")

    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", never)
    with pytest.raises(ConfigError, match="sees no CUDA device"):
        load_transformers_engine(shape_dir, GenerationSettings(device="cuda", **DUMMY))


# -- dummy weights -----------------------------------------------------------------------


@pytest.fixture
def engine(shape_dir: Path) -> Iterator[TransformersEngine]:
    settings = GenerationSettings(dtype="bfloat16", max_num_seqs=4, **DUMMY)
    loaded = load_transformers_engine(shape_dir, settings)
    try:
        yield loaded
    finally:
        loaded._manager.stop(block=True)


def test_dummy_builds_the_config_s_shape_in_the_configured_dtype(
    engine: TransformersEngine, shape_dir: Path
) -> None:
    model = engine._model
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.dtype == torch.bfloat16 and model.device == torch.device("cpu")
    assert engine.vocab_size == 400 and len(model.model.layers) == 2
    # Random, not all zeros or ones: the weights were initialised as in training.
    weight = model.model.layers[0].mlp.up_proj.weight.float()
    assert 0.01 < float(weight.std()) < 0.05
    assert not any(p.requires_grad for p in model.parameters())
    assert not list(shape_dir.glob("*.safetensors"))


async def test_a_dummy_model_generates_what_is_asked(engine: TransformersEngine) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens: list[int] = []
    async for step in engine.generate(engine.encode("The capital of France"), params):
        tokens.extend(step.token_ids)
    assert len(tokens) == 12 and all(0 <= t < engine.vocab_size for t in tokens)


def test_dummy_needs_a_config_json_not_a_gguf_file(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ConfigError, match=r"load_format: dummy builds a model from a config\.json"):
        load_transformers_engine(gguf, GenerationSettings(load_format="dummy"))


# -- out of memory -----------------------------------------------------------------------


def test_a_cache_larger_than_the_device_fails_the_load_naming_the_settings(
    shape_dir: Path,
) -> None:
    # 2 layers x 2 kv heads x 16 dims x 2 (k, v) x 4 bytes x 16 tokens = 8 KiB a block:
    # 2**31 blocks ask 16 TiB, beyond any host; transformers refuses before allocating.
    settings = GenerationSettings(load_format="dummy", num_blocks=2**31)
    expected = r"does not fit cpu in float32 \(Memory footprint .*num_blocks \(2147483648 blocks"
    with pytest.raises(OutOfDeviceMemory, match=expected):
        load_transformers_engine(shape_dir, settings)


def test_cuda_out_of_memory_while_building_fails_the_load_with_the_allocator_s_reason(
    shape_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def out_of_memory(*_args: object, **_kwargs: object) -> None:
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 1.96 GiB. GPU 0 has a total capacity of "
            "139.72 GiB of which 1.02 GiB is free.\nOf the allocated memory ..."
        )

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_config", out_of_memory)
    with pytest.raises(OutOfDeviceMemory) as caught:
        load_transformers_engine(shape_dir, GenerationSettings(**DUMMY))
    message = str(caught.value)
    assert "CUDA out of memory. Tried to allocate 1.96 GiB" in message
    assert "Of the allocated memory" not in message  # the first line only
    assert "lower generation.num_blocks (16 blocks of 16 tokens)" in message


async def test_a_step_that_fails_ends_its_sequences_and_the_model_then_answers_503(
    engine: TransformersEngine,
) -> None:
    engine._model.forward = _out_of_memory
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with pytest.raises(InternalError, match="CUDA out of memory"):
        async for _step in engine.generate(engine.encode("Hello"), params):
            pass
    status = engine._manager.background_thread_status
    deadline = time.monotonic() + 10
    while status.fatal_error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.failure is not None and "CUDA out of memory" in engine.failure
    with pytest.raises(Unavailable, match=r"generation loop stopped after an error \(CUDA out "
                                          r"of memory.*load the model again"):  # fmt: skip
        engine.admit(3, 4)


async def test_a_model_whose_loop_died_is_listed_unavailable_until_loaded_again(
    shape_dir: Path, tmp_path: Path
) -> None:
    shutil.copytree(shape_dir, tmp_path / "llm" / "1")
    write_config(tmp_path, "llm", {"backend": "transformers", "generation": DUMMY})
    models = LlmModels(tmp_path, CollectorRegistry())
    await models.load_all()
    try:
        engine = models.engine("llm")
        assert isinstance(engine, TransformersEngine)
        engine._model.forward = _out_of_memory
        job = Job(0, [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
        with pytest.raises(InternalError):
            async for _delta in models.generate("llm", [job], time.perf_counter()):
                pass
        while engine.failure is None:
            await asyncio.sleep(0.01)
        (entry,) = models.index()
        assert (entry.version, entry.state) == ("1", "UNAVAILABLE")
        assert "CUDA out of memory" in entry.reason and "load the model again" in entry.reason
        assert models.models() == [] and models.index(ready_only=True) == []

        await models.load("llm")
        (entry,) = models.index()
        assert entry.state == "READY" and [name for name, _ in models.models()] == ["llm"]
        steps = [d async for _, d in models.generate("llm", [job], time.perf_counter())]
        assert steps[-1].completion_tokens == 4
    finally:
        await models.close()


def _out_of_memory(*_args: object, **_kwargs: object) -> None:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
