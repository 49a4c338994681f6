"""The OpenAI-compatible REST routes: /v1/models, completions, chat, embeddings.

Generation runs on :class:`~slipstream.llm.service.GenerationService`; embeddings run on any V2
model whose config.yaml names a ``tokenizer``, through the same batcher as V2 requests.
Every failure is answered in OpenAI's error shape. A streamed response checks the
request completely (400/404/503) before its first byte; a failure after that ends the
stream with an error event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from slipstream.errors import InternalError, ModelNotFound, SlipstreamError
from slipstream.llm.api import GenerationService, Job
from slipstream.llm.engine import Engine, SamplingParams
from slipstream.names import path_model_name
from slipstream.protocol import openai
from slipstream.server.httpd import HttpRequest, HttpResponse, StreamingResponse, error_reply
from slipstream.server.router import no_route
from slipstream.serving.embeddings import Embedder
from slipstream.serving.service import InferenceService

logger = logging.getLogger(__name__)

Reply = HttpResponse | StreamingResponse


class OpenAIApp:
    """Handles every ``/v1/...`` request; see the module docstring."""

    def __init__(self, llm: GenerationService, service: InferenceService, repository: Path) -> None:
        self._llm = llm
        self._service = service
        self._repository = repository
        self._embedder = Embedder(service, repository)

    async def handle(self, request: HttpRequest) -> Reply:
        try:
            return await self._dispatch(request)
        except SlipstreamError as exc:
            return _openai_error(exc)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("unhandled error on %s %s", request.method, request.path)
            return _openai_error(InternalError("internal server error; see the server log"))

    async def _dispatch(self, request: HttpRequest) -> Reply:
        route = request.path.rstrip("/")
        if request.method in ("GET", "HEAD"):
            if route == "/v1/models":
                return HttpResponse(200, openai.models_list(self._model_list()))
            if route.startswith("/v1/models/"):
                name = path_model_name(route.removeprefix("/v1/models/"))
                for entry, created in self._model_list():
                    if entry == name:
                        return HttpResponse(200, openai.model_card(name, created))
                raise ModelNotFound(f"model: {name!r} is not served here")
        if request.method == "POST":
            if route == "/v1/completions":
                return await self._completions(request)
            if route == "/v1/chat/completions":
                return await self._chat(request)
            if route == "/v1/embeddings":
                return await self._embeddings(request)
        raise no_route(request.method, request.path)

    def _model_list(self) -> list[tuple[str, int]]:
        models = dict(self._llm.models())
        started = int(time.time())
        for entry in self._service.repository_index(ready_only=True):
            if entry.name not in models and self._embedder.is_embedding_model(entry.name):
                models[entry.name] = started
        return sorted(models.items())

    # -- generation ----------------------------------------------------------------------

    async def _completions(self, request: HttpRequest) -> Reply:
        arrived = time.perf_counter()
        body: openai.CompletionRequest = openai.parse(request.body, openai.CompletionRequest)
        engine = self._llm.engine(body.model)
        given = body.prompts()  # 400 for an empty prompt list, before it is indexed
        flat = isinstance(body.prompt, list) and isinstance(body.prompt[0], int)
        prompts = []
        for index, prompt in enumerate(given):
            if isinstance(prompt, list):
                engine.check_token_ids(prompt, "prompt" if flat else f"prompt[{index}]")
                prompts.append(prompt)
            else:
                prompts.append(engine.encode(prompt))
        jobs = self._jobs(engine, body, prompts, body.max_tokens)
        return await self._respond(body, jobs, arrived, chat=False)

    async def _chat(self, request: HttpRequest) -> Reply:
        arrived = time.perf_counter()
        body: openai.ChatRequest = openai.parse(request.body, openai.ChatRequest)
        engine = self._llm.engine(body.model)
        prompt = engine.chat_prompt(body.chat())
        jobs = self._jobs(engine, body, [prompt], body.limit())
        return await self._respond(body, jobs, arrived, chat=True)

    def _jobs(
        self, engine: Engine, body: Any, prompts: list[list[int]], max_tokens: int | None
    ) -> list[Job]:
        stops = body.stops()
        jobs: list[Job] = []
        for prompt in prompts:
            limit = max_tokens
            if limit is None:  # OpenAI's default: as much as the context leaves, capped
                room = min(engine.max_model_len, engine.cache_tokens) - len(prompt)
                limit = max(1, min(self._llm.default_max_tokens(body.model), room))
            for _ in range(body.n):
                seed = None if body.seed is None else body.seed + len(jobs)
                params = SamplingParams(
                    max_tokens=limit,
                    temperature=body.temperature,
                    top_p=body.top_p,
                    top_k=max(body.top_k, 0),
                    seed=seed,
                    ignore_eos=body.ignore_eos,
                )
                jobs.append(Job(len(jobs), prompt, params, stops))
        return jobs

    async def _respond(self, body: Any, jobs: list[Job], arrived: float, chat: bool) -> Reply:
        self._llm.admit(body.model, jobs)
        rid = openai.new_id("chatcmpl" if chat else "cmpl")
        created = openai.now()
        prompt_tokens = sum(len(job.prompt_ids) for job in jobs[:: body.n])
        stream = self._llm.generate(body.model, jobs, arrived)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = _events(stream, rid, created, body.model, len(jobs), prompt_tokens,
                             chat, include_usage)  # fmt: skip
            return StreamingResponse(200, events)
        texts = [[""] for _ in jobs]
        reasons = ["stop"] * len(jobs)
        completion_tokens = [0] * len(jobs)
        async for index, delta in stream:
            texts[index].append(delta.text)
            completion_tokens[index] = delta.completion_tokens
            if delta.finish_reason is not None:
                reasons[index] = delta.finish_reason
        choices = [("".join(parts), reason) for parts, reason in zip(texts, reasons, strict=True)]
        use = openai.usage(prompt_tokens, sum(completion_tokens))
        build = openai.chat_completion if chat else openai.completion
        return HttpResponse(200, build(rid, created, body.model, choices, use))

    # -- embeddings ----------------------------------------------------------------------

    async def _embeddings(self, request: HttpRequest) -> Reply:
        body: openai.EmbeddingRequest = openai.parse(request.body, openai.EmbeddingRequest)
        vectors, prompt_tokens = await self._embedder.embed(body.model, body.texts())
        reply = openai.embeddings(body.model, vectors, body.encoding_format, prompt_tokens)
        return HttpResponse(200, reply)


async def _events(
    stream: AsyncIterator[tuple[int, Any]],
    rid: str,
    created: int,
    model: str,
    choices: int,
    prompt_tokens: int,
    chat: bool,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """The server-sent events of a streamed completion: role first, reason last, [DONE]."""
    extra = {"usage": None} if include_usage else {}
    if chat:
        for index in range(choices):
            role = openai.chat_chunk(
                rid, created, model, index, {"role": "assistant", "content": ""}, None
            )
            yield openai.sse(role | extra)
    completion_tokens = [0] * choices
    try:
        async for index, delta in stream:
            completion_tokens[index] = delta.completion_tokens
            if chat:
                if delta.text:
                    chunk = openai.chat_chunk(
                        rid, created, model, index, {"content": delta.text}, None
                    )
                    yield openai.sse(chunk | extra)
                if delta.finish_reason is not None:
                    last = openai.chat_chunk(rid, created, model, index, {}, delta.finish_reason)
                    yield openai.sse(last | extra)
            else:
                chunk = openai.completion_chunk(rid, created, model, index, delta.text,
                                                delta.finish_reason)  # fmt: skip
                yield openai.sse(chunk | extra)
    except SlipstreamError as exc:
        yield openai.error_event(exc)
        return
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()
    if include_usage:
        obj = "chat.completion.chunk" if chat else "text_completion"
        use = openai.usage(prompt_tokens, sum(completion_tokens))
        yield openai.usage_chunk(rid, created, model, obj, use)
    yield openai.SSE_DONE


def _openai_error(exc: SlipstreamError) -> HttpResponse:
    return error_reply(exc, openai.error(exc))
