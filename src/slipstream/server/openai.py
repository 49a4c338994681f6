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

import numpy as np

from slipstream.config import ConfigError, ModelConfig
from slipstream.errors import InternalError, InvalidRequest, ModelNotFound, SlipstreamError
from slipstream.llm.api import GenerationService, Job
from slipstream.llm.engine import Engine, SamplingParams
from slipstream.protocol import openai
from slipstream.repository.layout import contained_file, model_path
from slipstream.server.http import error_reply, path_model_name
from slipstream.server.http_server import HttpRequest, HttpResponse, StreamingResponse
from slipstream.serving.service import InferenceService
from slipstream.types import InferRequest

logger = logging.getLogger(__name__)

Reply = HttpResponse | StreamingResponse


class OpenAIApp:
    """Handles every ``/v1/...`` request; see the module docstring."""

    def __init__(self, llm: GenerationService, service: InferenceService, repository: Path) -> None:
        self._llm = llm
        self._service = service
        self._repository = repository
        self._tokenizers: dict[Path, Any] = {}

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
        raise ModelNotFound(f"no route for {request.method} {request.path}")

    def _model_list(self) -> list[tuple[str, int]]:
        models = dict(self._llm.models())
        started = int(time.time())
        for entry in self._service.repository_index(ready_only=True):
            if entry.name not in models and self._embedding_config(entry.name) is not None:
                models[entry.name] = started
        return sorted(models.items())

    # -- generation ----------------------------------------------------------------------

    async def _completions(self, request: HttpRequest) -> Reply:
        arrived = time.perf_counter()
        body: openai.CompletionRequest = openai.parse(request.body, openai.CompletionRequest)
        engine = self._llm.engine(body.model)
        prompts = [p if isinstance(p, list) else engine.encode(p) for p in body.prompts()]
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

    def _embedding_config(self, name: str) -> Any:
        try:
            config = self._service.model_config(name)
        except SlipstreamError:
            return None
        return config if config.tokenizer else None

    async def _embeddings(self, request: HttpRequest) -> Reply:
        body: openai.EmbeddingRequest = openai.parse(request.body, openai.EmbeddingRequest)
        texts = body.texts()
        config = self._service.model_config(body.model)
        if not config.tokenizer:
            raise InvalidRequest(
                f"model: {body.model!r} is not an embedding model "
                "(its config.yaml names no tokenizer)"
            )
        try:
            where = model_path(self._repository, body.model)
            tokenizer = self._tokenizer(contained_file(where, config.tokenizer, "tokenizer"))
        except ConfigError as exc:
            raise InvalidRequest(f"model: {body.model!r}: {exc}") from None
        # Pieces of at most max_batch_size inputs, each a valid V2 request. Tokenizing up
        # to 2,048 texts takes milliseconds: off the event loop.
        step = config.max_batch_size or 1
        pieces = await asyncio.to_thread(
            lambda: [_pad(tokenizer, texts[i : i + step]) for i in range(0, len(texts), step)]
        )
        prompt_tokens = sum(int(mask.sum()) for _, mask in pieces)
        if prompt_tokens > config.max_request_tokens:
            raise InvalidRequest(
                f"input: {prompt_tokens} tokens in all; model {body.model!r} takes at most "
                f"{config.max_request_tokens} in one request (max_request_tokens in its "
                "config.yaml); send fewer or shorter inputs"
            )
        # All pieces queue at once, so the batcher can batch them and use every instance.
        # If one fails, or the client goes away, the others are cancelled too.
        runs = [asyncio.ensure_future(self._embed(body.model, config, *p)) for p in pieces]
        try:
            vectors = await asyncio.gather(*runs)
        finally:
            for run in runs:
                run.cancel()
        reply = openai.embeddings(
            body.model, np.concatenate(vectors), body.encoding_format, prompt_tokens
        )
        return HttpResponse(200, reply)

    async def _embed(
        self, model: str, config: ModelConfig, ids: np.ndarray, mask: np.ndarray
    ) -> np.ndarray:
        """One piece of an embeddings request through the model's V2 queue: [rows, width]."""
        feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
        inputs = {t.name: feeds[t.name] for t in config.input if t.name in feeds}
        if not config.max_batch_size:
            inputs = {name: array[0] for name, array in inputs.items()}
        response = await self._service.infer(InferRequest(model, "", inputs))
        output: np.ndarray = next(iter(response.outputs.values()))
        return output if config.max_batch_size else output[None]

    def _tokenizer(self, path: Path) -> Any:
        tokenizer = self._tokenizers.get(path)
        if tokenizer is None:
            try:
                from tokenizers import Tokenizer
            except ImportError:
                raise InvalidRequest(
                    "model: embeddings need the `tokenizers` package: pip install 'slipstream[llm]'"
                ) from None
            if not path.is_file():
                raise InvalidRequest(f"model: its tokenizer file {path} does not exist")
            tokenizer = self._tokenizers[path] = Tokenizer.from_file(str(path))
        return tokenizer


def _pad(tokenizer: Any, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and attention mask, padded to the batch's longest text."""
    encoded = tokenizer.encode_batch(texts)
    longest = max(len(e.ids) for e in encoded)
    pad_id = int((tokenizer.padding or {}).get("pad_id", 0))
    ids = np.full((len(encoded), longest), pad_id, dtype=np.int64)
    mask = np.zeros((len(encoded), longest), dtype=np.int64)
    for row, item in enumerate(encoded):
        ids[row, : len(item.ids)] = item.ids
        mask[row, : len(item.ids)] = 1
    return ids, mask


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
