"""Generative models on a CUDA GPU (issue #12): transformers' continuous batching manager
alone against Slipstream serving the same model, in the same run on the same GPU.

    PYTHONPATH=src python3 benchmarks/gpu_llm.py --shapes 1b,8b --json gpu_llm.json

For each shape, a Llama-3.2-1B or Llama-3.1-8B ``config.json`` (the public model cards'
values) is written to a temporary directory beside a tokenizer, and built with random
weights in bfloat16 directly on the GPU (``load_format: dummy``; nothing is downloaded).
Then N requests (default 256) of P prompt token ids (default 128) each ask for O new
tokens (default 128, end of sequence ignored), all at once:

* **alone**: the ``ContinuousBatchingManager`` transformers ships, called in this
  process with the ``ContinuousBatchingConfig`` Slipstream's engine builds from the same
  ``generation:`` settings (``slipstream.llm.hf.continuous_batching_config``), on the
  model ``slipstream.llm.hf.build_model`` builds; greedy, results collected when done;
* **served**: ``slipstream serve`` on a repository holding that directory
  (``backend: transformers``, ``device: cuda``, ``dtype: bfloat16``, ``load_format:
  dummy``), the same prompts as token ids sent as N concurrent streamed
  ``/v1/completions`` (greedy, ``ignore_eos``) by an httpx client in this process.

Output tokens per second is N x O over the span from the first request to the last
token; each side first runs a short warm-up batch, not counted. The ratio served /
alone is issue #12's target (>= 0.9).

The tokenizer is generated (a byte-level BPE as large as the shape's vocabulary, 128,256
tokens for Llama 3, so every id the random model emits decodes to text as a real one
would); ``--tokenizer DIR`` copies a real one's files instead.

    python benchmarks/gpu_llm.py --device cpu --shapes tiny --requests 8 \\
        --prompt-tokens 16 --output-tokens 16     # the CPU check tests run (~10 s)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch
import yaml

from slipstream.config import GenerationSettings
from slipstream.llm.hf import build_model, continuous_batching_config, resolve_device

from servers import ServerSpec, free_port, running

ROOT = Path(__file__).resolve().parents[1]
MODEL = "llm"
_LLAMA3 = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
    "initializer_range": 0.02, "rms_norm_eps": 1e-05, "pretraining_tp": 1, "use_cache": True,
    "max_position_embeddings": 131072, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
    "vocab_size": 128256, "num_attention_heads": 32, "num_key_value_heads": 8,
}  # fmt: skip
# config.json of each shape: Llama-3.2-1B and Llama-3.1-8B as their model cards publish
# them; tiny is the tests' 2-layer Llama, for the CPU check.
SHAPES: dict[str, dict[str, Any]] = {
    "1b": {**_LLAMA3, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
           "head_dim": 64, "tie_word_embeddings": True,
           "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                            "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
    "8b": {**_LLAMA3, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
           "tie_word_embeddings": False,
           "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                            "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
    "tiny": {**_LLAMA3, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048,
             "max_position_embeddings": 4096, "tie_word_embeddings": True},
}  # fmt: skip
SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>")
WARMUP_REQUESTS = 8
WARMUP_TOKENS = 16


@dataclass
class Side:
    """One side's measurement: the median run of ``--repeats``."""

    output_tokens_per_s: float
    makespan_s: float
    output_tokens: int
    runs_tokens_per_s: list[float]
    extra: dict[str, Any] = field(default_factory=dict)


# -- the model directory -------------------------------------------------------------------


def write_tokenizer(directory: Path, vocab_size: int) -> Any:
    """A byte-level BPE of exactly ``vocab_size`` tokens (the last two special).

    The 256 byte symbols, then every printable ASCII pair, then triples..., each merge a
    known token and one character: built in about a second for 128,256 tokens, and any
    id decodes to 1-3 characters of text.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    characters = [chr(c) for c in range(0x21, 0x7F)] + ["\u0120"]  # printable, and space
    merges: list[tuple[str, str]] = []
    target = vocab_size - len(SPECIALS)
    frontier = characters
    while len(vocab) < target:
        grown = []
        for left in frontier:
            for right in characters:
                token = left + right
                if len(vocab) < target and token not in vocab:
                    vocab[token] = len(vocab)
                    merges.append((left, right))
                    grown.append(token)
        frontier = grown
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=SPECIALS[0], eos_token=SPECIALS[1]
    )
    assert len(tokenizer) == vocab_size, (len(tokenizer), vocab_size)
    tokenizer.save_pretrained(directory)
    return tokenizer


def write_model_dir(
    directory: Path, shape: str, tokenizer_dir: Path | None
) -> tuple[dict[str, Any], int]:
    """config.json of ``shape`` and tokenizer files in ``directory``: the config, and the
    tokenizer's size."""
    from transformers import AutoTokenizer

    directory.mkdir(parents=True, exist_ok=True)
    config = dict(SHAPES[shape])
    if tokenizer_dir is None:
        tokenizer = write_tokenizer(directory, config["vocab_size"])
    else:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        tokenizer.save_pretrained(directory)
    config["bos_token_id"] = tokenizer.bos_token_id
    config["eos_token_id"] = tokenizer.eos_token_id
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return config, len(tokenizer)


def generation_settings(args: argparse.Namespace) -> dict[str, Any]:
    """``generation:`` for N sequences of P + O tokens all at once."""
    block_size = 16
    per_sequence = -(-(args.prompt_tokens + args.output_tokens) // block_size) + 1
    return {
        "device": args.device, "dtype": args.dtype, "load_format": "dummy",
        "block_size": block_size, "num_blocks": per_sequence * args.requests,
        "max_num_seqs": args.requests, "max_batch_tokens": args.max_batch_tokens,
        "max_queue_size": max(256, 2 * args.requests),
        "default_max_tokens": args.output_tokens,
    }  # fmt: skip


def make_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts below the special tokens (no chat template, no text round trip)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(256, vocab - len(SPECIALS), (count, length), generator=generator)
    return [[int(t) for t in row] for row in ids]


def summarize(runs: list[tuple[float, int]], extra: dict[str, Any]) -> Side:
    """Median of (makespan, tokens) runs by throughput."""
    rates = [tokens / span for span, tokens in runs]
    median = sorted(range(len(runs)), key=rates.__getitem__)[len(runs) // 2]
    span, tokens = runs[median]
    return Side(rates[median], span, tokens, rates, extra)


# -- alone: the manager in this process ----------------------------------------------------


def run_alone(model_dir: Path, settings: GenerationSettings, prompts: list[list[int]],
              output_tokens: int, repeats: int) -> Side:  # fmt: skip
    from transformers import GenerationConfig

    device = resolve_device(settings.device)
    model = build_model(str(model_dir), settings, device)
    generation = GenerationConfig(  # type: ignore[no-untyped-call]
        do_sample=False, eos_token_id=-1, max_new_tokens=output_tokens
    )
    manager = model.init_continuous_batching(
        generation_config=generation,
        continuous_batching_config=continuous_batching_config(settings),
    )
    resolved = manager.continuous_batching_config
    # What transformers chose on this host (flash attention, graphs, async batching).
    extra = {"attn_implementation": model.config._attn_implementation,
             "use_cuda_graph": list(resolved.use_cuda_graph or ()),
             "use_async_batching": resolved.use_async_batching}  # fmt: skip
    manager.start()
    try:
        batch(manager, prompts[:WARMUP_REQUESTS], WARMUP_TOKENS)
        runs = [batch(manager, prompts, output_tokens) for _ in range(repeats)]
    finally:
        manager.stop(block=True)
    del manager, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return summarize(runs, extra)


def batch(manager: Any, prompts: list[list[int]], output_tokens: int) -> tuple[float, int]:
    """Submit every prompt at once, wait for all: (makespan s, output tokens)."""
    started = time.perf_counter()
    pending = {
        manager.add_request(prompt, max_new_tokens=output_tokens, eos_token_id=-1)
        for prompt in prompts
    }
    tokens = 0
    while pending:
        result = manager.get_result(timeout=600)
        if result is None:
            raise RuntimeError(f"the manager stopped with {len(pending)} requests unfinished")
        if result.error is not None:
            raise RuntimeError(f"request {result.request_id} failed: {result.error}")
        if result.is_finished() and result.request_id in pending:
            pending.discard(result.request_id)
            tokens += len(result.generated_tokens)
    return time.perf_counter() - started, tokens


# -- served: slipstream serve and a streaming client ----------------------------------------


async def stream_one(http: httpx.AsyncClient, prompt: list[int], tokens: int) -> tuple[float, int]:
    """One streamed completion: (seconds to its first token, completion tokens)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    sent = time.perf_counter()
    first = 0.0
    got = 0
    async with http.stream("POST", "/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"HTTP {reply.status_code}: {(await reply.aread())[:500]!r}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and not first:
                first = time.perf_counter()
            if chunk.get("usage"):
                got = chunk["usage"]["completion_tokens"]
    if got != tokens:
        raise RuntimeError(f"asked for {tokens} tokens, the stream's usage says {got}")
    return first - sent, got


async def drive(url: str, prompts: list[list[int]], output_tokens: int,
                repeats: int) -> tuple[list[tuple[float, int]], list[float]]:  # fmt: skip
    """Warm-up, then ``repeats`` rounds of every prompt at once: the runs and TTFTs."""
    limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        warm = prompts[:WARMUP_REQUESTS]
        await asyncio.gather(*(stream_one(http, p, WARMUP_TOKENS) for p in warm))
        runs, ttfts = [], []
        for _ in range(repeats):
            started = time.perf_counter()
            done = await asyncio.gather(*(stream_one(http, p, output_tokens) for p in prompts))
            runs.append((time.perf_counter() - started, sum(tokens for _, tokens in done)))
            ttfts = [ttft for ttft, _ in done]
    return runs, ttfts


def run_served(repo: Path, settings: dict[str, Any], prompts: list[list[int]],
               args: argparse.Namespace, serve_args: str, log: Path) -> Side:  # fmt: skip
    """``repo``: a repository whose model ``MODEL`` is the shape's directory (version 1)."""
    config = {"backend": "transformers", "generation": settings}
    (repo / MODEL / "config.yaml").write_text(yaml.safe_dump(config))
    port = free_port()
    argv = [sys.executable, "-c", "from slipstream.cli import main; main()", "serve",
            "--model-repository", str(repo), "--host", "127.0.0.1", "--http-port", str(port),
            "--grpc-port", "0", *shlex.split(serve_args)]  # fmt: skip
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    env = {"HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
    spec = ServerSpec("slipstream", argv, port, "/v2/health/ready", 600, env)
    with running(spec, None, log):
        check_ready(spec.url("/v2/repository/index"), log)
        runs, ttfts = asyncio.run(drive(spec.url(""), prompts, args.output_tokens,
                                        args.repeats))  # fmt: skip
    ordered = sorted(ttfts)
    extra = {"ttft_p50_s": statistics.median(ordered),
             "ttft_p99_s": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]}  # fmt: skip
    return summarize(runs, extra)


def check_ready(index_url: str, log: Path) -> None:
    """Ready means every load ended: fail with the reason if the model's did not work."""
    with httpx.Client() as http:
        entries = http.post(index_url, json={}).json()
    state = {e["name"]: (e["state"], e.get("reason", "")) for e in entries}.get(MODEL)
    if state is None or state[0] != "READY":
        raise RuntimeError(f"the served model did not load: {state} (server log: {log})")


# -- main ----------------------------------------------------------------------------------


def measure_shape(shape: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Alone, then each ``--serve-args`` layout served, on one shape."""
    repo = work / shape
    model_dir = repo / MODEL / "1"
    config, tokenizer_size = write_model_dir(model_dir, shape, args.tokenizer)
    settings = generation_settings(args)
    prompts = make_prompts(args.requests, args.prompt_tokens, tokenizer_size)
    print(f"[{shape}] alone: the manager in-process ...", flush=True)
    alone = run_alone(model_dir, GenerationSettings(**settings), prompts, args.output_tokens,
                      args.repeats)  # fmt: skip
    print(f"[{shape}] alone: {alone.output_tokens_per_s:,.0f} output tok/s "
          f"({alone.makespan_s:.1f} s)", flush=True)  # fmt: skip
    served: dict[str, Any] = {}
    for number, serve_args in enumerate(args.serve_args):
        log = args.log_dir / f"gpu_llm-serve-{shape}-{number}.log"
        print(f"[{shape}] served: slipstream serve {serve_args} (log: {log}) ...", flush=True)
        side = run_served(repo, settings, prompts, args, serve_args, log)
        ratio = side.output_tokens_per_s / alone.output_tokens_per_s
        print(f"[{shape}] served: {side.output_tokens_per_s:,.0f} output tok/s "
              f"({side.makespan_s:.1f} s), {ratio:.2f} of alone", flush=True)  # fmt: skip
        served[serve_args] = {**asdict(side), "served_over_alone": ratio}
    return {"alone": asdict(alone), "served": served, "generation": settings, "config": config}


def print_table(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    print()
    print(f"N={args.requests} requests x {args.prompt_tokens} prompt tokens -> "
          f"{args.output_tokens} output tokens (ignore_eos), "
          f"{args.dtype} on {args.device}")  # fmt: skip
    print(f"{'shape':<6} {'serve args':<16} {'alone tok/s':>12} {'served tok/s':>13} "
          f"{'served/alone':>13} {'TTFT p50':>9}")  # fmt: skip
    for shape, result in results.items():
        alone = result["alone"]["output_tokens_per_s"]
        for serve_args, served in result["served"].items():
            ratio = served["served_over_alone"]
            verdict = "met" if ratio >= 0.9 else "MISSED"
            ttft = served["extra"]["ttft_p50_s"]
            print(f"{shape:<6} {serve_args or '(default)':<16} {alone:>12,.0f} "
                  f"{served['output_tokens_per_s']:>13,.0f} {ratio:>13.2f} "
                  f"{ttft:>8.2f}s  (target >= 0.9: {verdict})")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1b,8b", help=f"comma list of {', '.join(SHAPES)}")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--max-batch-tokens", type=int, default=4096,
                        help="generation.max_batch_tokens, both sides")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=1, help="measured rounds; the median")
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (tiny check)")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, else float32")
    parser.add_argument("--tokenizer", type=Path, help="copy this tokenizer directory's files")
    parser.add_argument("--serve-args", action="append",
                        help='extra `slipstream serve` arguments, e.g. "--frontends 2"; give it '
                        "again to serve in several layouts (default: one, with none)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--log-dir", type=Path, default=ROOT / "benchmarks" / "results",
                        help="where the servers' logs go")  # fmt: skip
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.serve_args = args.serve_args or [""]
    unknown = set(args.shapes.split(",")) - set(SHAPES)
    if unknown:
        parser.error(f"--shapes: unknown {sorted(unknown)}; choose from {sorted(SHAPES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"gpu_llm.py: --device {args.device}, but torch {torch.__version__} sees no CUDA "
              "device on this host; run it on a GPU host, or check the script on the CPU with "
              "--device cpu --shapes tiny", file=sys.stderr)  # fmt: skip
        return 2
    import transformers

    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="gpu_llm-") as tmp:
        for shape in args.shapes.split(","):
            results[shape] = measure_shape(shape, args, Path(tmp))
    print_table(results, args)
    if args.json:
        device = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
        payload = {"results": results, "args": {k: str(v) for k, v in vars(args).items()},
                   "device": device, "torch": torch.__version__,
                   "transformers": transformers.__version__}  # fmt: skip
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
