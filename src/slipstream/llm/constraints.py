"""Constrained decoding on llguidance, for every engine: a constraint compiled to a
grammar, and the tokens a matcher allows next."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from typing import Any

import numpy as np

from slipstream.errors import InvalidRequest
from slipstream.types import Constraint


@functools.lru_cache(maxsize=256)
def compile_constraint(constraint: Constraint) -> str:
    """The llguidance grammar of a constraint; InvalidRequest naming the field if bad.

    Cached: a request's constraint is checked before it streams and compiled again for
    its matcher, and services send the same few schemas over and over."""
    from llguidance import LLMatcher, grammar_from

    field = constraint_field(constraint)
    try:
        if constraint.kind in ("json_object", "json_schema"):
            schema = json.loads(constraint.source or '{"type": "object"}')
            if constraint.strict:
                schema = _closed(schema)
            grammar = LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_STYLE)
        elif constraint.kind == "choice":
            grammar = grammar_from("choice", json.dumps(list(constraint.choices)))
        elif constraint.kind == "regex":
            grammar = grammar_from("regex", constraint.source)
        else:
            grammar = grammar_from("gbnf", constraint.source)
    except ValueError as exc:
        raise InvalidRequest(f"{field}: does not compile: {exc}") from None
    problem = LLMatcher.validate_grammar(grammar)
    if problem:
        raise InvalidRequest(f"{field}: does not compile: {problem.strip()}")
    return str(grammar)


# JSON as OpenAI's structured outputs write it: one space after separators, no free
# whitespace (a small model given free whitespace can pad until max_tokens).
_JSON_STYLE: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _closed(schema: Any) -> Any:
    """OpenAI's strict mode: every object schema without additionalProperties gets false."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed(value) for key, value in schema.items()}
    if closed.get("type") == "object" or "properties" in closed:
        closed.setdefault("additionalProperties", False)
    return closed


# The request field a constraint of each kind came from, for error messages.
_FIELDS = {"json_schema": "response_format", "json_object": "response_format",
           "choice": "guided_choice", "regex": "guided_regex", "gbnf": "grammar"}  # fmt: skip


def constraint_field(constraint: Constraint) -> str:
    """The request field a constraint came from, for error messages."""
    return _FIELDS[constraint.kind]


def allowed_tokens(matcher: Any, n_vocab: int) -> np.ndarray:
    """[n_vocab] bool: the tokens an llguidance matcher allows next."""
    words = np.zeros((n_vocab + 31) // 32, np.int32)  # one bit a token
    matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
    return np.unpackbits(words.view(np.uint8), bitorder="little")[:n_vocab].astype(bool)


class Matchers:
    """Fresh llguidance matchers for one model. ``build_tokenizer`` makes llguidance's view
    of the vocabulary (about a second): called once, off the event loop, by the first
    constrained request."""

    def __init__(self, build_tokenizer: Callable[[], Any]) -> None:
        self._build = build_tokenizer
        self._tokenizer: Any = None
        self._lock = asyncio.Lock()

    async def new(self, constraint: Constraint) -> Any:
        from llguidance import LLMatcher

        async with self._lock:
            if self._tokenizer is None:
                self._tokenizer = await asyncio.to_thread(self._build)
        grammar = compile_constraint(constraint)
        # Building the matcher compiles the grammar against the vocabulary: off the loop.
        matcher = await asyncio.to_thread(LLMatcher, self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            field = constraint_field(constraint)
            raise InvalidRequest(f"{field}: does not compile: {matcher.get_error()}")
        return matcher
