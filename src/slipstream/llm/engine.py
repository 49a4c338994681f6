"""The contract every generation engine fulfils, whatever runs the model underneath.

An engine owns a model, its tokenizer and its KV cache. It takes prompt token ids and
sampling settings and streams back new token ids, one :class:`EngineStep` per decode
step that produced tokens for that sequence. Text (detokenization, stop strings) and
the OpenAI wire format live above it, in :mod:`slipstream.llm.service`, so a vLLM or
llama.cpp engine only has to implement this module's :class:`Engine`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from slipstream.errors import InvalidRequest
from slipstream.llm.constraints import compile_constraint
from slipstream.types import Constraint

FinishReason = Literal["stop", "length"]

# Temperatures below this sample greedily, the limit softmax(logits / T) tends to as T
# goes to 0 (vLLM's bound too). Dividing by them instead overflows: 1 / 5.8e-193 is
# infinite in float32, and 0 * inf made the largest logit's weight NaN (a 500).
GREEDY_BELOW = 1e-5


class ContextLengthExceeded(InvalidRequest):
    """A prompt and completion longer than the model's context: a 400 that OpenAI's
    clients recognise by ``code`` (LiteLLM and LangChain trim the conversation and retry
    on ``context_length_exceeded``) and by the message's first sentence, OpenAI's words.

    ``param`` names the field to change: the route calls :meth:`naming` with the field
    the client sent (max_tokens, max_completion_tokens), or the prompt's field when the
    client sent no maximum and the prompt alone fills the context.
    """

    # OpenAI's error code for it; the OpenAI error writer sends it as ``code``.
    code = "context_length_exceeded"

    def __init__(
        self,
        max_model_len: int,
        prompt_tokens: int,
        max_tokens: int,
        param: str = "max_tokens",
        prompt_field: str = "prompt",
        max_sent: bool = True,
    ) -> None:
        self.max_model_len = max_model_len
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        # The request field at fault, as OpenAI's error ``param``.
        self.param = param
        first = f"This model's maximum context length is {max_model_len} tokens. However, "
        if max_sent:
            needed = prompt_tokens + max_tokens
            message = (
                f"you requested {needed} tokens ({prompt_tokens} in the {prompt_field}, "
                f"{max_tokens} in the completion). Please reduce the length of the "
                f"{prompt_field} or {param}, so that both fit the context length of "
                f"{max_model_len} tokens."
            )
        else:
            message = (
                f"your {prompt_field} resulted in {prompt_tokens} tokens, which leaves no "
                f"room for a completion. Please reduce the length of the {prompt_field} to "
                f"less than the context length of {max_model_len} tokens."
            )
        super().__init__(first + message)

    def naming(self, sent: str | None, prompt_field: str) -> ContextLengthExceeded:
        """The same refusal in the request's own fields: ``sent`` is the maximum field the
        client sent (None: none), ``prompt_field`` where its prompt is (messages, prompt,
        input)."""
        return ContextLengthExceeded(
            self.max_model_len,
            self.prompt_tokens,
            self.max_tokens,
            param=sent or prompt_field,
            prompt_field=prompt_field,
            max_sent=sent is not None,
        )


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token. A temperature of 0 (or below ``GREEDY_BELOW``)
    means greedy."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    # 0 means no top-k cut.
    top_k: int = 0
    # Set: the sampled sequence depends only on the seed and the prompt, never on which
    # other sequences share the batch.
    seed: int | None = None
    # Keep generating past the end-of-sequence token (benchmarks use it).
    ignore_eos: bool = False
    # OpenAI's penalties on tokens already generated: minus presence once, minus
    # frequency per occurrence. 0 disables.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # The HF/vLLM extension over prompt and output tokens: positive logits divided by
    # it, negative ones multiplied. 1 disables.
    repetition_penalty: float = 1.0
    # Added to the logits of these token ids (OpenAI's logit_bias, -100..100).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # None: no logprobs; k >= 0: the chosen token's logprob and the k most likely.
    logprobs: int | None = None
    # Set: only texts of this language can be generated.
    constraint: Constraint | None = None
    # vLLM's extensions, as its SamplingParams defines them. min_p: a sampled token's
    # probability is at least min_p times the most likely one's, after temperature (0:
    # no cut; greedy steps are unchanged).
    min_p: float = 0.0
    # min_tokens: until this many tokens are generated, the end-of-sequence tokens (unless
    # ignore_eos) and stop_token_ids cannot be, and no stop string matches (llm/text.py).
    min_tokens: int = 0
    # stop_token_ids: generating one of them ends the sequence (finish_reason "stop").
    stop_token_ids: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's log-probability and the most likely alternatives at its step.

    Log-probabilities of the distribution the token was drawn from: the model's logits
    after penalties, logit bias and temperature (greedy steps: without temperature).
    """

    token_id: int
    logprob: float
    # (token id, logprob), most likely first; as many as the request asked for.
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class EngineStep:
    """New tokens for one sequence; ``finish_reason`` is set on its last step."""

    token_ids: Sequence[int]
    finish_reason: FinishReason | None = None
    # One per token of ``token_ids`` when the request asked for logprobs.
    logprobs: Sequence[TokenLogprob] | None = None


@dataclass(frozen=True, slots=True)
class CacheStats:
    """The KV cache and the sequences using it, at one instant."""

    block_size: int
    blocks_total: int
    blocks_used: int
    # Tokens whose keys and values sit in the used blocks.
    tokens_cached: int
    running: int
    waiting: int
    # Prompt tokens asked for and found in the cache (engines with prefix caching).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # CPU threads of the forward passes now (0: the engine does not say).
    cpu_threads: int = 0

    @property
    def blocks_free(self) -> int:
        return self.blocks_total - self.blocks_used

    @property
    def utilization(self) -> float:
        """Token slots holding a token / token slots in blocks handed to sequences."""
        reserved = self.blocks_used * self.block_size
        return self.tokens_cached / reserved if reserved else 0.0


class Engine(ABC):
    """A loaded generative model; see the module docstring."""

    #: Longest prompt + completion the model takes, in tokens.
    max_model_len: int
    #: Token capacity of the KV cache.
    cache_tokens: int
    #: Most tokens one sequence can hold in the cache (engines with a cache divided per
    #: sequence set less than cache_tokens).
    sequence_tokens: int
    #: Token ids run from 0 to vocab_size - 1; a prompt of ids is checked against it.
    vocab_size: int

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` as a completion prompt (special tokens as the model wants)."""

    @abstractmethod
    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of a chat, rendered by the model's chat template, ready to answer.

        ``tools`` (OpenAI's tool dicts) go to the template's ``tools`` variable; pass them
        only when :attr:`template_knows_tools`. ``variables`` are more of the template's
        variables (vLLM's ``chat_template_kwargs``, e.g. ``{"enable_thinking": False}``):
        none of them may be a name the rendering sets itself (``messages``, ``tools``...).
        """

    @property
    def template_knows_tools(self) -> bool:
        """Whether the chat template renders tools and tool calls itself."""
        return False

    @property
    def failure(self) -> str | None:
        """Why this engine can no longer generate (its loop died), or None while it can;
        the repository index then lists the model UNAVAILABLE with it."""
        return None

    @abstractmethod
    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``, special tokens dropped."""

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a piece of a UTF-8 character, maybe)."""
        return self.decode([token_id]).encode()

    def check_features(self, params: SamplingParams) -> None:
        """400 for what ``params`` asks that this model cannot give: a logit bias, a stop
        token id or a logprobs count beyond the vocabulary, a constraint that does not
        compile (checked before anything streams)."""
        for token, _bias in params.logit_bias:
            if not 0 <= token < self.vocab_size:
                raise InvalidRequest(
                    f"logit_bias: token id {token} is outside the model's vocabulary "
                    f"(ids 0 to {self.vocab_size - 1})"
                )
        for token in params.stop_token_ids:
            if not 0 <= token < self.vocab_size:
                raise InvalidRequest(
                    f"stop_token_ids: token id {token} is outside the model's vocabulary "
                    f"(ids 0 to {self.vocab_size - 1})"
                )
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise InvalidRequest(f"logprobs: at most the vocabulary's {self.vocab_size} tokens")
        if params.constraint is not None:
            compile_constraint(params.constraint)

    def check_token_ids(self, token_ids: Sequence[int], field: str) -> None:
        """400 naming ``field`` when a prompt given as ids holds one outside the vocabulary
        (llama.cpp would fail the whole batch's decode step on it)."""
        largest = max(token_ids, default=0)
        if largest >= self.vocab_size:
            raise InvalidRequest(
                f"{field}: token id {largest} is outside the model's vocabulary "
                f"(ids 0 to {self.vocab_size - 1})"
            )

    def admit(self, prompt_tokens: int, max_tokens: int) -> None:
        """Refuse a request before it streams: 400 if it can never fit, 503 if full now."""
        if prompt_tokens == 0:
            raise InvalidRequest("prompt: must contain at least one token")
        needed = prompt_tokens + max_tokens
        if needed > self.max_model_len:
            raise ContextLengthExceeded(self.max_model_len, prompt_tokens, max_tokens)
        if needed > self.sequence_tokens:
            where = (
                "the KV cache"
                if self.sequence_tokens == self.cache_tokens
                else "one sequence's KV stream"
            )
            raise InvalidRequest(
                f"max_tokens: prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
                f"{needed} tokens can never fit {where} of {self.sequence_tokens} tokens "
                "(generation.num_blocks x generation.block_size in config.yaml"
                + ("" if where == "the KV cache" else ", divided by max_num_seqs")
                + ")"
            )
        self._check_queue()

    @abstractmethod
    def _check_queue(self) -> None:
        """Raise :class:`~slipstream.errors.Unavailable` when no more sequences may wait."""

    @abstractmethod
    def generate(
        self, prompt_ids: list[int], params: SamplingParams, adapter: str | None = None
    ) -> AsyncIterator[EngineStep]:
        """Stream the completion of one prompt; ``adapter``: the LoRA adapter (by its
        ``generation.lora_modules`` name) to run the model with, None for none.

        Raises :class:`~slipstream.errors.Unavailable` at once when the waiting queue
        is full. Closing the iterator early cancels the sequence and frees its cache.
        """

    @abstractmethod
    def cache_stats(self) -> CacheStats: ...

    @abstractmethod
    async def close(self) -> None: ...
