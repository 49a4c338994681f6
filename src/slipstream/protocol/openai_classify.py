"""vLLM's classification request and reply: ``/classify`` (vLLM answers it there only,
not under ``/v1/``).

Pure codec, no I/O; the classes come from :mod:`slipstream.serving.text_classification`.
``input`` is a text, texts, token ids or lists of token ids, as vLLM takes it;
``truncate_prompt_tokens`` cuts each input (-1: where the model's tokenizer file cuts);
``use_activation`` (and vLLM's older names ``softmax`` and ``activation``) false answers
the raw logits as ``probs``. vLLM's chat-style request (``messages``) is not served.

    body = parse(b'{"model": "sentiment", "input": ["great", "awful"]}')
    body.inputs()  # ["great", "awful"]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, ClassVar

import orjson
from pydantic import Field, WithJsonSchema

from slipstream.errors import InvalidRequest
from slipstream.names import validate_model_name
from slipstream.protocol import openai, openai_score
from slipstream.protocol.openai_fields import VLLM_SAMPLING, Unserved, _Fields
from slipstream.protocol.openai_replies import new_id, now, usage

# Inputs one request may classify: the embeddings route's limit.
MAX_INPUTS = openai.MAX_EMBEDDING_INPUTS

_TEXT = {"type": "string", "minLength": 1}
_TOKEN_IDS = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1},
    "minItems": 1,
}

# vLLM's classification fields this server does not implement.
VLLM_CLASSIFY: Mapping[str, Unserved] = {
    "messages": Unserved(
        "not supported: vLLM's chat-style classification is not served here; send the "
        "text (or its token ids) as input"
    ),
    "add_special_tokens": Unserved(
        "only true is supported: the tokenizer file's special tokens are always added; "
        "send token ids to control the input's tokens exactly",
        (True,),
    ),
    "mm_processor_kwargs": VLLM_SAMPLING["mm_processor_kwargs"],
    "priority": VLLM_SAMPLING["priority"],
}


class ClassifyRequest(_Fields):
    """vLLM's ``/classify`` request (its ClassificationCompletionRequest)."""

    unserved: ClassVar[Mapping[str, Unserved]] = VLLM_CLASSIFY

    model: str = Field(min_length=1)
    input: Annotated[
        str | list[str] | list[int] | list[list[int]],
        WithJsonSchema({
            "anyOf": [_TEXT, {"type": "array", "items": _TEXT, "minItems": 1,
                              "maxItems": MAX_INPUTS},
                      _TOKEN_IDS, {"type": "array", "items": _TOKEN_IDS, "minItems": 1,
                                   "maxItems": MAX_INPUTS}],
            "description": "a non-empty text, texts, token ids, or lists of token ids (ids "
                           "beyond the model's vocabulary: 400)",
        }),
    ]  # fmt: skip
    truncate_prompt_tokens: Annotated[
        int | None,
        Field(ge=-1, le=2**31 - 1),
        WithJsonSchema({"anyOf": [{"const": -1},
                                  {"type": "integer", "minimum": 1, "maximum": 2**31 - 1}],
                        "description": "cut each input to this many tokens, special tokens "
                                       "included, where the tokenizer file cuts (its end by "
                                       "default); -1: at the file's own length"}),
    ] = None  # fmt: skip
    use_activation: bool | None = Field(
        None,
        description="probs are the logits' softmax (default true; a sigmoid per class for a "
        "multi-label model); false: the raw logits",
    )
    softmax: bool | None = Field(None, description="vLLM's older name of use_activation")
    activation: bool | None = Field(None, description="vLLM's older name of use_activation")
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        """Each input, as non-empty text or non-empty token ids (>= 0)."""
        found = self.input
        flat = isinstance(found, str) or (bool(found) and isinstance(found[0], int))
        items: list[Any] = [found] if flat else list(found)
        if not items:
            raise InvalidRequest("input: must not be empty; send a text or a list of texts")
        if len(items) > MAX_INPUTS:
            raise InvalidRequest(
                f"input: {len(items)} inputs; at most {MAX_INPUTS} in one request (send the "
                "rest in further requests)"
            )
        for index, item in enumerate(items):
            where = "input" if flat else f"input[{index}]"
            if not item:
                raise InvalidRequest(f"{where}: must not be empty")
            if isinstance(item, list) and min(item) < 0:
                raise InvalidRequest(
                    f"{where}: holds a negative token id {min(item)}; expected token ids (>= 0)"
                )
        return items

    def activated(self) -> bool:
        return openai_score.activated(self.use_activation, self.softmax, self.activation)

    def truncation(self) -> int | None:
        return openai_score.truncation(self.truncate_prompt_tokens)


def parse(body: bytes) -> ClassifyRequest:
    """Validate a JSON body; InvalidRequest names the first bad field."""
    request: ClassifyRequest = openai.parse(body, ClassifyRequest)
    validate_model_name(request.model, "model:")
    return request


def classify_list(
    model: str, probs: Sequence[Sequence[float]], labels: Sequence[str], prompt_tokens: int
) -> bytes:
    """vLLM's ClassificationResponse: one entry per input, in the inputs' order."""
    data = [{"index": i, "label": label, "probs": list(row), "num_classes": len(row)}
            for i, (row, label) in enumerate(zip(probs, labels, strict=True))]  # fmt: skip
    return orjson.dumps({"id": new_id("classify"), "object": "list", "created": now(),
                         "model": model, "data": data,
                         "usage": usage(prompt_tokens, 0)})  # fmt: skip
