"""The llama.cpp engine's step loop: admission by KV budget, prefix reuse, one batch a step.

See :mod:`slipstream.llm.llamacpp` for the design; this module is the loop thread's
state and steps. Everything below ``Scheduler._lock`` belongs to the loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from slipstream.errors import InternalError, SlipstreamError, Unavailable
from slipstream.llm.engine import CacheStats, EngineStep, FinishReason
from slipstream.llm.llamacpp_step import (
    LlamaSequence,
    Output,
    Read,
    adapter_groups,
    fill_batch,
    plan_reads,
)

if TYPE_CHECKING:
    from slipstream.config import GenerationSettings
    from slipstream.runtime.cpu_share import ThreadGovernor

logger = logging.getLogger(__name__)

# With a KV stream per sequence, the shortest cached prefix worth reusing: a shorter one
# costs more than reading it again (a copy of the whole stream, or a slot away from the
# running sequences' ids: see Scheduler._stream_rank).
_MIN_STREAM_PREFIX = 16
# With one shared cache, how many tokens the engine may run past an idle cached prefix
# before it is dropped. Every token a step reads attends over every cell up to the
# highest one in use, idle prefixes' included (~0.1-0.45 us a cell and token for SmolLM2
# here, against ~4 ms a prompt token to read one again), so prefixes nobody asks for
# again would slow every step: a cache full of them cost make run's smollm2 about 30% of
# its single-stream decode (benchmarks/llm_prefix_residue.py). Counted in tokens run, not
# seconds: on an idle server a prefix (a chat's last turn) stays.
_IDLE_PREFIX_TOKENS = 2048


@dataclass(frozen=True)
class LlamaRuntime:
    """What the loop needs of a loaded model: llama.cpp's handles and the limits."""

    lib: Any
    context: Any
    memory: Any
    # The one llama_batch every step fills (capacity: settings.max_batch_tokens).
    batch: Any
    settings: GenerationSettings
    cache_tokens: int
    # LlamaSequence ids of the context (running sequences plus idle cached prefixes).
    slots: int
    is_end: Callable[[int], bool]
    # One KV stream per slot (each of cache_tokens / slots) instead of one shared cache.
    per_sequence: bool = False
    # Threads of the forward passes, the most where a governor changes them.
    threads: int = 1
    # Sets the forward passes' thread count as the host's load changes (None: fixed).
    governor: ThreadGovernor | None = None
    # The model's LoRA adapters (llama_adapter_lora pointers): LlamaSequence.adapter i
    # runs with adapters[i - 1], 0 with none.
    adapters: tuple[Any, ...] = ()


@dataclass
class _Slot:
    """A sequence id of the context: running a sequence, or idle holding a cached prefix."""

    index: int
    tokens: list[int] = field(default_factory=list)
    sequence: LlamaSequence | None = None
    # The LoRA adapter its cells were computed with: only a sequence of the same one may
    # reuse them (keys and values differ wherever an adapter changes a layer's input).
    adapter: int = 0
    # For least-recently-used eviction of idle slots.
    released_at: float = 0.0
    # The engine's tokens run when the slot went idle (see _IDLE_PREFIX_TOKENS).
    released_at_token: int = 0


class Scheduler:
    """The step loop and its state; every field below ``_lock`` is the loop thread's."""

    def __init__(self, engine: LlamaRuntime) -> None:
        self._engine = engine
        self._lib = engine.lib
        self._lock = threading.Condition()
        self._submitted: deque[LlamaSequence] = deque()
        self._cancelled: list[LlamaSequence] = []
        # Sequences with ``queued`` set. A count of its own, not the queues' lengths: a
        # cancelled sequence leaves it at once, though the loop thread takes it out of
        # _waiting only at its next iteration (until 2026-12, cancelled ones behind the
        # head stayed counted, and new requests got 503 for a queue of abandoned ones).
        self._queued = 0
        self.stopping = False
        self._waiting: deque[LlamaSequence] = deque()
        self._running: list[LlamaSequence] = []
        self._slots = [_Slot(i) for i in range(engine.slots)]
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._tokens_run = 0
        # The adapter set on the context, the steps run (whose count rotates the order of
        # a step's adapter groups), and each adapter's llama_set_adapters_lora arguments.
        self._adapter = 0
        self._turn = 0
        lib = engine.lib
        self._adapter_args: list[tuple[Any, int, Any]] = [(None, 0, None)]
        for handle in engine.adapters:
            handles = (lib.llama_adapter_lora_p_ctypes * 1)(handle)
            self._adapter_args.append((handles, 1, (ctypes.c_float * 1)(1.0)))

    # -- called from the event loop ------------------------------------------------------

    def submit(self, sequence: LlamaSequence) -> None:
        with self._lock:
            self._submitted.append(sequence)
            sequence.queued = True
            self._queued += 1
            self._lock.notify()

    def cancel(self, sequence: LlamaSequence) -> None:
        with self._lock:
            sequence.cancelled = True
            self._unqueue(sequence)
            self._cancelled.append(sequence)
            self._lock.notify()

    def stop(self) -> None:
        with self._lock:
            self.stopping = True
            self._lock.notify()

    def waiting_count(self) -> int:
        """Sequences submitted and not yet running, the cancelled ones not counted."""
        return self._queued

    def _unqueue(self, sequence: LlamaSequence) -> None:
        """Count ``sequence`` out of the waiting ones (once); the caller holds the lock."""
        if sequence.queued:
            sequence.queued = False
            self._queued -= 1

    def stats(self) -> CacheStats:
        """Cells of running sequences count as used; an idle slot's cached prefix counts as
        free (it is evicted whenever the room is needed), as vLLM counts cached blocks.
        The cells are counted in blocks of the config's ``generation.block_size``, a
        sequence's cells rounded up to whole blocks, as the paged engine counts them."""
        # Read without the loop's lock: a snapshot, off by a step at most.
        running = [slot.sequence for slot in list(self._slots) if slot.sequence is not None]
        block = self._engine.settings.block_size
        reserved = [len(s.prompt) + s.params.max_tokens for s in running]
        cached = sum(min(len(s.cached), r) for s, r in zip(running, reserved, strict=True))
        return CacheStats(
            block_size=block,
            blocks_total=self._engine.cache_tokens // block,
            blocks_used=sum(-(-tokens // block) for tokens in reserved),
            tokens_cached=cached,
            running=len(running),
            waiting=self.waiting_count(),
            prefix_cache_queries=self._prefix_queries,
            prefix_cache_hits=self._prefix_hits,
            cpu_threads=self._threads(),
        )

    def _threads(self) -> int:
        governor = self._engine.governor
        return governor.threads if governor is not None else self._engine.threads

    def slot_tokens(self, slot: int) -> list[int]:
        return self._slots[slot].tokens

    def free_samplers(self) -> None:
        for sequence in [*self._waiting, *self._running, *self._submitted]:
            self._free_sampler(sequence)

    # -- the loop thread -----------------------------------------------------------------

    def run(self) -> None:
        while True:
            with self._lock:
                while not (self.stopping or self._submitted or self._cancelled) and not (
                    self._running or self._waiting
                ):
                    if self._engine.governor is not None:
                        self._engine.governor.resting()
                    self._lock.wait()
                if self.stopping:
                    break
                self._waiting.extend(self._submitted)
                self._submitted.clear()
                cancelled, self._cancelled = self._cancelled, []
            deliveries: list[tuple[LlamaSequence, EngineStep | BaseException]] = []
            for sequence in cancelled:
                self._drop(sequence)
            self._schedule()
            if self._running:
                try:
                    self._set_threads()
                    self._step(deliveries)
                except Exception as exc:
                    logger.exception("llama.cpp step failed")
                    for sequence in list(self._running):
                        deliveries.append((sequence, InternalError(f"generation failed: {exc}")))
                        self._finish(sequence)
            self._deliver(deliveries)
        self._fail_all(Unavailable("the generation engine stopped", retry_after_s=5))

    def _set_threads(self) -> None:
        governor = self._engine.governor
        if governor is not None and (threads := governor.observe()) is not None:
            self._lib.llama_set_n_threads(self._engine.context, threads, threads)

    def _fail_all(self, error: Unavailable) -> None:
        with self._lock:
            self._waiting.extend(self._submitted)
            self._submitted.clear()
            for sequence in self._waiting:
                self._unqueue(sequence)
        deliveries: list[tuple[LlamaSequence, EngineStep | BaseException]] = []
        for sequence in [*self._running, *self._waiting]:
            deliveries.append((sequence, error))
        self._deliver(deliveries)

    def _deliver(self, deliveries: list[tuple[LlamaSequence, EngineStep | BaseException]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[Callable[[], None]]] = {}
        for sequence, item in deliveries:
            by_loop.setdefault(sequence.loop, []).append(
                _putter(sequence.outputs, item),
            )
        for loop, puts in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that event loop has closed
                loop.call_soon_threadsafe(_run_all, puts)

    # -- scheduling ----------------------------------------------------------------------

    def _reserved(self) -> int:
        """Cache cells running sequences may grow into plus those idle slots hold."""
        total = 0
        for slot in self._slots:
            sequence = slot.sequence
            if sequence is None:
                total += len(slot.tokens)
            else:
                total += len(sequence.prompt) + sequence.params.max_tokens
        return total

    def _schedule(self) -> None:
        """Give waiting sequences (first come, first served) a slot while the cache has room."""
        while self._waiting:
            sequence = self._waiting[0]
            if sequence.cancelled:
                self._waiting.popleft()
                continue
            if not self._place(sequence):
                return
            self._waiting.popleft()
            self._running.append(sequence)
            with self._lock:
                self._unqueue(sequence)

    def _place(self, sequence: LlamaSequence) -> bool:
        prompt = sequence.prompt
        idle = [slot for slot in self._slots if slot.sequence is None]
        if not idle:
            return False
        # The longest cached prefix anywhere (idle or running), at most all but the last
        # prompt token: that one is read again for the logits of the first new token.
        source, common = None, 0
        for slot in self._slots if self._engine.settings.prefix_caching else ():
            if slot.adapter != sequence.adapter:
                continue
            shared = _common_prefix(slot.tokens, prompt, len(prompt) - 1)
            if shared > common:
                source, common = slot, shared
        if self._engine.per_sequence and common < _MIN_STREAM_PREFIX:
            # Not worth a stream copy, nor a place outside the running ids' runs.
            source, common = None, 0
        # Run in the source slot itself when it is idle, else in the best idle slot.
        if source is not None and source.sequence is None:
            target = source
        elif self._engine.per_sequence:
            target = min(idle, key=self._stream_rank())
        else:
            target = min(idle, key=lambda slot: (len(slot.tokens) > 0, slot.released_at))
        if self._engine.per_sequence:
            # Every stream holds any admitted request: no budget to check or evict for.
            self._take_stream(target, source, common)
        else:
            kept = self._make_room(sequence, idle, target, source, common)
            if kept is None:
                return False
            common = kept
        self._prefix_queries += len(prompt)
        self._prefix_hits += common
        target.tokens = prompt[:common]
        target.sequence = sequence
        target.adapter = sequence.adapter
        sequence.slot = target.index
        sequence.cached = target.tokens
        return True

    def _stream_rank(self) -> Callable[[_Slot], tuple[int, bool, float]]:
        """The order to pick an idle slot in when each sequence has a KV stream: next to
        running ones first (llama.cpp runs each run of consecutive sequence ids in a step
        as a forward pass of its own, so a slot that closes a gap saves a pass per step
        and one beside a run costs none), then empty, then least recently used."""
        running = {slot.index for slot in self._slots if slot.sequence is not None}

        def rank(slot: _Slot) -> tuple[int, bool, float]:
            beside = (slot.index - 1 in running) + (slot.index + 1 in running)
            return -beside, len(slot.tokens) > 0, slot.released_at

        return rank

    def _take_stream(self, target: _Slot, source: _Slot | None, common: int) -> None:
        """Per-sequence streams: keep ``common`` tokens of ``source``'s prefix in ``target``."""
        lib, memory = self._lib, self._engine.memory
        if source is target:
            lib.llama_memory_seq_rm(memory, target.index, common, -1)
        elif source is not None and common:
            # Across streams llama.cpp copies a whole stream (its buffers at the next
            # decode, its cells now), so copy it all, then drop what follows the prefix.
            lib.llama_memory_seq_cp(memory, source.index, target.index, -1, -1)
            lib.llama_memory_seq_rm(memory, target.index, common, -1)
        else:
            lib.llama_memory_seq_rm(memory, target.index, -1, -1)

    def _make_room(
        self,
        sequence: LlamaSequence,
        idle: list[_Slot],
        target: _Slot,
        source: _Slot | None,
        common: int,
    ) -> int | None:
        """Shared cache: evict idle prefixes until ``sequence`` fits, then share the prefix
        (the tokens of it kept; None when the cache has no room for ``sequence`` now)."""
        lib, memory = self._lib, self._engine.memory
        need = len(sequence.prompt) + sequence.params.max_tokens
        free = self._engine.cache_tokens - self._reserved() + len(target.tokens)
        evictable = sorted(
            (slot for slot in idle if slot is not target and slot is not source and slot.tokens),
            key=lambda slot: slot.released_at,
        )
        while free < need and evictable:
            victim = evictable.pop(0)
            free += len(victim.tokens)
            lib.llama_memory_seq_rm(memory, victim.index, -1, -1)
            victim.tokens = []
        if free < need:
            if source is not None and source is not target and source.sequence is None:
                # The source's cells would be shared, not freed: count them out as well.
                free += len(source.tokens)
                if free >= need:
                    lib.llama_memory_seq_rm(memory, source.index, -1, -1)
                    source.tokens, source, common = [], None, 0
            if free < need:
                return None
        if source is target:
            lib.llama_memory_seq_rm(memory, target.index, common, -1)
        else:
            lib.llama_memory_seq_rm(memory, target.index, -1, -1)
            if source is not None and common:
                lib.llama_memory_seq_cp(memory, source.index, target.index, 0, common)
        return common

    def _drop_stale_prefixes(self) -> None:
        """Shared cache: drop idle prefixes nothing has reused in _IDLE_PREFIX_TOKENS."""
        oldest = self._tokens_run - _IDLE_PREFIX_TOKENS
        for slot in self._slots:
            if slot.sequence is None and slot.tokens and slot.released_at_token < oldest:
                self._lib.llama_memory_seq_rm(self._engine.memory, slot.index, -1, -1)
                slot.tokens = []

    def _free_sampler(self, sequence: LlamaSequence) -> None:
        if sequence.sampler is not None:
            sequence.sampler.free()
            sequence.sampler = None

    def _drop(self, sequence: LlamaSequence) -> None:
        if sequence in self._running:
            self._finish(sequence)
            return
        # Out of the queue now, not when it reaches the head: until then it would hold
        # its place in memory and in every scan of the queue.
        with contextlib.suppress(ValueError):  # already dropped at the head by _schedule
            self._waiting.remove(sequence)
        self._free_sampler(sequence)

    def _finish(self, sequence: LlamaSequence) -> None:
        """Release the sequence's slot; its cached tokens stay for prefix reuse."""
        self._running.remove(sequence)
        slot = self._slots[sequence.slot]
        slot.sequence = None
        slot.released_at = time.monotonic()
        slot.released_at_token = self._tokens_run
        if not self._engine.settings.prefix_caching:
            self._lib.llama_memory_seq_rm(self._engine.memory, slot.index, -1, -1)
            slot.tokens = []
        self._free_sampler(sequence)

    # -- one step ------------------------------------------------------------------------

    def _step(self, deliveries: list[tuple[LlamaSequence, EngineStep | BaseException]]) -> None:
        """One step: every sequence's reads, decoded in one batch per LoRA adapter."""
        reads = plan_reads(self._running, self._engine.settings.max_batch_tokens)
        self._turn += 1
        for group in adapter_groups(reads, self._turn):
            self._use_adapter(group[0].sequence.adapter)
            self._sample(self._decode(group), deliveries)

    def _use_adapter(self, adapter: int) -> None:
        """Set the context's LoRA adapters to ``adapter``'s (0: none) for the next decode."""
        if adapter == self._adapter:
            return
        handles, count, scales = self._adapter_args[adapter]
        status = self._lib.llama_set_adapters_lora(self._engine.context, handles, count, scales)
        if status != 0:
            raise RuntimeError(f"llama_set_adapters_lora returned {status}")
        self._adapter = adapter

    def _decode(self, reads: list[Read]) -> list[Output]:
        engine = self._engine
        outputs = fill_batch(engine.batch, reads)
        self._tokens_run += engine.batch.n_tokens
        if not engine.per_sequence:
            self._drop_stale_prefixes()
        status = self._lib.llama_decode(engine.context, engine.batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")
        return outputs

    def _sample(
        self,
        outputs: list[Output],
        deliveries: list[tuple[LlamaSequence, EngineStep | BaseException]],
    ) -> None:
        """Each output's next token, from the logits of the decode just run."""
        engine = self._engine
        for output in outputs:
            sequence = output.sequence
            assert sequence.sampler is not None  # freed only once the sequence is done
            try:
                token, logprob = sequence.sampler.sample(engine.context, output.index)
            except SlipstreamError as exc:  # this request's constraint: it alone ends
                deliveries.append((sequence, exc))
                self._finish(sequence)
                continue
            except Exception as exc:  # a fault in one sequence's choice: it alone fails
                logger.exception("llama.cpp sampling failed for one sequence")
                deliveries.append((sequence, InternalError(f"generation failed: {exc}")))
                self._finish(sequence)
                continue
            sequence.generated += 1
            params = sequence.params
            reason: FinishReason | None = None
            if (
                not params.ignore_eos and (engine.is_end(token) or sequence.sampler.finished)
            ) or token in params.stop_token_ids:
                reason = "stop"
            elif sequence.generated >= params.max_tokens:
                reason = "length"
            deliveries.append(
                (sequence, EngineStep((token,), reason, None if logprob is None else (logprob,)))
            )
            if reason is None:
                sequence.pending = token
            else:
                self._finish(sequence)


def _common_prefix(cached: list[int], prompt: list[int], limit: int) -> int:
    n = min(len(cached), limit)
    if n <= 0 or cached[0] != prompt[0]:
        return 0
    if cached[:n] == prompt[:n]:
        return n
    low, high = 1, n  # cached[:low] matches; cached[:high] does not
    while high - low > 1:
        middle = (low + high) // 2
        if cached[:middle] == prompt[:middle]:
            low = middle
        else:
            high = middle
    return low


def _putter(
    queue: asyncio.Queue[EngineStep | BaseException], item: EngineStep | BaseException
) -> Callable[[], None]:
    return lambda: queue.put_nowait(item)


def _run_all(calls: list[Callable[[], None]]) -> None:
    for call in calls:
        call()
