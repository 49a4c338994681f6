"""The rollout splitter: weighted shares, sticky keys, and keys that move on a weight change."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from slipstream.serving.rollout_split import Split, Splitter, key_point
from slipstream.serving.shadow import compare_outputs


def test_unkeyed_requests_follow_the_weights_closely_from_the_first_requests() -> None:
    splitter = Splitter(Split.of({"1": 90, "2": 10}))  # type: ignore[arg-type]
    for n in (100, 1000, 5000):
        counts = Counter(splitter.choose("") for _ in range(n))
        assert abs(counts["2"] / n - 0.10) < 0.015, (n, counts)


def test_a_key_always_lands_on_one_version() -> None:
    splitter = Splitter(Split.of({"1": 50, "2": 30, "3": 20}))  # type: ignore[arg-type]
    for key in (f"user-{i}" for i in range(500)):
        assert len({splitter.choose(key) for _ in range(5)}) == 1


def test_keys_spread_by_weight() -> None:
    split = Split.of({"1": 75, "2": 25})
    assert split is not None
    counts = Counter(split.at(key_point(f"k{i}")) for i in range(20_000))
    assert abs(counts["2"] / 20_000 - 0.25) < 0.015


@pytest.mark.parametrize("before, after", [(10, 25), (25, 10), (5, 100), (50, 0)])
def test_a_weight_change_moves_only_the_keys_that_must(before: float, after: float) -> None:
    old = Split.of({"1": 100 - before, "2": before})
    new = Split.of({"1": 100 - after, "2": after})
    assert old is not None and new is not None
    keys = [f"user-{i}" for i in range(10_000)]
    moved = [k for k in keys if old.at(key_point(k)) != new.at(key_point(k))]
    # Growing the candidate moves keys only to it, shrinking only away from it.
    direction = "2" if after > before else "1"
    assert all(new.at(key_point(k)) == direction for k in moved)
    assert abs(len(moved) / len(keys) - abs(after - before) / 100) < 0.02


def test_zero_weights_and_the_order_of_versions() -> None:
    assert Split.of({}) is None
    assert Split.of({"1": 0}) is None
    split = Split.of({"10": 1, "9": 1, "2": 0})
    assert split is not None
    assert split.versions == ("9", "10")  # numeric order, zero weights dropped
    assert split.shares() == {"9": 50.0, "10": 50.0}
    assert Splitter(Split.of({"3": 5})).choose("any") == "3"  # type: ignore[arg-type]


def test_key_points_are_stable_across_processes() -> None:
    # blake2b of the key, not Python's salted hash: a restart keeps every user's version.
    assert key_point("user-42") == pytest.approx(key_point("user-42"))
    assert 0 <= key_point("") < 1
    assert round(key_point("user-42"), 6) == round(
        int.from_bytes(__import__("hashlib").blake2b(b"user-42", digest_size=8).digest(), "big")
        / 2**64,
        6,
    )


def test_shadow_comparison_of_labels_tensors_and_text() -> None:
    labels = {"label": np.array([1, 2, 3])}
    assert compare_outputs(labels, {"label": np.array([1, 2, 3])}).agree
    assert not compare_outputs(labels, {"label": np.array([1, 2, 4])}).agree
    x = np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32)
    close = compare_outputs({"y": x}, {"y": x + 1e-5})
    assert close.agree and close.max_abs_diff == pytest.approx(1e-5, rel=0.1)
    far = compare_outputs({"y": x}, {"y": -x})
    assert not far.agree and far.cosine == pytest.approx(-1.0)
    text = {"t": np.array([b"yes", b"no"], dtype=object)}
    assert compare_outputs(text, {"t": np.array([b"yes", b"no"], dtype=object)}).agree
    assert not compare_outputs(text, {"t": np.array([b"yes", b"No"], dtype=object)}).agree
    assert not compare_outputs(labels, {}).agree
