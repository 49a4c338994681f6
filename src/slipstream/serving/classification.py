"""Triton's classification extension: an output returned as its top classes.

A request asks for it per output (``"parameters": {"classification": N}``; tritonclient's
``InferRequestedOutput(name, class_count=N)``). The output then comes back as BYTES of
shape ``[batch, min(N, classes)]`` (``[min(N, elements)]`` for a model that does not
batch), each element ``"<value>:<index>"``, or ``"<value>:<index>:<label>"`` where the
output's ``label_filename`` names a file of labels, one a line. The classes of a row are
its highest values first, ties in index order; values are written as Triton writes them
(six decimals for floats).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from slipstream.config import ConfigError, ModelConfig
from slipstream.datatypes import v2_datatype
from slipstream.errors import InvalidRequest
from slipstream.types import InferRequest, InferResponse

# Triton's bound on the classes of one row: a larger output is refused, not sorted.
MAX_CLASSES = 1_000_000


def wanted(request: InferRequest) -> bool:
    """Whether the request asks for any output's classes."""
    return request.outputs is not None and any(o.classification for o in request.outputs)


def load_labels(model_dir: Path, config: ModelConfig) -> dict[str, list[str]]:
    """Each output's labels, from its ``label_filename`` in the model directory."""
    labels = {}
    for tensor in config.output:
        if not tensor.label_filename:
            continue
        path = model_dir / tensor.label_filename
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise ConfigError(
                f"output {tensor.name!r}: label_filename {tensor.label_filename!r}: {reason}"
            ) from None
        labels[tensor.name] = text.splitlines()
    return labels


def classify_response(
    request: InferRequest,
    response: InferResponse,
    batching: bool,
    labels: Mapping[str, Sequence[str]],
) -> InferResponse:
    """A copy of ``response`` with each output the request asked classes of replaced by
    them (the response itself is left as it is: a shadow may still compare it)."""
    outputs = dict(response.outputs)
    for output in request.outputs or ():
        if output.classification and output.name in outputs:
            outputs[output.name] = classify(
                output.name,
                outputs[output.name],
                output.classification,
                batching,
                labels.get(output.name),
            )
    return replace(response, outputs=outputs)


def classify(
    name: str,
    array: np.ndarray,
    count: int,
    batching: bool,
    labels: Sequence[str] | None = None,
) -> np.ndarray:
    """The top ``count`` classes of each row of ``array`` (of the whole array when the
    model does not batch), as BYTES "value:index[:label]"."""
    if array.dtype.kind not in "iuf":
        raise InvalidRequest(
            f"output {name!r}: classification needs a numeric output; this one is "
            f"{_datatype(array)}"
        )
    rows = array.reshape(array.shape[0], -1) if batching and array.ndim else array.reshape(1, -1)
    classes = rows.shape[1]
    if classes > MAX_CLASSES:
        raise InvalidRequest(
            f"output {name!r}: classification of {classes} classes a row; at most {MAX_CLASSES:,}"
        )
    count = min(count, classes)
    # Highest first, ties in index order: a stable ascending sort of each row reversed,
    # read backwards (values are compared in their own type, as integers stay exact).
    order = classes - 1 - np.argsort(rows[:, ::-1], axis=1, kind="stable")[:, ::-1][:, :count]
    floats = array.dtype.kind == "f"
    answer = np.empty((rows.shape[0], count), dtype=object)
    for row in range(rows.shape[0]):
        for rank, index in enumerate(order[row].tolist()):
            value = rows[row, index].item()
            text = f"{value:f}:{index}" if floats else f"{value}:{index}"
            if labels is not None and index < len(labels):
                text = f"{text}:{labels[index]}"
            answer[row, rank] = text.encode()
    return answer if batching and array.ndim else answer.reshape(count)


def _datatype(array: np.ndarray) -> str:
    try:
        return v2_datatype(array.dtype)
    except ValueError:
        return str(array.dtype)
