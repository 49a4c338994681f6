"""What the transformers engine does per token and per step: outputs that pile up while
the event loop is busy stream as one step, text decodes straight through the Rust
tokenizer, and sampling processors that no row of a step needs do nothing."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from slipstream.config import GenerationSettings
from slipstream.llm import sampling
from slipstream.llm.engine import EngineStep, SamplingParams
from slipstream.llm.hf import TransformersEngine, _Mailbox, load_transformers_engine
from tests.llm_models import write_tiny_llama_shape


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TransformersEngine]:
    directory = tmp_path_factory.mktemp("shape")
    write_tiny_llama_shape(directory)
    settings = GenerationSettings(load_format="dummy", num_blocks=16, block_size=16)
    loaded = load_transformers_engine(Path(directory), settings)
    try:
        yield loaded
    finally:
        loaded._manager.stop(block=True)


# -- delivery ------------------------------------------------------------------------------


async def test_outputs_delivered_while_the_loop_is_busy_stream_as_one_step(
    engine: TransformersEngine,
) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = engine.encode("The capital of France")
    alone = [t async for step in engine.generate(prompt, params) for t in step.token_ids]

    steps: list[EngineStep] = []
    stream = engine.generate(prompt, params)
    steps.append(await anext(stream))
    # The loop is blocked: the generation thread finishes the sequence meanwhile, and
    # every output it delivers waits on the loop for this coroutine.
    time.sleep(1.0)
    steps.extend([step async for step in stream])
    tokens = [t for step in steps for t in step.token_ids]
    assert tokens == alone
    assert len(steps) < len(tokens)
    assert steps[-1].finish_reason == "length"
    assert all(step.finish_reason is None for step in steps[:-1])
    assert not engine._manager.output_router.result_handlers


async def test_a_stream_closed_early_drops_its_result_handler(engine: TransformersEngine) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    stream = engine.generate(engine.encode("Hello"), params)
    await anext(stream)
    assert len(engine._manager.output_router.result_handlers) == 1
    await stream.aclose()
    assert not engine._manager.output_router.result_handlers


async def test_the_mailbox_hands_over_the_newest_output_once() -> None:
    mailbox = _Mailbox()
    assert mailbox.take() is None
    waiting = asyncio.create_task(mailbox.wait())
    await asyncio.sleep(0)
    mailbox.put("first")
    mailbox.put("second")
    await asyncio.wait_for(waiting, 1)
    assert mailbox.take() == "second"
    assert mailbox.take() is None


async def test_a_cancelled_wait_leaves_the_mailbox_usable() -> None:
    mailbox = _Mailbox()
    waiting = asyncio.create_task(mailbox.wait())
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    mailbox.put("after")  # no error setting a cancelled waiter
    assert mailbox.take() == "after"


# -- text ----------------------------------------------------------------------------------


def test_decode_goes_straight_to_the_rust_tokenizer_with_the_same_text(
    engine: TransformersEngine,
) -> None:
    assert engine._decode_ids is not None
    tokenizer = engine._tokenizer
    generator = torch.Generator().manual_seed(0)
    special = sorted(engine.eos_token_ids)
    for _ in range(50):
        ids = torch.randint(0, engine.vocab_size, (12,), generator=generator).tolist()
        ids = special + ids[:6] + special + ids[6:]
        assert engine.decode(ids) == tokenizer.decode(ids, skip_special_tokens=True)
        assert engine.decode(tuple(ids)) == engine.decode(ids)


# -- sampling processors -------------------------------------------------------------------


def _rows(*kwargs: dict[str, Any]) -> list[Any]:
    """Requests of one step as the manager hands them to ``prepare_tensor_args``."""
    return [
        SimpleNamespace(state=SimpleNamespace(logit_processor_kwargs=k, generated_len=lambda: 3))
        for k in kwargs
    ]


def _processors() -> list[Any]:
    manager = SimpleNamespace(
        logit_processor=SimpleNamespace(
            logits_processor=[], tensors_required=0, _retrieve_processors_kwargs=lambda: None
        )
    )
    sampling.install(manager, sampling.ExtrasRegistry())
    processors: list[Any] = manager.logit_processor.logits_processor
    return processors


def _step(processors: list[Any], requests: list[Any], scores: torch.Tensor) -> torch.Tensor:
    """prepare_tensor_args then __call__ of each processor, as the manager runs them."""
    storage = torch.zeros((len(processors), len(requests)), dtype=torch.int32)
    for row, processor in enumerate(processors):
        processor.fill_defaults(storage[row])
        arg = processor.prepare_tensor_args(requests)
        storage[row, : arg.size(0)] = arg
    for row, processor in enumerate(processors):
        scores = processor(scores, storage[row])
    return scores


def test_an_all_greedy_step_leaves_the_scores_to_the_engine_s_argmax() -> None:
    processors = _processors()
    greedy = sampling.sampling_kwargs(True, 0.0, 0, 1.0, None)
    requests = _rows(greedy, greedy, greedy)
    scores = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    before = scores.clone()
    out = _step(processors, requests, scores)
    assert all(not p.active for p in processors)
    assert all(p.prepare_tensor_args(requests).numel() == 0 for p in processors)
    assert torch.equal(out, before)


def test_a_mixed_step_samples_its_sampled_rows_and_leaves_greedy_rows_their_argmax() -> None:
    processors = _processors()
    greedy = sampling.sampling_kwargs(True, 0.0, 0, 1.0, None)
    top2 = sampling.sampling_kwargs(False, 0.7, 2, 1.0, 5)
    nucleus = sampling.sampling_kwargs(False, 1.0, 0, 0.5, 9)
    requests = _rows(greedy, top2, nucleus)
    scores = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    scores[2, 7] = 10.0  # one token holds nearly all of row 2's probability
    best = scores.argmax(dim=-1)
    top_two = set(scores[1].topk(2).indices.tolist())
    out = _step(processors, requests, scores.clone())
    picks = out.argmax(dim=-1)
    assert int(picks[0]) == int(best[0])
    assert int(picks[1]) in top_two
    assert int(picks[2]) == 7
    # Sampled rows are left with their chosen token the only possible one.
    assert all(int((out[row] > -math.inf).sum()) == 1 for row in (1, 2))
    # Seeded: the same step draws the same tokens.
    again = _step(_processors(), requests, scores.clone()).argmax(dim=-1)
    assert torch.equal(again, picks)


def test_a_temperature_is_applied_to_the_rows_that_set_it_only() -> None:
    temperature = next(p for p in _processors() if type(p).__name__ == "_Temperature")
    requests = _rows({"pick": -2}, {"pick": -1, "temperature": 0.5})
    arg = temperature.prepare_tensor_args(requests)
    assert temperature.active
    scores = torch.ones(2, 4)
    out = temperature(scores, arg)
    assert torch.equal(out[0], torch.ones(4)) and torch.equal(out[1], torch.full((4,), 2.0))


def test_min_p_cuts_what_transformers_min_p_warper_cuts_after_temperature() -> None:
    """vLLM's min_p, after temperature: row by row the same cut as transformers'
    MinPLogitsWarper on the tempered scores; a row without min_p is left whole."""
    from transformers.generation.logits_process import MinPLogitsWarper

    steps = {type(p).__name__: p for p in _processors()}
    temperature, min_p = steps["_Temperature"], steps["_MinP"]
    kwargs = [sampling.sampling_kwargs(False, 1.5, 0, 1.0, None, min_p=0.2),
              sampling.sampling_kwargs(False, 0.7, 0, 1.0, None, min_p=0.05),
              sampling.sampling_kwargs(False, 1.0, 0, 1.0, None)]  # fmt: skip
    requests = _rows(*kwargs)
    scores = torch.randn(3, 400, generator=torch.Generator().manual_seed(4)) * 3
    tempered = temperature(scores.clone(), temperature.prepare_tensor_args(requests))
    out = min_p(tempered.clone(), min_p.prepare_tensor_args(requests))
    for row, value in ((0, 0.2), (1, 0.05)):
        expected = MinPLogitsWarper(value)(None, tempered[row : row + 1].clone())[0]
        assert torch.equal(out[row] == -math.inf, expected == -math.inf)
        assert 1 < int((out[row] > -math.inf).sum()) < 400  # the cut does cut, not all
    assert torch.equal(out[2], tempered[2])
