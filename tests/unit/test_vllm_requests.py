"""Reading a V2 request as Triton's vLLM backend reads it (protocol/vllm_requests.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from slipstream.errors import InvalidRequest
from slipstream.protocol.vllm_requests import DEFAULT_MAX_TOKENS, read_text_request
from slipstream.types import InferRequest


def _request(parameters: dict[str, Any] | None = None, **inputs: Any) -> InferRequest:
    arrays = {}
    for name, value in inputs.items():
        if isinstance(value, np.ndarray):
            arrays[name] = value
        elif isinstance(value, bool):
            arrays[name] = np.array([value])
        else:
            arrays[name] = np.array([value.encode()], dtype=object)
    return InferRequest("m", "", arrays, parameters=parameters or {})


def test_a_request_that_does_not_stream_gets_the_prompt_first_and_vllm_s_defaults() -> None:
    text = read_text_request(_request(text_input="Hi"))
    assert (text.prompt, text.stream, text.prepend_input) == ("Hi", False, True)
    assert text.max_tokens == DEFAULT_MAX_TOKENS and text.sampling.temperature == 1.0
    assert text.sampling_source == "parameters"


def test_a_stream_never_sends_the_prompt_and_refuses_asking_for_it() -> None:
    text = read_text_request(_request(text_input="Hi", stream=True))
    assert text.stream and not text.prepend_input
    with pytest.raises(InvalidRequest, match=r"^exclude_input_in_output: false is not allowed"):
        read_text_request(_request(text_input="Hi", stream=True, exclude_input_in_output=False))
    excluded = read_text_request(_request(text_input="Hi", exclude_input_in_output=True))
    assert not excluded.prepend_input


def test_sampling_parameters_input_wins_over_request_parameters() -> None:
    request = _request(
        {"temperature": 0.5}, text_input="Hi",
        sampling_parameters='{"temperature": 0, "max_tokens": "20", "stop": ["."], "seed": 3}',
    )  # fmt: skip
    text = read_text_request(request)
    assert text.sampling_source == "sampling_parameters"
    sampling = text.sampling
    assert (sampling.temperature, text.max_tokens, sampling.stops(), sampling.seed) == (
        0.0, 20, ["."], 3,
    )  # fmt: skip


def test_vllm_s_defaults_are_accepted_and_other_values_named() -> None:
    plain = {"min_p": 0.0, "skip_special_tokens": True, "n": 1, "logprobs": None}
    assert read_text_request(_request(plain, text_input="x")).max_tokens == DEFAULT_MAX_TOKENS
    for parameters, named in [
        ({"skip_special_tokens": False}, "parameters.skip_special_tokens: False is not"),
        ({"min_p": 1.5}, "parameters.min_p: "),
        ({"min_tokens": 17}, "parameters.min_tokens: 17 cannot be combined with the default"),
        ({"min_tokens": 5, "max_tokens": 4}, "parameters.min_tokens: 5 cannot be combined"),
        ({"stop_token_ids": [-3]}, "parameters.stop_token_ids.0: "),
        ({"n": 2}, "parameters.n: only 1"),
        ({"temprature": 1}, "parameters.temprature: not a sampling parameter"),
        ({"top_k": "many"}, "parameters.top_k: "),
        ({"max_tokens": 0}, "parameters.max_tokens: "),
    ]:
        with pytest.raises(InvalidRequest) as info:
            read_text_request(_request(parameters, text_input="x"))
        assert info.value.message.startswith(named), info.value.message


def test_vllm_s_min_p_min_tokens_and_stop_token_ids_are_served() -> None:
    values = {"min_p": 0.3, "min_tokens": 16, "stop_token_ids": [4, 2],
              "include_stop_str_in_output": True}  # fmt: skip
    text = read_text_request(_request(values, text_input="x"))
    sampling = text.sampling
    assert (sampling.min_p, sampling.min_tokens, sampling.stop_token_ids) == (0.3, 16, [4, 2])
    assert sampling.include_stop_str_in_output and text.max_tokens == DEFAULT_MAX_TOKENS


@pytest.mark.parametrize(
    ("inputs", "named"),
    [
        ({}, "text_input: missing"),
        ({"text_input": np.array([1.0], np.float32)}, "text_input: expected datatype BYTES"),
        ({"text_input": np.array([b"a", b"b"], object)}, "text_input: expected one element"),
        ({"text_input": "x", "stream": np.array([1], np.int32)}, "stream: expected datatype BOOL"),
        ({"text_input": "x", "sampling_parameters": "{"}, "sampling_parameters: not valid JSON"),
        ({"text_input": "x", "sampling_parameters": "3"}, "sampling_parameters: expected a JSON"),
        ({"text_input": "x", "image": "y"}, "image: model 'm' has no such input"),
    ],
)  # fmt: skip
def test_bad_inputs_are_named(inputs: dict[str, Any], named: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        read_text_request(_request(**inputs))
    assert info.value.message.startswith(named), info.value.message
