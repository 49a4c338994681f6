"""The llama.cpp engine's sequences, what one step reads of them, and the batches it fills.

A step reads the next token of each decoding sequence plus chunks of prompts still being
read (:func:`plan_reads`). llama.cpp applies a context's LoRA adapters to the whole of a
``llama_decode`` call, so the step's reads are split by adapter (:func:`adapter_groups`)
and each group is decoded on its own (:func:`fill_batch`), the context's adapters set
before it. Plain data and functions: the loop (:mod:`slipstream.llm.llamacpp_scheduler`)
owns the state.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from slipstream.llm.engine import EngineStep, SamplingParams
from slipstream.llm.llamacpp_sampling import SequenceSampler

# A step's cost besides its tokens, in tokens' worth (see _worth_packing): measured ~1.3
# for SmolLM2 on llama.cpp's CPU kernels; rounded up, so prompts of a token or two more
# than a step's decodes still pack.
_STEP_COST_TOKENS = 2


@dataclass(eq=False)
class LlamaSequence:
    """One request's sequence, from submission to its last token."""

    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[EngineStep | BaseException]
    slot: int = -1
    # Tokens whose keys and values are in the cache under this slot.
    cached: list[int] = field(default_factory=list)
    # The sampled token not yet fed back (its KV is written by the next step).
    pending: int = -1
    generated: int = 0
    sampler: SequenceSampler | None = None
    cancelled: bool = False
    # Counted in Scheduler.waiting_count(): submitted, not yet given a slot nor cancelled.
    queued: bool = False
    # The LoRA adapter it runs with: 1 + its index in LlamaRuntime.adapters; 0 for none.
    adapter: int = 0


@dataclass(frozen=True, slots=True)
class Read:
    """What one sequence reads in a step."""

    sequence: LlamaSequence
    # The part of its prompt, [start, end); start -1: its pending token (it is decoding).
    start: int = -1
    end: int = -1


@dataclass(frozen=True, slots=True)
class Output:
    """A sequence whose next token is sampled from the decoded batch."""

    sequence: LlamaSequence
    # Its row of logits in the batch.
    index: int


def plan_reads(running: list[LlamaSequence], budget: int) -> list[Read]:
    """The reads of one step of at most ``budget`` tokens, in sequence-id order: decoding
    sequences first (one token each), then prompt chunks in arrival order."""
    reads = [Read(sequence) for sequence in running if sequence.pending >= 0][:budget]
    count = decodes = len(reads)
    finishing = 0
    for sequence in running:
        if count >= budget:
            break
        if sequence.pending >= 0 or sequence.generated:
            continue
        start = len(sequence.cached)
        if finishing and not _worth_packing(
            len(sequence.prompt) - start, budget - count, finishing, decodes
        ):
            break
        end = min(len(sequence.prompt), start + budget - count)
        finishing += end == len(sequence.prompt)
        reads.append(Read(sequence, start, end))
        count += end - start
    # Into the batch in sequence-id order: with a KV stream per sequence, llama.cpp
    # splits a batch into one forward pass per run of consecutive ids (in batch order),
    # each reading every weight again; a shared cache takes the batch whole either way.
    reads.sort(key=lambda read: read.sequence.slot)
    return reads


def adapter_groups(reads: list[Read], turn: int) -> list[list[Read]]:
    """``reads`` split by LoRA adapter (0, the base model, included), each group decoded
    on its own. Every group runs in every step, so no adapter waits on another's
    sequences; the order rotates with ``turn`` so none always comes last."""
    groups: dict[int, list[Read]] = {}
    for read in reads:
        groups.setdefault(read.sequence.adapter, []).append(read)
    if len(groups) == 1:
        return list(groups.values())
    order = sorted(groups)
    first = turn % len(order)
    return [groups[adapter] for adapter in order[first:] + order[:first]]


def fill_batch(batch: Any, reads: list[Read]) -> list[Output]:
    """Write ``reads`` into the ``llama_batch`` (each sequence's cached tokens advance by
    what it reads); the sequences whose next token the decode's logits give."""
    outputs: list[Output] = []
    count = 0
    for read in reads:
        sequence = read.sequence
        if read.start < 0:
            _add(batch, count, sequence.pending, len(sequence.cached), sequence.slot, True)
            sequence.cached.append(sequence.pending)
            sequence.pending = -1
            outputs.append(Output(sequence, count))
            count += 1
            continue
        for position in range(read.start, read.end):
            last = position == len(sequence.prompt) - 1
            _add(batch, count, sequence.prompt[position], position, sequence.slot, last)
            if last:
                outputs.append(Output(sequence, count))
            count += 1
        sequence.cached.extend(sequence.prompt[read.start : read.end])
    batch.n_tokens = count
    return outputs


def _worth_packing(remaining: int, room: int, finishing: int, decodes: int) -> bool:
    """Whether a step that already ends ``finishing`` prompts should read the whole rest
    of another (``remaining`` tokens) as well, or leave it to the next step.

    On a CPU a step costs about ``a + b * tokens``: the per-token cost ``b`` dominates
    (SmolLM2 on this machine: ~5.6 ms a prompt token, ~7 ms a step besides, so
    ``a / b`` is about 1.3 tokens). Packing delays the first tokens of the prompts ending
    in this step by ``b * remaining`` each; waiting delays the other prompt's by the next
    step's own cost, ``a + b * (its decodes)``. So a short prompt joins (many short chats
    arriving together read in one step), a long one waits, and its first token comes one
    short step later instead of holding the others' back. A part of a prompt is never
    read after another prompt ends in the step: its own first token would come no sooner.
    """
    if remaining > room:
        return False
    next_decodes = decodes + finishing  # the step's decodes go on, and the prompts ending
    return finishing * remaining < _STEP_COST_TOKENS + next_decodes


def _add(batch: Any, index: int, token: int, position: int, slot: int, logits: bool) -> None:
    batch.token[index] = token
    batch.pos[index] = position
    batch.n_seq_id[index] = 1
    batch.seq_id[index][0] = slot
    batch.logits[index] = logits
