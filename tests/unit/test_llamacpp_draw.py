"""The llama.cpp engine's numpy sampling (llm/llamacpp_sampling.draw): the same cuts as a
whole-vocabulary sort would make, vLLM's min_p as llama.cpp's own min_p sampler cuts,
draws in proportion to the probabilities, and a draw that depends only on the seed. No
model needed: rows of logits are made here."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from slipstream.llm.engine import SamplingParams
from slipstream.llm.llamacpp_sampling import _draw_all, _top_k, cuts, draw, nucleus


def params(**given: float) -> SamplingParams:
    return SamplingParams(max_tokens=8, **given)  # type: ignore[arg-type]


def weights_of(logits: np.ndarray, temperature: float) -> np.ndarray:
    """As draw() computes them: exp((logits - max) / temperature), the largest 1.0."""
    weights: np.ndarray = np.exp((logits - logits.max()) * np.float32(1.0 / temperature))
    return weights


def sorted_cuts(weights: np.ndarray, top_k: int, top_p: float) -> set[int]:
    """The reference: sort the whole vocabulary, keep the top k, then the top-p prefix."""
    order = np.argsort(-weights.astype(np.float64), kind="stable")
    if 0 < top_k < order.size:
        order = order[:top_k]
    if top_p < 1.0:
        kept = weights[order].astype(np.float64)
        cumulative = np.cumsum(kept)
        # The first token whose running share reaches top_p, and all before it.
        crossing = int(np.argmax(cumulative >= top_p * cumulative[-1]))
        order = order[: crossing + 1]
    return {int(i) for i in order}


@st.composite
def rows(draw_: st.DrawFn) -> np.ndarray:
    """Rows of distinct logits: peaked, flat or long-tailed, 1 to 3,000 tokens."""
    size = draw_(st.integers(1, 3000))
    rng = np.random.default_rng(draw_(st.integers(0, 2**32 - 1)))
    scale = draw_(st.sampled_from([0.01, 1.0, 5.0, 30.0]))
    # At least 1e-3 apart (distinct weights too, in float32): which of two equal values a
    # cut keeps is arbitrary.
    logits = np.sort(rng.standard_normal(size) * scale) + np.arange(size) * 1e-3
    return rng.permutation(logits).astype(np.float32)


@settings(max_examples=200, deadline=None)
@given(
    rows(),
    st.sampled_from([0, 1, 2, 40, 500]),
    st.sampled_from([1.0, 0.999, 0.95, 0.5, 0.01]),
    st.sampled_from([0.3, 1.0, 2.5]),
)
def test_the_cuts_keep_what_a_whole_sort_keeps(
    logits: np.ndarray, top_k: int, top_p: float, temperature: float
) -> None:
    weights = weights_of(logits, temperature)
    chosen = _top_k(weights, top_k) if 0 < top_k < weights.size else None
    if top_p < 1.0:
        chosen = nucleus(weights, chosen, top_p)
    got = set(range(weights.size)) if chosen is None else {int(i) for i in chosen}
    # Weights below 1e-30 of the largest are 0 or denormal in float32 and may tie: which
    # of them a cut keeps is arbitrary, and none is ever drawn in practice.
    drawable = set(np.flatnonzero(weights > 1e-30).tolist())
    assert got & drawable == sorted_cuts(weights, top_k, top_p) & drawable


@settings(max_examples=50, deadline=None)
@given(rows(), st.integers(0, 2**32 - 1))
def test_every_draw_lands_inside_the_cuts_and_depends_only_on_the_seed(
    logits: np.ndarray, seed: int
) -> None:
    chosen = params(temperature=0.8, top_k=40, top_p=0.9)
    allowed = sorted_cuts(weights_of(logits, 0.8), 40, 0.9)
    first = [draw(logits, chosen, np.random.default_rng(seed)) for _ in range(3)]
    rng = np.random.default_rng(seed)
    series = [draw(logits, chosen, rng) for _ in range(20)]
    assert set(series) <= allowed
    assert first == [series[0]] * 3  # a generator seeded alike draws alike
    assert draw(logits, params(temperature=0.0), rng) == int(np.argmax(logits))


@pytest.mark.parametrize("size", [1, 256, 700, 5000])
def test_draws_from_a_whole_vocabulary_follow_its_probabilities(size: int) -> None:
    """A chi-square test over 20,000 draws (a fixed seed: the verdict is the same every
    run); the few heaviest tokens and one bin for the rest, padding blocks included."""
    rng = np.random.default_rng(size)
    logits = (rng.standard_normal(size) * 2).astype(np.float32)
    weights = weights_of(logits, 1.0)
    draws = np.array([_draw_all(weights, rng) for _ in range(20_000)])
    assert draws.min() >= 0 and draws.max() < size
    probabilities = weights.astype(np.float64) / weights.sum(dtype=np.float64)
    heaviest = np.argsort(-probabilities)[: min(size, 20)]
    observed = [int((draws == token).sum()) for token in heaviest]
    expected = [float(probabilities[token]) * draws.size for token in heaviest]
    rest = draws.size - sum(observed)
    if rest or size > len(heaviest):
        observed.append(rest)
        expected.append(draws.size - sum(expected))
    if len(observed) > 1:
        assert stats.chisquare(observed, expected).pvalue > 1e-4
    else:
        assert observed == [draws.size]


def test_a_vocabulary_with_one_likely_token_always_draws_it() -> None:
    logits = np.full(1000, -100.0, np.float32)
    logits[617] = 0.0
    rng = np.random.default_rng(0)
    assert {draw(logits, params(temperature=1.0), rng) for _ in range(200)} == {617}
    assert {draw(logits, params(top_p=0.5), rng) for _ in range(50)} == {617}


@pytest.mark.parametrize("temperature", [5.849951876234426e-193, 1e-40, 9e-6])
def test_a_vanishing_temperature_is_greedy(temperature: float) -> None:
    """schemathesis sent temperature 5.8e-193: 1 / T overflowed float32, the largest
    weight became 0 * inf = NaN, and the draw failed with a 500."""
    rng = np.random.default_rng(3)
    logits = rng.standard_normal(49_152).astype(np.float32)
    assert params(temperature=temperature).greedy
    for top_p in (1.0, 0.9):
        chosen = {
            draw(logits, params(temperature=temperature, top_p=top_p), rng) for _ in range(20)
        }
        assert chosen == {int(np.argmax(logits))}
    assert not params(temperature=2e-5).greedy


# -- vLLM's min_p, against llama.cpp's own samplers ---------------------------------------


def llama_cpp_kept(
    logits: np.ndarray, temperature: float, min_p: float, top_k: int, top_p: float
) -> set[int]:
    """The tokens llama.cpp's sampler chain temp -> top_k -> min_p -> top_p leaves: vLLM's
    order (min_p after temperature, before top-p), its samplers' own rules."""
    lib = pytest.importorskip("llama_cpp", reason="the llama extra is not installed")
    chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
    try:
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_temp(temperature))
        if top_k:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_k(top_k))
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_min_p(min_p, 1))
        if top_p < 1.0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_p(top_p, 1))
        data = (lib.llama_token_data * logits.size)(
            *(lib.llama_token_data(i, float(value), 0.0) for i, value in enumerate(logits))
        )
        candidates = lib.llama_token_data_array(data, logits.size, -1, False)
        lib.llama_sampler_apply(chain, ctypes.byref(candidates))
        return {int(candidates.data[i].id) for i in range(candidates.size)}
    finally:
        lib.llama_sampler_free(chain)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize(
    ("temperature", "min_p", "top_k", "top_p"),
    [(1.0, 0.05, 0, 1.0), (1.0, 0.5, 0, 1.0), (0.7, 0.1, 0, 1.0), (2.0, 0.02, 0, 0.9),
     (1.3, 0.2, 5, 1.0), (1.0, 0.01, 40, 0.8), (1.0, 1.0, 0, 1.0)],
)  # fmt: skip
def test_min_p_keeps_what_llama_cpp_s_min_p_sampler_keeps(
    seed: int, temperature: float, min_p: float, top_k: int, top_p: float
) -> None:
    rng = np.random.default_rng(seed)
    size = int(rng.integers(50, 3000))
    scale = float(rng.choice([1.0, 3.0, 8.0]))
    logits = (rng.standard_normal(size) * scale + np.arange(size) * 1e-4).astype(np.float32)
    logits = rng.permutation(logits)
    chosen = params(temperature=temperature, min_p=min_p, top_k=top_k, top_p=top_p)
    kept = cuts(weights_of(logits, temperature), chosen)
    assert kept is not None
    assert {int(i) for i in kept} == llama_cpp_kept(logits, temperature, min_p, top_k, top_p)
    # And every draw lands among them.
    assert {draw(logits, chosen, rng) for _ in range(30)} <= {int(i) for i in kept}


def test_min_p_of_one_always_draws_the_most_likely_token() -> None:
    rng = np.random.default_rng(5)
    logits = rng.standard_normal(49_152).astype(np.float32)
    for temperature in (0.5, 1.0, 2.0):
        drawn = {draw(logits, params(temperature=temperature, min_p=1.0), rng) for _ in range(20)}
        assert drawn == {int(np.argmax(logits))}


@pytest.mark.parametrize("cut", [{}, {"min_p": 0.1}, {"top_p": 0.5}, {"top_k": 5}])
def test_logits_past_float32_s_range_still_draw_a_token(cut: dict[str, float]) -> None:
    """A tiny repetition penalty divides logits to +inf (the penalized row is made finite
    first); a row left with no finite logit at all draws its argmax instead of failing."""
    rng = np.random.default_rng(0)
    logits = np.random.default_rng(1).normal(size=1000).astype(np.float32)
    logits[[3, 7]] = np.inf
    settings_ = params(temperature=0.8, **cut)
    assert 0 <= draw(logits.copy(), settings_, rng) < logits.size
    for hopeless in (np.full(1000, -np.inf, np.float32), np.full(1000, np.nan, np.float32)):
        assert draw(hopeless, settings_, rng) == 0
