"""The transformers engine: continuous batching over a paged KV cache.

It drives the ``ContinuousBatchingManager`` and ``PagedAttentionCache`` that
transformers ships (iteration-level scheduling, fixed-size cache blocks with per-sequence
block tables, preemption by recompute when blocks run out) rather than re-implementing
them. What this module adds is what a server needs around it: admission control with a
bounded waiting queue, per-request sampling settings (greedy, temperature, min-p, top-p,
top-k, seed, vLLM's min_tokens and stop token ids) on one shared batch, asyncio
streaming, cancellation, and cache statistics.

The model, its paged cache and the batching run on ``generation.device`` (``cpu``,
``cuda``, ``cuda:N``) in ``generation.dtype``; ``generation.load_format: dummy`` builds
random weights of the directory's ``config.json`` shape on that device. A load that does
not fit the device's memory fails that model alone with :class:`OutOfDeviceMemory`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slipstream.config import ConfigError
from slipstream.errors import InternalError, InvalidRequest, ModelNotFound, Unavailable
from slipstream.llm import sampling
from slipstream.llm.constraints import Matchers
from slipstream.llm.engine import CacheStats, Engine, EngineStep, FinishReason, SamplingParams

if TYPE_CHECKING:
    import torch
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from slipstream.config import GenerationSettings

logger = logging.getLogger(__name__)


class OutOfDeviceMemory(MemoryError):
    """The model's weights, its KV cache or its batch buffers do not fit the device."""


class TransformersEngine(Engine):
    """A causal LM from a Hugging Face directory or a GGUF file; see the module docstring."""

    def __init__(self, model: Any, tokenizer: Any, settings: GenerationSettings) -> None:
        from transformers import GenerationConfig

        self._model = model
        self._tokenizer = tokenizer
        self._settings = settings
        config = model.config
        self.vocab_size = int(config.vocab_size)
        position_limit = int(getattr(config, "max_position_embeddings", 0) or 0) or 2048
        self.max_model_len = min(settings.max_model_len or position_limit, position_limit)
        self.cache_tokens = settings.num_blocks * settings.block_size
        self.sequence_tokens = self.cache_tokens
        self.eos_token_ids = _eos_ids(model, tokenizer)
        # Sampling is done by slipstream.llm.sampling's processors, which leave one
        # possible token per row: the engine's own step is then a plain argmax.
        generation = GenerationConfig(  # type: ignore[no-untyped-call]
            do_sample=False,
            eos_token_id=sorted(self.eos_token_ids) or -1,
            pad_token_id=tokenizer.pad_token_id,
            max_new_tokens=settings.default_max_tokens,
        )
        self._manager = model.init_continuous_batching(
            generation_config=generation,
            continuous_batching_config=continuous_batching_config(settings),
        )
        self._extras = sampling.ExtrasRegistry()
        sampling.install(self._manager, self._extras)
        self._matchers = Matchers(self._build_lltokenizer)
        self._decode_ids = _backend_decode(tokenizer)
        self._waiting: set[str] = set()
        self._running: set[str] = set()
        # The paged cache and the batch buffers are allocated here, on the loading
        # thread, rather than by the generation thread's first step: a cache that does
        # not fit fails the load (MemoryError, torch.OutOfMemoryError) instead of
        # leaving a READY model whose loop died.
        self._manager.warmup()
        self._manager.start()

    # -- text ----------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text))

    @property
    def template_knows_tools(self) -> bool:
        return "tools" in (getattr(self._tokenizer, "chat_template", None) or "")

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> list[int]:
        if not getattr(self._tokenizer, "chat_template", None):
            raise InvalidRequest(
                "messages: this model has no chat template; use /v1/completions with a prompt"
            )
        # apply_chat_template passes its other keyword arguments to the template; one of
        # its own parameters (padding, return_dict...) would change the call instead.
        own = inspect.signature(self._tokenizer.apply_chat_template).parameters
        for name in variables or {}:
            if name in own:
                raise InvalidRequest(
                    f"chat_template_kwargs.{name}: a parameter of the template's rendering, "
                    "not a variable a request may set; leave it out"
                )
        try:
            encoded = self._tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, **(variables or {})
            )
        except Exception as exc:  # jinja raises for roles or orders a template refuses
            raise InvalidRequest(f"messages: the chat template refused them: {exc}") from exc
        ids = encoded["input_ids"] if not isinstance(encoded, list) else encoded
        return [int(i) for i in ids]

    def decode(self, token_ids: Sequence[int]) -> str:
        ids = token_ids if isinstance(token_ids, list) else list(token_ids)
        if self._decode_ids is not None:
            return self._decode_ids(ids, skip_special_tokens=True)
        return str(self._tokenizer.decode(ids, skip_special_tokens=True))

    # -- generation ----------------------------------------------------------------------

    @property
    def failure(self) -> str | None:
        # The generation loop died (out of GPU memory in a step, a kernel error): every
        # sequence it held has already failed, and no new one can run.
        error = self._manager.background_thread_status.fatal_error
        if error is None:
            return None
        return (
            f"the generation loop stopped after an error ({_first_line(error)}); load the "
            "model again (POST /v2/repository/models/<name>/load), with a smaller "
            "generation.num_blocks or max_batch_tokens if it ran out of memory"
        )

    def _check_queue(self) -> None:
        failure = self.failure
        if failure is not None:
            raise Unavailable(f"this model cannot generate: {failure}")
        limit = self._settings.max_queue_size
        if len(self._waiting) >= limit:
            raise Unavailable(
                f"{len(self._waiting)} sequences are already waiting for the KV cache "
                f"(generation.max_queue_size {limit}); retry later",
                retry_after_s=1,
            )

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, adapter: str | None = None
    ) -> AsyncIterator[EngineStep]:
        if adapter is not None:  # the loader refuses generation.lora_modules here
            raise ModelNotFound(f"model: {adapter!r}: this engine serves no LoRA adapter")
        matcher = None if params.constraint is None else await self._matchers.new(params.constraint)
        # Checked after the matcher's await, with nothing awaited until the sequence counts
        # as waiting (the first step of _steps): requests that passed the check together
        # before an await could overfill the queue.
        self._check_queue()
        extras = sampling.RequestExtras(params, prompt_ids, matcher, self.eos_token_ids)
        extras_id = self._extras.add(extras) if extras.needed else 0
        request_id = uuid.uuid4().hex
        mailbox = _Mailbox()
        manager = self._manager
        # The tokens that end the sequence: EOS unless ignore_eos, and the stop token ids.
        ends = {*params.stop_token_ids, *(() if params.ignore_eos else self.eos_token_ids)}
        self._add_handler(request_id, mailbox.put)
        try:
            submitted = manager.add_request(
                prompt_ids,
                request_id=request_id,
                max_new_tokens=params.max_tokens,
                streaming=True,
                eos_token_id=sorted(ends) or -1,
                **sampling.sampling_kwargs(
                    params.greedy,
                    params.temperature,
                    params.top_k,
                    params.top_p,
                    params.seed,
                    min_p=params.min_p,
                ),
                **({"extras": extras_id} if extras_id else {}),
            )
            if submitted is None:
                raise Unavailable(
                    "the generation engine is stopping or has failed", retry_after_s=5
                )
            async for step in self._steps(request_id, mailbox, params, extras):
                yield step
        finally:
            self._drop_handler(request_id)
            self._extras.drop(extras_id)

    async def _steps(
        self,
        request_id: str,
        mailbox: _Mailbox,
        params: SamplingParams,
        extras: sampling.RequestExtras,
    ) -> AsyncIterator[EngineStep]:
        self._waiting.add(request_id)
        sent = 0
        finished = False
        try:
            while True:
                output = mailbox.take()
                if output is None:
                    await mailbox.wait()
                    continue
                if output.error is not None:
                    finished = True
                    raise InternalError(f"generation failed: {output.error}")
                if sent == 0:
                    self._waiting.discard(request_id)
                    self._running.add(request_id)
                # The latest output holds every token so far: outputs delivered while this
                # coroutine waited for the event loop become one step.
                tokens = output.generated_tokens
                new = tokens[sent:]
                sent = len(tokens)
                logprobs = extras.take_logprobs(len(new)) if params.logprobs is not None else None
                if output.is_finished():
                    finished = True
                    yield EngineStep(new, self._finish_reason(tokens, params), logprobs)
                    return
                if new:
                    yield EngineStep(new, None, logprobs)
        finally:
            self._waiting.discard(request_id)
            self._running.discard(request_id)
            if not finished:
                # The client went away or a stop string matched: free the blocks now.
                self._manager.cancel_request(request_id)

    def _finish_reason(self, tokens: Sequence[int], params: SamplingParams) -> FinishReason:
        """The reason ``tokens`` ended: "stop" on an end or stop token (at max_tokens too,
        as the llama.cpp engine and vLLM say) or short of max_tokens, else "length"."""
        last = tokens[-1] if tokens else -1
        ended = last in params.stop_token_ids or (
            not params.ignore_eos and last in self.eos_token_ids
        )
        return "stop" if ended or len(tokens) < params.max_tokens else "length"

    def _build_lltokenizer(self) -> Any:
        from llguidance.hf import from_tokenizer

        return from_tokenizer(self._tokenizer, self.vocab_size, sorted(self.eos_token_ids) or None)

    def _add_handler(self, request_id: str, callback: Callable[[Any], None]) -> None:
        # What register_result_handler does, without the wrapper it puts around the
        # callback to drop it after the last output (a call and an is_finished() per
        # output): every path out of generate() drops it.
        router = self._manager.output_router
        loop = asyncio.get_running_loop()
        with router._lock:
            router.result_handlers[request_id] = (callback, loop)

    def _drop_handler(self, request_id: str) -> None:
        router = self._manager.output_router
        with router._lock:
            router.result_handlers.pop(request_id, None)

    # -- state ---------------------------------------------------------------------------

    def cache_stats(self) -> CacheStats:
        block_size = self._settings.block_size
        processor = self._manager.batch_processor
        if processor is None:
            return CacheStats(block_size, self._settings.num_blocks, 0, 0, 0, len(self._waiting))
        cache = processor.cache
        total = used = 0
        for allocator in cache.cache_allocators.values():
            free = cache.pool.count_free_blocks(allocator.index)
            free += cache.pool.num_free_sectors * allocator.blocks_per_sector
            total += allocator.num_blocks
            used += allocator.num_blocks - free
        tokens = 0
        # Read without a lock from the generation thread: a snapshot, off by a step at most.
        for state in list(processor.scheduler.active_requests.values()):
            tokens += int(getattr(state, "position_offset", 0))
        return CacheStats(block_size, total, used, tokens, len(self._running), len(self._waiting))

    async def close(self) -> None:
        await asyncio.to_thread(self._manager.stop, block=True)


class _Mailbox:
    """The newest output of one request, from the manager's result callback (run on the
    event loop) to the request's coroutine.

    Every output carries all the tokens so far, so only the newest matters: a slot and a
    future instead of an asyncio.Queue (no queue item, getter deque or loop lookup per
    token), and outputs that arrive while the coroutine waits for its turn on the loop
    are sent as one step: one text delta and one SSE event instead of several.
    """

    __slots__ = ("_latest", "_waiter")

    def __init__(self) -> None:
        self._latest: Any = None
        self._waiter: asyncio.Future[None] | None = None

    def put(self, output: Any) -> None:
        self._latest = output
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def take(self) -> Any:
        """The newest output not yet taken, or None."""
        output, self._latest = self._latest, None
        return output

    async def wait(self) -> None:
        """Until :meth:`put` is called."""
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        await waiter


def continuous_batching_config(settings: GenerationSettings) -> ContinuousBatchingConfig:
    """The manager's batching and cache settings for ``generation:`` (benchmarks running
    the manager alone use it too, so both sides run the same configuration)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    return ContinuousBatchingConfig(
        page_size=settings.block_size,
        num_blocks=settings.num_blocks,
        max_batch_tokens=settings.max_batch_tokens,
        max_requests_per_batch=settings.max_num_seqs,
        # Prefix sharing would make two sequences hold one block: utilisation
        # accounting and "cancel frees its blocks" both assume one owner per block.
        allow_block_sharing=False,
        # slipstream.llm.sampling's processors run inside the step and read their
        # arguments on the host (.tolist(), nonzero): a captured CUDA graph would
        # replay stale values, and capture refuses the synchronisation. transformers
        # turns graphs on by itself only with flash attention.
        use_cuda_graph=False,
        scheduler_type="fifo",
    )


def resolve_device(name: str) -> torch.device:
    """The torch device ``generation.device`` names (``cuda`` is ``cuda:0``).

    Raises :class:`~slipstream.config.ConfigError` naming the fix when this host has no
    such device, before anything is loaded.
    """
    import torch

    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ConfigError(
            f"generation.device: {name!r}, but torch {torch.__version__} sees no CUDA device "
            "on this host (torch.cuda.is_available() is false); set device: cpu, or serve "
            "the model on a host with a GPU and a CUDA build of torch"
        )
    count = torch.cuda.device_count()
    index = device.index or 0
    if index >= count:
        raise ConfigError(
            f"generation.device: {name!r}, but this host has {count} CUDA device(s): "
            f"cuda:0 to cuda:{count - 1}"
        )
    return torch.device("cuda", index)


# transformers' lazy module imports are not thread-safe (two threads importing at once
# can see a half-initialised module), so models load one at a time.
_LOAD_LOCK = threading.Lock()


def load_transformers_engine(path: Path, settings: GenerationSettings) -> TransformersEngine:
    """Load a model directory (``config.json`` + weights) or a ``.gguf`` file. Blocking.

    Example ``config.yaml`` of a model served on the first GPU::

        backend: transformers
        generation: {device: cuda, dtype: bfloat16, num_blocks: 4096}
    """
    with _LOAD_LOCK:
        return _load(path, settings)


def _load(path: Path, settings: GenerationSettings) -> TransformersEngine:
    import torch
    from transformers import AutoTokenizer

    device = resolve_device(settings.device)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    if path.is_file() and path.suffix == ".gguf":
        if settings.load_format == "dummy":
            raise ConfigError(
                f"generation.load_format: dummy builds a model from a config.json; {path} is "
                "a GGUF file (serve a Hugging Face directory, or use load_format: auto)"
            )
        where, extra = str(path.parent), {"gguf_file": path.name}
    elif path.is_dir() and (path / "config.json").is_file():
        where, extra = str(path), {}
    else:
        raise ValueError(
            f"{path}: expected a .gguf file or a Hugging Face model directory with config.json"
        )
    tokenizer = AutoTokenizer.from_pretrained(where, **extra)
    try:
        return _build_engine(where, extra, tokenizer, settings, device)
    except (torch.OutOfMemoryError, MemoryError) as exc:
        reason = _first_line(exc)
    # The failed model's tensors are freed with the exception's frames (the model and
    # its manager refer to each other, hence the collection); hand their memory back.
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    raise OutOfDeviceMemory(
        f"the model does not fit {device} in {settings.dtype} ({reason}); lower "
        f"generation.num_blocks ({settings.num_blocks} blocks of {settings.block_size} tokens) "
        f"or max_batch_tokens ({settings.max_batch_tokens}), pick a smaller dtype, or another "
        "device"
    )


def _build_engine(
    where: str,
    extra: dict[str, str],
    tokenizer: Any,
    settings: GenerationSettings,
    device: torch.device,
) -> TransformersEngine:
    import torch

    # The current CUDA device is the model's while it loads: transformers sizes the
    # cache against the current device's free memory.
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with on_device:
        model = build_model(where, settings, device, extra)
        return TransformersEngine(model, tokenizer, settings)


def build_model(
    where: str,
    settings: GenerationSettings,
    device: torch.device,
    extra: dict[str, str] | None = None,
) -> Any:
    """The causal LM the engine serves from ``where`` for ``settings`` (weights or, with
    ``load_format: dummy``, random weights of its config.json), on ``device``, ready for
    inference. ``extra``: ``from_pretrained`` arguments (``gguf_file``).

    Benchmarks build the model they run transformers' manager on with it, so both sides
    of a comparison run the same model::

        model = build_model("models/llama/1", GenerationSettings(load_format="dummy"),
                            resolve_device("cpu"))
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = getattr(torch, settings.dtype)
    model: Any
    if settings.load_format == "dummy":
        config = AutoConfig.from_pretrained(where)
        # Built where it runs: an 8B shape is never materialised in host memory.
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                config, dtype=dtype
            )
    else:
        model = AutoModelForCausalLM.from_pretrained(
            where, dtype=dtype, device_map=device, **(extra or {})
        )
    model.eval()
    model.requires_grad_(False)
    return model


def _backend_decode(tokenizer: Any) -> Callable[..., str] | None:
    """The Rust tokenizer's own ``decode`` when ``tokenizer.decode`` would return just its
    text, else None.

    Streaming decodes twice per token per sequence, and transformers' wrapper around the
    Rust call (argument conversion, kwargs, the clean-up check) measured as much again as
    the call itself on the event loop.
    """
    from tokenizers import Tokenizer
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    backend = getattr(tokenizer, "_tokenizer", None)
    kind = type(tokenizer)
    if (
        not isinstance(backend, Tokenizer)
        or kind.decode is not PreTrainedTokenizerBase.decode
        or getattr(kind, "_decode", None) is not TokenizersBackend._decode
    ):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        # transformers skips the clean-up for BPE models unless told to corrupt them.
        forced = getattr(
            tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
            False,
        )  # fmt: skip
        if type(backend.model).__name__ != "BPE" or forced:
            return None
    decode: Callable[..., str] = backend.decode
    return decode


def _first_line(error: BaseException | str) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return frozenset(i for i in ids if i >= 0)
