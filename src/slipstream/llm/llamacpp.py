"""The llama.cpp engine: GGUF models on llama.cpp's own kernels, continuously batched.

It drives llama.cpp through ``llama-cpp-python``'s low-level bindings (the C API of
``llama.h``), not its high-level ``Llama`` class, which runs one sequence at a time.
One context holds the KV cache, in one of two layouts (``generation.kv_streams``):
shared by every sequence (``kv_unified``: each request gets a sequence id, and its
cells are masked off from the others, so attention reads every occupied cell), or one
stream per sequence (each of the cache's tokens / ``max_num_seqs``, and attention reads
only the sequence's own stream: at 16 sequences a step took 47-51 ms instead of 56, or
74-79 with idle prefixes left in a shared cache). A dedicated thread runs the step loop:

* **continuous batching**: every step is one ``llama_batch`` holding the next token of
  each decoding sequence plus chunks of prompts still being read; a request joins at the
  next step and leaves when it is done. Prompts are read in chunks of at most
  ``generation.max_batch_tokens`` tokens per step (minus the decoding tokens), so a long
  prompt never stalls the streams already decoding. A step that ends one prompt reads
  another whole only when it is short: a CPU step costs about its tokens, so reading
  two long prompts together delays the first one's first token by the second's reading
  for nothing (``_worth_packing``: at C=4 on 128-token prompts, TTFT mean -23%, output
  tok/s unchanged);
* **admission by KV budget**: a sequence is scheduled when its prompt plus ``max_tokens``
  fits the cache beside what running sequences have reserved (per sequence: when a
  stream is free, since any admitted request fits one); until then it waits (at most
  ``generation.max_queue_size`` of them, then 503). Nothing is ever preempted;
* **prefix caching**: a sequence that ends leaves its tokens in the cache under its id
  (an idle slot). A new request whose prompt starts with tokens some slot holds, idle
  or running, takes that prefix and reads only the rest: in the slot itself when it is
  idle, else by ``llama_memory_seq_cp`` (in a shared cache the cells are shared, no data
  copied; across streams llama.cpp copies the whole stream, and the tail after the
  prefix is dropped). Idle slots are evicted, least recently used first, when the cache
  or the sequence ids run out; in a shared cache also once the engine has run 2,048
  tokens without reusing one (its cells would slow every step's attention). With a
  stream per sequence a prefix under 16 tokens is not reused, and a new sequence takes
  the idle slot beside running ones: llama.cpp runs each run of consecutive sequence ids
  in a step as a forward pass of its own, so the step's batch also goes in id order;
* **LoRA adapters** (``generation.lora_modules``): loaded once with the model, each
  request runs with at most one. llama.cpp applies a context's adapters to a whole
  ``llama_decode``, so each step decodes its sequences in one batch per adapter (the
  base model's included), setting the context's adapters before each; every group runs
  every step, in an order that rotates. A cached prefix is reused only by a sequence of
  the adapter that computed it;
* **sampling**, one sampler per sequence: llama.cpp's penalties and logit bias, then
  greedy, or temperature, min-p, top-k, top-p and a draw from one numpy generator per
  seed; logprobs, llguidance constraints (structured outputs, required tool calls) and
  min_tokens' hold on the end and stop tokens only for the sequences that ask
  (:mod:`slipstream.llm.llamacpp_sampling`).

Text: tokens and chat templates come from the GGUF file itself (the Jinja template in
``tokenizer.chat_template``, rendered in a sandbox as transformers renders it).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slipstream.errors import InvalidRequest, ModelNotFound, Unavailable
from slipstream.llm.chat_template import ChatTemplate
from slipstream.llm.constraints import Matchers
from slipstream.llm.engine import CacheStats, Engine, EngineStep, SamplingParams
from slipstream.llm.llamacpp_sampling import SequenceSampler, build_tokenizer
from slipstream.llm.llamacpp_scheduler import LlamaRuntime, Scheduler
from slipstream.llm.llamacpp_step import LlamaSequence
from slipstream.runtime.cpu_share import ThreadGovernor, pressure_source

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

    def __init__(
        self,
        path: Path,
        settings: GenerationSettings,
        threads: int,
        adaptive: bool = False,
        adapters: Mapping[str, Path] | None = None,
    ) -> None:
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
        with ExitStack() as on_failure:
            on_failure.callback(lib.llama_model_free, model)
            self._adapters = _load_adapters(lib, model, adapters or {}, on_failure)
            self._init_context(path, settings, threads, adaptive)
            on_failure.pop_all()
        # Request names -> LlamaSequence.adapter (0 is the base model).
        self._adapter_ids = {name: index + 1 for index, name in enumerate(adapters or {})}

    def _init_context(
        self, path: Path, settings: GenerationSettings, threads: int, adaptive: bool
    ) -> None:
        lib, model = self._lib, self._model
        self._vocab = lib.llama_model_get_vocab(model)
        trained = int(lib.llama_model_n_ctx_train(model))
        if settings.max_model_len > trained:
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
        per_sequence = _per_sequence_streams(settings, self.cache_tokens, self.slots,
                                             self.max_model_len)  # fmt: skip
        context_params.kv_unified = not per_sequence
        context_params.n_threads = threads
        context_params.n_threads_batch = threads
        context_params.no_perf = True
        context = lib.llama_init_from_model(model, context_params)
        if not context:
            raise ValueError(
                f"{path}: llama.cpp could not create a context of {self.cache_tokens} tokens "
                "(generation.num_blocks x generation.block_size); see the log"
            )
        self._context = context
        self._memory = lib.llama_get_memory(context)
        self.sequence_tokens = self.cache_tokens
        if per_sequence:
            # llama.cpp rounds each stream up to a multiple of 256 tokens.
            self.sequence_tokens = int(lib.llama_n_ctx_seq(context))
            self.cache_tokens = int(lib.llama_n_ctx(context))
        self._batch = lib.llama_batch_init(settings.max_batch_tokens, 0, 1)
        self._template = ChatTemplate.from_model(lib, model, self._vocab)
        self._add_bos = bool(lib.llama_vocab_get_add_bos(self._vocab))
        self._matchers = Matchers(lambda: build_tokenizer(lib, self._vocab))
        # The vocabulary's end-of-generation tokens, for min_tokens to hold back (found
        # here, on the loading thread: ~35 ms for SmolLM2's 49k tokens).
        is_eog = lib.llama_vocab_is_eog
        self._end_tokens = [t for t in range(self.vocab_size) if is_eog(self._vocab, t)]
        governor = None
        if adaptive and threads > 1:
            stalled_us = pressure_source()
            if stalled_us is None:
                logger.info("no CPU pressure information (PSI) here: %d threads throughout",
                            threads)  # fmt: skip
            else:
                governor = ThreadGovernor(threads, stalled_us)
        runtime = LlamaRuntime(
            lib,
            context,
            self._memory,
            self._batch,
            settings,
            self.cache_tokens,
            self.slots,
            self.is_end,
            per_sequence,
            threads,
            governor,
            tuple(self._adapters),
        )
        self._scheduler = Scheduler(runtime)
        self._thread = threading.Thread(
            target=self._scheduler.run, name="slipstream-llama-cpp", daemon=True
        )
        self._thread.start()
        logger.info(
            "llama.cpp engine: %s, %d threads%s, KV cache %d tokens (%s), %d sequences at "
            "once, %d-token steps, %d LoRA adapters",
            path.name, threads, " (fewer while the CPU is crowded)" if governor else "",
            self.cache_tokens,
            f"a stream of {self.sequence_tokens} per sequence" if per_sequence else "shared",
            self.slots, settings.max_batch_tokens, len(self._adapters),
        )  # fmt: skip

    # -- text ----------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return self._tokenize(text, add_special=True)

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> list[int]:
        if self._template is None:
            raise InvalidRequest(
                "messages: this model has no chat template; use /v1/completions with a prompt"
            )
        try:
            text = self._template.render(messages, tools, variables)
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

    @property
    def template_knows_tools(self) -> bool:
        return self._template is not None and self._template.knows_tools

    def token_bytes(self, token_id: int) -> bytes:
        buffer = ctypes.create_string_buffer(64)
        written = self._lib.llama_token_to_piece(self._vocab, token_id, buffer, 64, 0, True)
        if written < 0:
            buffer = ctypes.create_string_buffer(-written)
            written = self._lib.llama_token_to_piece(
                self._vocab, token_id, buffer, -written, 0, True
            )
        return buffer.raw[: max(written, 0)]

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
        self, prompt_ids: list[int], params: SamplingParams, adapter: str | None = None
    ) -> AsyncIterator[EngineStep]:
        loop = asyncio.get_running_loop()
        adapter_id = 0 if adapter is None else self._adapter_ids.get(adapter)
        if adapter_id is None:  # the model was reloaded without it
            raise ModelNotFound(f"model: {adapter!r} is no LoRA adapter of this model now")
        matcher = None
        if params.constraint is not None:
            matcher = await self._matchers.new(params.constraint)
        # Checked after the matcher's await, with nothing awaited until the sequence is
        # submitted: a sequence counts as waiting from the moment it passes the check, so
        # the requests the service admitted together never overfill the queue.
        self._check_queue()
        if self._scheduler.stopping:
            raise Unavailable("the generation engine is stopping", retry_after_s=5)
        blocked = self._min_tokens_blocked(params) if params.min_tokens else None
        sampler = SequenceSampler(self._lib, self._vocab, params, prompt_ids, matcher, blocked)
        sequence = LlamaSequence(list(prompt_ids), params, loop, asyncio.Queue(), sampler=sampler,
                                 adapter=adapter_id)  # fmt: skip
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

    def _min_tokens_blocked(self, params: SamplingParams) -> list[int]:
        """The tokens min_tokens holds back: the stop token ids, and every end-of-generation
        token unless ignore_eos (vLLM's: EOS is then no stop, so nothing to hold back)."""
        ends = [] if params.ignore_eos else self._end_tokens
        return sorted({*ends, *params.stop_token_ids})

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
        for adapter in self._adapters:
            lib.llama_adapter_lora_free(adapter)
        lib.llama_model_free(self._model)


# -- loading ---------------------------------------------------------------------------


def _per_sequence_streams(
    settings: GenerationSettings, cache_tokens: int, slots: int, max_model_len: int
) -> bool:
    """Whether each sequence gets a KV stream of its own (``generation.kv_streams``).

    Auto: per sequence when one stream holds the longest request the model admits, so
    the layout never refuses a request a shared cache would take; with one slot the two
    layouts are the same and shared is kept.
    """
    if settings.kv_streams != "auto":
        return settings.kv_streams == "per_sequence"
    return slots > 1 and cache_tokens // slots >= max_model_len


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


def _load_adapters(
    lib: Any, model: Any, adapters: Mapping[str, Path], on_failure: ExitStack
) -> list[Any]:
    """Each LoRA adapter of ``adapters`` (name -> GGUF file) loaded for ``model``; each
    freed by ``on_failure`` unless the load goes through. ValueError naming the adapter
    llama.cpp refuses (the log says why: another architecture, a tensor's shape...)."""
    loaded = []
    for name, path in adapters.items():
        field = f"generation.lora_modules.{name}"
        _check_gguf(path, field)
        adapter = lib.llama_adapter_lora_init(model, str(path).encode())
        if not adapter:
            raise ValueError(
                f"{field}: llama.cpp could not load {path} as a LoRA adapter of this model "
                "(see the server log: an adapter of another model, or not a LoRA GGUF)"
            )
        on_failure.callback(lib.llama_adapter_lora_free, adapter)
        loaded.append(adapter)
    return loaded


def _check_gguf(path: Path, what: str) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"{what}: {path}: no such GGUF file")
    with path.open("rb") as handle:
        magic = handle.read(4)
    if magic != _GGUF_MAGIC:
        raise ValueError(f"{what}: {path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")


def load_llama_cpp_engine(
    path: Path,
    settings: GenerationSettings,
    threads: int,
    adaptive: bool = False,
    adapters: Mapping[str, Path] | None = None,
) -> Engine:
    """Load a ``.gguf`` file with llama.cpp, and its LoRA ``adapters`` (name -> GGUF
    file). Blocking; clear errors for what is not one. ``adaptive``: ``threads`` is the
    most its forward passes use, fewer while the host's cores are crowded
    (:mod:`slipstream.runtime.cpu_share`)."""
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
    return LlamaCppEngine(path, settings, threads, adaptive, adapters)
