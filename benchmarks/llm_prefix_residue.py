"""What idle cached prefixes cost the llama.cpp engine's shared KV cache (a script).

With one KV cache shared by all sequences (`kv_streams: shared`, `make run`'s
`smollm2`), llama.cpp attends every token over the cells up to the highest one in use,
those of idle prefixes the prefix cache keeps included. Two parts:

1. **llama.cpp alone**: a decode step of 1 and of 4 sequences with and without 8,000
   cells of idle prefixes placed above them, flash attention as the engine runs it
   (llama.cpp's default, auto; `--flash-off` adds a run without it).
2. **The server**: `slipstream serve` with `make run`'s smollm2 config; C=1 output tok/s
   on a fresh server, right after 40 distinct 480-token prompts (which leave idle
   prefixes behind), and after 8 more ordinary requests. The engine drops an idle prefix
   nothing reused while it ran 2,048 tokens, so the last figure should be back near the
   first; without that the cache stays full of old prefixes (the code before: 0.69-0.73x).

    .venv/bin/python benchmarks/llm_prefix_residue.py           # ~4 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import llama_cpp as lib
from llama_step_order import context, load_model, put_token
from llm_llama_cpp import SLIPSTREAM

from models import REPO_ROOT
from servers import ServerSpec, free_port, running

RESIDUE_CELLS = 8_000


def _read(ctx: Any, batch: Any, sequence: int, tokens: int, rng: random.Random) -> int:
    position = 0
    while position < tokens:
        chunk = min(256, tokens - position)
        for i in range(chunk):
            put_token(batch, i, rng.randrange(1000, 20000), position + i, sequence, i == chunk - 1)
        batch.n_tokens = chunk
        assert lib.llama_decode(ctx, batch) == 0
        position += chunk
    return position


def _decode_ms(ctx: Any, batch: Any, positions: dict[int, int], sequences: list[int],
               rng: random.Random, steps: int = 12) -> float:  # fmt: skip
    times = []
    for _ in range(steps):
        for i, sequence in enumerate(sequences):
            put_token(batch, i, rng.randrange(1000, 20000), positions[sequence], sequence, True)
            positions[sequence] += 1
        batch.n_tokens = len(sequences)
        started = time.perf_counter()
        assert lib.llama_decode(ctx, batch) == 0
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times[2:])


def llama_alone(threads: int, flash_modes: tuple[str, ...]) -> None:
    print(f"1. llama.cpp alone: one shared cache of 16,384 cells, {threads} threads")
    model = load_model()
    for flash in flash_modes:
        ctx = context(model, 32, True, threads, flash=flash == "auto")  # 32 x 512 cells
        memory, batch = lib.llama_get_memory(ctx), lib.llama_batch_init(256, 0, 1)
        figures = {}
        for residue in (0, RESIDUE_CELLS):
            rng = random.Random(0)
            lib.llama_memory_clear(memory, True)
            positions = {s: _read(ctx, batch, s, 128, rng) for s in range(4)}
            for idle in range(0, residue, 1000):  # idle prefixes above the running ones
                _read(ctx, batch, 10 + idle // 1000, 1000, rng)
            figures[residue] = (_decode_ms(ctx, batch, positions, [0], rng),
                                _decode_ms(ctx, batch, positions, [0, 1, 2, 3], rng))  # fmt: skip
        for width, label in ((0, "1 sequence"), (1, "4 sequences")):
            bare, full = figures[0][width], figures[RESIDUE_CELLS][width]
            print(f"  flash attention {flash:<4} {label:<12} a step {bare:6.2f} ms, beside "
                  f"{RESIDUE_CELLS:,} idle cells {full:6.2f} ms: x{full / bare:.2f}")  # fmt: skip
        lib.llama_batch_free(batch)
        lib.llama_free(ctx)
    lib.llama_model_free(model)


def _bench(url: str, concurrency: int, requests: int, prompt: int, output: int, seed: int,
           work: Path) -> dict[str, Any]:  # fmt: skip
    out = work / f"bench-{seed}.json"
    argv = [SLIPSTREAM, "bench", url, "-m", "smollm2", "--protocol", "openai-completions",
            "--concurrency", str(concurrency), "--num-requests", str(requests),
            "--prompt-tokens", str(prompt), "--output-tokens", str(output), "--ignore-eos",
            "--seed", str(seed), "--json", str(out)]  # fmt: skip
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    level: dict[str, Any] = json.loads(out.read_text())["levels"][0]
    return level


def served(rounds: int) -> None:
    print("2. slipstream serve, make run's smollm2 (one shared cache), C=1, 128 tokens out")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        repo = work / "repo"
        subprocess.run([sys.executable, str(REPO_ROOT / "examples" / "build_models.py"),
                        str(repo), "--only", "smollm2"], check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        for round_ in range(rounds):
            port = free_port()
            argv = [SLIPSTREAM, "serve", "--model-repository", str(repo), "--http-port",
                    str(port), "--grpc-port", str(free_port())]  # fmt: skip
            spec = ServerSpec("slipstream", argv, port, "/v2/health/ready")
            log = REPO_ROOT / "benchmarks" / "results" / "work" / "logs" / "residue.log"
            with running(spec, None, log):
                url = spec.url("")
                seed = 100 * round_
                fresh = _bench(url, 1, 4, 64, 128, seed + 1, work)
                _bench(url, 4, 40, 480, 1, seed + 2, work)  # leaves 40 idle prefixes
                right_after = _bench(url, 1, 4, 64, 128, seed + 3, work)
                later = _bench(url, 1, 8, 64, 128, seed + 4, work)
            rates = [level["output_throughput_tok_per_s"] for level in (fresh, right_after, later)]
            print(f"  round {round_ + 1}: fresh {rates[0]:6.1f} tok/s, right after 40 other "
                  f"prompts {rates[1]:6.1f} (x{rates[1] / rates[0]:.2f}), 8 requests later "
                  f"{rates[2]:6.1f} (x{rates[2] / rates[0]:.2f})")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--flash-off", action="store_true",
                        help="part 1 without flash attention too (slow)")  # fmt: skip
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}")
    llama_alone(args.threads, ("auto", "off") if args.flash_off else ("auto",))
    served(args.rounds)
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
