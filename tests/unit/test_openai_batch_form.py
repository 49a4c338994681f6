"""The multipart/form-data of ``POST /v1/files`` (python-multipart underneath): the parts
by name, and a 400 naming what is wrong with a form that is not one."""

from __future__ import annotations

import pytest

from slipstream.errors import InvalidRequest
from slipstream.protocol.openai_batch import parse_form

BOUNDARY = "b0und4ry"


def form(*parts: tuple[str, str]) -> bytes:
    """A form of ``(headers, data)`` parts, closed by the boundary."""
    body = b"".join(
        f"--{BOUNDARY}\r\n{headers}\r\n\r\n{data}\r\n".encode() for headers, data in parts
    )
    return body + f"--{BOUNDARY}--\r\n".encode()


CONTENT_TYPE = f'multipart/form-data; boundary="{BOUNDARY}"'.encode()


def test_the_parts_by_name_with_their_file_names() -> None:
    body = form(
        ('Content-Disposition: form-data; name="purpose"', "batch"),
        ('Content-Disposition: form-data; name="file"; filename="in put.jsonl"\r\n'
         "Content-Type: application/jsonl", '{"a": 1}\n{"b": 2}\r\n'),
        ('Content-Disposition: form-data; name="purpose"', "later, ignored"),
        ("Content-Type: text/plain", "no name: ignored"),
    )  # fmt: skip
    parts = parse_form(CONTENT_TYPE, body)
    assert set(parts) == {"purpose", "file"}
    assert (parts["purpose"].data, parts["purpose"].filename) == (b"batch", None)
    assert parts["file"].filename == "in put.jsonl"
    assert parts["file"].data == b'{"a": 1}\n{"b": 2}\r\n'


@pytest.mark.parametrize(
    ("content_type", "body", "says"),
    [
        (b"application/json", form(), "Content-Type: expected multipart/form-data"),
        (None, form(), "got 'none'"),
        (b"multipart/form-data", form(), "needs a boundary"),
        (CONTENT_TYPE, form(('Content-Disposition: form-data; name="a"', "x"))[:-12],
         "does not end with its closing boundary"),
        (CONTENT_TYPE, b"not a form at all", "body: not the multipart form"),
    ],
)  # fmt: skip
def test_what_is_not_a_form_is_refused_naming_why(
    content_type: bytes | None, body: bytes, says: str
) -> None:
    with pytest.raises(InvalidRequest) as refused:
        parse_form(content_type, body)
    assert says in refused.value.message
