"""check_head: what the HTTP transport refuses from a request's headers, and when the
client waits for 100 Continue."""

from __future__ import annotations

import pytest

from slipstream.server.http_messages import BodyRefused, check_head

LIMIT = 1000


def check(headers: list[tuple[bytes, bytes]], version: str = "1.1") -> bool:
    return check_head(headers, LIMIT, lambda: version)


@pytest.mark.parametrize(
    ("headers", "version", "expects_continue"),
    [
        ([(b"content-length", b"1000")], "1.1", False),
        ([(b"content-length", b"0" * 5000 + b"7")], "1.1", False),  # int() takes <= 4300
        ([(b"content-length", b"5"), (b"expect", b"100-Continue")], "1.1", True),
        ([(b"content-length", b"5"), (b"expect", b"100-continue")], "1.0", False),
        ([(b"transfer-encoding", b"Chunked"), (b"expect", b"100-continue")], "1.1", True),
    ],
)
def test_a_head_the_transport_takes(
    headers: list[tuple[bytes, bytes]], version: str, expects_continue: bool
) -> None:
    assert check(headers, version) is expects_continue


@pytest.mark.parametrize(
    ("headers", "version", "status", "named"),
    [
        ([(b"content-length", b"1001")], "1.1", 413, "of 1001 bytes"),
        ([(b"content-length", b"0" * 50 + b"1" + b"0" * 19)], "1.1", 413, "--max-request-bytes"),
        ([(b"transfer-encoding", b"gzip, chunked")], "1.1", 501, "'gzip, chunked'"),
        ([(b"transfer-encoding", b"chunked")], "1.0", 400, "HTTP/1.0"),
    ],
)
def test_a_head_the_transport_refuses(
    headers: list[tuple[bytes, bytes]], version: str, status: int, named: str
) -> None:
    with pytest.raises(BodyRefused) as refused:
        check(headers, version)
    assert refused.value.status == status and named in refused.value.message


def test_the_version_is_asked_only_when_an_answer_depends_on_it() -> None:
    def version() -> str:
        raise AssertionError("asked for the HTTP version of a plain request")

    assert not check_head([(b"host", b"t"), (b"content-length", b"3")], LIMIT, version)
