"""What sampling costs an LLM server: output tok/s at OpenAI's defaults against greedy.

Prints ratios (a script, never a test). SmolLM2-135M-Instruct Q4_1 (a 49k vocabulary)
served by Slipstream (`backend: llama_cpp`, one thread) and by llama.cpp's own
`llama-server` (one thread, `--parallel` as the highest level; built once by
benchmarks/peers/llama_server.py), each pinned to core 0; the load, closed loops of
streamed `/v1/completions` from asyncio and httpx, on core 1. Each request: a prompt of
its own (~20 tokens), `--tokens` out with `ignore_eos`, and one of three samplings:

- `greedy`: `temperature: 0`;
- `default`: nothing but the model: OpenAI's defaults, temperature 1 over the whole
  vocabulary. llama-server would apply its own default top-k of 40 here, which is not
  OpenAI's meaning, so it is sent `top_k: 0` (no cut), as Slipstream needs none;
- `top_p`: `temperature: 0.7, top_p: 0.9`.

The samplings take turns (`--rounds` times); a figure is the median of its rounds. The
ratio printed is a sampling's tok/s over greedy's on the same server at the same level:
what choosing tokens costs beside computing the logits.

    .venv/bin/python benchmarks/llm_sampling.py                 # ~4 min on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from llm_llama_cpp import llama_server_spec, slipstream_spec

from servers import ServerSpec, running

ROOT = Path(__file__).resolve().parents[1]
SAMPLINGS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "default": {},
    "top_p": {"temperature": 0.7, "top_p": 0.9},
}
WORDS = [
    "river",
    "stone",
    "cloud",
    "lantern",
    "harbor",
    "meadow",
    "copper",
    "violet",
    "signal",
    "orchard",
]


def tok_per_s(url: str, sampling: str, label: str, level: int, args: argparse.Namespace,
              round_: int) -> float:  # fmt: skip
    """Output tokens per second of ``--requests`` requests, ``level`` at a time."""
    body = {"model": "smollm2", "max_tokens": args.tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **SAMPLINGS[sampling]}  # fmt: skip
    if label == "llama-server" and sampling != "greedy":
        body["top_k"] = 0

    async def run() -> float:
        tokens = 0
        queue = list(range(args.requests))

        async def worker(client: httpx.AsyncClient) -> None:
            nonlocal tokens
            while queue:
                index = queue.pop()
                prompt = " ".join(WORDS[(index * 7 + round_ * 3 + i) % len(WORDS)]
                                  for i in range(16)) + f" {round_}.{index}"  # fmt: skip
                async with client.stream("POST", f"{url}/v1/completions",
                                         json={**body, "prompt": prompt}) as reply:  # fmt: skip
                    reply.raise_for_status()
                    async for line in reply.aiter_lines():
                        if line.startswith("data: {"):
                            usage = json.loads(line[6:]).get("usage")
                            if usage:  # the last chunk's
                                tokens += usage["completion_tokens"]

        async with httpx.AsyncClient(timeout=300) as client:
            started = time.perf_counter()
            await asyncio.gather(*(worker(client) for _ in range(level)))
            return tokens / (time.perf_counter() - started)

    return asyncio.run(run())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,8")
    parser.add_argument("--requests", type=int, default=8, help="requests a level and sampling")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--servers", default="slipstream,llama-server")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs two cores: the server on one, the load on another")
    os.sched_setaffinity(0, {cores[1]})
    levels = [int(level) for level in args.levels.split(",")]
    print(f"load average at start: {os.getloadavg()}", flush=True)
    logs = ROOT / "benchmarks" / "results" / "work" / "logs"
    with tempfile.TemporaryDirectory() as tmp:
        specs: dict[str, ServerSpec] = {}
        for label in args.servers.split(","):
            if label == "slipstream":
                specs[label] = slipstream_spec(Path(tmp) / "repo", threads=1, prefix=False)
            else:
                specs[label] = llama_server_spec(threads=1, parallel=max(levels))
        for label, spec in specs.items():
            with running(spec, cores[0], logs / f"llm_sampling-{label}.log"):
                url = spec.url("")
                warm_up = argparse.Namespace(**{**vars(args), "requests": 2})
                tok_per_s(url, "greedy", label, 1, warm_up, -1)
                for level in levels:
                    rounds: dict[str, list[float]] = {name: [] for name in SAMPLINGS}
                    for round_ in range(args.rounds):
                        order = list(SAMPLINGS) if round_ % 2 == 0 else list(reversed(SAMPLINGS))
                        for name in order:
                            rounds[name].append(tok_per_s(url, name, label, level, args, round_))
                    greedy = statistics.median(rounds["greedy"])
                    for name, figures in rounds.items():
                        ratios = [figure / greedy for figure in figures]
                        print(f"{label:13s} C={level:<3d} {name:8s} "
                              f"{statistics.median(figures):7.1f} tok/s  "
                              f"x{statistics.median(ratios):.3f} of greedy "
                              f"(rounds {min(ratios):.3f}-{max(ratios):.3f})",
                              flush=True)  # fmt: skip
    print(f"load average at end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
