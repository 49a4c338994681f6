"""Triton's ``reshape`` of a model's input or output.

A tensor's ``dims`` are the shape clients send and receive; its ``reshape`` is the shape
the model file takes or produces (the batch dim excluded from both, when the model
batches). Triton's image classifiers are the usual case: clients send ``[3, 224, 224]``,
the model takes ``[1, 3, 224, 224]``; it answers ``[1, 1000, 1, 1]``, clients get
``[1000]``.

The two shapes must hold the same elements for every request: as in Triton, they have
the same number of variable dims (-1), and the fixed dims between two variable ones (or
before the first, or after the last) multiply to the same count on both sides. A
request's variable sizes then carry over in order:

>>> convert((5, 2, 3), (-1, 6), (-1, 2, 3))
(5, 2, 3)
>>> convert((7, 12), (-1, 12), (-1, 3, 4))
(7, 3, 4)
>>> convert((3, 224, 224), (3, 224, 224), (1, 3, 224, 224))
(1, 3, 224, 224)
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def segments(dims: Sequence[int]) -> list[int]:
    """The element counts of the fixed dims around and between the variable ones.

    >>> segments([2, -1, 3, 4, -1])
    [2, 12, 1]
    """
    counts = [1]
    for dim in dims:
        if dim == -1:
            counts.append(1)
        else:
            counts[-1] *= dim
    return counts


def dims_problem(dims: Sequence[int]) -> str | None:
    """Why ``dims`` are no tensor's dims (each -1, variable, or > 0); None when they are."""
    for dim in dims:
        if dim < -1 or dim == 0:
            return f"each dim must be -1 (variable) or > 0, got {dim}"
    return None


def reshape_problem(dims: Sequence[int], reshape: Sequence[int]) -> str | None:
    """Why ``reshape`` cannot stand for ``dims``; None when it can."""
    if (problem := dims_problem(reshape)) is not None:
        return problem
    if list(dims).count(-1) != list(reshape).count(-1):
        return (
            f"shape {list(reshape)} has {list(reshape).count(-1)} variable dims (-1) but "
            f"dims {list(dims)} have {list(dims).count(-1)}; they must have as many"
        )
    if segments(dims) != segments(reshape):
        if -1 not in dims:
            return (
                f"shape {list(reshape)} holds {math.prod(reshape)} elements but dims "
                f"{list(dims)} hold {math.prod(dims)}"
            )
        return (
            f"shape {list(reshape)} does not hold the same elements as dims {list(dims)}: "
            "the fixed dims around each variable one must multiply to the same count"
        )
    return None


def convert(
    shape: tuple[int, ...], source: Sequence[int], target: Sequence[int]
) -> tuple[int, ...]:
    """``shape`` (a tensor of ``source`` dims) as ``target`` dims: each -1 of ``target``
    takes the size of the tensor's dim at the matching -1 of ``source``. Raises
    ValueError when ``shape`` does not fit ``source``."""
    if len(shape) != len(source) or any(
        want != -1 and got != want for got, want in zip(shape, source, strict=True)
    ):
        raise ValueError(f"shape {list(shape)} does not fit dims {list(source)}")
    sizes = iter([got for got, want in zip(shape, source, strict=True) if want == -1])
    return tuple([next(sizes) if dim == -1 else dim for dim in target])
