"""The generative models on the V2 routes, as Triton's vLLM backend shows a model.

:class:`GenerativeV2` is the :class:`InferenceService` the V2 front ends (HTTP, gRPC,
the generate extension) run on: it passes every call to the serving core and answers
those the core refuses as naming a generative model (``GenerativeModel``, the LLM
lane's) itself, so a tensor model's request costs nothing more. A generative model then
has the metadata and config of a vLLM backend model (inputs ``text_input``, ``stream``,
``sampling_parameters``...; output ``text_output``; decoupled), its requests run on the
LLM lane's own generation (:mod:`slipstream.server.openai_generation` builds the jobs, as
for /v1/completions, so greedy texts are the same), and its statistics count them.

``backend`` is reported as ``vllm`` because that is the request contract clients branch
on (Triton's OpenAI front end and LLM tools pick the vLLM request format by it); the
engine that really runs the model is the config's ``slipstream_backend`` parameter.

In the split layout this wraps the engine process's core, so the front ends reach it
through the engine's calls unchanged. A request that streams (``stream: true``) raises
``Decoupled`` from :meth:`infer` as any decoupled model's does; gRPC ModelStreamInfer
(which sends a decoupled model's requests straight to :meth:`infer_stream`) and
/generate_stream read its answers from :meth:`infer_stream`.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence

import numpy as np

from slipstream.config import ModelConfig
from slipstream.config.sections import TransactionPolicy
from slipstream.errors import (
    Decoupled,
    GenerativeModel,
    InternalError,
    InvalidRequest,
    ModelNotFound,
    SlipstreamError,
    Unavailable,
)
from slipstream.llm.engine import ContextLengthExceeded
from slipstream.llm.service import LlmModels
from slipstream.observability.stats import ModelStats, ResponseOutcome, add_response
from slipstream.protocol.vllm_requests import INPUTS, OUTPUTS, TextRequest, read_text_request
from slipstream.repository.layout import model_path, read_config, read_model_directory
from slipstream.server.openai_generation import build_jobs
from slipstream.serving.forwarding import ForwardingService
from slipstream.serving.service import InferenceService, StreamItem, unstack
from slipstream.types import (
    InferRequest,
    InferResponse,
    ModelMetadata,
    TensorMetadata,
)

# What the metadata's platform and the config's backend say (see the module docstring).
VLLM_BACKEND = "vllm"
_OUTPUT_NAMES = tuple(tensor.name for tensor in OUTPUTS)


class GenerativeV2(ForwardingService):
    """``inner`` (the serving core) with ``llm``'s models on the V2 routes too."""

    def __init__(self, inner: InferenceService, llm: LlmModels) -> None:
        super().__init__(inner)
        self._llm = llm
        # Each generative model version's V2 requests, as Triton's statistics count them.
        self._stats: dict[tuple[str, str], ModelStats] = {}

    # -- metadata ------------------------------------------------------------------------

    async def model_metadata(self, name: str, version: str = "") -> ModelMetadata:
        try:
            return await self._inner.model_metadata(name, version)
        except GenerativeModel:
            served = self._served_version(name, version)
        inputs = [TensorMetadata(t.name, t.data_type, list(t.dims)) for t in INPUTS]
        outputs = [TensorMetadata(t.name, t.data_type, list(t.dims)) for t in OUTPUTS]
        return ModelMetadata(name, [served], VLLM_BACKEND, inputs, outputs)

    async def model_config(self, name: str, version: str = "") -> ModelConfig:
        try:
            return await self._inner.model_config(name, version)
        except GenerativeModel:
            self._served_version(name, version)
        own = read_config(read_model_directory(model_path(self._llm.repository, name)))
        return own.model_copy(update={
            "name": name, "backend": VLLM_BACKEND, "platform": "", "max_batch_size": 0,
            "input": list(INPUTS), "output": list(OUTPUTS),
            "model_transaction_policy": TransactionPolicy(decoupled=True),
            "parameters": {**own.parameters, "slipstream_backend": own.backend},
        })  # fmt: skip

    async def model_statistics(self, name: str = "", version: str = "") -> list[ModelStats]:
        if not name:
            found = await self._inner.model_statistics("", version)
            found += [copy.deepcopy(stats) for key, stats in self._stats.items()
                      if version in ("", key[1])]  # fmt: skip
            return sorted(found, key=lambda stats: (stats.name, stats.version))
        try:
            return await self._inner.model_statistics(name, version)
        except GenerativeModel:
            served = self._served_version(name, version)
        return [copy.deepcopy(self._stats.get((name, served)) or ModelStats(name, served))]

    def _served_version(self, name: str, version: str) -> str:
        """The version of generative model ``name`` served now (loaded, or asleep and
        loaded again by its next request); ModelNotFound naming why there is none."""
        served = self._llm.version_of(name)
        if served is None:
            try:
                engine = self._llm.engine(name)  # raises the reason: loading, not loaded...
            except Unavailable as exc:
                raise ModelNotFound(exc.message) from None
            raise ModelNotFound(f"model {name!r} failed: {engine.failure}")
        if version not in ("", str(served)):
            raise ModelNotFound(
                f"model {name!r} has no version {version!r}; version {served} is served"
            )
        return str(served)

    # -- inference -----------------------------------------------------------------------

    def _served(self, name: str) -> bool:
        """Whether the LLM lane serves ``name`` now (two dict lookups: a tensor model's
        request pays no more; one not loaded is refused by the core, then answered)."""
        return self._llm.version_of(name) is not None

    async def infer(self, request: InferRequest) -> InferResponse:
        if self._served(request.model_name):
            return await self._generate_once(request)
        try:
            return await self._inner.infer(request)
        except GenerativeModel:
            return await self._generate_once(request)

    async def infer_stream(self, request: InferRequest) -> AsyncIterator[StreamItem]:
        """A generative model's answers (every new piece of text when it streams), or
        the core's."""
        if not self._served(request.model_name):
            answers = self._inner.infer_stream(request)
            try:
                first = await anext(answers, None)
            except GenerativeModel:
                pass  # one not served now: the generation below names why
            else:
                try:
                    if first is not None:
                        yield first
                    async for item in answers:
                        yield item
                finally:
                    aclose = getattr(answers, "aclose", None)
                    if aclose is not None:
                        await aclose()
                return
        version = self._served_version(request.model_name, request.model_version)
        text = read_text_request(request)
        started_ns = time.perf_counter_ns()
        clock = _ResponseClock(self._stats_of(request.model_name, version), started_ns)
        generated = self._generate(request, text, version)
        final, left_ns = False, 0
        try:
            async for response, final, arrived_ns in generated:
                clock.answered("success", arrived_ns)
                yield response, "", final
        except SlipstreamError:
            clock.answered("fail")
            self._count(request.model_name, version, started_ns, ok=False)
            raise
        except (GeneratorExit, asyncio.CancelledError):
            left_ns = 0 if final else time.perf_counter_ns()  # the client left mid-stream
            raise
        finally:
            await generated.aclose()
            if left_ns:
                clock.cancelled(left_ns)
        self._count(request.model_name, version, started_ns, ok=True)

    async def infer_group(
        self, requests: Sequence[InferRequest]
    ) -> list[InferResponse | Exception]:
        answers = await self._inner.infer_group(requests)
        return await self._generate_refused(answers, requests)

    async def infer_stack(
        self, stacked: InferRequest, parts: Sequence[InferRequest], rows: Sequence[int]
    ) -> InferResponse | list[InferResponse | Exception]:
        try:
            answers = await self._inner.infer_stack(stacked, parts, rows)
        except GenerativeModel:
            return await self.infer_group(unstack(stacked, parts, rows))
        if isinstance(answers, InferResponse):
            return answers
        return await self._generate_refused(answers, unstack(stacked, parts, rows))

    async def _generate_refused(
        self, answers: list[InferResponse | Exception], requests: Sequence[InferRequest]
    ) -> list[InferResponse | Exception]:
        """``answers`` with the generative models' refusals answered by generating."""
        refused = [i for i, answer in enumerate(answers) if isinstance(answer, GenerativeModel)]

        async def one(index: int) -> None:
            try:
                answers[index] = await self._generate_once(requests[index])
            except Exception as exc:
                answers[index] = exc

        await asyncio.gather(*(one(index) for index in refused))
        return answers

    async def check(self, request: InferRequest) -> None:
        try:
            if not self._served(request.model_name):
                await self._inner.check(request)
                return
        except GenerativeModel:
            pass
        self._served_version(request.model_name, request.model_version)
        read_text_request(request)

    async def _generate_once(self, request: InferRequest) -> InferResponse:
        """A request that does not stream: its one answer, the whole text."""
        version = self._served_version(request.model_name, request.model_version)
        text = read_text_request(request)
        if text.stream:
            raise Decoupled(
                f"model {request.model_name!r}: a request with stream true answers each new "
                "piece of text; read them on gRPC ModelStreamInfer or POST "
                f"/v2/models/{request.model_name}/generate_stream (or send stream false)"
            )
        started_ns = time.perf_counter_ns()
        clock = _ResponseClock(self._stats_of(request.model_name, version), started_ns)
        generated = self._generate(request, text, version)
        answer: InferResponse | None = None
        arrived_ns = 0  # when the whole text was there
        try:
            async for response, _final, text_ns in generated:
                answer, arrived_ns = response, text_ns  # one answer: the whole text
        except SlipstreamError:
            clock.answered("fail")
            self._count(request.model_name, version, started_ns, ok=False)
            raise
        finally:
            await generated.aclose()
        if answer is None:  # a generation always ends with its finish reason
            raise InternalError("the generation ended without an answer; see the server log")
        clock.answered("success", arrived_ns)
        self._count(request.model_name, version, started_ns, ok=True)
        return answer

    async def _generate(
        self, request: InferRequest, text: TextRequest, version: str
    ) -> AsyncGenerator[tuple[InferResponse, bool, int], None]:
        """The request's answers, whether each is the last, and when its text came from
        the engine (perf_counter_ns): one per new piece of text when it streams, else one
        with the whole text. Closing it cancels the sequence."""
        arrived = time.perf_counter()
        name = request.model_name
        wanted = _wanted_outputs(request, text)
        await self._llm.wake(name)
        engine = self._llm.engine(name)
        prompt_ids = engine.encode(text.prompt)
        if not prompt_ids:
            raise InvalidRequest("text_input: the prompt is empty; send the text to continue")
        jobs = build_jobs(engine, text.sampling, [prompt_ids], text.max_tokens, text.max_tokens,
                          None, None)  # fmt: skip
        try:
            self._llm.admit(name, jobs)
        except ContextLengthExceeded as exc:
            raise exc.naming(f"{text.sampling_source}.max_tokens", "text_input") from None
        except InvalidRequest as exc:  # a token id beyond the vocabulary: named where sent
            if exc.message.startswith(("logit_bias:", "stop_token_ids:")):
                raise InvalidRequest(f"{text.sampling_source}.{exc.message}") from None
            raise
        answer = _Answer(name, version, request.id, wanted, len(prompt_ids))
        deltas = self._llm.generate(name, jobs, arrived)
        pieces: list[str] = [text.prompt] if text.prepend_input else []
        try:
            async for _, delta in deltas:
                arrived_ns = time.perf_counter_ns()
                final = delta.finish_reason is not None
                if text.stream:
                    made = answer.of(delta.text, delta.finish_reason, delta.completion_tokens)
                    yield made, final, arrived_ns
                    continue
                pieces.append(delta.text)
                if final:
                    whole = "".join(pieces)
                    made = answer.of(whole, delta.finish_reason, delta.completion_tokens)
                    yield made, True, arrived_ns
        finally:
            aclose = getattr(deltas, "aclose", None)
            if aclose is not None:
                await aclose()

    def _stats_of(self, name: str, version: str) -> ModelStats:
        stats = self._stats.get((name, version))
        if stats is None:
            stats = self._stats[name, version] = ModelStats(name, version)
        return stats

    def _count(self, name: str, version: str, started_ns: int, ok: bool) -> None:
        stats = self._stats_of(name, version)
        elapsed_ns = time.perf_counter_ns() - started_ns
        if ok:
            stats.inference_stats.success.add(elapsed_ns)
            stats.inference_stats.compute_infer.add(elapsed_ns)
            stats.inference_count += 1
            stats.execution_count += 1
            stats.last_inference_ms = int(time.time() * 1000)
        else:
            stats.inference_stats.fail.add(elapsed_ns)


class _ResponseClock:
    """Times one request's answers into its model's ``response_stats``, as Triton's
    decoupled backends report them: each from the request's start (then the previous
    answer) to its text from the engine, then to the answer made and handed over."""

    def __init__(self, stats: ModelStats, started_ns: int) -> None:
        self._responses = stats.response_stats
        self._begun_ns = started_ns
        self._index = 0

    def answered(self, outcome: ResponseOutcome, output_start_ns: int = 0) -> None:
        end_ns = time.perf_counter_ns()
        add_response(self._responses, self._index, outcome=outcome, start_ns=self._begun_ns,
                     output_start_ns=output_start_ns, end_ns=end_ns)  # fmt: skip
        self._index += 1
        self._begun_ns = end_ns

    def cancelled(self, left_ns: int) -> None:
        """The client left at ``left_ns``; the generation is cancelled now."""
        add_response(self._responses, self._index, outcome="cancel", start_ns=left_ns,
                     end_ns=time.perf_counter_ns())  # fmt: skip


class _Answer:
    """Builds one request's answers: text_output and the optional outputs it asked for."""

    def __init__(
        self, model: str, version: str, request_id: str, wanted: tuple[str, ...], prompt_tokens: int
    ) -> None:
        self._model, self._version, self._id = model, version, request_id
        self._wanted = wanted
        self._prompt_tokens = prompt_tokens
        self._tokens_sent = 0

    def of(self, text: str, reason: str | None, completion_tokens: int) -> InferResponse:
        """The answer carrying ``text``; ``completion_tokens`` generated so far."""
        values: dict[str, np.ndarray] = {
            "text_output": np.array([text.encode()], dtype=object),
            # vLLM's str() of a reason not yet known, as the backend sends it.
            "finish_reason": np.array([str(reason).encode()], dtype=object),
            "num_input_tokens": np.array([self._prompt_tokens], dtype=np.uint32),
            "num_output_tokens": np.array([completion_tokens - self._tokens_sent], np.uint32),
        }
        self._tokens_sent = completion_tokens
        outputs = {name: values[name] for name in self._wanted}
        return InferResponse(self._model, self._version, outputs, self._id)


def _wanted_outputs(request: InferRequest, text: TextRequest) -> tuple[str, ...]:
    """The outputs to send: those the request names, else text_output and those its
    return_* inputs ask for. Shared memory and classification are not served here."""
    if request.shared_memory_inputs:
        raise InvalidRequest(
            f"{next(iter(request.shared_memory_inputs))}: shared-memory inputs are not "
            "served for a generative model; send text_input in the request"
        )
    if request.outputs:
        for output in request.outputs:
            if output.name not in _OUTPUT_NAMES:
                raise InvalidRequest(
                    f"output {output.name!r}: model {request.model_name!r} has no such output "
                    f"(outputs: {', '.join(_OUTPUT_NAMES)})"
                )
            if output.shared_memory is not None or output.classification:
                raise InvalidRequest(
                    f"output {output.name!r}: shared memory and classification are not served "
                    "for a generative model's text"
                )
        return tuple(output.name for output in request.outputs)
    flags = {"finish_reason": text.finish_reason, "num_input_tokens": text.num_input_tokens,
             "num_output_tokens": text.num_output_tokens}  # fmt: skip
    return ("text_output", *(name for name, asked in flags.items() if asked))
