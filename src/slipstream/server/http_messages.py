"""What the HTTP transport hands the handlers and takes back, and the limits it enforces.

Plain data between :mod:`slipstream.server.httpd` (the transport) and the front ends
(``v2_rest``, ``openai_rest``, ``router``), which import these names from ``httpd``.
"""

from __future__ import annotations

import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus

from slipstream.errors import SlipstreamError


@dataclass(slots=True)
class HttpRequest:
    method: str
    # The path without the query string, percent-decoding not applied.
    path: str
    # Lower-cased header names, as sent.
    headers: list[tuple[bytes, bytes]]
    body: bytes
    query: bytes = b""
    # The models the caller's API key may use (None: every model); set by the front door,
    # so lists of models (/v1/models, the repository index) show only these.
    models: frozenset[str] | None = None
    # The name of the caller's API key ("" without one); set by the front door: whose
    # shared-memory regions the request sees and uses.
    owner: str = ""
    # "1.1" or "1.0": an HTTP/1.0 client knows no chunked responses, and keeps its
    # connection open only when the response says ``connection: keep-alive``.
    http_version: str = "1.1"

    def header(self, name: bytes) -> bytes | None:
        """The first value of a (lower-case) header, or None."""
        for key, value in self.headers:
            if key == name:
                return value
        return None


@dataclass(slots=True)
class HttpResponse:
    status: int
    body: bytes = b""
    content_type: bytes = b"application/json"
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)


@dataclass(slots=True)
class StreamingResponse:
    """A response whose body is produced while it is sent (server-sent events).

    Written with chunked transfer encoding, one chunk per item, each flushed as it comes.
    If the client disconnects, the iterator is closed, so its ``finally`` blocks run at
    once (the LLM engine frees the sequence's KV-cache blocks there).
    """

    status: int
    chunks: AsyncIterator[bytes]
    content_type: bytes = b"text/event-stream"
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)


Handler = Callable[[HttpRequest], Awaitable[HttpResponse | StreamingResponse]]
ErrorBody = Callable[[str], bytes]

STATUS_LINES = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in HTTPStatus}


# --max-buffered-body-bytes by default, in bodies of --max-request-bytes: a few of the
# largest at once, and many ordinary ones (512 MiB at the default 64 MiB).
BUFFERED_BODIES = 8


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """What one client may cost the server; each is a ``slipstream serve`` option.

    Example::

        HttpServer(handler, error_body=encode, limits=HttpLimits(max_header_bytes=8192))
    """

    # Largest request body; a larger Content-Length (or chunked total) gets 413.
    max_body_bytes: int = 64 * 1024 * 1024
    # Largest request line plus headers: 431, or 414 when the URL alone is past it.
    max_header_bytes: int = 64 * 1024
    # Most header lines in one request (431).
    max_header_count: int = 100
    # From a request's first byte (or the connection's start) to the end of its headers.
    header_timeout_s: float = 10.0
    # Longest time a started request body may receive nothing (408).
    body_timeout_s: float = 30.0
    # Slowest average a body may arrive at once it has taken body_timeout_s (408); 0: off.
    min_body_rate_bytes_s: float = 500.0
    # Longest time a client may accept none of a response the server has to send.
    send_timeout_s: float = 60.0
    # How long a keep-alive connection may wait for its next request.
    keep_alive_timeout_s: float = 75.0
    # Open connections at most; beyond, the longest-idle one is closed (or the new refused).
    max_connections: int = 10_000
    # Request-body bytes all connections together may hold (being received, queued, or
    # with the handler); past it, bodies still arriving wait (their reading paused).
    # None: BUFFERED_BODIES x max_body_bytes.
    max_buffered_body_bytes: int | None = None

    @property
    def buffered_body_bytes(self) -> int:
        """max_buffered_body_bytes, or its default."""
        return self.max_buffered_body_bytes or BUFFERED_BODIES * self.max_body_bytes


class BodyRefused(Exception):
    """A request (its body, or its head) the transport cannot hand on: its status and
    message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def check_head(
    headers: list[tuple[bytes, bytes]], max_body_bytes: int, http_version: Callable[[], str]
) -> bool:
    """Refuse a request, from its headers, whose body the transport cannot take; return
    whether its client waits for ``100 Continue`` before sending the body. Raises
    :class:`BodyRefused`. llhttp has already refused what makes the framing ambiguous
    (Content-Length with Transfer-Encoding, two lengths, chunked not last); what it lets
    through and is refused here: a declared length past the limit (413, before a byte of
    the body is read), a transfer coding other than chunked (501: served as if chunked, a
    ``gzip, chunked`` body would reach the handler still compressed; compression belongs
    in Content-Encoding), and Transfer-Encoding in HTTP/1.0 (or 0.9), which has none (400,
    RFC 9112 6.1). ``http_version``: the parser's, asked only when an answer depends on it."""
    expects_continue = False
    for name, value in headers:
        if name == b"content-length" and value.isdigit():
            # Leading zeros are legal, and int() refuses more than 4,300 digits.
            digits = value.lstrip(b"0") if len(value) > 18 else value
            if len(digits) > 18 or int(digits or b"0") > max_body_bytes:
                raise BodyRefused(  # llhttp refuses a length past 2^64: 20 digits at most
                    413, f"request body of {digits.decode()} bytes exceeds the limit of "
                    f"{max_body_bytes} bytes (--max-request-bytes)"
                )  # fmt: skip
        elif name == b"transfer-encoding":
            version = http_version()
            if version != "1.1":
                raise BodyRefused(
                    400, f"Transfer-Encoding is not defined in HTTP/{version}; send Content-Length"
                )
            if value.lower() != b"chunked":
                coding = value.decode("latin-1")
                raise BodyRefused(
                    501, f"Transfer-Encoding {coding!r} is not supported; send the body "
                    "chunked or with Content-Length, compressed with Content-Encoding"
                )  # fmt: skip
        elif name == b"expect" and value.lower() == b"100-continue":
            # An HTTP/1.0 client knows no 1xx response (RFC 9110 10.1.1: ignore it).
            expects_continue = http_version() == "1.1"
    return expects_continue


def decode_body(headers: list[tuple[bytes, bytes]], body: bytes, limit: int) -> bytes:
    """``body`` as it was before its Content-Encoding, removing that header (and the
    length it describes): gzip and deflate, what tritonclient's
    ``request_compression_algorithm`` sends (its Inference-Header-Content-Length counts
    the decoded bytes). The decoded body is held to ``limit`` as a plain one is, so a small
    compressed body cannot become a huge one. Raises :class:`BodyRefused`."""
    decoded = begin_decoding(headers, body, limit, limit)
    return decoded if isinstance(decoded, bytes) else decoded.run()


# Decoded bodies up to this size are inflated where they arrive, on the event loop (0.1
# ms for 256 KiB, measured); a larger one is inflated in a worker thread
# (PendingDecode): 64 MiB took 0.3-0.45 s, a stall every other client on the loop shared.
INLINE_DECODED_BYTES = 256 * 1024


@dataclass(frozen=True, slots=True)
class PendingDecode:
    """A compressed body too large to inflate on the event loop: :meth:`run` it in a
    worker thread (zlib lets go of the GIL while it inflates)."""

    body: bytes
    wbits: int  # the format that inflated its start
    coding: str  # the Content-Encoding, for messages
    limit: int

    def run(self) -> bytes:
        """The decoded body. Raises :class:`BodyRefused`, as :func:`decode_body` does."""
        try:
            decoded = _inflate(self.body, self.wbits, self.coding, self.limit, self.limit)
        except zlib.error as exc:
            raise BodyRefused(
                400, f"request body is not valid {self.coding} data ({exc})"
            ) from None
        assert decoded is not None  # within the limit, or refused
        return decoded


def begin_decoding(
    headers: list[tuple[bytes, bytes]], body: bytes, limit: int, inline_bytes: int
) -> bytes | PendingDecode:
    """:func:`decode_body`, but one whose decoded size passes ``inline_bytes`` (checked
    as it inflates: a 60 KiB gzip body may hold 64 MiB) is left for :meth:`PendingDecode.run`,
    started again from its first byte (what was inflated here, at most ``inline_bytes``,
    is dropped: cheaper than carrying zlib's state across threads)."""
    for header, _ in headers:
        if header == b"content-encoding":
            break
    else:
        return body  # the common case: one pass over the headers, nothing made
    coding = b",".join(v for n, v in headers if n == b"content-encoding").strip().lower()
    if coding == b"identity":
        return body
    headers[:] = [(n, v) for n, v in headers if n not in (b"content-encoding", b"content-length")]
    name = coding.decode("latin-1")
    if coding in (b"gzip", b"x-gzip"):
        attempts = [16 + zlib.MAX_WBITS]
    elif coding == b"deflate":  # zlib's format, as HTTP means it; raw deflate from some
        attempts = [zlib.MAX_WBITS, -zlib.MAX_WBITS]
    else:
        raise BodyRefused(
            415, f"Content-Encoding {name!r} is not supported; send gzip, deflate or identity"
        )
    for wbits in attempts:
        try:
            decoded = _inflate(body, wbits, name, limit, min(inline_bytes, limit))
        except zlib.error as exc:
            error = str(exc)
            continue
        if decoded is None:
            return PendingDecode(body, wbits, name, limit)
        return decoded
    raise BodyRefused(400, f"request body is not valid {name} data ({error})")


# Inflated this much at a time: zlib holds the GIL while it hands over what one call
# inflated, so one call for 128 MiB held up the event loop 80-170 ms (measured), steps of
# this size about 10 ms. Smaller steps take the GIL back more often, which a busy event
# loop makes slower (1 MiB: no shorter stalls, and the inflation itself slower).
_INFLATE_STEP_BYTES = 4 * 1024 * 1024


def _inflate(body: bytes, wbits: int, name: str, limit: int, most: int) -> bytes | None:
    """``body`` inflated, if that is at most ``most`` bytes; None when it is more (and
    ``most`` is below ``limit``). Raises :class:`BodyRefused` past ``limit`` or for a
    truncated body, zlib.error for one that is not in the format ``wbits`` names."""
    decoder = zlib.decompressobj(wbits)
    parts = []
    size = 0
    data = body
    while True:
        step = min(_INFLATE_STEP_BYTES, most + 1 - size)
        part = decoder.decompress(data, step)
        parts.append(part)
        size += len(part)
        if size > most:
            if most < limit:
                return None
            raise BodyRefused(
                413, f"request body exceeds the limit of {limit} bytes once decoded from "
                f"{name} (--max-request-bytes)"
            )  # fmt: skip
        data = decoder.unconsumed_tail
        if decoder.eof or (not data and len(part) < step):
            break  # the end, or the input ran out (a truncated body)
    if not decoder.eof or decoder.unused_data:
        raise BodyRefused(400, f"request body: {name} data is truncated or has trailing bytes")
    return parts[0] if len(parts) == 1 else b"".join(parts)


# Smaller response bodies are sent as they are: compressing saves next to nothing.
_MIN_COMPRESSED_BYTES = 1024


def encode_body(accept: bytes, body: bytes, headers: list[tuple[bytes, bytes]]) -> bytes:
    """``body`` compressed as the client's Accept-Encoding asks (gzip, else deflate; what
    tritonclient's ``response_compression_algorithm`` sends), naming it in ``headers``;
    as it is when the client accepts neither, or the body is too small to gain. Level 1:
    a tensor's bytes compress little at any level, and the client asked to save bytes
    on the wire, not the server's CPU."""
    if len(body) < _MIN_COMPRESSED_BYTES:
        return body
    offered = {
        coding.strip(): quality
        for coding, _, quality in (part.partition(b";") for part in accept.lower().split(b","))
    }
    for coding in (b"gzip", b"deflate"):
        if coding in offered and offered[coding].replace(b" ", b"") not in (b"q=0", b"q=0.0"):
            headers.append((b"content-encoding", coding))
            wbits = 16 + zlib.MAX_WBITS if coding == b"gzip" else zlib.MAX_WBITS
            compressor = zlib.compressobj(1, zlib.DEFLATED, wbits)
            return compressor.compress(body) + compressor.flush()
    return body


def response_head(
    status: int,
    content_type: bytes,
    headers: list[tuple[bytes, bytes]],
    keep_alive: bool,
    http10: bool = False,
) -> list[bytes]:
    """Status line and headers, ending with the blank line (the last item). ``http10``:
    the request was HTTP/1.0, whose connection stays open only if the response says so."""
    line = STATUS_LINES.get(status) or f"HTTP/1.1 {status} Unknown\r\n".encode()
    parts = [line, b"content-type: ", content_type, b"\r\n"]
    for name, value in headers:
        parts += (name, b": ", value, b"\r\n")
    if not keep_alive:
        parts.append(b"connection: close\r\n")
    elif http10:
        parts.append(b"connection: keep-alive\r\n")
    parts.append(b"\r\n")
    return parts


def closing_reply(status: int, body: bytes, headers: bytes = b"") -> bytes:
    """A whole JSON response that ends its connection: the transport's own refusals.
    ``headers``: more header lines, each ending in CRLF (``b"retry-after: 1\\r\\n"``)."""
    return (
        STATUS_LINES[status] + b"content-type: application/json\r\ncontent-length: "
        + str(len(body)).encode() + b"\r\n" + headers + b"connection: close\r\n\r\n" + body
    )  # fmt: skip


def error_reply(exc: SlipstreamError, body: bytes) -> HttpResponse:
    """``exc``'s status with ``body``, and Retry-After or Allow when the error carries one."""
    headers = []
    retry_after = getattr(exc, "retry_after_s", None)
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    allow = getattr(exc, "allow", None)
    if allow:
        headers.append((b"allow", ", ".join(allow).encode()))
    return HttpResponse(exc.http_status, body, headers=headers)
