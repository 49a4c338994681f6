"""Token ids to text deltas: stop strings, partial UTF-8, cancellation on stop."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slipstream.llm.engine import CacheStats, EngineStep, SamplingParams
from slipstream.llm.text import IncrementalText, StopMatcher, TextDelta, stream_text

# A toy vocabulary: token i decodes to PIECES[i]; 9 and 10 are the two UTF-8 bytes of "é".
PIECES = ["Hel", "lo", " wor", "ld", "!", " The", " end", ".", "\\n"]


def decode(ids: Sequence[int]) -> str:
    raw = b"".join(b"\xc3" if i == 9 else b"\xa9" if i == 10 else PIECES[i].encode() for i in ids)
    return raw.decode("utf-8", errors="replace")


class Steps:
    """An engine stream of single tokens that records whether it was closed early."""

    def __init__(self, ids: list[int], reason: str = "length") -> None:
        self.ids = ids
        self.reason = reason
        self.closed = False
        self.sent = 0

    async def run(self) -> AsyncIterator[EngineStep]:
        try:
            for n, token in enumerate(self.ids):
                self.sent += 1
                last = n == len(self.ids) - 1
                yield EngineStep([token], self.reason if last else None)  # type: ignore[arg-type]
        finally:
            self.closed = True


async def collect(steps: Steps, stops: Sequence[str] = ()) -> list[TextDelta]:
    return [d async for d in stream_text(steps.run(), decode, stops)]


async def test_deltas_concatenate_to_the_decoded_text() -> None:
    deltas = await collect(Steps([0, 1, 2, 3, 4]))
    assert "".join(d.text for d in deltas) == "Hello world!"
    assert deltas[-1].finish_reason == "length" and deltas[-1].completion_tokens == 5
    assert all(d.finish_reason is None for d in deltas[:-1])


async def test_a_partial_utf8_character_is_held_back() -> None:
    deltas = await collect(Steps([0, 9, 10, 4]))
    assert [d.text for d in deltas] == ["Hel", "é", "!"]


async def test_a_stop_string_cuts_the_text_and_cancels_generation() -> None:
    steps = Steps([0, 1, 2, 3, 4, 5, 6, 7])
    deltas = await collect(steps, stops=["ld!"])
    assert "".join(d.text for d in deltas) == "Hello wor"
    assert deltas[-1].finish_reason == "stop"
    assert steps.closed and steps.sent == 5


async def test_text_that_may_start_a_stop_string_waits_for_the_next_token() -> None:
    deltas = await collect(Steps([0, 1, 2, 3]), stops=["world peace"])
    # "wor" could begin "world peace": it is held until the stream ends without it.
    assert [d.text for d in deltas] == ["Hel", "lo", " ", "world"]


def test_stop_matcher() -> None:
    matcher = StopMatcher(["END", "\n\n"])
    assert matcher.find("abc END", 0) == 4
    assert matcher.find("abc", 0) == -1
    assert matcher.safe_end("text EN") == len("text ")
    assert matcher.safe_end("text\n") == len("text")
    assert StopMatcher([]).safe_end("anything") == len("anything")


def test_sampling_and_cache_arithmetic() -> None:
    assert SamplingParams(max_tokens=1, temperature=0).greedy
    assert SamplingParams(max_tokens=1, temperature=0.7, top_k=1).greedy
    assert not SamplingParams(max_tokens=1, temperature=0.7).greedy
    stats = CacheStats(block_size=16, blocks_total=10, blocks_used=4, tokens_cached=60,
                       running=2, waiting=1)  # fmt: skip
    assert stats.blocks_free == 6
    assert stats.utilization == pytest.approx(60 / 64)


# A SentencePiece-like vocabulary: "▁" is a space, and a decoded text drops the space
# its first piece starts with (as SentencePiece does), so a token's text depends on
# whether it starts the decoded range; 6 and 7 are the two UTF-8 bytes of "ñ".
SP_PIECES = ["▁the", "▁cat", "s", "▁sat", "!", "▁on"]


def sp_decode(ids: Sequence[int]) -> str:
    raw = b"".join(
        b"\xc3" if i == 6 else b"\xb1" if i == 7 else SP_PIECES[i].replace("▁", " ").encode()
        for i in ids
    )
    return raw.decode("utf-8", errors="replace").removeprefix(" ")


@given(st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=3), max_size=40))
def test_incremental_text_is_the_whole_decode(steps: list[list[int]]) -> None:
    text = IncrementalText(sp_decode)
    tokens: list[int] = []
    for step in steps:
        tokens.extend(step)
        assert text.extend(step) == sp_decode(tokens)


@given(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3), min_size=1, max_size=40))
def test_incremental_text_decodes_a_window_of_two_steps(steps: list[list[int]]) -> None:
    """Whole characters every step: each decode spans at most this step's tokens and
    the last step's, however long the completion grows."""
    lengths: list[int] = []

    def counting_decode(ids: Sequence[int]) -> str:
        lengths.append(len(ids))
        return sp_decode(ids)

    text = IncrementalText(counting_decode)
    for step in steps:
        text.extend(step)
    assert max(lengths) <= 6


def test_incremental_text_holds_a_window_open_until_its_character_is_whole() -> None:
    text = IncrementalText(sp_decode)
    assert text.extend([0]) == "the"
    assert text.extend([6]) == "the\ufffd"
    assert text.extend([7, 1]) == "theñ cat"
