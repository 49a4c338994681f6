"""The rollout splitter: weighted shares, sticky keys, and keys that move on a weight change."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from slipstream.serving.rollout_split import Split, Splitter, key_point
from slipstream.serving.shadow import Comparison, compare_many, compare_outputs


@pytest.mark.parametrize("start", range(50))
def test_unkeyed_requests_follow_the_weights_closely_from_the_first_requests(start: int) -> None:
    """Within 3 requests of the exact share at 100, 1,000 and 5,000, whatever the random
    start (drawn at random, 100 requests would miss a 10% share by 3 in one run of three)."""
    random.seed(start)
    splitter = Splitter(Split.of({"1": 90, "2": 10}))  # type: ignore[arg-type]
    for n in (100, 1000, 5000):
        counts = Counter(splitter.choose("") for _ in range(n))
        assert abs(counts["2"] - 0.10 * n) <= 3, (n, counts)


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


def _one_pair(primary: dict[str, np.ndarray], shadow: dict[str, np.ndarray]) -> Comparison:
    """The comparison of one pair written plainly, output by output."""
    agree, max_diff, cosine = True, 0.0, 1.0
    for name, expected in primary.items():
        got = shadow.get(name)
        if got is None or got.shape != expected.shape:  # disagrees; the others still count
            agree, max_diff, cosine = False, float("inf"), min(cosine, 0.0)
        elif expected.dtype.kind == "f" or got.dtype.kind == "f":
            a, b = expected.astype(np.float64).ravel(), got.astype(np.float64).ravel()
            if a.size:
                max_diff = max(max_diff, float(np.max(np.abs(a - b))))
                norms = float(np.linalg.norm(a) * np.linalg.norm(b))
                similarity = float(a @ b) / norms if norms > 0 else float(np.array_equal(a, b))
                cosine = min(cosine, similarity)
                agree = agree and similarity >= 0.999
        else:
            agree = agree and bool(np.array_equal(expected, got))
    return Comparison(agree, max_diff, cosine)


@st.composite
def _answer_pairs(
    draw: st.DrawFn,
) -> tuple[list[dict[str, np.ndarray]], list[dict[str, np.ndarray]]]:
    """A batch of (primary, shadow) answers with float, integer and 0-d outputs: shapes
    that vary between pairs (some empty), shadows equal, perturbed, negated or zero, and
    outputs missing or reshaped."""
    primaries, shadows = [], []
    for seed in range(draw(st.integers(1, 6))):
        rng = np.random.default_rng(draw(st.integers(0, 2**16)) + seed)
        rows = draw(st.sampled_from([0, 1, 3]))
        y = rng.normal(size=(rows, 4)).astype(draw(st.sampled_from([np.float32, np.float64])))
        label = rng.integers(0, 3, size=rows)
        how = draw(st.sampled_from(["same", "close", "negated", "zero", "missing", "reshaped"]))
        got_y = {"same": y, "close": y + 1e-4, "negated": -y, "zero": y * 0,
                 "missing": y, "reshaped": y.reshape(-1)}[how]  # fmt: skip
        got_label = label if draw(st.booleans()) else (label + 1) % 3
        score = np.array(rng.normal())  # a 0-d output
        got_score = score if draw(st.booleans()) else -score
        primaries.append({"y": y, "label": label, "score": score})
        shadow = {"y": got_y, "label": got_label, "score": got_score}
        if how == "missing":
            del shadow["y"]
        shadows.append(shadow)
    return primaries, shadows


@given(_answer_pairs())
def test_pairs_compared_together_match_each_compared_alone(
    batch: tuple[list[dict[str, np.ndarray]], list[dict[str, np.ndarray]]],
) -> None:
    primaries, shadows = batch
    together = compare_many(primaries, shadows)
    for primary, shadow, result in zip(primaries, shadows, together, strict=True):
        alone = _one_pair(primary, shadow)
        assert result.agree == alone.agree
        assert result.max_abs_diff == pytest.approx(alone.max_abs_diff)
        assert result.cosine == pytest.approx(alone.cosine)
