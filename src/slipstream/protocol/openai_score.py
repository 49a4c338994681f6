"""vLLM's scoring requests and replies: ``/v1/score`` (``text_1`` against ``text_2``) and
``/v1/rerank`` (Jina's and Cohere's shape: a query against documents, the best first).

Pure codec, no I/O; the scores come from :mod:`slipstream.serving.scoring`. Pairing
follows vLLM: one ``text_1`` against every ``text_2`` (1:1, 1:N), or lists of the same
length paired in order (N:N); N:1 and other lengths are a 400 naming ``text_2``.
vLLM's ``use_activation`` (and its older names ``softmax`` and ``activation``) turns a
cross-encoder's sigmoid off; ``truncate_prompt_tokens`` cuts each pair (or text).
"""

from __future__ import annotations

from typing import Annotated, Any

import orjson
from pydantic import Field, WithJsonSchema

from slipstream.errors import InvalidRequest
from slipstream.names import validate_model_name
from slipstream.protocol import openai
from slipstream.protocol.openai_base import _Request
from slipstream.protocol.openai_fields import VLLM_SAMPLING, Unserved, _Fields
from slipstream.protocol.openai_replies import new_id, now

# Pairs (or documents) one request may score: the embeddings route's inputs.
MAX_PAIRS = openai.MAX_EMBEDDING_INPUTS

_TEXT = {"type": "string", "minLength": 1}
_TEXTS = {"type": "array", "items": _TEXT, "minItems": 1, "maxItems": MAX_PAIRS}

# vLLM's scoring extensions this server does not implement.
VLLM_SCORING: dict[str, Unserved] = {
    "mm_processor_kwargs": VLLM_SAMPLING["mm_processor_kwargs"],
    "priority": VLLM_SAMPLING["priority"],
}


class _Scoring(_Fields):
    """The fields both routes share."""

    unserved = VLLM_SCORING

    model: str = Field(min_length=1)
    truncate_prompt_tokens: Annotated[
        int | None,
        Field(ge=-1, le=2**31 - 1),
        WithJsonSchema({"anyOf": [{"const": -1},
                                  {"type": "integer", "minimum": 1, "maximum": 2**31 - 1}],
                        "description": "cut each pair (an embedding model: each text) to "
                                       "this many tokens, the longer text first; -1: where "
                                       "the model's tokenizer file cuts"}),
    ] = None  # fmt: skip
    use_activation: bool | None = Field(
        None, description="a cross-encoder's sigmoid (default true); false: the raw logit"
    )
    softmax: bool | None = Field(None, description="vLLM's older name of use_activation")
    activation: bool | None = Field(None, description="vLLM's older name of use_activation")

    def activated(self) -> bool:
        return activated(self.use_activation, self.softmax, self.activation)

    def truncation(self) -> int | None:
        return truncation(self.truncate_prompt_tokens)


class ScoreRequest(_Scoring):
    """vLLM's score request: ``text_1`` and ``text_2``, each a text or texts."""

    text_1: Annotated[str | list[str], WithJsonSchema({"anyOf": [_TEXT, _TEXTS]})]
    text_2: Annotated[str | list[str], WithJsonSchema({"anyOf": [_TEXT, _TEXTS]})]

    def pairs(self) -> tuple[list[str], list[str]]:
        """(firsts, seconds): one first, or as many as there are seconds."""
        firsts = _texts(self.text_1, "text_1")
        seconds = _texts(self.text_2, "text_2")
        if len(firsts) > 1 and len(firsts) != len(seconds):
            raise InvalidRequest(
                f"text_2: {len(seconds)} texts against {len(firsts)} in text_1; expected "
                "1:1, 1:N or N:N (one text_1, or as many as text_2)"
            )
        return firsts, seconds


class RerankDocument(_Request):
    """A document given as an object (Cohere's and Jina's clients may send them)."""

    text: str


class RerankRequest(_Scoring):
    """Jina's and Cohere's rerank request, as vLLM serves it."""

    query: Annotated[str, WithJsonSchema(_TEXT)]
    documents: Annotated[
        list[str | RerankDocument],
        WithJsonSchema({"type": "array", "minItems": 1, "maxItems": MAX_PAIRS, "items": {
            "anyOf": [_TEXT, {"type": "object", "properties": {"text": _TEXT},
                              "required": ["text"]}]}}),
    ]  # fmt: skip
    top_n: Annotated[
        int | None,
        WithJsonSchema({"type": "integer", "minimum": 0, "maximum": 2**31 - 1,
                        "description": "the best this many (0 or unset: all)"}),
    ] = None  # fmt: skip
    return_documents: bool = Field(True, description="each result's document text too")

    def texts(self) -> list[str]:
        """The query checked, and the documents' texts."""
        _texts(self.query, "query")
        if not self.documents:
            raise InvalidRequest("documents: must not be empty; send at least one document")
        texts = [item if isinstance(item, str) else item.text for item in self.documents]
        return _texts(texts, "documents")

    def top(self) -> int:
        """How many results to answer, at most (0: all)."""
        if self.top_n is not None and self.top_n < 0:
            raise InvalidRequest(f"top_n: {self.top_n} is negative; send 0 (all) or more")
        return self.top_n or 0


def _texts(value: str | list[str], field: str) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if not texts:
        raise InvalidRequest(f"{field}: must not be empty; send a text or a list of texts")
    if len(texts) > MAX_PAIRS:
        raise InvalidRequest(
            f"{field}: {len(texts)} texts; at most {MAX_PAIRS} in one request (send the rest "
            "in further requests)"
        )
    for index, text in enumerate(texts):
        if not text:
            where = field if isinstance(value, str) else f"{field}[{index}]"
            raise InvalidRequest(f"{where}: must not be empty")
    return texts


def parse(body: bytes, schema: type[_Scoring]) -> Any:
    """Validate a JSON body; InvalidRequest names the first bad field."""
    request = openai.parse(body, schema)
    validate_model_name(request.model, "model:")
    return request


def score_list(model: str, scores: list[float], prompt_tokens: int) -> bytes:
    """vLLM's ScoreResponse."""
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return orjson.dumps({"id": new_id("score"), "object": "list", "created": now(),
                         "model": model, "data": data,
                         "usage": {"prompt_tokens": prompt_tokens,
                                   "total_tokens": prompt_tokens}})  # fmt: skip


def rerank_list(
    model: str, scores: list[float], documents: list[str] | None, top_n: int, prompt_tokens: int
) -> bytes:
    """vLLM's RerankResponse: the documents by relevance_score, highest first (ties in
    the order sent), at most ``top_n`` of them (0: all); ``documents``: their texts, to
    return with each (None: without)."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: top_n or None]
    results: list[dict[str, Any]] = []
    for index in order:
        result: dict[str, Any] = {"index": index, "relevance_score": scores[index]}
        if documents is not None:
            result["document"] = {"text": documents[index]}
        results.append(result)
    return orjson.dumps({"id": new_id("rerank"), "model": model, "results": results,
                         "usage": {"prompt_tokens": prompt_tokens,
                                   "total_tokens": prompt_tokens}})  # fmt: skip


def activated(use_activation: bool | None, softmax: bool | None, activation: bool | None) -> bool:
    """Whether to apply the model's activation: ``use_activation``, else vLLM's older
    names for it (``softmax``, ``activation``), else yes."""
    for value in (use_activation, softmax, activation):
        if value is not None:
            return value
    return True


def truncation(value: int | None) -> int | None:
    """``truncate_prompt_tokens`` checked: None, -1 (the model's own length) or >= 1."""
    if value is not None and value != -1 and value < 1:
        raise InvalidRequest(
            f"truncate_prompt_tokens: {value} is not a length; send a number of tokens "
            "(at least 1), or -1 for the model's own length"
        )
    return value
