"""The generation-service contract: what the OpenAI routes ask of the LLM lane.

The process runner builds one :class:`GenerationService` and hands it to two places:

* the serving core (:class:`slipstream.serving.core.ModelServer`), which only starts it
  (``load_all``), asks whether it is ready, and stops it (``close``): those three make
  it a *lane* of models beside the V2 models, and the core knows nothing else of it;
* the OpenAI app (``server/openai_rest.py``), which lists models, admits requests and streams
  their tokens through the rest.

An implementation owns its engines (:class:`slipstream.llm.engine.Engine`: transformers
today, llama.cpp or a GPU engine next). Admission errors are raised before anything
streams: :class:`~slipstream.errors.InvalidRequest` (400) for a request that can never
fit, :class:`~slipstream.errors.Unavailable` (503) for one that does not fit now,
:class:`~slipstream.errors.ModelNotFound` (404) for a name it does not serve.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from slipstream.llm.engine import Engine, EngineStep, SamplingParams
from slipstream.llm.text import TextDelta, stream_text


@dataclass(frozen=True, slots=True)
class Job:
    """One sequence to generate: choice ``index`` of a response."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    # Stop strings: generation ends before the first one that appears.
    stops: Sequence[str] = ()
    # vLLM's include_stop_str_in_output: the text ends after the stop string instead, and
    # keeps the text of a stop token id that ended it.
    include_stop: bool = False

    def text(
        self, steps: AsyncIterator[EngineStep], decode: Callable[[Sequence[int]], str]
    ) -> AsyncIterator[TextDelta]:
        """The job's text deltas from its engine's ``steps``, its stop rules applied."""
        params = self.params
        return stream_text(steps, decode, self.stops, self.include_stop, params.min_tokens,
                           params.stop_token_ids)  # fmt: skip


@dataclass(frozen=True, slots=True)
class AdapterCard:
    """A LoRA adapter served as a model of its own name (vLLM's ``--lora-modules``)."""

    # The generative model it runs on (its ``config.yaml`` names the adapter).
    parent: str
    # The adapter's file as ``generation.lora_modules`` names it (vLLM lists its path).
    root: str


class GenerationService(ABC):
    """The repository's generative models; see the module docstring."""

    # -- lifecycle (what the serving core uses) -----------------------------------------

    @abstractmethod
    async def load_all(self, only: set[str] | None = None) -> None:
        """Load every generative model of the repository (or those named in ``only``)."""

    @abstractmethod
    def is_ready(self) -> bool:
        """False while a model is still loading."""

    @abstractmethod
    async def close(self) -> None:
        """Stop every engine; unfinished sequences end."""

    # -- requests (what the OpenAI routes use) --------------------------------------------

    @abstractmethod
    def models(self) -> list[tuple[str, int]]:
        """(name, created unix time) of every ready model."""

    def adapters(self) -> dict[str, AdapterCard]:
        """The LoRA adapters among :meth:`models`, by name (none unless a lane has them)."""
        return {}

    async def wake(self, name: str) -> None:  # noqa: B027 - most lanes never sleep
        """Load ``name`` again if it was unloaded for being idle, waiting for it (503 past
        the wait); nothing for a model that is loaded or unknown."""

    @abstractmethod
    def engine(self, name: str) -> Engine:
        """The engine serving ``name`` (its tokenizer, limits and templates)."""

    @abstractmethod
    def default_max_tokens(self, name: str) -> int:
        """max_tokens for a request that sets none."""

    @abstractmethod
    def admit(self, model: str, jobs: Sequence[Job]) -> Engine:
        """Check every job fits before anything streams; return the engine."""

    @abstractmethod
    def generate(
        self, model: str, jobs: Sequence[Job], arrived: float
    ) -> AsyncIterator[tuple[int, TextDelta]]:
        """Run the jobs concurrently; yield (job index, delta) as deltas come.

        ``arrived`` is the request's ``time.perf_counter()`` at arrival (TTFT and
        end-to-end latency count from it). Closing the iterator cancels every unfinished
        sequence and frees what it held.
        """
