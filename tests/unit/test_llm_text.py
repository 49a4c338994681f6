"""Token ids to text deltas: stop strings, partial UTF-8, cancellation on stop, and
vLLM's stop rules (include_stop_str_in_output, stop_token_ids, min_tokens)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

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
    assert matcher.find("abc END", 0) == (4, 7)
    assert matcher.find("abc", 0) == (-1, -1)
    # Past ``after`` characters only: the first END ends at 3, the second at 7.
    assert matcher.find("END END", 0, after=3) == (4, 7)
    assert matcher.find("END END", 0, after=2) == (0, 3)
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


# -- vLLM's stop rules, as its V1 detokenizer applies them ------------------------------

# vLLM's case (tests/detokenizer/test_min_tokens.py) in words: token i is WORDS[i].
WORDS = [" is", " Lee", ",", " and", " I", "'m", " a", " stud", "ent"]


def words(ids: Sequence[int]) -> str:
    return "".join(WORDS[i] for i in ids)


def letters(ids: Sequence[int]) -> str:
    """vLLM's detokenizer test vocabulary: token i is the character chr(i)."""
    return "".join(chr(i) for i in ids)


async def rules(
    ids: list[int],
    reason: str = "length",
    stops: Sequence[str] = (),
    decoder: Any = letters,
    **given: Any,
) -> list[TextDelta]:
    steps = Steps(ids, reason)
    return [d async for d in stream_text(steps.run(), decoder, stops, **given)]


@pytest.mark.parametrize(
    ("min_tokens", "stop", "truth"),
    [(0, None, " is Lee, and I'm a student"), (0, "e", " is L"),
     (5, "e", " is Lee, and I'm a stud")],
)  # fmt: skip
async def test_min_tokens_keeps_stop_strings_out_of_its_text(
    min_tokens: int, stop: str | None, truth: str
) -> None:
    """vLLM's own cases: a stop string counts only once it ends past the text of the
    first min_tokens tokens."""
    deltas = await rules(list(range(len(WORDS))), stops=[stop] if stop else [],
                         decoder=words, min_tokens=min_tokens)  # fmt: skip
    assert "".join(d.text for d in deltas) == truth
    assert deltas[-1].finish_reason == ("stop" if stop else "length")


def chars(text: str) -> list[int]:
    return [ord(c) for c in text]


async def test_a_stop_string_may_begin_inside_the_min_tokens_text() -> None:
    # "ab" at tokens 2-3: past min_tokens 2 it ends, so it stops; with 3 it does not.
    deltas = await rules(chars("xabyab"), stops=["ab"], min_tokens=2)
    assert "".join(d.text for d in deltas) == "x"
    deltas = await rules(chars("xabyab"), stops=["ab"], min_tokens=3)
    assert "".join(d.text for d in deltas) == "xaby"


async def test_include_stop_str_in_output_ends_the_text_after_the_stop_string() -> None:
    deltas = await rules(chars("Hello world!"), stops=["wor", "!"], include_stop=True)
    assert "".join(d.text for d in deltas) == "Hello wor"
    assert deltas[-1].finish_reason == "stop" and deltas[-1].completion_tokens == 9
    # Nothing is held back: each letter is sent as it comes.
    assert [d.text for d in deltas] == list("Hello wor")


async def test_a_stop_token_id_s_text_is_left_out_unless_asked_for() -> None:
    stop = ord("!")
    deltas = await rules(chars("Hi!"), "stop", stop_token_ids={stop})
    assert "".join(d.text for d in deltas) == "Hi"
    assert deltas[-1].finish_reason == "stop" and deltas[-1].completion_tokens == 3
    kept = await rules(chars("Hi!"), "stop", stop_token_ids={stop}, include_stop=True)
    assert "".join(d.text for d in kept) == "Hi!"
    # Cut by max_tokens on it, it is ordinary text.
    cut = await rules(chars("Hi!"), "length", stop_token_ids={stop})
    assert "".join(d.text for d in cut) == "Hi!"


@pytest.mark.parametrize(
    ("reason", "given", "stop_reason"),
    [("stop", {"stop_token_ids": {ord("!")}}, ord("!")),
     ("stop", {"stop_token_ids": {ord("!")}, "include_stop": True}, ord("!")),
     ("stop", {"stops": ["lo", "l"]}, "l"),  # the stop string that matched first
     ("stop", {"stops": ["lo"], "include_stop": True}, "lo"),
     ("stop", {"stop_token_ids": {ord("?")}}, None),  # an end-of-sequence token
     ("length", {"stop_token_ids": {ord("!")}}, None)],
)  # fmt: skip
async def test_the_last_delta_names_the_stop_string_or_token_id_that_ended_it(
    reason: str, given: dict[str, Any], stop_reason: str | int | None
) -> None:
    """vLLM's stop_reason: the stop string (str) or stop_token_ids entry (int) that ended
    the text, None for anything else; on the last delta only."""
    deltas = await rules(chars("Hello!"), reason, **given)
    assert deltas[-1].stop_reason == stop_reason and deltas[-1].finish_reason == reason
    assert all(d.stop_reason is None for d in deltas[:-1])
