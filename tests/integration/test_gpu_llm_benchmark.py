"""benchmarks/gpu_llm.py cannot rot: its CPU mode (the tiny shape, the manager alone and
``slipstream serve``, token-id prompts streamed) runs end to end here, and its generated
tokenizer covers a Llama 3 vocabulary. The GPU run itself is made on a GPU host."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_llm.py"


@pytest.fixture(scope="module")
def gpu_llm() -> Iterator[ModuleType]:
    sys.path.insert(0, str(SCRIPT.parent))  # the script imports benchmarks/servers.py
    before = set(sys.modules)
    spec = importlib.util.spec_from_file_location("gpu_llm", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_llm"] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        for name in set(sys.modules) - before:  # servers, models: benchmarks/ modules
            if str(SCRIPT.parent) in str(getattr(sys.modules[name], "__file__", "") or ""):
                del sys.modules[name]
        sys.modules.pop("gpu_llm", None)
        sys.path.remove(str(SCRIPT.parent))


def test_the_cpu_mode_measures_both_sides_with_every_token_asked(tmp_path: Path) -> None:
    out = tmp_path / "gpu_llm.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--shapes", "tiny", "--requests", "4",
         "--prompt-tokens", "16", "--output-tokens", "8", "--json", str(out),
         "--log-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=200, check=False, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())["results"]["tiny"]
    assert result["alone"]["output_tokens"] == 4 * 8
    served = result["served"][""]
    assert served["output_tokens"] == 4 * 8
    assert served["served_over_alone"] == pytest.approx(
        served["output_tokens_per_s"] / result["alone"]["output_tokens_per_s"]
    )
    assert served["extra"]["ttft_p50_s"] > 0
    generation = result["generation"]
    assert (generation["load_format"], generation["device"]) == ("dummy", "cpu")
    assert "served/alone" in done.stdout and "tiny" in done.stdout.splitlines()[-1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA")
def test_without_cuda_it_exits_saying_how_to_run_the_cpu_check(
    gpu_llm: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    # main() in this process: a subprocess spent 4 s importing torch to say this.
    assert gpu_llm.main(["--shapes", "tiny"]) == 2
    stderr = capsys.readouterr().err
    assert "sees no CUDA device" in stderr and "--device cpu --shapes tiny" in stderr


def test_the_generated_tokenizer_spans_llama_3_s_vocabulary(
    gpu_llm: ModuleType, tmp_path: Path
) -> None:
    tokenizer = gpu_llm.write_tokenizer(tmp_path, 128256)
    assert len(tokenizer) == 128256
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (128254, 128255)
    # Every id the random model can emit decodes to text, as a real tokenizer's would.
    for token_id in (300, 9000, 64000, 128253):
        assert tokenizer.decode([token_id]).strip()
    assert tokenizer.decode(tokenizer.encode("Hello, world")) == "Hello, world"


def test_the_shapes_are_the_model_cards(gpu_llm: ModuleType) -> None:
    one, eight = gpu_llm.SHAPES["1b"], gpu_llm.SHAPES["8b"]
    assert (one["hidden_size"], one["num_hidden_layers"], one["intermediate_size"]) == (
        2048, 16, 8192)  # fmt: skip
    assert (eight["hidden_size"], eight["num_hidden_layers"], eight["intermediate_size"]) == (
        4096, 32, 14336)  # fmt: skip
    for shape in (one, eight):
        assert (shape["vocab_size"], shape["num_key_value_heads"]) == (128256, 8)
        assert shape["rope_scaling"]["rope_type"] == "llama3"


def test_the_cache_holds_every_request_at_once(gpu_llm: ModuleType) -> None:
    args = gpu_llm.parse_args(["--requests", "256"])
    settings = gpu_llm.generation_settings(args)
    tokens_each = args.prompt_tokens + args.output_tokens
    assert settings["num_blocks"] * settings["block_size"] >= 256 * tokens_each
    assert settings["max_num_seqs"] == 256 and settings["max_queue_size"] >= 256
    assert (settings["device"], settings["dtype"]) == ("cuda", "bfloat16")
