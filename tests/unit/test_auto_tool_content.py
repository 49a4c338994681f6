"""What a streamed ``tool_choice: "auto"`` answer may send before the choice ends."""

from __future__ import annotations

import pytest

from slipstream.server.openai_tool_stream import sendable_end


@pytest.mark.parametrize(
    ("text", "sent", "end"),
    [
        ("Hello world", 0, 11),
        ("Let me check. <tool", 0, 13),  # a tail that may open a call, and its space
        ("Let me check.\n<tool_call>\n{", 0, 13),  # from the tag on, held
        ("a <toolbox> b", 0, 13),  # not the tag: sent
        ("Hello   ", 0, 5),  # trailing whitespace waits: stripped if a call follows
        ("Hello <", 5, 5),
        ("<tool_call>", 0, 0),
        ("", 0, 0),
    ],
)
def test_sendable_end(text: str, sent: int, end: int) -> None:
    assert sendable_end(text, sent) == end
