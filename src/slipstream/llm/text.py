"""From token ids to text deltas: incremental detokenization and stop strings.

Engine-independent, so every engine streams text the same way. The stop rules are
vLLM's (its V1 detokenizer): a stop string ends the text before it, or after it with
``include_stop_str_in_output``; a sequence that ends on one of its ``stop_token_ids``
leaves that token's text out unless ``include_stop_str_in_output``; with ``min_tokens``,
a stop string counts only when it ends in the text of the tokens after the first
``min_tokens`` (the engines hold the end and stop tokens back until then).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Collection, Sequence
from dataclasses import dataclass

from slipstream.llm.engine import EngineStep, FinishReason, TokenLogprob

# What a decoder emits for bytes that do not yet form a whole UTF-8 character.
_PARTIAL = "\ufffd"


@dataclass(frozen=True, slots=True)
class TextDelta:
    """New text of one sequence; the last delta carries ``finish_reason``."""

    text: str
    completion_tokens: int
    finish_reason: FinishReason | None = None
    # Logprobs of the tokens generated since the last delta (when the request asked):
    # the text they stand for may still be held back, or fall after a stop string.
    logprobs: tuple[TokenLogprob, ...] = ()
    # vLLM's stop_reason, on the last delta: the stop string that matched, or the
    # stop_token_ids entry that ended the sequence; None for an end-of-sequence token,
    # max_tokens or a finished constraint.
    stop_reason: str | int | None = None


class StopMatcher:
    """Finds the first stop string in a growing text and holds back text that may start one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._longest = max((len(s) for s in self._stops), default=0)

    def __bool__(self) -> bool:
        """Whether there is any stop string to look for."""
        return bool(self._stops)

    def find(self, text: str, start: int, after: int = 0) -> tuple[int, int]:
        """(start, end) of the earliest stop string that ends at or after ``start`` and
        past ``after`` characters, or (-1, -1)."""
        best = (-1, -1)
        begin = max(0, start - self._longest + 1)
        for stop in self._stops:
            at = text.find(stop, max(begin, after - len(stop) + 1))
            if at != -1 and (best[0] == -1 or at < best[0]):
                best = (at, at + len(stop))
        return best

    def safe_end(self, text: str) -> int:
        """How much of ``text`` can be sent: all but a tail that may begin a stop string."""
        for keep in range(min(self._longest - 1, len(text)), 0, -1):
            tail = text[-keep:]
            if any(stop.startswith(tail) for stop in self._stops):
                return len(text) - keep
        return len(text)


class IncrementalText:
    """The text of a growing list of tokens, decoding only a window at its end.

    Tokens decoded one by one give wrong spaces (tokenizers merge pieces across token
    boundaries), and the whole list decoded again each step costs a step more the longer
    the completion grows. As vLLM does, a window starts at the tokens committed the step
    before: the text of the window's committed part and of the whole window are decoded,
    and what the second adds is the new text. It is committed (and the window moves on)
    unless it ends in a partial UTF-8 character, which the next tokens complete.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._tokens: list[int] = []
        self._start = 0  # the window's first token
        self._read = 0  # tokens whose text is committed
        self._committed = ""

    def extend(self, token_ids: Sequence[int]) -> str:
        """The whole text after ``token_ids`` (its end may be a partial character)."""
        tokens = self._tokens
        tokens.extend(token_ids)
        before = self._decode(tokens[self._start : self._read]) if self._read > self._start else ""
        now = self._decode(tokens[self._start :])
        if not now.startswith(before):
            # A tokenizer whose window text is not a prefix of the longer one: decode it all.
            return self._decode(tokens)
        new = now[len(before) :]
        if new.endswith(_PARTIAL):
            return self._committed + new
        self._committed += new
        self._start, self._read = self._read, len(tokens)
        return self._committed


async def stream_text(
    steps: AsyncIterator[EngineStep],
    decode: Callable[[Sequence[int]], str],
    stops: Sequence[str] = (),
    include_stop: bool = False,
    min_tokens: int = 0,
    stop_token_ids: Collection[int] = (),
) -> AsyncIterator[TextDelta]:
    """Turn engine steps into text deltas, ending at EOS, max_tokens or a stop string.

    The completion's text grows by :class:`IncrementalText`; the text sent is held back
    while it ends in a partial UTF-8 character or (unless ``include_stop``) a possible
    stop-string prefix. Generation is cancelled as soon as a stop string appears; the
    stop rules are the module docstring's.
    """
    matcher = StopMatcher(stops)
    incremental = IncrementalText(decode)
    count = 0
    logprobs: list[TokenLogprob] = []
    sent = 0
    # A stop string must end past this many characters: the first min_tokens tokens' text.
    protected = 0
    text = ""
    try:
        async for step in steps:
            tokens = step.token_ids
            if step.logprobs:
                logprobs.extend(step.logprobs)
            shown = tokens
            stop_token = (
                tokens[-1] if step.finish_reason == "stop" and tokens
                and tokens[-1] in stop_token_ids else None
            )  # fmt: skip
            if stop_token is not None and not include_stop:
                shown = tokens[:-1]  # counted, not shown
            if count < min_tokens:
                head = min_tokens - count
                text = incremental.extend(shown[:head])
                protected = len(text)
                if len(shown) > head:
                    text = incremental.extend(shown[head:])
            elif shown:
                text = incremental.extend(shown)
            count += len(tokens)
            start, end = matcher.find(text, sent, protected) if matcher else (-1, -1)
            if start != -1:
                cut = end if include_stop else max(start, sent)
                yield TextDelta(text[sent:cut], count, "stop", tuple(logprobs), text[start:end])
                return
            if step.finish_reason is not None:
                yield TextDelta(text[sent:], count, step.finish_reason, tuple(logprobs),
                                stop_token)  # fmt: skip
                return
            end = len(text)
            while end > sent and text[end - 1] == _PARTIAL:
                end -= 1
            if matcher and not include_stop:
                end = sent + matcher.safe_end(text[sent:end])
            if end > sent:
                yield TextDelta(text[sent:end], count, None, tuple(logprobs))
                logprobs.clear()
                sent = end
    finally:
        aclose = getattr(steps, "aclose", None)
        if aclose is not None:
            await aclose()
