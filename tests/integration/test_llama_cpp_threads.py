"""The llama.cpp engine's threads beside busy processes (``runtime/cpu_share.py``): real
llama.cpp, real neighbours spinning on every core, the host's own CPU pressure (PSI).

Automatic threads: a generation that starts with every core's thread gives threads up
once the neighbours crowd the cores. Threads set by the config stay as set. (The way
back up, once the cores are calm, is the governor's unit test: a test host is rarely
calm while the rest of the suite runs beside it.)
"""

from __future__ import annotations

import asyncio
import time

import pytest

from slipstream.config import GenerationSettings
from slipstream.llm.engine import SamplingParams
from slipstream.llm.llamacpp import LlamaCppEngine, load_llama_cpp_engine
from slipstream.runtime.base import usable_cpu_count
from slipstream.runtime.cpu_share import pressure_source
from tests.llm_models import smollm2_gguf

pytestmark = pytest.mark.skipif(
    usable_cpu_count() < 2 or pressure_source() is None,
    reason="needs 2 cores and the kernel's CPU pressure (PSI) to have threads to give up",
)

PROMPT = [504, 3468, 282, 260, 3725, 314, 1345, 30, 657, 253, 2397, 1117, 28, 5629, 288, 441]


def _engine(threads: int, adaptive: bool) -> LlamaCppEngine:
    settings = GenerationSettings(num_blocks=64, block_size=16, max_num_seqs=2,
                                  max_batch_tokens=32)  # fmt: skip
    engine = load_llama_cpp_engine(smollm2_gguf(), settings, threads, adaptive)
    assert isinstance(engine, LlamaCppEngine)
    return engine


async def _generate_until(engine: LlamaCppEngine, done: int, seconds: float) -> int:
    """Greedy tokens until the engine's thread count is ``done`` or ``seconds`` pass: the
    count at the end."""
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        steps = engine.generate(PROMPT, params)
        try:
            async for _ in steps:
                if engine.cache_stats().cpu_threads == done or time.monotonic() > deadline:
                    break
        finally:
            await steps.aclose()  # type: ignore[attr-defined]
        if engine.cache_stats().cpu_threads == done:
            break
    return engine.cache_stats().cpu_threads


def test_automatic_threads_give_way_to_busy_neighbours(neighbours: None) -> None:
    cores = usable_cpu_count()
    engine = _engine(cores, adaptive=True)
    try:
        assert engine.cache_stats().cpu_threads == cores
        assert asyncio.run(_generate_until(engine, 1, 30)) == 1
    finally:
        asyncio.run(engine.close())


def test_threads_set_by_the_config_stay(neighbours: None) -> None:
    cores = usable_cpu_count()
    engine = _engine(cores, adaptive=False)
    try:
        assert asyncio.run(_generate_until(engine, 1, 2)) == cores
    finally:
        asyncio.run(engine.close())
