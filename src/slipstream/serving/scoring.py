"""Scores of text pairs on a V2 model that names a ``tokenizer``: what vLLM's ``/v1/score``
and ``/v1/rerank`` answer, for retrieval pipelines.

Two kinds of model score, told apart by the model's first output:

- a **cross-encoder** answers one logit per pair (an output of last dimension 1, as a
  transformers ``*ForSequenceClassification`` with ``num_labels=1`` exports): each
  (first, second) pair is tokenized as the tokenizer file's pair template makes it
  (``[CLS] first [SEP] second [SEP]`` for BERT), with ``token_type_ids`` where the model
  takes them, and its score is the logit's sigmoid (vLLM's default for such models), or
  the logit itself without ``activation``;
- an **embedding model** (any other width) embeds every text once and scores a pair by
  the cosine similarity of its two vectors, as vLLM does for embedding models.

Every pair (or text) of one call runs as rows of the model's own queue, in pieces of at
most ``max_batch_size`` (:meth:`Embedder.run`), so they batch with other traffic.

    scorer = Scorer(embedder, service)
    scores = await scorer.score("reranker", ["what is a cat?"], ["A cat purrs.", "Paris"])
    scores.values  # [0.93, 0.08]
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np

from slipstream.config import ModelConfig
from slipstream.errors import InvalidRequest
from slipstream.serving.embeddings import (
    Embedder,
    is_cross_encoder,
    text_model_config,
    tokenize,
    unpadded,
)
from slipstream.serving.service import InferenceService

# Tokenizers kept per (model, tokenizer file, truncation): a copy costs ~30 ms to make
# (a BERT vocabulary parsed again), so each truncation a client uses is made once.
_MAX_TOKENIZERS = 64


@dataclass(frozen=True, slots=True)
class Scores:
    """What :meth:`Scorer.score` answers."""

    # One score per pair, in the pairs' order.
    values: list[float]
    # Tokens the model ran: each pair's for a cross-encoder, each text's once for an
    # embedding model.
    prompt_tokens: int


class Scorer:
    """Scores text pairs on the V2 models that name a tokenizer; see the module docstring."""

    def __init__(self, embedder: Embedder, service: InferenceService) -> None:
        self._embedder = embedder
        self._service = service
        # (model, tokenizer file, truncate_prompt_tokens) -> a copy of the model's
        # tokenizer that pads nothing and truncates there.
        self._tokenizers: dict[tuple[str, str, int | None], Any] = {}

    async def score(
        self,
        model: str,
        firsts: list[str],
        seconds: list[str],
        *,
        truncate: int | None = None,
        activation: bool = True,
        route_key: str = "",
        field: str = "text_2",
    ) -> Scores:
        """The scores of the pairs (``firsts[i]``, ``seconds[i]``); one first text is paired
        with every second one. ``truncate``: vLLM's ``truncate_prompt_tokens`` (each pair,
        or text, cut to that many tokens; -1 or None: where the tokenizer file cuts).
        ``field`` names the request's texts in a 400 about their size.

        InvalidRequest (400) naming ``model`` for a generative model or one that names no
        tokenizer, ``truncate_prompt_tokens`` for a length the model cannot take;
        ModelNotFound (404) naming ``model`` for one not served.
        """
        config = await self._config(model)
        cross = is_cross_encoder(config)
        tokenizer = await self.tokenizer(model, config, truncate, pair=cross)
        if cross:
            paired = firsts * len(seconds) if len(firsts) == 1 else firsts
            pairs = list(zip(paired, seconds, strict=True))
            size = sum(len(first) + len(second) for first, second in pairs)
            rows, types = await tokenize(size, _encode, tokenizer, pairs)
            logits, tokens = await self._embedder.run(model, config, rows, route_key, types, field)
            values = np.asarray(logits, dtype=np.float64).reshape(len(rows))
            if activation:  # the sigmoid, without exp's overflow for large logits
                values = 0.5 * (1.0 + np.tanh(0.5 * values))
            return Scores([float(v) for v in values], tokens)
        texts = [*firsts, *seconds]
        rows, _ = await tokenize(sum(map(len, texts)), _encode, tokenizer, texts)
        vectors, tokens = await self._embedder.run(model, config, rows, route_key, field=field)
        if vectors.ndim != 2:
            raise InvalidRequest(
                f"model: {model!r} answers {list(vectors.shape[1:])} per text, not one vector "
                "(or, for a cross-encoder, one logit of shape [1])"
            )
        return Scores(_cosines(vectors[: len(firsts)], vectors[len(firsts) :]), tokens)

    async def _config(self, model: str) -> ModelConfig:
        return await text_model_config(
            self._service, model,
            "scores come from a cross-encoder or an embedding model",
            f"model: {model!r} is not an embedding model or a cross-encoder (its config.yaml "
            "names no tokenizer)",
        )  # fmt: skip

    async def tokenizer(
        self, model: str, config: ModelConfig, truncate: int | None, pair: bool
    ) -> Any:
        """The model's tokenizer, padding nothing and truncating at ``truncate`` tokens
        (None: where its file does); a 400 naming ``truncate_prompt_tokens`` for a length
        the model cannot take. :mod:`slipstream.serving.text_classification` shares it."""
        base = self._embedder.tokenizer(model, config.tokenizer)
        limit = int((base.truncation or {}).get("max_length", 0))
        if truncate == -1:
            truncate = None
        if truncate is not None:
            special = int(base.num_special_tokens_to_add(pair))
            if truncate <= special:
                what = "a pair" if pair else "a text"
                raise InvalidRequest(
                    f"truncate_prompt_tokens: {truncate} leaves no room for text: model "
                    f"{model!r}'s tokenizer adds {special} special tokens to {what}; send "
                    f"more than {special}, or -1 for the model's own length"
                )
            if limit and truncate > limit:
                raise InvalidRequest(
                    f"truncate_prompt_tokens: {truncate} is more than model {model!r} takes "
                    f"({limit} tokens, its tokenizer file's truncation); send at most "
                    f"{limit}, or -1"
                )
        key = (model, config.tokenizer, truncate)
        found = self._tokenizers.get(key)
        if found is None:
            found = await asyncio.to_thread(_copy, base, truncate)
            if len(self._tokenizers) >= _MAX_TOKENIZERS:
                self._tokenizers.clear()
            self._tokenizers[key] = found
        return found


def _copy(base: Any, truncate: int | None) -> Any:
    """A copy of ``base`` that pads nothing (the rows are padded per piece) and, given
    ``truncate``, cuts at that many tokens, a pair's longest text first (transformers'
    ``longest_first``, which vLLM's tokenization uses), where the file's rule does not say."""
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(base.to_str())
    copy.no_padding()
    if truncate is not None:
        rule = base.truncation or {}
        copy.enable_truncation(
            max_length=truncate,
            strategy=rule.get("strategy", "longest_first"),
            direction=rule.get("direction", "right"),
        )
    return copy


def _encode(tokenizer: Any, items: list[Any]) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids and type ids of each text, or (first, second) pair."""
    rows, types = [], []
    for encoding in tokenizer.encode_batch(items):
        ids, type_ids = unpadded(encoding)
        rows.append(ids)
        types.append(type_ids)
    return rows, types


def _cosines(firsts: np.ndarray, seconds: np.ndarray) -> list[float]:
    """Each row of ``seconds`` against its row of ``firsts`` (or the one row there):
    ``a.b / (max(|a|, eps) * max(|b|, eps))``, as torch's cosine_similarity."""
    eps = 1e-8
    a = np.asarray(firsts, dtype=np.float64)  # [1 or N, H]
    b = np.asarray(seconds, dtype=np.float64)  # [N, H]
    dots = (a * b).sum(axis=1)
    norms = np.maximum(np.linalg.norm(a, axis=1), eps) * np.maximum(np.linalg.norm(b, axis=1), eps)
    return [float(v) for v in dots / norms]
