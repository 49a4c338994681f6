"""The OpenAI-compatible REST routes: /v1/models, completions, chat, responses, embeddings,
vLLM's /v1/score and /v1/rerank (also at /rerank and /v2/rerank, as vLLM answers it), and
vLLM's /classify.

Generation runs on :class:`~slipstream.llm.service.GenerationService`; embeddings, scores
and classes run on any V2 model whose config.yaml names a ``tokenizer``, through the same
batcher as V2 requests.
Every failure is answered in OpenAI's error shape. A streamed response checks the
request completely (400/404/503) before its first byte; a failure after that ends the
stream with an error event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from slipstream.errors import InternalError, ModelNotFound, SlipstreamError
from slipstream.llm.api import GenerationService, Job
from slipstream.llm.tools import Tool
from slipstream.names import path_model_name
from slipstream.observability.metrics import ServerMetrics
from slipstream.protocol import openai, openai_classify, openai_score
from slipstream.protocol import openai_replies as replies
from slipstream.server.httpd import HttpRequest, HttpResponse, StreamingResponse, error_reply
from slipstream.server.openai_cache import GenerationCache
from slipstream.server.openai_generation import (
    Pieces,
    StreamHead,
    admit,
    build_jobs,
    chat_with_tools,
    collect,
    own_constraint,
    read_tool_calls,
    replay_events,
    sse_events,
)
from slipstream.server.openai_responses import respond
from slipstream.server.openai_tool_stream import auto_tool_events
from slipstream.server.router import no_route
from slipstream.serving.cache import ResponseCache
from slipstream.serving.embeddings import Embedder
from slipstream.serving.scoring import Scorer
from slipstream.serving.service import InferenceService
from slipstream.serving.text_classification import Classifier

logger = logging.getLogger(__name__)

Reply = HttpResponse | StreamingResponse

# vLLM answers its rerank route at all three paths (Jina's and Cohere's clients differ).
RERANK_ROUTES = frozenset(("/v1/rerank", "/rerank", "/v2/rerank"))


class OpenAIApp:
    """Handles every ``/v1/...`` request; see the module docstring."""

    def __init__(
        self,
        llm: GenerationService,
        service: InferenceService,
        repository: Path,
        cache: ResponseCache | None = None,
        metrics: ServerMetrics | None = None,
    ) -> None:
        """``cache``: the server's --cache, for deterministic generations of the models
        whose config enables response_cache (see ``openai_cache.py``), counted in
        ``metrics``' nv_cache_* series."""
        self._llm = llm
        self._service = service
        self._repository = repository
        self._embedder = Embedder(service, repository)
        self._scorer = Scorer(self._embedder, service)
        self._classifier = Classifier(self._embedder, self._scorer, service, repository)
        self._cached = (
            GenerationCache(cache, llm, repository, metrics) if cache is not None else None
        )

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
                listed = await self._model_list()
                if request.models is not None:  # only what the caller's key may use
                    listed = [entry for entry in listed if entry[0] in request.models]
                return HttpResponse(200, replies.models_list(listed, self._lineage()))
            if route.startswith("/v1/models/"):
                name = path_model_name(route.removeprefix("/v1/models/"))
                for entry, created in await self._model_list():
                    if entry == name:
                        return HttpResponse(200, replies.model_card(name, created,
                                                                    self._lineage()))  # fmt: skip
                raise ModelNotFound(f"model: {name!r} is not served here")
        if request.method == "POST":
            if route == "/v1/completions":
                if self._cached is not None:
                    return await self._cached.answer(route, request, self._completions)
                return await self._completions(request)
            if route == "/v1/chat/completions":
                if self._cached is not None:
                    return await self._cached.answer(route, request, self._chat)
                return await self._chat(request)
            if route == "/v1/embeddings":
                return await self._embeddings(request)
            if route == "/v1/score":
                return await self._score(request)
            if route in RERANK_ROUTES:
                return await self._rerank(request)
            if route == "/classify":
                return await self._classify(request)
            if route == "/v1/responses":
                return await respond(self._llm, request.body, time.perf_counter())
        raise no_route(request.method, request.path)

    def _lineage(self) -> replies.Lineage:
        """vLLM's ``root`` (its file) and ``parent`` (its model) of each LoRA adapter."""
        adapters = self._llm.adapters()
        return {name: {"root": card.root, "parent": card.parent} for name, card in adapters.items()}

    async def _model_list(self) -> list[tuple[str, int]]:
        """(name, created) of the generative and embedding models served. An embedding
        model asleep (idle-unloaded, README "Scale to zero") is served, its next request
        loads it; one that failed or that the operator unloaded is not."""
        models = dict(self._llm.models())
        for entry in await self._service.repository_index():
            asleep = (entry.state, entry.reason) == ("UNAVAILABLE", "idle")
            if entry.name in models or not (entry.state == "READY" or asleep):
                continue
            if await self._embedder.is_embedding_model(entry.name):
                models[entry.name] = self._embedder.created(entry.name)
        return sorted(models.items())

    # -- generation ----------------------------------------------------------------------

    async def _completions(self, request: HttpRequest) -> Reply:
        arrived = time.perf_counter()
        body: openai.CompletionRequest = openai.parse(request.body, openai.CompletionRequest)
        await self._llm.wake(body.model)
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
        jobs = build_jobs(engine, body, prompts, body.max_tokens,
                          self._llm.default_max_tokens(body.model), body.logprobs,
                          own_constraint(body))  # fmt: skip
        # echo: each choice's text starts with its prompt's.
        echoes = [engine.decode(job.prompt_ids) for job in jobs] if body.echo else None
        return await self._respond(body, jobs, arrived, chat=False, echoes=echoes)

    async def _chat(self, request: HttpRequest) -> Reply:
        arrived = time.perf_counter()
        body: openai.ChatRequest = openai.parse(request.body, openai.ChatRequest)
        await self._llm.wake(body.model)
        engine = self._llm.engine(body.model)
        choice = body.choice()
        offered = body.tools or [] if choice != "none" else []
        tools = [Tool(t.function.name, t.function.description, t.function.parameters)
                 for t in offered]  # fmt: skip
        prompt, constraint = chat_with_tools(
            engine, body.chat(), tools, choice, body.parallel_tool_calls, own_constraint(body),
            body.chat_template_kwargs,
        )  # fmt: skip
        jobs = build_jobs(engine, body, [prompt], body.limit(),
                          self._llm.default_max_tokens(body.model), body.wanted_logprobs(),
                          constraint)  # fmt: skip
        if tools:
            return await self._respond_with_tools(body, jobs, arrived, tools, choice)
        return await self._respond(body, jobs, arrived, chat=True)

    async def _respond(
        self,
        body: Any,
        jobs: list[Job],
        arrived: float,
        chat: bool,
        echoes: list[str] | None = None,
    ) -> Reply:
        engine = admit(self._llm, body, jobs)
        pieces = Pieces(engine) if jobs[0].params.logprobs is not None else None
        head = _head(body, chat, pieces)
        prompt_tokens = sum(len(job.prompt_ids) for job in jobs[:: body.n])
        stream = self._llm.generate(body.model, jobs, arrived)
        if body.stream:
            events = sse_events(stream, head, len(jobs), prompt_tokens, echoes)
            return StreamingResponse(200, events)
        collected = await collect(stream, len(jobs), pieces, echoes)
        use = replies.usage(prompt_tokens, sum(collected.completion_tokens))
        build = replies.chat_completion if chat else replies.completion
        return HttpResponse(
            200, build(head.rid, head.created, body.model, collected.choices(), use)
        )

    async def _respond_with_tools(
        self, body: Any, jobs: list[Job], arrived: float, tools: list[Tool], choice: str
    ) -> Reply:
        """With ``auto``, a streamed answer's content is sent as it comes and its calls
        once complete; a constrained call (``required``, a named function) is read from
        the whole text, so that stream is sent once it is complete (its events are the
        ones a stream of it would carry)."""
        engine = admit(self._llm, body, jobs)
        pieces = Pieces(engine) if jobs[0].params.logprobs is not None else None
        head = _head(body, True, pieces)
        prompt_tokens = len(jobs[0].prompt_ids)
        stream = self._llm.generate(body.model, jobs, arrived)
        if body.stream and choice == "auto":
            events = auto_tool_events(stream, head, len(jobs), prompt_tokens, tools)
            return StreamingResponse(200, events)
        collected = await collect(stream, len(jobs), pieces)
        read_tool_calls(collected, tools, choice)
        if body.stream:
            return StreamingResponse(200, replay_events(collected, head, prompt_tokens))
        use = replies.usage(prompt_tokens, sum(collected.completion_tokens))
        reply = replies.chat_completion(head.rid, head.created, body.model, collected.choices(),
                                       use, collected.calls)  # fmt: skip
        return HttpResponse(200, reply)

    # -- embeddings ----------------------------------------------------------------------

    async def _embeddings(self, request: HttpRequest) -> Reply:
        body: openai.EmbeddingRequest = openai.parse(request.body, openai.EmbeddingRequest)
        vectors, prompt_tokens = await self._embedder.embed(
            body.model, body.inputs(), _route_key(request, body.user),
            check_width=body.check_dimensions,
        )  # fmt: skip
        reply = replies.embeddings(body.model, vectors, body.encoding_format, prompt_tokens)
        return HttpResponse(200, reply)

    async def _score(self, request: HttpRequest) -> Reply:
        body: openai_score.ScoreRequest = openai_score.parse(
            request.body, openai_score.ScoreRequest
        )
        firsts, seconds = body.pairs()
        scores = await self._scorer.score(
            body.model, firsts, seconds, truncate=body.truncation(),
            activation=body.activated(), route_key=_route_key(request), field="text_2",
        )  # fmt: skip
        reply = openai_score.score_list(body.model, scores.values, scores.prompt_tokens)
        return HttpResponse(200, reply)

    async def _rerank(self, request: HttpRequest) -> Reply:
        body: openai_score.RerankRequest = openai_score.parse(
            request.body, openai_score.RerankRequest
        )
        documents, top_n = body.texts(), body.top()
        scores = await self._scorer.score(
            body.model, [body.query], documents, truncate=body.truncation(),
            activation=body.activated(), route_key=_route_key(request), field="documents",
        )  # fmt: skip
        shown = documents if body.return_documents else None
        reply = openai_score.rerank_list(
            body.model, scores.values, shown, top_n, scores.prompt_tokens
        )
        return HttpResponse(200, reply)

    async def _classify(self, request: HttpRequest) -> Reply:
        body = openai_classify.parse(request.body)
        inputs, truncate = body.inputs(), body.truncation()
        found = await self._classifier.classify(
            body.model, inputs, truncate=truncate, activation=body.activated(),
            route_key=_route_key(request, body.user),
        )  # fmt: skip
        reply = openai_classify.classify_list(
            body.model, found.probs.tolist(), found.labels, found.prompt_tokens
        )
        return HttpResponse(200, reply)


def _route_key(request: HttpRequest, user: str | None = None) -> str:
    """The sticky-routing key: the X-Slipstream-Route-Key header, else OpenAI's ``user``."""
    given = request.header(b"x-slipstream-route-key")
    return given.decode("latin-1") if given else (user or "")


def _head(body: Any, chat: bool, pieces: Pieces | None) -> StreamHead:
    options = body.stream_options if body.stream else None
    include_usage = bool(options and options.include_usage)
    continuous = bool(options and options.include_usage and options.continuous_usage_stats)
    rid = replies.new_id("chatcmpl" if chat else "cmpl")
    return StreamHead(rid, replies.now(), body.model, chat, include_usage, pieces, continuous)


def _openai_error(exc: SlipstreamError) -> HttpResponse:
    return error_reply(exc, replies.error(exc))
