"""The llama.cpp engine: GGUF models on llama.cpp's own kernels, continuously batched.

It drives llama.cpp through ``llama-cpp-python``'s low-level bindings (the C API of
``llama.h``), not its high-level ``Llama`` class, which runs one sequence at a time.
One context holds a KV cache shared by every sequence (``kv_unified``: each request
gets a sequence id, and its cells are masked off from the others). A dedicated thread
runs the step loop:

* **continuous batching**: every step is one ``llama_batch`` holding the next token of
  each decoding sequence plus chunks of prompts still being read; a request joins at the
  next step and leaves when it is done. Prompts are read in chunks of at most
  ``generation.max_batch_tokens`` tokens per step (minus the decoding tokens), so a long
  prompt never stalls the streams already decoding;
* **admission by KV budget**: a sequence is scheduled when its prompt plus ``max_tokens``
  fits the cache beside what running sequences have reserved; until then it waits (at
  most ``generation.max_queue_size`` of them, then 503). Nothing is ever preempted;
* **prefix caching**: a sequence that ends leaves its tokens in the cache under its id
  (an idle slot). A new request whose prompt starts with tokens some slot holds, idle
  or running, copies that prefix (``llama_memory_seq_cp`` shares the cells, no copy of
  data) and reads only the rest. Idle slots are evicted, least recently used first, when
  the cache or the sequence ids run out;
* **sampling** by llama.cpp's sampler chain, one per sequence: greedy, or temperature,
  top-k, top-p and a seeded draw (the text depends only on the seed and the prompt).

Text: tokens and chat templates come from the GGUF file itself (the Jinja template in
``tokenizer.chat_template``, rendered in a sandbox as transformers renders it).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slipstream.errors import InternalError, InvalidRequest, Unavailable
from slipstream.llm.engine import CacheStats, Engine, EngineStep, FinishReason, SamplingParams

if TYPE_CHECKING:
    from slipstream.config import GenerationSettings

logger = logging.getLogger(__name__)

_GGUF_MAGIC = b"GGUF"
# llama.h: ggml_log_level
_LOG_WARN = 3
_LOG_ERROR = 4
# llama.cpp's limit on sequence ids in one context (LLAMA_MAX_SEQ).
_MAX_SEQ_IDS = 256


class LlamaCppEngine(Engine):
    """A GGUF model on llama.cpp; see the module docstring."""

    def __init__(self, path: Path, settings: GenerationSettings, threads: int) -> None:
        import llama_cpp as lib

        self._lib = lib
        self._settings = settings
        _init_backend(lib)
        model_params = lib.llama_model_default_params()
        model_params.n_gpu_layers = 0
        model = lib.llama_model_load_from_file(str(path).encode(), model_params)
        if not model:
            raise ValueError(f"{path}: llama.cpp could not load this GGUF file (see the log)")
        self._model = model
        self._vocab = lib.llama_model_get_vocab(model)
        trained = int(lib.llama_model_n_ctx_train(model))
        if settings.max_model_len > trained:
            lib.llama_model_free(model)
            raise ValueError(
                f"{path}: generation.max_model_len {settings.max_model_len} exceeds the "
                f"{trained} tokens of context this model was trained for"
            )
        self.max_model_len = settings.max_model_len or trained
        self.cache_tokens = settings.num_blocks * settings.block_size
        self.vocab_size = int(lib.llama_vocab_n_tokens(self._vocab))
        self.slots = min(settings.max_num_seqs, _MAX_SEQ_IDS)
        self.threads = threads
        context_params = lib.llama_context_default_params()
        context_params.n_ctx = self.cache_tokens
        context_params.n_batch = settings.max_batch_tokens
        context_params.n_ubatch = settings.max_batch_tokens
        context_params.n_seq_max = self.slots
        context_params.kv_unified = True
        context_params.n_threads = threads
        context_params.n_threads_batch = threads
        context_params.no_perf = True
        context = lib.llama_init_from_model(model, context_params)
        if not context:
            lib.llama_model_free(model)
            raise ValueError(
                f"{path}: llama.cpp could not create a context of {self.cache_tokens} tokens "
                "(generation.num_blocks x generation.block_size); see the log"
            )
        self._context = context
        self._memory = lib.llama_get_memory(context)
        self._batch = lib.llama_batch_init(settings.max_batch_tokens, 0, 1)
        self._template = _ChatTemplate.from_model(lib, model, self._vocab)
        self._add_bos = bool(lib.llama_vocab_get_add_bos(self._vocab))
        self._scheduler = _Scheduler(self)
        self._thread = threading.Thread(
            target=self._scheduler.run, name="slipstream-llama-cpp", daemon=True
        )
        self._thread.start()
        logger.info(
            "llama.cpp engine: %s, %d threads, KV cache %d tokens, %d sequences at once, "
            "%d-token steps",
            path.name, threads, self.cache_tokens, self.slots, settings.max_batch_tokens,
        )  # fmt: skip

    # -- text ----------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return self._tokenize(text, add_special=True)

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        if self._template is None:
            raise InvalidRequest(
                "messages: this model has no chat template; use /v1/completions with a prompt"
            )
        try:
            text = self._template.render(messages)
        except Exception as exc:  # the template raised for roles or orders it refuses
            raise InvalidRequest(f"messages: the chat template refused them: {exc}") from exc
        # The template writes the special tokens it wants (BOS included) as text.
        return self._tokenize(text, add_special=False)

    def _tokenize(self, text: str, add_special: bool) -> list[int]:
        data = text.encode()
        capacity = len(data) + 8
        while True:
            tokens = (ctypes.c_int32 * capacity)()
            count = self._lib.llama_tokenize(
                self._vocab, data, len(data), tokens, capacity, add_special, True
            )
            if count >= 0:
                return list(tokens[:count])
            capacity = -count

    def decode(self, token_ids: Sequence[int]) -> str:
        count = len(token_ids)
        if not count:
            return ""
        tokens = (ctypes.c_int32 * count)(*token_ids)
        capacity = count * 8 + 16
        while True:
            buffer = ctypes.create_string_buffer(capacity)
            written = self._lib.llama_detokenize(
                self._vocab, tokens, count, buffer, capacity, False, False
            )
            if written >= 0:
                return buffer.raw[:written].decode("utf-8", errors="replace")
            capacity = -written

    def is_end(self, token: int) -> bool:
        return bool(self._lib.llama_vocab_is_eog(self._vocab, token))

    # -- generation ----------------------------------------------------------------------

    def _check_queue(self) -> None:
        waiting = self._scheduler.waiting_count()
        limit = self._settings.max_queue_size
        if waiting >= limit:
            raise Unavailable(
                f"{waiting} sequences are already waiting for the KV cache "
                f"(generation.max_queue_size {limit}); retry later",
                retry_after_s=1,
            )

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[EngineStep]:
        self._check_queue()
        if self._scheduler.stopping:
            raise Unavailable("the generation engine is stopping", retry_after_s=5)
        loop = asyncio.get_running_loop()
        sequence = _Sequence(list(prompt_ids), params, loop, asyncio.Queue())
        self._scheduler.submit(sequence)
        finished = False
        try:
            while True:
                item = await sequence.outputs.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finish_reason is not None:
                    finished = True
                    yield item
                    return
                yield item
        finally:
            if not finished:
                # The client went away or a stop string matched: free the slot now.
                self._scheduler.cancel(sequence)

    # -- state ---------------------------------------------------------------------------

    def cache_stats(self) -> CacheStats:
        return self._scheduler.stats()

    # -- inspection (tests, debugging): meaningful while no sequence runs ------------------

    def slot_tokens(self, slot: int) -> list[int]:
        """The tokens the scheduler believes ``slot`` holds in the cache."""
        return list(self._scheduler.slot_tokens(slot))

    def cached_positions(self) -> dict[int, tuple[int, int] | None]:
        """(first, last) position llama.cpp holds for each slot; None when it holds none."""
        lib, memory = self._lib, self._memory
        positions: dict[int, tuple[int, int] | None] = {}
        for slot in range(self.slots):
            last = int(lib.llama_memory_seq_pos_max(memory, slot))
            first = int(lib.llama_memory_seq_pos_min(memory, slot))
            positions[slot] = None if last < 0 else (first, last)
        return positions

    async def close(self) -> None:
        self._scheduler.stop()
        await asyncio.to_thread(self._thread.join)
        lib = self._lib
        self._scheduler.free_samplers()
        lib.llama_batch_free(self._batch)
        lib.llama_free(self._context)
        lib.llama_model_free(self._model)


@dataclass(eq=False)
class _Sequence:
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
    sampler: Any = None
    cancelled: bool = False


@dataclass
class _Slot:
    """A sequence id of the context: running a sequence, or idle holding a cached prefix."""

    index: int
    tokens: list[int] = field(default_factory=list)
    sequence: _Sequence | None = None
    # For least-recently-used eviction of idle slots.
    released_at: float = 0.0


class _Scheduler:
    """The step loop and its state; every field below ``_lock`` is the loop thread's."""

    def __init__(self, engine: LlamaCppEngine) -> None:
        self._engine = engine
        self._lib = engine._lib
        self._lock = threading.Condition()
        self._submitted: deque[_Sequence] = deque()
        self._cancelled: list[_Sequence] = []
        self.stopping = False
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._slots = [_Slot(i) for i in range(engine.slots)]
        self._prefix_queries = 0
        self._prefix_hits = 0

    # -- called from the event loop ------------------------------------------------------

    def submit(self, sequence: _Sequence) -> None:
        with self._lock:
            self._submitted.append(sequence)
            self._lock.notify()

    def cancel(self, sequence: _Sequence) -> None:
        with self._lock:
            sequence.cancelled = True
            self._cancelled.append(sequence)
            self._lock.notify()

    def stop(self) -> None:
        with self._lock:
            self.stopping = True
            self._lock.notify()

    def waiting_count(self) -> int:
        return len(self._submitted) + len(self._waiting)

    def stats(self) -> CacheStats:
        """Cells of running sequences count as used; an idle slot's cached prefix counts as
        free (it is evicted whenever the room is needed), as vLLM counts cached blocks."""
        # Read without the loop's lock: a snapshot, off by a step at most.
        running = [slot.sequence for slot in list(self._slots) if slot.sequence is not None]
        reserved = sum(len(s.prompt) + s.params.max_tokens for s in running)
        cached = sum(len(s.cached) for s in running)
        return CacheStats(
            block_size=1,
            blocks_total=self._engine.cache_tokens,
            blocks_used=reserved,
            tokens_cached=min(cached, reserved),
            running=len(running),
            waiting=self.waiting_count(),
            prefix_cache_queries=self._prefix_queries,
            prefix_cache_hits=self._prefix_hits,
        )

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
                    self._lock.wait()
                if self.stopping:
                    break
                self._waiting.extend(self._submitted)
                self._submitted.clear()
                cancelled, self._cancelled = self._cancelled, []
            deliveries: list[tuple[_Sequence, EngineStep | BaseException]] = []
            for sequence in cancelled:
                self._drop(sequence)
            self._schedule()
            if self._running:
                try:
                    self._step(deliveries)
                except Exception as exc:
                    logger.exception("llama.cpp step failed")
                    for sequence in list(self._running):
                        deliveries.append((sequence, InternalError(f"generation failed: {exc}")))
                        self._finish(sequence)
            self._deliver(deliveries)
        self._fail_all(Unavailable("the generation engine stopped", retry_after_s=5))

    def _fail_all(self, error: Unavailable) -> None:
        with self._lock:
            self._waiting.extend(self._submitted)
            self._submitted.clear()
        deliveries: list[tuple[_Sequence, EngineStep | BaseException]] = []
        for sequence in [*self._running, *self._waiting]:
            deliveries.append((sequence, error))
        self._deliver(deliveries)

    def _deliver(self, deliveries: list[tuple[_Sequence, EngineStep | BaseException]]) -> None:
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

    def _place(self, sequence: _Sequence) -> bool:
        lib, memory = self._lib, self._engine._memory
        prompt = sequence.prompt
        need = len(prompt) + sequence.params.max_tokens
        idle = [slot for slot in self._slots if slot.sequence is None]
        if not idle:
            return False
        # The longest cached prefix anywhere (idle or running), at most all but the last
        # prompt token: that one is read again for the logits of the first new token.
        source, common = None, 0
        for slot in self._slots if self._engine._settings.prefix_caching else ():
            shared = _common_prefix(slot.tokens, prompt, len(prompt) - 1)
            if shared > common:
                source, common = slot, shared
        # Run in the source slot itself when it is idle, else in the emptiest idle slot.
        if source is not None and source.sequence is None:
            target = source
        else:
            target = min(idle, key=lambda slot: (len(slot.tokens) > 0, slot.released_at))
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
                return False
        if source is target:
            lib.llama_memory_seq_rm(memory, target.index, common, -1)
        else:
            lib.llama_memory_seq_rm(memory, target.index, -1, -1)
            if source is not None and common:
                lib.llama_memory_seq_cp(memory, source.index, target.index, 0, common)
        self._prefix_queries += len(prompt)
        self._prefix_hits += common
        target.tokens = prompt[:common]
        target.sequence = sequence
        sequence.slot = target.index
        sequence.cached = target.tokens
        sequence.sampler = self._sampler(sequence.params)
        return True

    def _sampler(self, params: SamplingParams) -> Any:
        lib = self._lib
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        if params.greedy:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_greedy())
            return chain
        # OpenAI's order, as the transformers engine applies it: temperature, then the
        # top-k and top-p cuts on the tempered distribution, then the draw.
        if params.temperature != 1.0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_temp(params.temperature))
        if params.top_k > 0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_k(params.top_k))
        if params.top_p < 1.0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_p(params.top_p, 1))
        seed = lib.LLAMA_DEFAULT_SEED if params.seed is None else params.seed & 0xFFFFFFFF
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dist(seed))
        return chain

    def _free_sampler(self, sequence: _Sequence) -> None:
        if sequence.sampler is not None:
            self._lib.llama_sampler_free(sequence.sampler)
            sequence.sampler = None

    def _drop(self, sequence: _Sequence) -> None:
        if sequence in self._running:
            self._finish(sequence)
        else:
            self._free_sampler(sequence)

    def _finish(self, sequence: _Sequence) -> None:
        """Release the sequence's slot; its cached tokens stay for prefix reuse."""
        self._running.remove(sequence)
        slot = self._slots[sequence.slot]
        slot.sequence = None
        slot.released_at = time.monotonic()
        if not self._engine._settings.prefix_caching:
            self._lib.llama_memory_seq_rm(self._engine._memory, slot.index, -1, -1)
            slot.tokens = []
        self._free_sampler(sequence)

    # -- one step ------------------------------------------------------------------------

    def _step(self, deliveries: list[tuple[_Sequence, EngineStep | BaseException]]) -> None:
        engine, lib = self._engine, self._lib
        batch = engine._batch
        budget = engine._settings.max_batch_tokens
        count = 0
        outputs: list[tuple[_Sequence, int]] = []
        # Decoding sequences first (one token each), then prompt chunks in arrival order.
        for sequence in self._running:
            if sequence.pending >= 0 and count < budget:
                _add(batch, count, sequence.pending, len(sequence.cached), sequence.slot, True)
                sequence.cached.append(sequence.pending)
                sequence.pending = -1
                outputs.append((sequence, count))
                count += 1
        for sequence in self._running:
            if count >= budget:
                break
            if sequence.pending >= 0 or sequence.generated:
                continue
            start = len(sequence.cached)
            end = min(len(sequence.prompt), start + budget - count)
            for position in range(start, end):
                last = position == len(sequence.prompt) - 1
                _add(batch, count, sequence.prompt[position], position, sequence.slot, last)
                if last:
                    outputs.append((sequence, count))
                count += 1
            sequence.cached.extend(sequence.prompt[start:end])
        batch.n_tokens = count
        if count == 0:
            return
        status = lib.llama_decode(engine._context, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")
        for sequence, index in outputs:
            token = int(lib.llama_sampler_sample(sequence.sampler, engine._context, index))
            sequence.generated += 1
            reason: FinishReason | None = None
            if not sequence.params.ignore_eos and engine.is_end(token):
                reason = "stop"
            elif sequence.generated >= sequence.params.max_tokens:
                reason = "length"
            deliveries.append((sequence, EngineStep((token,), reason)))
            if reason is None:
                sequence.pending = token
            else:
                self._finish(sequence)


def _add(batch: Any, index: int, token: int, position: int, slot: int, logits: bool) -> None:
    batch.token[index] = token
    batch.pos[index] = position
    batch.n_seq_id[index] = 1
    batch.seq_id[index][0] = slot
    batch.logits[index] = logits


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


class _ChatTemplate:
    """The GGUF's ``tokenizer.chat_template``, rendered as transformers renders it."""

    def __init__(self, source: str, bos: str, eos: str) -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise
        environment.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
        self._template = environment.from_string(source)
        self._bos, self._eos = bos, eos

    @classmethod
    def from_model(cls, lib: Any, model: Any, vocab: Any) -> _ChatTemplate | None:
        source = lib.llama_model_chat_template(model, None)
        if not source:
            return None

        def text(token: int) -> str:
            if token < 0:
                return ""
            raw = lib.llama_vocab_get_text(vocab, token)
            return raw.decode("utf-8", errors="replace") if raw else ""

        bos = text(lib.llama_vocab_bos(vocab))
        eos = text(lib.llama_vocab_eos(vocab))
        return cls(source.decode("utf-8", errors="replace"), bos, eos)

    def render(self, messages: list[dict[str, str]]) -> str:
        return str(
            self._template.render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self._bos,
                eos_token=self._eos,
            )
        )


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _raise(message: str) -> None:
    raise ValueError(message)


# -- loading ---------------------------------------------------------------------------

_BACKEND_LOCK = threading.Lock()
_backend_ready = False
# llama.cpp calls this from any thread; kept referenced for the life of the process.
_log_callback: Any = None


def _init_backend(lib: Any) -> None:
    global _backend_ready, _log_callback
    with _BACKEND_LOCK:
        if _backend_ready:
            return
        lib.llama_backend_init()

        def log(level: int, text: bytes | None, _user: Any) -> None:
            if text and level in (_LOG_WARN, _LOG_ERROR):
                message = text.decode("utf-8", errors="replace").rstrip()
                if message:
                    logger.log(logging.ERROR if level == _LOG_ERROR else logging.DEBUG, message)

        _log_callback = lib.llama_log_callback(log)
        lib.llama_log_set(_log_callback, ctypes.c_void_p())
        _backend_ready = True


def load_llama_cpp_engine(path: Path, settings: GenerationSettings, threads: int) -> Engine:
    """Load a ``.gguf`` file with llama.cpp. Blocking; clear errors for what is not one."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    with path.open("rb") as handle:
        magic = handle.read(4)
    if magic != _GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "backend: llama_cpp needs llama-cpp-python: pip install 'slipstream[llama]' "
            "(make install builds it)"
        ) from exc
    return LlamaCppEngine(path, settings, threads)
