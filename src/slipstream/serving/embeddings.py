"""Embeddings on a V2 model: text in, vectors out, through the model's own queue.

A V2 model whose config.yaml names a ``tokenizer`` (a tokenizers JSON file inside its
directory) embeds text: the texts are tokenized and padded into pieces of at most
``max_batch_size`` rows, each piece is a V2 request on the model's batcher (so the
pieces batch with other traffic and use every instance), and the model's first output
is the vectors. The OpenAI ``/v1/embeddings`` route is a thin caller of this.

    embedder = Embedder(service, repository)
    vectors, prompt_tokens = await embedder.embed("minilm", ["a cat", "a dog"])  # [2, 384]
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import numpy as np

from slipstream.config import ConfigError, ModelConfig
from slipstream.errors import GenerativeModel, InvalidRequest, ModelNotFound, SlipstreamError
from slipstream.repository.layout import contained_file, model_path
from slipstream.serving.service import InferenceService
from slipstream.types import InferRequest


class Embedder:
    """Embeds texts on the V2 models that name a tokenizer; see the module docstring."""

    def __init__(self, service: InferenceService, repository: Path) -> None:
        self._service = service
        self._repository = repository
        # (model, tokenizer file named in its config) -> the loaded tokenizer.
        self._tokenizers: dict[tuple[str, str], Any] = {}

    async def is_embedding_model(self, name: str) -> bool:
        try:
            return bool((await self._service.model_config(name)).tokenizer)
        except SlipstreamError:
            return False

    async def embed(
        self, model: str, texts: list[str], route_key: str = ""
    ) -> tuple[np.ndarray, int]:
        """The vectors of ``texts`` ([len(texts), width]) and how many tokens they took.

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
        if not config.tokenizer:
            raise InvalidRequest(
                f"model: {model!r} is not an embedding model (its config.yaml names no tokenizer)"
            )
        tokenizer = self._tokenizer(model, config.tokenizer)
        # Tokenizing up to 2,048 texts takes milliseconds: off the event loop.
        step = config.max_batch_size or 1
        pieces = await asyncio.to_thread(
            lambda: [_pad(tokenizer, texts[i : i + step]) for i in range(0, len(texts), step)]
        )
        prompt_tokens = sum(int(mask.sum()) for _, mask in pieces)
        if prompt_tokens > config.max_request_tokens:
            raise InvalidRequest(
                f"input: {prompt_tokens} tokens in all; model {model!r} takes at most "
                f"{config.max_request_tokens} in one request (max_request_tokens in its "
                "config.yaml); send fewer or shorter inputs"
            )
        if not route_key and len(pieces) > 1:
            route_key = os.urandom(8).hex()
        runs = [
            asyncio.ensure_future(self._run(model, config, route_key, *piece)) for piece in pieces
        ]
        try:
            vectors = await asyncio.gather(*runs)
        finally:
            for run in runs:
                run.cancel()
        return np.concatenate(vectors), prompt_tokens

    async def _run(
        self, model: str, config: ModelConfig, route_key: str, ids: np.ndarray, mask: np.ndarray
    ) -> np.ndarray:
        """One piece through the model's V2 queue: [rows, width]."""
        feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
        inputs = {t.name: feeds[t.name] for t in config.input if t.name in feeds}
        if not config.max_batch_size:
            inputs = {name: array[0] for name, array in inputs.items()}
        response = await self._service.infer(InferRequest(model, "", inputs, route_key=route_key))
        output: np.ndarray = next(iter(response.outputs.values()))
        return output if config.max_batch_size else output[None]

    def _tokenizer(self, model: str, name: str) -> Any:
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


def _pad(tokenizer: Any, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and attention mask, padded to the piece's longest text."""
    encoded = tokenizer.encode_batch(texts)
    longest = max(len(e.ids) for e in encoded)
    pad_id = int((tokenizer.padding or {}).get("pad_id", 0))
    ids = np.full((len(encoded), longest), pad_id, dtype=np.int64)
    mask = np.zeros((len(encoded), longest), dtype=np.int64)
    for row, item in enumerate(encoded):
        ids[row, : len(item.ids)] = item.ids
        mask[row, : len(item.ids)] = 1
    return ids, mask
