"""Requests to a generative model in the shape of Triton's vLLM backend.

A Triton user serving an LLM with the vLLM backend calls it with V2 requests whose
inputs are ``text_input`` (BYTES, the prompt), the optional BOOLs ``stream``,
``exclude_input_in_output`` and ``return_finish_reason`` / ``return_num_input_tokens`` /
``return_num_output_tokens``, and ``sampling_parameters`` (BYTES: a JSON object of
vLLM's ``SamplingParams``); without that input the request's own parameters are the
sampling parameters (Triton's generate extension puts its ``parameters`` there, those
named as inputs becoming the inputs). The answers carry ``text_output`` (BYTES) and the
outputs asked for. Pure codec, no I/O: this module reads and checks the request; the
answers are built where generation runs (``server/v2_llm.py``).

As the backend does: a request that does not stream answers once, its text preceded by
the prompt unless ``exclude_input_in_output`` is true; a streaming one answers each new
piece of text (the prompt never, ``exclude_input_in_output: false`` refused).
``max_tokens`` defaults to vLLM's 16 (a ``min_tokens`` above it is a 400, as in vLLM).
Sampling parameters take the OpenAI lane's validation, ranges and semantics (``min_p``,
``min_tokens``, ``stop_token_ids`` and ``include_stop_str_in_output`` as vLLM defines
them); vLLM's parameters that this server does not implement are accepted at their
default values only, anything else named in a 400.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from slipstream.config import TensorConfig
from slipstream.datatypes import v2_datatype
from slipstream.errors import InvalidRequest
from slipstream.protocol import openai
from slipstream.types import InferRequest

# vLLM's SamplingParams.max_tokens default: what a request that sets none generates.
DEFAULT_MAX_TOKENS = 16

_BOOL_INPUTS = (
    "stream",
    "exclude_input_in_output",
    "return_finish_reason",
    "return_num_input_tokens",
    "return_num_output_tokens",
)

# The tensors as the backend's auto-completed config.pbtxt lists them (less the inputs
# this server does not serve: image, return_logprobs, return_cumulative_logprob and the
# OpenAI front end's embedding_request).
INPUTS = (
    TensorConfig(name="text_input", data_type="BYTES", dims=[1]),
    TensorConfig(name="sampling_parameters", data_type="BYTES", dims=[1], optional=True),
    *(TensorConfig(name=name, data_type="BOOL", dims=[1], optional=True) for name in _BOOL_INPUTS),
)
OUTPUTS = (
    TensorConfig(name="text_output", data_type="BYTES", dims=[-1]),
    TensorConfig(name="finish_reason", data_type="BYTES", dims=[-1]),
    TensorConfig(name="num_input_tokens", data_type="UINT32", dims=[1]),
    TensorConfig(name="num_output_tokens", data_type="UINT32", dims=[-1]),
)
_INPUT_NAMES = tuple(tensor.name for tensor in INPUTS)

# vLLM sampling parameters served here: they become the OpenAI lane's fields of the
# same names (n and best_of at 1 only).
_SERVED = frozenset({
    "temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "stop",
    "stop_token_ids", "include_stop_str_in_output", "seed", "ignore_eos",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "n",
    "best_of",
})  # fmt: skip
# vLLM sampling parameters accepted at these values only (None is the default too).
_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "logprobs": (),
    "prompt_logprobs": (),
    "detokenize": (True,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "bad_words": ([],),
    "allowed_token_ids": (),
    "truncate_prompt_tokens": (),
    "lora_name": (),
    "guided_decoding": (),
    "structured_outputs": (),
}


@dataclass(frozen=True, slots=True)
class TextRequest:
    """One request read as the vLLM backend reads it."""

    # The prompt, as sent.
    prompt: str
    # Answer each new piece of text as it comes (else one answer at the end).
    stream: bool
    # The one answer's text starts with the prompt (never when streaming).
    prepend_input: bool
    # The sampling settings in the OpenAI lane's terms (its validation and ranges).
    sampling: openai.CompletionRequest
    # Where they came from, to name in errors: "sampling_parameters" or "parameters".
    sampling_source: str
    # The optional outputs asked for.
    finish_reason: bool = False
    num_input_tokens: bool = False
    num_output_tokens: bool = False

    @property
    def max_tokens(self) -> int:
        return self.sampling.max_tokens or DEFAULT_MAX_TOKENS


def read_text_request(request: InferRequest) -> TextRequest:
    """``request`` as the vLLM backend reads it; InvalidRequest naming the input or
    parameter at fault."""
    inputs = request.inputs
    unknown = sorted(set(inputs) - set(_INPUT_NAMES))
    if unknown:
        raise InvalidRequest(
            f"{unknown[0]}: model {request.model_name!r} has no such input (inputs: "
            f"{', '.join(_INPUT_NAMES)})"
        )
    if "text_input" not in inputs:
        raise InvalidRequest(
            f"text_input: missing; model {request.model_name!r} (served as Triton's vLLM "
            "backend serves a model) takes the prompt as a BYTES input named text_input"
        )
    prompt = _one_text(inputs["text_input"], "text_input")
    flags = {name: _one_bool(inputs[name], name) for name in _BOOL_INPUTS if name in inputs}
    stream = flags.get("stream", False)
    exclude = flags.get("exclude_input_in_output")
    if stream and exclude is False:
        raise InvalidRequest(
            "exclude_input_in_output: false is not allowed when streaming (a stream sends "
            "only the new text); leave it out or send true"
        )
    if "sampling_parameters" in inputs:
        source = "sampling_parameters"
        values = _json_object(_one_text(inputs[source], source), source)
    else:
        source, values = "parameters", dict(request.parameters)
    return TextRequest(
        prompt=prompt,
        stream=stream,
        prepend_input=not stream and not exclude,
        sampling=sampling_settings(request.model_name, values, source),
        sampling_source=source,
        finish_reason=flags.get("return_finish_reason", False),
        num_input_tokens=flags.get("return_num_input_tokens", False),
        num_output_tokens=flags.get("return_num_output_tokens", False),
    )


def sampling_settings(model: str, values: dict[str, Any], source: str) -> openai.CompletionRequest:
    """vLLM's sampling parameters ``values`` as the OpenAI lane's settings; InvalidRequest
    naming ``source.<parameter>`` for one unknown, unserved or out of range."""
    served: dict[str, Any] = {}
    for key, value in values.items():
        if value is None:
            continue  # vLLM's default, as the backend reads a null
        if key in _SERVED:
            served[key] = value
        elif key in _DEFAULT_ONLY:
            if value not in _DEFAULT_ONLY[key]:
                allowed = " or ".join(repr(v) for v in _DEFAULT_ONLY[key]) or "null"
                raise InvalidRequest(
                    f"{source}.{key}: {value!r} is not supported by this server (only "
                    f"{allowed}); leave it out"
                )
        else:
            names = ", ".join(sorted(_SERVED))
            raise InvalidRequest(f"{source}.{key}: not a sampling parameter (served: {names})")
    for key in ("n", "best_of"):
        if served.get(key, 1) not in (1, "1"):
            raise InvalidRequest(f"{source}.{key}: only 1 is supported (one text per request)")
    served.pop("best_of", None)
    body = orjson.dumps({"model": model, "prompt": "", **served}, option=orjson.OPT_NON_STR_KEYS)
    try:
        settings: openai.CompletionRequest = openai.parse(body, openai.CompletionRequest)
    except InvalidRequest as exc:
        raise InvalidRequest(f"{source}.{exc.message}") from None
    if settings.max_tokens is None and settings.min_tokens > DEFAULT_MAX_TOKENS:
        raise InvalidRequest(
            f"{source}.min_tokens: {settings.min_tokens} cannot be combined with the default "
            f"max_tokens {DEFAULT_MAX_TOKENS} (vLLM's); send a max_tokens of at least "
            "min_tokens"
        )
    return settings


def _one_text(array: np.ndarray, name: str) -> str:
    if array.dtype.kind not in ("O", "S", "U"):
        raise InvalidRequest(f"{name}: expected datatype BYTES, got {_datatype(array)}")
    if array.size != 1:
        raise InvalidRequest(
            f"{name}: expected one element (shape [1]), got shape {list(array.shape)}"
        )
    value = array.reshape(-1)[0]
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode()
    except (TypeError, UnicodeDecodeError):
        raise InvalidRequest(f"{name}: not UTF-8 text") from None


def _one_bool(array: np.ndarray, name: str) -> bool:
    if array.dtype != np.bool_:
        raise InvalidRequest(f"{name}: expected datatype BOOL, got {_datatype(array)}")
    if array.size != 1:
        raise InvalidRequest(
            f"{name}: expected one element (shape [1]), got shape {list(array.shape)}"
        )
    return bool(array.reshape(-1)[0])


def _json_object(text: str, name: str) -> dict[str, Any]:
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(
            f"{name}: not valid JSON ({exc}); send a JSON object, e.g. "
            '{"temperature": 0, "max_tokens": 20}'
        ) from None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{name}: expected a JSON object, got {type(value).__name__}")
    return value


def _datatype(array: np.ndarray) -> str:
    try:
        return v2_datatype(array.dtype)
    except ValueError:
        return str(array.dtype)
