"""The transformers engine checks its waiting queue after awaiting a request's grammar
matcher, with nothing awaited until the sequence counts as waiting: two constrained
requests whose matchers compile at the same time never both take the queue's last room."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slipstream.config import GenerationSettings
from slipstream.errors import Unavailable
from slipstream.llm.engine import SamplingParams
from slipstream.llm.hf import TransformersEngine, load_transformers_engine
from slipstream.types import Constraint
from tests.llm_models import write_tiny_llama_shape


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TransformersEngine]:
    directory = tmp_path_factory.mktemp("shape")
    write_tiny_llama_shape(directory)
    settings = GenerationSettings(
        load_format="dummy", num_blocks=16, block_size=16, max_queue_size=1
    )
    loaded = load_transformers_engine(Path(directory), settings)
    try:
        yield loaded
    finally:
        loaded._manager.stop(block=True)


async def test_requests_whose_matchers_compile_together_do_not_overfill_the_queue(
    engine: TransformersEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    both_compiling = asyncio.Barrier(2)

    async def slow_matcher(constraint: Constraint) -> Any:
        await both_compiling.wait()  # each request is past its start, neither is queued
        return None

    monkeypatch.setattr(engine._matchers, "new", slow_matcher)
    params = SamplingParams(max_tokens=4, temperature=0.0, constraint=Constraint("json_object"))
    prompt = engine.encode("Hello")

    async def first_step(stream: Any) -> Any:
        try:
            return await anext(stream)
        finally:
            await stream.aclose()

    outcomes = await asyncio.gather(
        first_step(engine.generate(prompt, params)),
        first_step(engine.generate(prompt, params)),
        return_exceptions=True,
    )
    refused = [o for o in outcomes if isinstance(o, Unavailable)]
    assert len(refused) == 1, outcomes
    assert "generation.max_queue_size 1" in refused[0].message
