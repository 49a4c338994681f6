"""The OpenAI API's replies: completions, chat completions and their stream chunks,
embeddings, model cards and errors, as OpenAI writes them (the requests are
:mod:`slipstream.protocol.openai`). Pure codec, no I/O."""

from __future__ import annotations

import base64
import re
import time
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson

from slipstream.errors import ModelNotFound, SlipstreamError

# A message naming the field at fault starts with it: "temperature: ...".
_PARAM = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


# One token's logprobs as the routes hand them over: (token text, its bytes, logprob,
# [(alternative's text, its bytes, logprob), ...] most likely first).
Alternative = tuple[str, bytes, float]
LogprobEntry = tuple[str, bytes, float, list[Alternative]]


def chat_logprobs(entries: list[LogprobEntry] | None) -> dict[str, Any] | None:
    """A chat choice's ``logprobs``: ``{"content": [...], "refusal": None}``."""
    if entries is None:
        return None
    content = [
        {"token": token, "logprob": logprob, "bytes": list(raw),
         "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(b)} for t, b, lp in top]}
        for token, raw, logprob, top in entries
    ]  # fmt: skip
    return {"content": content, "refusal": None}


def completion_logprobs(entries: list[LogprobEntry] | None, offset: int) -> dict[str, Any] | None:
    """A completion choice's legacy ``logprobs``; ``offset``: characters before the first."""
    if entries is None:
        return None
    offsets = []
    for token, *_ in entries:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": [token for token, *_ in entries],
        "token_logprobs": [logprob for _, _, logprob, _ in entries],
        "top_logprobs": [{t: lp for t, _, lp in top} for *_, top in entries],
        "text_offset": offsets,
    }


# vLLM's stop_reason: the stop string or stop token id that ended a choice, else None.
StopReason = str | int | None
# A choice as the routes hand it over: (text, finish_reason, stop_reason, logprob entries
# or None).
Choice = tuple[str, str, StopReason, "list[LogprobEntry] | None"]


def completion(
    rid: str, created: int, model: str, texts: list[Choice], use: dict[str, int]
) -> bytes:
    """A text_completion, one choice per item of ``texts``."""
    choices = [
        {"index": i, "text": text, "logprobs": completion_logprobs(entries, 0),
         "finish_reason": reason, "stop_reason": stop_reason}
        for i, (text, reason, stop_reason, entries) in enumerate(texts)
    ]  # fmt: skip
    return orjson.dumps({"id": rid, "object": "text_completion", "created": created,
                         "model": model, "choices": choices, "usage": use})  # fmt: skip


# A tool call as the routes hand it over: (call id, function name, arguments JSON text).
CallItem = tuple[str, str, str]


def tool_calls(calls: list[CallItem]) -> list[dict[str, Any]]:
    """The ``tool_calls`` of a message (with ``index``, for a streamed delta)."""
    return [
        {"index": i, "id": cid, "type": "function",
         "function": {"name": name, "arguments": arguments}}
        for i, (cid, name, arguments) in enumerate(calls)
    ]  # fmt: skip


def chat_completion(
    rid: str, created: int, model: str, texts: list[Choice], use: dict[str, int],
    calls: list[list[CallItem]] | None = None,
) -> bytes:  # fmt: skip
    choices = []
    for i, (text, reason, stop_reason, entries) in enumerate(texts):
        message: dict[str, Any] = {"role": "assistant", "content": text}
        made = calls[i] if calls else []
        if made:
            message["content"] = text or None
            message["tool_calls"] = [
                {key: value for key, value in call.items() if key != "index"}
                for call in tool_calls(made)
            ]
        choices.append({"index": i, "message": message, "logprobs": chat_logprobs(entries),
                        "finish_reason": reason, "stop_reason": stop_reason})  # fmt: skip
    return orjson.dumps({"id": rid, "object": "chat.completion", "created": created,
                         "model": model, "choices": choices, "usage": use})  # fmt: skip


def sse(payload: Any) -> bytes:
    """One server-sent event carrying ``payload`` as JSON."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def completion_chunk(
    rid: str, created: int, model: str, index: int, text: str, reason: str | None,
    logprobs: dict[str, Any] | None = None, stop_reason: StopReason = None,
) -> dict[str, Any]:  # fmt: skip
    """A text_completion chunk; the one carrying ``reason`` carries ``stop_reason`` too."""
    choice: dict[str, Any] = {"index": index, "text": text, "logprobs": logprobs,
                              "finish_reason": reason}  # fmt: skip
    if reason is not None:
        choice["stop_reason"] = stop_reason
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [choice]}  # fmt: skip


def chat_chunk(
    rid: str, created: int, model: str, index: int, delta: dict[str, str], reason: str | None,
    logprobs: dict[str, Any] | None = None, stop_reason: StopReason = None,
) -> dict[str, Any]:  # fmt: skip
    """A chat.completion.chunk; the one carrying ``reason`` carries ``stop_reason`` too."""
    choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs,
                              "finish_reason": reason}  # fmt: skip
    if reason is not None:
        choice["stop_reason"] = stop_reason
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [choice]}  # fmt: skip


def usage_chunk(rid: str, created: int, model: str, obj: str, use: dict[str, int]) -> bytes:
    return sse({"id": rid, "object": obj, "created": created, "model": model,
                "choices": [], "usage": use})  # fmt: skip


# A model card's fields beyond OpenAI's, by model: vLLM's ``root`` and ``parent`` of a
# LoRA adapter (its file, the model it runs on).
Lineage = Mapping[str, Mapping[str, str]]


def _card(name: str, created: int, lineage: Lineage) -> dict[str, Any]:
    card = {"id": name, "object": "model", "created": created, "owned_by": "slipstream"}
    return card | dict(lineage.get(name, {}))


def model_card(name: str, created: int, lineage: Lineage | None = None) -> bytes:
    return orjson.dumps(_card(name, created, lineage or {}))


def models_list(models: list[tuple[str, int]], lineage: Lineage | None = None) -> bytes:
    data = [_card(name, created, lineage or {}) for name, created in models]
    return orjson.dumps({"object": "list", "data": data})


def embeddings(model: str, vectors: np.ndarray, encoding: str, prompt_tokens: int) -> bytes:
    rows = np.asarray(vectors, dtype=np.float32)
    values: list[Any]
    if encoding == "base64":
        values = [base64.b64encode(row.astype("<f4").tobytes()).decode("ascii") for row in rows]
    else:
        # Widened to float64 and written by orjson from the array: the same digits as
        # row.tolist() (each float32's shortest float64 form), in 2/3 of the time.
        values = list(rows.astype(np.float64))
    data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(values)]
    return orjson.dumps({"object": "list", "data": data, "model": model,
                         "usage": {"prompt_tokens": prompt_tokens,
                                   "total_tokens": prompt_tokens}},
                        option=orjson.OPT_SERIALIZE_NUMPY)  # fmt: skip


# The front door's refusals, with the type and code OpenAI's own API answers them with.
_CLIENT_CODES = {
    401: ("invalid_request_error", "invalid_api_key"),
    403: ("permission_error", "permission_denied"),
    429: ("requests", "rate_limit_exceeded"),
}


def error(exc: SlipstreamError) -> bytes:
    """``{"error": {message, type, param, code}}`` as OpenAI writes it."""
    status = exc.http_status
    match = _PARAM.match(exc.message)
    param = match.group(1) if match and status < 500 else None
    # An error that carries OpenAI's own code and param (ContextLengthExceeded: clients
    # detect an overflow by its code) has them in the reply, whatever its message says.
    own_code, own_param = getattr(exc, "code", None), getattr(exc, "param", None)
    if isinstance(own_param, str):
        param = own_param
    if isinstance(own_code, str):
        kind, code = "invalid_request_error", own_code
    elif isinstance(exc, ModelNotFound):
        kind, code = "invalid_request_error", "model_not_found"
    elif status in _CLIENT_CODES:
        kind, code = _CLIENT_CODES[status]
        # OpenAI's type names the limit: "tokens" for tokens per minute.
        if status == 429 and any(value.startswith('"tokens"') for _, value in
                                 getattr(exc, "headers", ())):  # fmt: skip
            kind = "tokens"
    elif status < 500:
        kind, code = "invalid_request_error", None
    else:
        kind, code = "server_error", "service_unavailable" if status == 503 else None
    return orjson.dumps({"error": {"message": exc.message, "type": kind, "param": param,
                                   "code": code}})  # fmt: skip


def error_event(exc: SlipstreamError) -> bytes:
    """An error met after a stream began, sent as its last event."""
    return b"data: " + error(exc) + b"\n\n"
