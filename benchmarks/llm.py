"""Generative serving on smollm2: continuous batching against its two baselines.

Prints ratios (a script, never a test). One Poisson trace of requests with mixed prompt
lengths (16-256 tokens) and output lengths (16-128 tokens, `ignore_eos` so every request
produces exactly what it asked for) is replayed, in one run, against:

1. **continuous**: `slipstream serve`, transformers' continuous batching over the paged
   KV cache (`max_num_seqs: 32`), through /v1/completions with streaming;
2. **one at a time**: the same server and model with `max_num_seqs: 1`;
3. **static**: fixed batches in-process (HF `generate()` on a left-padded batch of up
   to `--static-batch` requests that have arrived; each batch runs until its longest
   member is done, and late arrivals wait for the next batch).

For each: generated tokens/s (useful tokens over the makespan, first arrival to last
completion), TTFT p50/p99, end-to-end p50. Then the ratios the issue sets (continuous
/ one-at-a-time >= 2.5, continuous / static >= 1.5), KV-cache utilisation sampled from
/metrics during the continuous run (tokens held / token slots of the blocks handed out;
target >= 0.9), and single-stream decode tokens/s of the server beside an in-process
`generate()` loop (server overhead target < 10%).

Usage (from the repository root, after `make models`):
    .venv/bin/python benchmarks/llm.py                       # ~8 min on 2 cores
    .venv/bin/python benchmarks/llm.py --requests 12 --rate 0.5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor

from servers import ServerSpec, free_port, running

ROOT = Path(__file__).resolve().parents[1]
SENTENCES = ROOT / "benchmarks" / "data" / "sentences.txt"
GGUF = "model.gguf"
CONFIG = """\
backend: transformers
generation:
  block_size: 16
  num_blocks: 1024
  max_batch_tokens: 256
  max_num_seqs: {seqs}
  max_model_len: 2048
  threads: {threads}
"""


@dataclass(frozen=True)
class Request:
    arrival_s: float
    prompt_ids: list[int]
    max_tokens: int


@dataclass
class Outcome:
    ttft_s: float
    e2e_s: float
    tokens: int
    done_at_s: float  # since the trace started


@dataclass
class ModeResult:
    mode: str
    tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    e2e_p50_s: float
    makespan_s: float
    extra: dict[str, Any] = field(default_factory=dict)


def make_trace(tokenizer: Any, count: int, rate: float, seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    sentences = [s for s in SENTENCES.read_text().splitlines() if s.strip()]
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=count))
    arrivals -= arrivals[0]
    trace = []
    for arrival in arrivals:
        want = int(rng.integers(16, 257))
        ids: list[int] = []
        while len(ids) < want:
            ids += tokenizer.encode(" " + sentences[int(rng.integers(len(sentences)))])
        trace.append(Request(float(arrival), ids[:want], int(rng.integers(16, 129))))
    return trace


def summarize(mode: str, outcomes: list[Outcome], extra: dict[str, Any]) -> ModeResult:
    makespan = max(o.done_at_s for o in outcomes)
    ttfts = [o.ttft_s for o in outcomes]
    return ModeResult(
        mode=mode,
        tokens_per_s=sum(o.tokens for o in outcomes) / makespan,
        ttft_p50_s=float(np.percentile(ttfts, 50)),
        ttft_p99_s=float(np.percentile(ttfts, 99)),
        e2e_p50_s=float(np.percentile([o.e2e_s for o in outcomes], 50)),
        makespan_s=makespan,
        extra=extra,
    )


# -- served modes ------------------------------------------------------------------------


async def stream_one(
    http: httpx.AsyncClient, url: str, model: str, request: Request, start: float
) -> Outcome:
    await asyncio.sleep(max(0.0, start + request.arrival_s - time.perf_counter()))
    sent = time.perf_counter()
    body = {"model": model, "prompt": request.prompt_ids, "max_tokens": request.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    first = 0.0
    tokens = 0
    async with http.stream("POST", url + "/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{model}: HTTP {reply.status_code}: {await reply.aread()!r}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and not first:
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    done = time.perf_counter()
    if tokens != request.max_tokens:
        raise RuntimeError(f"{model}: asked for {request.max_tokens} tokens, got {tokens}")
    return Outcome(first - sent, done - sent, tokens, done - start)


async def replay(url: str, model: str, trace: list[Request]) -> tuple[list[Outcome], list[float]]:
    """Send the trace; also sample KV-cache utilisation from /metrics while it runs."""
    samples: list[float] = []
    async with httpx.AsyncClient(timeout=600) as http:

        async def sample() -> None:
            while True:
                text = (await http.get(url + "/metrics")).text
                used = _gauge(text, "slipstream_llm_kv_cache_blocks_used", model)
                if used > 0:
                    samples.append(_gauge(text, "slipstream_llm_kv_cache_utilization", model))
                await asyncio.sleep(0.5)

        sampler = asyncio.create_task(sample())
        start = time.perf_counter()
        try:
            outcomes = await asyncio.gather(
                *(stream_one(http, url, model, r, start) for r in trace)
            )
        finally:
            sampler.cancel()
    return list(outcomes), samples


def _gauge(text: str, name: str, model: str) -> float:
    match = re.search(rf'^{name}\{{model="{model}"\}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


async def single_stream(url: str, model: str, prompt_ids: list[int], tokens: int) -> float:
    """Decode tokens/s of one streamed request: (tokens - 1) / (e2e - ttft)."""
    async with httpx.AsyncClient(timeout=600) as http:
        outcome = await stream_one(http, url, model, Request(0.0, prompt_ids, tokens),
                                   time.perf_counter())  # fmt: skip
    return (tokens - 1) / (outcome.e2e_s - outcome.ttft_s)


# -- in-process modes --------------------------------------------------------------------


class FirstToken(LogitsProcessor):
    """Records when generate() asks for its first token (prefill done)."""

    def __init__(self) -> None:
        self.at = 0.0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if not self.at:
            self.at = time.perf_counter()
        return scores


def run_static(model: Any, tokenizer: Any, trace: list[Request], batch: int) -> ModeResult:
    pending = list(trace)
    outcomes: list[Outcome] = []
    sizes = []
    start = time.perf_counter()
    while pending:
        now = time.perf_counter() - start
        ready = [r for r in pending if r.arrival_s <= now][:batch]
        if not ready:
            time.sleep(pending[0].arrival_s - now)
            continue
        for r in ready:
            pending.remove(r)
        width = max(len(r.prompt_ids) for r in ready)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        ids = torch.tensor([[pad] * (width - len(r.prompt_ids)) + r.prompt_ids for r in ready])
        mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids)
                             for r in ready])  # fmt: skip
        longest = max(r.max_tokens for r in ready)
        first = FirstToken()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest,
                           min_new_tokens=longest, do_sample=False, pad_token_id=pad,
                           logits_processor=[first])  # fmt: skip
        done = time.perf_counter()
        sizes.append(len(ready))
        for r in ready:
            arrived = start + r.arrival_s
            outcomes.append(Outcome(first.at - arrived, done - arrived, r.max_tokens, done - start))
    return summarize(
        "static", outcomes, {"batches": len(sizes), "mean_batch": float(np.mean(sizes))}
    )


def generate_decode_rate(model: Any, prompt_ids: list[int], tokens: int) -> float:
    first = FirstToken()
    with torch.no_grad():
        started = time.perf_counter()
        model.generate(torch.tensor([prompt_ids]), max_new_tokens=tokens, min_new_tokens=tokens,
                       do_sample=False, logits_processor=[first])  # fmt: skip
        done = time.perf_counter()
    del started
    return (tokens - 1) / (done - first.at)


# -- main --------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=ROOT / "models")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals per second")
    parser.add_argument("--static-batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads, in-process and in the server"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    gguf = args.repo / "smollm2" / "1" / GGUF
    if not gguf.is_file():
        parser.error(f"{gguf} is missing: run `make models` first")

    if args.threads:
        torch.set_num_threads(args.threads)
    print("loading smollm2 in-process (GGUF -> float32) ...", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=GGUF, dtype=torch.float32)
    model.eval()
    trace = make_trace(tokenizer, args.requests, args.rate, args.seed)
    useful = sum(r.max_tokens for r in trace)
    print(f"trace: {len(trace)} requests over {trace[-1].arrival_s:.1f} s, prompts "
          f"{min(len(r.prompt_ids) for r in trace)}-{max(len(r.prompt_ids) for r in trace)} "
          f"tokens, outputs {min(r.max_tokens for r in trace)}-"
          f"{max(r.max_tokens for r in trace)} ({useful} in all)", flush=True)  # fmt: skip
    probe = trace[0].prompt_ids[:64]

    results: dict[str, ModeResult] = {}
    generate_rate = generate_decode_rate(model, probe, 64)  # warm-up
    generate_rate = generate_decode_rate(model, probe, 128)
    print(f"in-process generate(): {generate_rate:.1f} decode tokens/s", flush=True)
    results["static"] = run_static(model, tokenizer, trace, args.static_batch)
    print(f"static: {results['static']}", flush=True)
    del model

    # One server per mode, each holding one model: two engines in one process would
    # mean two generation threads with OpenMP pools, more threads than cores, and
    # libgomp then sleeps its workers between parallel regions (decode slows ~40%).
    server_rate = 0.0
    for mode, seqs in (("continuous", 32), ("serial", 1)):
        with tempfile.TemporaryDirectory() as tmp:
            repo = Path(tmp)
            (repo / mode / "1").mkdir(parents=True)
            os.link(gguf, repo / mode / "1" / GGUF)
            config = CONFIG.format(seqs=seqs, threads=args.threads)
            (repo / mode / "config.yaml").write_text(config)
            port = free_port()
            spec = ServerSpec(
                "slipstream",
                [str(ROOT / ".venv" / "bin" / "slipstream"), "serve", "--model-repository",
                 str(repo), "--host", "127.0.0.1", "--http-port", str(port), "--grpc-port", "0"],
                port, "/v2/health/ready", startup_timeout_s=300,
            )  # fmt: skip
            log = ROOT / "benchmarks" / "results" / f"llm-server-{mode}.log"
            with running(spec, None, log):
                url = spec.url("")
                if mode == "continuous":
                    asyncio.run(single_stream(url, mode, probe, 16))  # warm-up
                    server_rate = asyncio.run(single_stream(url, mode, probe, 128))
                    print(f"server single stream: {server_rate:.1f} decode tokens/s", flush=True)
                outcomes, samples = asyncio.run(replay(url, mode, trace))
                extra = {"kv_utilization_mean": statistics.fmean(samples) if samples else 0.0,
                         "kv_utilization_samples": len(samples)}  # fmt: skip
                results[mode] = summarize(mode, outcomes, extra)
                print(f"{mode}: {results[mode]}", flush=True)

    cont, serial, static = results["continuous"], results["serial"], results["static"]
    print()
    print(f"{'mode':<12} {'tokens/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'e2e p50':>9}")
    for r in (cont, serial, static):
        print(f"{r.mode:<12} {r.tokens_per_s:>9.1f} {r.ttft_p50_s:>8.2f}s {r.ttft_p99_s:>8.2f}s "
              f"{r.e2e_p50_s:>8.2f}s")  # fmt: skip
    ratios = {
        "continuous / one-at-a-time": (cont.tokens_per_s / serial.tokens_per_s, 2.5),
        "continuous / static": (cont.tokens_per_s / static.tokens_per_s, 1.5),
        "KV cache utilisation": (cont.extra["kv_utilization_mean"], 0.9),
        "server / generate() decode": (server_rate / generate_rate, 0.9),
    }
    print()
    for label, (value, target) in ratios.items():
        verdict = "met" if value >= target else "MISSED"
        print(f"{label:<28} {value:6.2f}  (target >= {target}: {verdict})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        trace_info = {"requests": len(trace), "rate": args.rate, "seed": args.seed}
        payload = {"results": {k: asdict(v) for k, v in results.items()},
                   "ratios": {k: v[0] for k, v in ratios.items()},
                   "generate_decode_tps": generate_rate, "server_decode_tps": server_rate,
                   "trace": trace_info}  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
