"""Choosing each sequence's next token on llama.cpp: penalties, grammars, logprobs, draws.

One :class:`SequenceSampler` per sequence. The token is always chosen by the same code,
:func:`draw`, from the sequence's final logits: greedy is an argmax; a draw takes the
tempered softmax's exact min-p (vLLM's), top-k and top-p sets (llama.cpp's order and
rules for the last two) with a numpy generator seeded by the request's seed, all 64
bits of it. So one seed is one random stream, whatever else the request asks:
logprobs, or a logit bias that changes nothing, never change the sampled text (until
2026-12, a sequence with either drew from llama.cpp's ``dist`` sampler instead, another
stream, seeded with the low 32 bits).

What comes before the draw runs only for the sequences that ask. The repetition
penalty (over prompt and output), the frequency and presence penalties (over the
output, as OpenAI defines them) and the logit bias are llama.cpp's samplers, one chain,
applied in that order to a copy of the context's row of logits. A constraint is an
llguidance matcher (JSON schemas, regular expressions, choices, GBNF grammars), checked
the way llama-server checks its grammars: on the token drawn alone first (one token
through the matcher, cheap); only when the matcher refuses it is the vocabulary masked
(llguidance's bitmask) and the token drawn again. Logprobs are a log-softmax of the
logits after the penalties, bias and temperature, in numpy.

``min_tokens`` holds the end-of-generation and stop tokens back by cutting them from a
copy of the row, as a constraint's refusals are cut (logprobs are of the row before
either cut).

A plain sequence draws straight from the context's row (no copy). Through llama.cpp's
own chain a token of SmolLM2 (a 49k vocabulary) cost 0.84 ms drawn from the whole
vocabulary (OpenAI's default: temperature 1, no top-k) and 1.0 ms with top-p 0.9, on
one core; :func:`draw` avoids its full sorts (see there).
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import numpy as np

from slipstream.errors import InvalidRequest
from slipstream.llm.constraints import allowed_tokens, constraint_field
from slipstream.llm.engine import SamplingParams, TokenLogprob

_FLT_MAX = float(np.finfo(np.float32).max)

# llama_token_data as numpy sees it: id, logit, p.
_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])


def build_tokenizer(lib: Any, vocab: Any) -> Any:
    """llguidance's view of a GGUF vocabulary (about a second: build once per model)."""
    from llguidance.llamacpp import lltokenizer_from_vocab

    n_vocab = int(lib.llama_vocab_n_tokens(vocab))
    ends = [token for token in range(n_vocab) if lib.llama_vocab_is_eog(vocab, token)]
    return lltokenizer_from_vocab(vocab, eos_token=ends or None)


class SequenceSampler:
    """The next-token choice of one sequence; see the module docstring."""

    def __init__(
        self,
        lib: Any,
        vocab: Any,
        params: SamplingParams,
        prompt: list[int],
        matcher: Any = None,
        blocked: list[int] | None = None,
    ) -> None:
        """``blocked``: the tokens that cannot be drawn until ``params.min_tokens`` are."""
        self._lib = lib
        self._params = params
        self.n_vocab = int(lib.llama_vocab_n_tokens(vocab))
        # An llguidance LLMatcher when the output is constrained.
        self._matcher = matcher
        self._blocked = np.array(blocked or [], dtype=np.int64)
        self._drawn = 0
        # numpy takes only non-negative seeds: a negative one as its two's complement.
        seed = None if params.seed is None else params.seed % 2**64
        self._rng = np.random.default_rng(seed)
        # llama.cpp's penalties and logit bias, when the request sets any (else None).
        self.chain = None
        if params.penalized or params.logit_bias:
            self.chain = self._build_chain(prompt, len(prompt) + params.max_tokens)

    def _build_chain(self, prompt: list[int], max_len: int) -> Any:
        lib, params = self._lib, self._params
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        add = lib.llama_sampler_chain_add
        if params.repetition_penalty != 1.0:
            repeat = lib.llama_sampler_init_penalties(
                self.n_vocab, max_len, params.repetition_penalty, 0.0, 0.0
            )
            for token in prompt:  # the prompt counts as history for this one only
                lib.llama_sampler_accept(repeat, token)
            add(chain, repeat)
        if params.frequency_penalty or params.presence_penalty:
            add(chain, lib.llama_sampler_init_penalties(
                self.n_vocab, max_len, 1.0, params.frequency_penalty, params.presence_penalty
            ))  # fmt: skip
        if params.logit_bias:
            biases = (lib.llama_logit_bias * len(params.logit_bias))(
                *(lib.llama_logit_bias(token, bias) for token, bias in params.logit_bias)
            )
            add(chain, lib.llama_sampler_init_logit_bias(self.n_vocab, len(biases), biases))
        return chain

    def free(self) -> None:
        if self.chain:
            self._lib.llama_sampler_free(self.chain)
            self.chain = None

    @property
    def finished(self) -> bool:
        """The constraint is complete: nothing but the end of the text may follow."""
        return self._matcher is not None and bool(self._matcher.is_stopped())

    # -- one step --------------------------------------------------------------------------

    def sample(self, context: Any, index: int) -> tuple[int, TokenLogprob | None]:
        """The next token from row ``index`` of the last decode's logits (and its logprob)."""
        lib, params, matcher = self._lib, self._params, self._matcher
        # [n_vocab], read only: the context reuses its buffer next step.
        logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(context, index), (self.n_vocab,))
        if self.chain is not None:
            logits = self._processed(logits)
        # min_tokens: the blocked tokens are cut like a constraint's refusals (logprobs
        # are of the distribution before either cut).
        held = logits
        if self._drawn < params.min_tokens and self._blocked.size:
            held = logits.copy()
            held[self._blocked] = -np.inf
        self._drawn += 1
        token = draw(held, params, self._rng)
        if matcher is not None:
            if matcher.validate_tokens([token]) != 1:
                allowed = allowed_tokens(matcher, self.n_vocab)
                masked = np.where(allowed, held, -np.inf)
                if held is not logits and not np.isfinite(masked).any():
                    # The grammar allows only what min_tokens holds back (its end): it ends.
                    masked = np.where(allowed, logits, -np.inf)
                token = draw(masked, params, self._rng)
            if not matcher.consume_token(token):
                raise _unfollowable(params, matcher)
        if self.chain is not None:
            lib.llama_sampler_accept(self.chain, token)
        logprob = _logprob(logits, token, params) if params.logprobs is not None else None
        return token, logprob

    def _processed(self, row: np.ndarray) -> np.ndarray:
        """``row`` after the chain's penalties and bias ([n_vocab] float32, a new array)."""
        lib = self._lib
        data = np.empty(self.n_vocab, _TOKEN_DATA)
        data["id"] = np.arange(self.n_vocab, dtype=np.int32)
        data["logit"] = row
        data["p"] = 0.0
        candidates = lib.llama_token_data_array(
            data.ctypes.data_as(ctypes.POINTER(lib.llama_token_data)), self.n_vocab, -1, False
        )
        lib.llama_sampler_apply(self.chain, ctypes.byref(candidates))
        # Penalties and bias change logits in place, keeping the order and the size; put
        # them back by id all the same.
        size = int(candidates.size)
        logits = np.full(self.n_vocab, -np.inf, np.float32)
        logits[data["id"][:size]] = data["logit"][:size]
        # A tiny repetition penalty divides logits past float32's range: +inf would make
        # every weight NaN (inf - inf), so it is the largest finite value (NaN: -inf).
        return np.nan_to_num(logits, copy=False, nan=-np.inf, posinf=_FLT_MAX, neginf=-np.inf)


def _logprob(logits: np.ndarray, token: int, params: SamplingParams) -> TokenLogprob:
    """``token``'s log-probability in the distribution it was drawn from (the logits
    after penalties and bias, tempered unless greedy), and the ``params.logprobs`` best."""
    scores = logits.astype(np.float64)  # [n_vocab]
    if not params.greedy:
        scores /= params.temperature
    top = scores.max()
    log_total = top + math.log(float(np.exp(scores - top).sum()))
    wanted = params.logprobs or 0
    best: tuple[tuple[int, float], ...] = ()
    if wanted:
        ids = np.argpartition(-scores, wanted)[:wanted]
        ids = ids[np.argsort(-scores[ids], kind="stable")]
        best = tuple((int(i), float(scores[i] - log_total)) for i in ids)
    return TokenLogprob(token, float(scores[token] - log_total), best)


def draw(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """The next token from one row of logits ([n_vocab], float32, read only): the first
    argmax when greedy; else a draw from the softmax of ``logits / temperature`` cut to
    the tokens at least ``min_p`` times as likely as the most likely one (vLLM's min_p,
    after temperature), to its ``top_k`` most likely tokens, then to the smallest set of
    most likely tokens whose probability reaches ``top_p`` (llama.cpp's order and rules).

    A whole vocabulary is never sorted, partitioned or summed cumulatively (numpy takes
    ~0.3-1 ms for each on 49k tokens): the tokens above a fraction of the largest weight
    are a prefix of the sorted order, so the cuts look among those first."""
    if params.greedy:
        return int(np.argmax(logits))
    top = logits.max()
    if not np.isfinite(top):  # nothing drawable is left (all -inf), or NaN: the argmax
        return int(np.argmax(np.nan_to_num(logits, nan=-np.inf)))
    weights = logits - top  # [n_vocab] float32, the largest 0
    if params.temperature != 1.0:
        weights *= np.float32(1.0 / params.temperature)
    np.exp(weights, out=weights)  # the largest 1.0
    chosen = cuts(weights, params)
    if chosen is None:
        return _draw_all(weights, rng)
    cumulative = np.cumsum(weights[chosen], dtype=np.float64)
    pick = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
    return int(chosen[min(pick, chosen.size - 1)])


def cuts(weights: np.ndarray, params: SamplingParams) -> np.ndarray | None:
    """Indices of the tokens a draw chooses among (None: all of them), from ``weights``,
    each token's probability over the most likely one's (that one's weight is 1.0): the
    min_p, top_k and top_p cuts of :func:`draw`."""
    chosen: np.ndarray | None = None
    if params.min_p > 0.0:
        # The tokens kept are a prefix of the sorted order, as top_k's are: the shorter
        # of the two is both.
        chosen = np.flatnonzero(weights >= params.min_p)
    if 0 < params.top_k < weights.size and (chosen is None or chosen.size > params.top_k):
        chosen = _top_k(weights, params.top_k)
    if params.top_p < 1.0:
        chosen = nucleus(weights, chosen, params.top_p)
    return chosen


# Tokens a block when drawing from a whole vocabulary (see _draw_all).
_BLOCK = 256


def _draw_all(weights: np.ndarray, rng: np.random.Generator) -> int:
    """A token drawn in proportion to ``weights``, in two levels: a block of ``_BLOCK``
    by the blocks' sums, then a token within it."""
    size = weights.size
    padded = weights
    if size % _BLOCK:
        padded = np.zeros(size + _BLOCK - size % _BLOCK, np.float32)
        padded[:size] = weights
    blocks = np.cumsum(padded.reshape(-1, _BLOCK).sum(axis=1, dtype=np.float64))
    point = rng.random() * blocks[-1]
    block = min(int(np.searchsorted(blocks, point, side="right")), blocks.size - 1)
    point -= blocks[block - 1] if block else 0.0
    inner = padded[block * _BLOCK : (block + 1) * _BLOCK]
    cumulative = np.cumsum(inner, dtype=np.float64)
    pick = int(np.searchsorted(cumulative, point, side="right"))
    # Rounding can put the point past the block's last token of any weight.
    pick = min(pick, int(np.flatnonzero(inner)[-1]))
    return block * _BLOCK + pick


def _top_k(weights: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest weights (ties at the edge: any of them)."""
    for floor in (1e-2, 1e-4, 1e-6):
        above = np.flatnonzero(weights >= floor)
        if above.size == k:
            return above
        if above.size > k:
            return above[np.argpartition(weights[above], -k)[-k:]]
    return np.argpartition(weights, -k)[-k:]


def nucleus(weights: np.ndarray, among: np.ndarray | None, top_p: float) -> np.ndarray:
    """Indices of the smallest set of the most likely tokens (of ``among``, or all) whose
    share of ``among``'s total weight reaches ``top_p``: the token that crosses it is
    kept, and at least one is. ``among`` holds the largest weight, 1.0."""
    ids = np.arange(weights.size) if among is None else among
    values = weights if among is None else weights[among]
    target = top_p * float(values.sum(dtype=np.float64))
    for floor in (1e-3, 1e-6):
        above = np.flatnonzero(values >= floor)
        if above.size < values.size and float(values[above].sum(dtype=np.float64)) >= target:
            ids, values = ids[above], values[above]
            break
    order = np.argsort(-values, kind="stable")
    cumulative = np.cumsum(values[order], dtype=np.float64)
    keep = min(int(np.searchsorted(cumulative, target, side="left")) + 1, order.size)
    return ids[order[:keep]]


def _unfollowable(params: SamplingParams, matcher: Any) -> InvalidRequest:
    """The error of a constraint whose next byte no token of the vocabulary gives, though
    llguidance's mask allowed one (seen with ASCII control characters in a choice): the
    request's constraint cannot be followed by this model, a 400 naming its field. Only
    the first line of llguidance's error: the rest is its parser's state dump."""
    field = "constraint" if params.constraint is None else constraint_field(params.constraint)
    reason = str(matcher.get_error()).split("\n", 1)[0]
    return InvalidRequest(f"{field}: this model's vocabulary cannot follow it: {reason}")
