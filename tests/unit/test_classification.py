"""Triton's classification extension (top classes of an output as "value:index:label")
and its ``reshape`` (the model file's shape beside the clients'): the pure parts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from slipstream.config import ConfigError, parse_model_config
from slipstream.config.reshape import convert, reshape_problem
from slipstream.errors import InvalidRequest
from slipstream.protocol import grpc_codec, v2
from slipstream.protocol.proto import inference_pb2 as pb
from slipstream.serving.classification import classify, load_labels


def _text(answer: np.ndarray) -> list[list[str]] | list[str]:
    return np.vectorize(bytes.decode, otypes=[object])(answer).tolist()  # type: ignore[no-any-return]


def test_each_row_s_top_classes_are_value_index_and_label() -> None:
    scores = np.array([[0.1, 0.7, 0.2, 0.0], [3.0, -1.0, 3.0, 5.5]], dtype=np.float32)
    answer = classify("probs", scores, 3, batching=True, labels=["cat", "dog", "owl", "eel"])
    assert answer.shape == (2, 3) and answer.dtype == object
    assert _text(answer) == [
        ["0.700000:1:dog", "0.200000:2:owl", "0.100000:0:cat"],
        # A tie keeps index order.
        ["5.500000:3:eel", "3.000000:0:cat", "3.000000:2:owl"],
    ]


def test_without_labels_or_with_too_few_the_label_is_left_out() -> None:
    scores = np.array([[1, 9, 5]], dtype=np.int32)
    assert _text(classify("y", scores, 2, batching=True)) == [["9:1", "5:2"]]
    assert _text(classify("y", scores, 3, batching=True, labels=["a"])) == [["9:1", "5:2", "1:0:a"]]


def test_a_count_beyond_the_classes_returns_every_class() -> None:
    answer = classify("y", np.ones((2, 3), dtype=np.float64), 1000, batching=True)
    assert answer.shape == (2, 3)


def test_unsigned_and_wide_integers_are_ranked_exactly() -> None:
    # Negating a uint8 wraps, and int64 values this close are equal as float64.
    assert _text(classify("y", np.array([[0, 255, 128]], np.uint8), 3, True)) == [
        ["255:1", "128:2", "0:0"]
    ]
    big = np.array([[2**62 + 1, 2**62 + 3, 2**62 + 2]], dtype=np.int64)
    assert _text(classify("y", big, 1, True)) == [[f"{2**62 + 3}:1"]]


def test_a_model_that_does_not_batch_is_ranked_as_a_whole() -> None:
    scores = np.array([[0.5], [0.25], [0.75]], dtype=np.float32)
    answer = classify("y", scores, 2, batching=False)
    assert answer.shape == (2,)
    assert _text(answer) == ["0.750000:2", "0.500000:0"]


def test_a_batched_output_with_more_dims_is_ranked_per_row_flattened() -> None:
    scores = np.arange(12, dtype=np.float32).reshape(2, 1, 6, 1)
    assert _text(classify("y", scores, 1, batching=True)) == [["5.000000:5"], ["11.000000:5"]]


@pytest.mark.parametrize("array", [np.array([[True, False]]), np.array([[b"a", b"b"]], object)])
def test_outputs_without_values_to_rank_are_refused(array: np.ndarray) -> None:
    with pytest.raises(InvalidRequest, match="output 'y': classification needs a numeric"):
        classify("y", array, 1, batching=True)


@given(
    hnp.arrays(
        st.sampled_from([np.float32, np.int16, np.uint16]),
        hnp.array_shapes(min_dims=2, max_dims=2, max_side=6),
    ),
    st.integers(1, 8),
)
def test_ranks_agree_with_a_sort_of_each_row(scores: np.ndarray, count: int) -> None:
    if scores.dtype.kind == "f" and np.isnan(scores).any():
        return
    answer = classify("y", scores, count, batching=True)
    for row, classes in zip(scores, answer, strict=True):
        indices = [int(text.split(b":")[1]) for text in classes]
        expected = sorted(range(row.size), key=lambda i: (-row[i].item(), i))[:count]
        assert indices == expected


def test_labels_are_read_from_the_model_directory_and_a_missing_file_is_named(
    tmp_path: Path,
) -> None:
    config = parse_model_config(
        {"output": [{"name": "y", "data_type": "FP32", "dims": [3], "label_filename": "l.txt"}]},
        "test",
    )
    (tmp_path / "l.txt").write_text("cat\ndog\nowl\n")
    assert load_labels(tmp_path, config) == {"y": ["cat", "dog", "owl"]}
    (tmp_path / "l.txt").unlink()
    with pytest.raises(ConfigError, match=r"output 'y': label_filename 'l\.txt': No such file"):
        load_labels(tmp_path, config)


@pytest.mark.parametrize(
    ("tensor", "expected"),
    [
        ({"label_filename": "../secrets"}, "label_filename: a file in the model directory"),
        ({"label_filename": "/etc/passwd"}, "label_filename: a file in the model directory"),
        ({"reshape": [4, 5]}, r"reshape: shape \[4, 5\] holds 20 elements but dims \[16\]"),
        ({"reshape": [0, 16]}, "reshape: each dim must be -1"),
        ({"dims": [-1, 4], "reshape": [4, 4]}, "has 0 variable dims"),
        ({"dims": [-1, 4], "reshape": [-1, 2, 3]}, "the fixed dims around each variable"),
    ],
)
def test_bad_reshapes_and_label_files_are_refused_naming_the_key(
    tensor: dict[str, object], expected: str
) -> None:
    raw = {"name": "y", "data_type": "FP32", "dims": [16], **tensor}
    with pytest.raises(ConfigError, match=expected):
        parse_model_config({"output": [raw]}, "test")


def test_label_files_belong_to_outputs() -> None:
    raw = {"name": "x", "data_type": "FP32", "dims": [16], "label_filename": "l.txt"}
    with pytest.raises(ConfigError, match="input 'x': label_filename is for outputs"):
        parse_model_config({"input": [raw]}, "test")


def test_a_reshape_carries_the_request_s_variable_sizes_over_in_order() -> None:
    assert reshape_problem([3, 224, 224], [1, 3, 224, 224]) is None
    assert reshape_problem([1], []) is None  # Triton's scalar reshape
    assert convert((1,), [1], []) == ()
    assert convert((5, 7, 12), [-1, -1, 12], [-1, 3, -1, 4]) == (5, 3, 7, 4)
    with pytest.raises(ValueError, match=r"shape \[5, 11\] does not fit dims \[-1, 12\]"):
        convert((5, 11), [-1, 12], [-1, 3, 4])


def _http_outputs(parameters: dict[str, object]) -> bytes:
    return json.dumps({"inputs": [], "outputs": [{"name": "y", "parameters": parameters}]}).encode()


def test_classification_is_read_from_http_and_grpc_requests() -> None:
    (output,) = (
        v2.decode_infer_request(_http_outputs({"classification": 3}), None, "m", "").outputs or []
    )
    assert output.classification == 3
    message = pb.ModelInferRequest(model_name="m")
    message.outputs.add(name="y").parameters["classification"].int64_param = 5
    (output,) = grpc_codec.decode_infer_request(message).outputs or []
    assert output.classification == 5


@pytest.mark.parametrize(
    "parameters",
    [
        {"classification": -1},
        {"classification": "3"},
        {"classification": 2.5},
        {"classification": True},
        {"classification": 2, "shared_memory_region": "r", "shared_memory_byte_size": 8},
    ],
)
def test_bad_http_classification_parameters_are_refused(parameters: dict[str, object]) -> None:
    with pytest.raises(InvalidRequest, match=r"output 'y': .*classification"):
        v2.decode_infer_request(_http_outputs(parameters), None, "m", "")


@pytest.mark.parametrize("kind", ["string_param", "bool_param", "double_param", "int64_param"])
def test_bad_grpc_classification_parameters_are_refused(kind: str) -> None:
    message = pb.ModelInferRequest(model_name="m")
    value = {"string_param": "3", "bool_param": True, "double_param": 3.0, "int64_param": -2}
    parameter = message.outputs.add(name="y").parameters["classification"]
    setattr(parameter, kind, value[kind])
    with pytest.raises(InvalidRequest, match="output 'y': parameter 'classification'"):
        grpc_codec.decode_infer_request(message)
