"""Embeddings on a V2 model: text or token ids in, vectors out, through the model's own
queue.

A V2 model whose config.yaml names a ``tokenizer`` (a tokenizers JSON file inside its
directory) embeds text: the texts are tokenized (token id lists, which LangChain sends,
are taken as they are, cut where the tokenizer cuts text) and padded into pieces of at
most ``max_batch_size`` rows, each piece is a V2 request on the model's batcher (so the
pieces batch with other traffic and use every instance), and the model's first output
is the vectors. The OpenAI ``/v1/embeddings`` route is a thin caller of this;
:mod:`slipstream.serving.scoring` runs its pairs through :meth:`Embedder.run`.

    embedder = Embedder(service, repository)
    vectors, prompt_tokens = await embedder.embed("minilm", ["a cat", [101, 3899, 102]])
    vectors.shape  # (2, 384)
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from slipstream.config import ConfigError, ModelConfig
from slipstream.errors import GenerativeModel, InvalidRequest, ModelNotFound, SlipstreamError
from slipstream.repository.layout import CONFIG_FILES, contained_file, model_path
from slipstream.serving.service import InferenceService
from slipstream.types import InferRequest

_T = TypeVar("_T")
# Requests of at most this many characters (or token ids) tokenize on the event loop:
# ~80 us of work (see tokenize).
INLINE_TOKENIZE_SIZE = 256


class Embedder:
    """Embeds texts on the V2 models that name a tokenizer; see the module docstring."""

    def __init__(self, service: InferenceService, repository: Path) -> None:
        self._service = service
        self._repository = repository
        # (model, tokenizer file named in its config) -> the loaded tokenizer.
        self._tokenizers: dict[tuple[str, str], Any] = {}
        # Model -> when it was first listed, for a model without a config file to date.
        self._first_listed: dict[str, int] = {}

    def created(self, name: str) -> int:
        """The model's ``created`` (unix seconds) for /v1/models: when its config.yaml was
        last written, so it stays the same across listings, reloads and sleeps. Without
        a readable file: when this server first listed it."""
        try:
            directory = model_path(self._repository, name)
        except SlipstreamError:
            return self._first_listed.setdefault(name, int(time.time()))
        for filename in CONFIG_FILES:
            try:
                return int((directory / filename).stat().st_mtime)
            except OSError:
                continue
        return self._first_listed.setdefault(name, int(time.time()))

    async def is_embedding_model(self, name: str) -> bool:
        try:
            return bool((await self._service.model_config(name)).tokenizer)
        except SlipstreamError:
            return False

    async def embed(
        self,
        model: str,
        inputs: list[str | list[int]],
        route_key: str = "",
        check_width: Callable[[int], None] | None = None,
    ) -> tuple[np.ndarray, int]:
        """The vectors of ``inputs`` ([len(inputs), width]) and how many tokens they took.

        Each input is a text or a list of token ids (already checked non-empty and >= 0);
        an id beyond the tokenizer's vocabulary is a 400 naming ``input``.
        ``check_width`` is called with the model's width (from its config when that
        fixes it, so a request it refuses runs nothing; else from the vectors).

        ``route_key`` (sticky routing, e.g. OpenAI's ``user``) picks the version during a
        rollout; without one, a request of several pieces gets a key of its own, so all
        its pieces run on one version.

        InvalidRequest (400) names the limit when the texts take more than the model's
        ``max_request_tokens``. If one piece fails, or the caller is cancelled (the
        client went away), the other pieces are cancelled too.
        """
        try:
            config = await self._service.model_config(model)
        except GenerativeModel:  # a model, but not one this route serves: 404
            raise ModelNotFound(
                f"model: {model!r} is a generative model, served on /v1/completions and "
                "/v1/chat/completions; /v1/embeddings serves embedding models (a V2 model "
                "whose config.yaml names a tokenizer)"
            ) from None
        except ModelNotFound as exc:  # named as the field it is, as the other routes do
            raise ModelNotFound(f"model: {exc.message}") from None
        if not config.tokenizer:
            raise InvalidRequest(
                f"model: {model!r} is not an embedding model (its config.yaml names no tokenizer)"
            )
        if is_cross_encoder(config):
            raise InvalidRequest(
                f"model: {model!r} is a cross-encoder (one logit per pair of texts), not an "
                "embedding model: score pairs with /v1/score or /v1/rerank"
            )
        tokenizer = self.tokenizer(model, config.tokenizer)
        width = config.output[0].dims[-1] if config.output and config.output[0].dims else -1
        if check_width is not None and width > 0:
            check_width(width)
        ids = await tokenize(sum(len(item) for item in inputs), token_ids, tokenizer, inputs)
        joined, prompt_tokens = await self.run(model, config, ids, route_key)
        if check_width is not None and width <= 0:
            check_width(int(joined.shape[-1]))
        return joined, prompt_tokens

    async def run(
        self,
        model: str,
        config: ModelConfig,
        rows: list[list[int]],
        route_key: str = "",
        type_rows: list[list[int]] | None = None,
        field: str = "input",
    ) -> tuple[np.ndarray, int]:
        """The model's first output for the token id ``rows`` ([len(rows), ...]) and how
        many tokens they took, run in pieces of at most ``max_batch_size`` rows on the
        model's queue. ``type_rows``: each row's token type ids (a cross-encoder's
        segments), fed as ``token_type_ids`` where the model takes them (zeros without).

        InvalidRequest (400, naming ``field``) when the rows take more than the model's
        ``max_request_tokens``. ``route_key`` as :meth:`embed` takes it.
        """
        step = config.max_batch_size or 1
        pad_id = int((self.tokenizer(model, config.tokenizer).padding or {}).get("pad_id", 0))
        pieces = [
            _pad(rows[i : i + step], pad_id, type_rows[i : i + step] if type_rows else None)
            for i in range(0, len(rows), step)
        ]
        prompt_tokens = sum(int(piece[1].sum()) for piece in pieces)
        if prompt_tokens > config.max_request_tokens:
            raise InvalidRequest(
                f"{field}: {prompt_tokens} tokens in all; model {model!r} takes at most "
                f"{config.max_request_tokens} in one request (max_request_tokens in its "
                "config.yaml); send fewer or shorter inputs"
            )
        if not route_key and len(pieces) > 1:
            route_key = os.urandom(8).hex()
        if len(pieces) == 1:  # no task to make: cancelling the caller cancels its run
            return await self._run(model, config, route_key, *pieces[0]), prompt_tokens
        runs = [
            asyncio.ensure_future(self._run(model, config, route_key, *piece)) for piece in pieces
        ]
        try:
            outputs = await asyncio.gather(*runs)
        finally:
            for run in runs:
                run.cancel()
        return np.concatenate(outputs), prompt_tokens

    async def _run(
        self,
        model: str,
        config: ModelConfig,
        route_key: str,
        ids: np.ndarray,
        mask: np.ndarray,
        types: np.ndarray,
    ) -> np.ndarray:
        """One piece through the model's V2 queue: [rows, ...]."""
        feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        inputs = {t.name: feeds[t.name] for t in config.input if t.name in feeds}
        if not config.max_batch_size:
            inputs = {name: array[0] for name, array in inputs.items()}
        response = await self._service.infer(InferRequest(model, "", inputs, route_key=route_key))
        output: np.ndarray = next(iter(response.outputs.values()))
        return output if config.max_batch_size else output[None]

    def tokenizer(self, model: str, name: str) -> Any:
        """The model's tokenizer, loaded once: resolving its path (symlinks and all, to
        keep it inside the model's directory) costs file-system calls, not per request."""
        key = (model, name)
        tokenizer = self._tokenizers.get(key)
        if tokenizer is not None:
            return tokenizer
        try:
            path = contained_file(model_path(self._repository, model), name, "tokenizer")
        except ConfigError as exc:
            raise InvalidRequest(f"model: {model!r}: {exc}") from None
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise InvalidRequest(
                "model: embeddings need the `tokenizers` package: pip install 'slipstream[llm]'"
            ) from None
        if not path.is_file():
            raise InvalidRequest(f"model: its tokenizer file {path} does not exist")
        tokenizer = self._tokenizers[key] = Tokenizer.from_file(str(path))
        return tokenizer


async def tokenize(size: int, function: Callable[..., _T], *args: Any) -> _T:
    """``function(*args)``, tokenizing a request of ``size`` characters (or token ids):
    on the event loop when it is short, else on a worker thread. WordPiece takes ~0.3 us a
    character on one core, the hop to a thread and back ~70-150 us (two context switches
    on a busy core): below INLINE_TOKENIZE_SIZE the hop costs more than the work it moves
    and the loop is held no longer than it; up to 2,048 texts take milliseconds, which
    must not hold the loop."""
    if size <= INLINE_TOKENIZE_SIZE:
        return function(*args)
    return await asyncio.to_thread(function, *args)


def token_ids(tokenizer: Any, inputs: list[str | list[int]]) -> list[list[int]]:
    """Each input's token ids: texts tokenized (in one batch), id lists checked against
    the vocabulary and cut to the length the tokenizer cuts texts to."""
    texts = [item for item in inputs if isinstance(item, str)]
    encoded = iter(tokenizer.encode_batch(texts)) if texts else iter(())
    vocab = int(tokenizer.get_vocab_size(with_added_tokens=True))
    truncation = tokenizer.truncation or {}
    longest = int(truncation.get("max_length", 0))
    from_left = truncation.get("direction") == "left"
    ids: list[list[int]] = []
    for index, item in enumerate(inputs):
        if isinstance(item, str):
            ids.append(unpadded(next(encoded))[0])
            continue
        largest = max(item)
        if largest >= vocab:
            where = "input" if len(inputs) == 1 else f"input[{index}]"
            raise InvalidRequest(
                f"{where}: token id {largest} is outside the model's vocabulary "
                f"(ids 0 to {vocab - 1})"
            )
        if longest and len(item) > longest:
            item = item[-longest:] if from_left else item[:longest]
        ids.append(item)
    return ids


async def text_model_config(
    service: InferenceService, model: str, serves: str, no_tokenizer: str
) -> ModelConfig:
    """The config of a V2 text model for a scoring or classifying route: a generative
    model is a 400 saying where it is served and ``serves`` (what the route takes), an
    unknown one a 404 naming ``model``, one without a tokenizer the 400 ``no_tokenizer``."""
    try:
        config = await service.model_config(model)
    except GenerativeModel:
        raise InvalidRequest(
            f"model: {model!r} is a generative model, served on /v1/completions and "
            f"/v1/chat/completions; {serves} (a V2 model whose config.yaml names a tokenizer)"
        ) from None
    except ModelNotFound as exc:
        raise ModelNotFound(f"model: {exc.message}") from None
    if not config.tokenizer:
        raise InvalidRequest(no_tokenizer)
    return config


def is_cross_encoder(config: ModelConfig) -> bool:
    """Whether the model answers one logit per row: its first output's last dimension is 1."""
    return bool(config.output and config.output[0].dims and config.output[0].dims[-1] == 1)


def unpadded(encoding: Any) -> tuple[list[int], list[int]]:
    """An encoding's token ids and type ids without the padding its tokenizer file asks for
    (make run's minilm pads a batch to its longest text): that padding would be masked
    in, as if it were text; the rows are padded, and masked out, per piece."""
    kept = [i for i, mask in enumerate(encoding.attention_mask) if mask]
    return [encoding.ids[i] for i in kept], [encoding.type_ids[i] for i in kept]


def _pad(
    rows: list[list[int]], pad_id: int, type_rows: list[list[int]] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token ids, attention mask and token type ids (zeros without ``type_rows``), padded
    to the piece's longest row: [rows, longest] each."""
    longest = max(len(row) for row in rows)
    ids = np.full((len(rows), longest), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), longest), dtype=np.int64)
    types = np.zeros((len(rows), longest), dtype=np.int64)
    for index, row in enumerate(rows):
        ids[index, : len(row)] = row
        mask[index, : len(row)] = 1
        if type_rows is not None:
            types[index, : len(row)] = type_rows[index]
    return ids, mask, types
