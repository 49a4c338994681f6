"""Whether a reply is a greedy path of llama.cpp's own model (the llama.cpp engine's tests).

Steps of other shapes (several sequences at once, a prompt read in chunks, a prefix taken
from the cache) run other kernels and sum floats in other orders, so logits move by a
few hundredths and two tokens that near-tie can swap; a sequence that read another's
cache cells, or a grammar that leaked into it, trails by whole units.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# Logits by which a token may trail llama.cpp's best and still count as a greedy choice.
# Seen: a first token that trailed by 0.011 on another CPU, and ' ' taken where 'T' led by
# 0.26 alone (the plain sequence of the constrained-neighbour test, beside three others,
# in a busy `make test`); garbage trails by whole units.
NEAR_TIE = 0.5


def token_text(model: Any, ids: list[int]) -> str:
    """``ids`` as text, by a ``llama_cpp.Llama``."""
    return str(model.detokenize(ids).decode("utf-8", errors="replace"))


def greedy_path(model: Any, prompt: list[int], text: str, max_tokens: int) -> None:
    """Assert ``text`` is ``max_tokens`` tokens that ``model`` (a ``llama_cpp.Llama`` made
    with ``logits_all=True``) would choose greedily after ``prompt``: each its best next
    token or within ``NEAR_TIE`` logits of it."""
    model.reset()
    model.eval(prompt)
    tokens: list[int] = []
    while len(tokens) < max_tokens:
        logits = model.scores[model.n_tokens - 1]
        best = float(logits.max())
        # The best-scoring near-tie whose text the reply continues with.
        chosen = next(
            (
                int(token)
                for token in np.argsort(-logits)[:16]
                if logits[token] >= best - NEAR_TIE
                and text.startswith(token_text(model, [*tokens, int(token)]).rstrip("\ufffd"))
            ),
            None,
        )
        assert chosen is not None, (
            f"token {len(tokens)} of {text!r} is not llama.cpp's greedy choice after "
            f"{token_text(model, tokens)!r}: it preferred "
            f"{token_text(model, [int(logits.argmax())])!r}"
        )
        tokens.append(chosen)
        model.eval([chosen])
    assert token_text(model, tokens) == text
