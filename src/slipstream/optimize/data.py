"""Validation and calibration data for ``slipstream optimize``.

Three formats, all holding arrays named like the model's inputs plus optional labels:

- ``data.npz``: ``numpy.savez("data.npz", input=x, labels=y)``;
- a directory of ``.npy`` files: ``input.npy`` (one per model input), ``labels.npy``;
- a V2 JSON request file: one request ``{"inputs": [...]}`` or a list of them; an input
  named ``labels`` is taken as the labels. Requests are concatenated along the batch dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from slipstream.tensors import TensorFileError, read_tensor_file

__all__ = ["LABELS_NAME", "DataError", "Dataset", "array_names", "load_dataset"]

# The array holding the expected class per row, in every format.
LABELS_NAME = "labels"


class DataError(ValueError):
    """The data file cannot be used; the message names the file and the fix."""


@dataclass(frozen=True, slots=True)
class Dataset:
    """Rows to run through a model: inputs by name (batch dim first) and optional labels."""

    # Input name -> array [N, ...]; every array has the same N.
    inputs: dict[str, np.ndarray]
    # Expected class per row [N], or None when the data has no labels.
    labels: np.ndarray | None
    # Where the rows came from, for the record.
    source: str

    @property
    def num_rows(self) -> int:
        return len(next(iter(self.inputs.values())))

    def rows(self, start: int, stop: int) -> Dataset:
        """Rows [start, stop) as a new dataset."""
        return Dataset(
            inputs={name: array[start:stop] for name, array in self.inputs.items()},
            labels=None if self.labels is None else self.labels[start:stop],
            source=f"{self.source}[{start}:{stop}]",
        )


def load_dataset(path: Path, input_names: Sequence[str]) -> Dataset:
    """Read ``path`` (.npz, directory of .npy, or V2 JSON) for a model with ``input_names``."""
    arrays = _read_arrays(path)
    labels = arrays.pop(LABELS_NAME, None)
    missing = [name for name in input_names if name not in arrays]
    if missing:
        raise DataError(
            f"{path}: no array for model input(s) {', '.join(missing)}; "
            f"found {', '.join(sorted(arrays)) or 'nothing'}"
        )
    inputs = {name: arrays[name] for name in input_names}
    _check_rows(path, inputs, labels)
    if labels is not None:
        labels = labels.reshape(len(labels), -1)[:, 0] if labels.ndim > 1 else labels
        labels = labels.astype(np.int64)
    return Dataset(inputs=inputs, labels=labels, source=str(path))


def array_names(path: Path) -> list[str]:
    """The names of the arrays in ``path`` (labels included), for a model whose input
    names are not known yet (a PyTorch model is named after its data on export)."""
    return sorted(_read_arrays(path))


def _read_arrays(path: Path) -> dict[str, np.ndarray]:
    """Every array of ``path`` by name; a JSON file's requests concatenated as rows."""
    try:
        requests = read_tensor_file(path)
    except TensorFileError as exc:
        raise DataError(str(exc)) from None
    if len(requests) == 1:
        return requests[0]
    parts: dict[str, list[np.ndarray]] = {}
    for arrays in requests:
        for name, array in arrays.items():
            parts.setdefault(name, []).append(array)
    try:
        return {name: np.concatenate(arrays) for name, arrays in parts.items()}
    except ValueError as exc:
        raise DataError(f"{path}: requests disagree on an input's shape ({exc})") from None


def _check_rows(path: Path, inputs: dict[str, np.ndarray], labels: np.ndarray | None) -> None:
    counts = {name: len(array) for name, array in inputs.items() if array.ndim > 0}
    if labels is not None:
        counts[LABELS_NAME] = len(labels)
    if len(counts) != len(inputs) + (labels is not None):
        raise DataError(f"{path}: every array needs a batch dim (rows first)")
    if len(set(counts.values())) > 1:
        shown = ", ".join(f"{name}: {count}" for name, count in counts.items())
        raise DataError(f"{path}: arrays disagree on the number of rows ({shown})")
    if not counts or min(counts.values()) == 0:
        raise DataError(f"{path}: holds no rows")
