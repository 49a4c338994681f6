"""The tools' one tensor-file reader and one random-input generator (slipstream/tensors.py)."""

from __future__ import annotations

import doctest
from pathlib import Path

import numpy as np
import orjson
import pytest

from slipstream import tensors
from slipstream.datatypes import V2_TO_NUMPY
from slipstream.tensors import TensorFileError, random_tensor, read_tensor_file, value_source

# A request whose data holds 1 element for a shape of 2.
SHORT_REQUEST = b'{"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [1]}]}'


def test_the_three_formats_give_arrays_by_name(tmp_path: Path) -> None:
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    np.savez(tmp_path / "data.npz", x=x)
    (tmp_path / "dir").mkdir()
    np.save(tmp_path / "dir" / "x.npy", x)
    request = {
        "inputs": [{"name": "x", "shape": [3, 2], "datatype": "FP32", "data": x.ravel().tolist()}]
    }
    (tmp_path / "one.json").write_bytes(orjson.dumps(request))
    (tmp_path / "two.json").write_bytes(orjson.dumps([request, request]))
    for name, count in [("data.npz", 1), ("dir", 1), ("one.json", 1), ("two.json", 2)]:
        arrays = read_tensor_file(tmp_path / name)
        assert len(arrays) == count
        for got in arrays:
            np.testing.assert_array_equal(got["x"], x)
            assert got["x"].dtype == np.float32


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("missing.npz", None, "no such file"),
        ("data.csv", b"1,2", r"expected a \.npz or \.json"),
        ("bad.npz", b"not a zip", "not a readable .npz"),
        ("bad.json", b"{", "not readable JSON"),
        ("empty.json", b"[]", "the list of requests is empty"),
        ("short.json", SHORT_REQUEST, "request 0: input 'x'"),
    ],
)  # fmt: skip
def test_a_bad_file_is_named_with_what_is_wrong(
    tmp_path: Path, name: str, content: bytes | None, message: str
) -> None:
    if content is not None:
        (tmp_path / name).write_bytes(content)
    with pytest.raises(TensorFileError, match=message):
        read_tensor_file(tmp_path / name)


@pytest.mark.parametrize("datatype", sorted(V2_TO_NUMPY))
def test_random_tensors_have_the_datatype_and_shape(datatype: str) -> None:
    array = random_tensor(datatype, (4, 3), np.random.default_rng(0))
    assert array.shape == (4, 3) and array.dtype == V2_TO_NUMPY[datatype]
    if datatype == "BYTES":
        assert all(isinstance(item, bytes) and len(item) == 8 for item in array.flat)
    elif datatype not in ("BOOL", "FP16", "BF16", "FP32", "FP64"):
        assert array.min() >= 0 and array.max() < 1000


def test_names_pick_masks_token_types_and_positions() -> None:
    rng = np.random.default_rng(0)
    assert (random_tensor("INT64", (2, 5), rng, name="attention_mask") == 1).all()
    assert (random_tensor("INT64", (2, 5), rng, name="token_type_ids") == 0).all()
    positions = random_tensor("INT64", (2, 5), rng, name="position_ids")
    assert positions.tolist() == [[0, 1, 2, 3, 4]] * 2
    assert random_tensor("INT64", (1000,), rng, high=10).max() < 10
    assert value_source("input_ids", "INT8") == "random integers in [0, 128)"


def test_the_module_examples_hold() -> None:
    assert doctest.testmod(tensors).failed == 0
