"""When a llama.cpp step that already ends a prompt reads another one too (the cost model
of ``_worth_packing``: on a CPU a step's cost grows with its tokens)."""

from __future__ import annotations

from slipstream.llm.llamacpp_step import _worth_packing


def test_a_long_prompt_waits_for_the_next_step() -> None:
    # Four users' 128-token prompts arriving together: one ends per step, so the first
    # gets its token after one prompt's reading, not four.
    assert not _worth_packing(128, room=240, finishing=1, decodes=3)


def test_short_prompts_arriving_together_share_a_step() -> None:
    # Sixteen 5-token chats while 15 sequences decode: waiting a step would cost each the
    # 15 decodes and more, reading it now costs the one ending prompt 5 tokens.
    assert _worth_packing(5, room=200, finishing=1, decodes=15)
    # With nothing decoding, three prompts ending would each wait 5 tokens more (15 in
    # all) to save the fourth a step of 2 + 3 tokens' worth: it waits.
    assert not _worth_packing(5, room=200, finishing=3, decodes=0)
    assert _worth_packing(1, room=200, finishing=3, decodes=0)


def test_part_of_a_prompt_never_follows_another_prompts_end() -> None:
    assert not _worth_packing(3, room=2, finishing=1, decodes=100)
