"""The search space: named dimensions, each a short list of values, and their product.

A point holds one value per dimension, in the space's order. Ordered dimensions
(batch sizes, delays, counts) have neighbours: the values next to a point's value;
unordered ones (model variants, hardware profiles) have every other value as a neighbour.

Example::

    space = Space((Dimension("max_batch_size", (1, 4, 16)), Dimension("instances", (1, 2))))
    space.size                         # 6
    space.neighbours((4, 1))           # [(1, 1), (16, 1), (4, 2)]
    space.as_dict((4, 1))              # {"max_batch_size": 4, "instances": 1}
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Any

# One value per dimension, in the space's order.
Point = tuple[Hashable, ...]


@dataclass(frozen=True)
class Dimension:
    """One axis of the search."""

    name: str
    # The values tried, in their natural order (for ordered dimensions).
    values: tuple[Hashable, ...]
    # Whether neighbouring values are alike (a hill climber steps to the next one);
    # False: every other value is a neighbour.
    ordered: bool = True

    def __post_init__(self) -> None:
        if not self.values:
            raise ValueError(f"dimension {self.name!r} has no values")
        if len(set(self.values)) != len(self.values):
            raise ValueError(f"dimension {self.name!r} repeats a value: {self.values}")


@dataclass(frozen=True)
class Space:
    """The product of its dimensions."""

    dimensions: tuple[Dimension, ...]

    @property
    def size(self) -> int:
        return math.prod(len(d.values) for d in self.dimensions)

    @property
    def names(self) -> list[str]:
        return [d.name for d in self.dimensions]

    def points(self) -> Iterator[Point]:
        """Every point, the last dimension varying fastest."""
        return itertools.product(*(d.values for d in self.dimensions))

    def contains(self, point: Point) -> bool:
        return len(point) == len(self.dimensions) and all(
            value in d.values for value, d in zip(point, self.dimensions, strict=True)
        )

    def first(self) -> Point:
        """The smallest configuration: each dimension's first value."""
        return tuple(d.values[0] for d in self.dimensions)

    def neighbours(self, point: Point) -> list[Point]:
        """Points one step away along one dimension."""
        found = []
        for axis, dimension in enumerate(self.dimensions):
            index = dimension.values.index(point[axis])
            if dimension.ordered:
                steps = [i for i in (index - 1, index + 1) if 0 <= i < len(dimension.values)]
            else:
                steps = [i for i in range(len(dimension.values)) if i != index]
            for step in steps:
                found.append((*point[:axis], dimension.values[step], *point[axis + 1 :]))
        return found

    def as_dict(self, point: Point) -> dict[str, Any]:
        return dict(zip(self.names, point, strict=True))
