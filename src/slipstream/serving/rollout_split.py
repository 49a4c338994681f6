"""The weighted version choice of a rollout: which version a request that names none runs on.

Every request maps to a point in [0, 1); the versions own consecutive slices of that
interval, as wide as their weights, in ascending version order. A request with a route
key takes the point its key hashes to, so one key always lands on one version, and a
weight change moves only the keys whose points change owner (90/10 -> 75/25 moves the
keys in [0.75, 0.9) from the first version to the second, and no other key). A request
without a key takes the next point of a golden-ratio (Weyl) sequence, which spreads
consecutive requests evenly: a 90/10 split is 90/10 within a few requests, not only on
average.

    split = Split.of({"1": 90, "2": 10})
    splitter = Splitter(split)
    splitter.choose("user-42")   # the same answer for this key on every call
    splitter.choose("")          # the next point of the sequence
"""

from __future__ import annotations

import hashlib
import random
from bisect import bisect_right
from collections.abc import Mapping
from dataclasses import dataclass

# 1/phi: successive multiples mod 1 are as evenly spread as points can be.
_GOLDEN = 0.6180339887498949
_HASH_SPAN = float(2**64)


def key_point(key: str) -> float:
    """Where a route key lies in [0, 1): stable across processes and restarts (not
    Python's salted ``hash``)."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / _HASH_SPAN


@dataclass(frozen=True, slots=True)
class Split:
    """Versions with a weight > 0 and the cumulative upper bound of each one's slice."""

    # Ascending version numbers, as strings ("1", "2", ...).
    versions: tuple[str, ...]
    # bounds[i]: the end of versions[i]'s slice of [0, 1); the last is 1.0.
    bounds: tuple[float, ...]

    @classmethod
    def of(cls, weights: Mapping[str, float]) -> Split | None:
        """The split of ``weights`` (any positive scale); None when no weight is > 0."""
        kept = sorted(((int(v), w) for v, w in weights.items() if w > 0))
        total = sum(w for _, w in kept)
        if not kept or total <= 0:
            return None
        bounds, running = [], 0.0
        for _, weight in kept:
            running += weight
            bounds.append(running / total)
        bounds[-1] = 1.0
        return cls(tuple(str(v) for v, _ in kept), tuple(bounds))

    def at(self, point: float) -> str:
        """The version owning ``point`` in [0, 1)."""
        index = bisect_right(self.bounds, point)
        return self.versions[min(index, len(self.versions) - 1)]

    def shares(self) -> dict[str, float]:
        """Each version's share in percent."""
        shares, previous = {}, 0.0
        for version, bound in zip(self.versions, self.bounds, strict=True):
            shares[version] = round((bound - previous) * 100, 6)
            previous = bound
        return shares


class Splitter:
    """Chooses versions for requests: by key when there is one, else evenly in turn."""

    __slots__ = ("_next", "split")

    def __init__(self, split: Split) -> None:
        self.split = split
        # A random start, so replicas behind one balancer do not move in lockstep.
        self._next = random.random()

    def choose(self, key: str) -> str:
        if len(self.split.versions) == 1:
            return self.split.versions[0]
        if key:
            return self.split.at(key_point(key))
        self._next = (self._next + _GOLDEN) % 1.0
        return self.split.at(self._next)
