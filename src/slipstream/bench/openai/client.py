"""The streaming client of the OpenAI mode: server-sent events over HTTP/1.1.

It rides the same keep-alive connections and one-write requests as the V2 HTTP client
(:class:`slipstream.bench.core.http.HttpConnections`), and parses each response's events
as its bytes arrive, stamping every content chunk with the time its bytes were read:
the first is the time to first token, the gaps between the rest the inter-token
latencies. ``usage.completion_tokens`` of the final usage chunk is the output length
(chunks and tokens differ: a server holds back the bytes of a split UTF-8 character).

Example::

    client = OpenAIClient(parse_endpoint("http://localhost:8000", "http"),
                          "/v1/chat/completions", timeout_s=60)
    stream = await client.send(body)
    print(stream.error, stream.first_content_s, stream.output_tokens)
"""

from __future__ import annotations

import time

import orjson

from slipstream.bench.core.endpoint import Endpoint
from slipstream.bench.core.errors import ErrorExamples
from slipstream.bench.core.http import HttpConnection, HttpConnections, RequestFailed, post_request

DONE = b"[DONE]"


class SseParser:
    """Server-sent events from bytes as they arrive, in any split.

    Returns the data of each complete event (several ``data:`` lines joined by a
    newline); comments and the ``event``, ``id`` and ``retry`` fields are skipped. Lines
    end in LF or CRLF.

    >>> parser = SseParser()
    >>> parser.feed(b'data: {"a": 1}\\n\\nda')
    [b'{"a": 1}']
    >>> parser.feed(b"ta: [DONE]\\r\\n\\r\\n")
    [b'[DONE]']
    """

    __slots__ = ("_buffer", "_data")

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[bytes] = []

    def feed(self, chunk: bytes) -> list[bytes]:
        buffer = self._buffer + chunk if self._buffer else chunk
        events: list[bytes] = []
        start = 0
        while True:
            end = buffer.find(b"\n", start)
            if end < 0:
                break
            line = buffer[start:end]
            start = end + 1
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if self._data:
                    events.append(b"\n".join(self._data))
                    self._data = []
                continue
            name, _, value = line.partition(b":")
            if name == b"data":
                self._data.append(value[1:] if value.startswith(b" ") else value)
        self._buffer = buffer[start:]
        return events


class StreamState:
    """What one streamed response showed, filled in as its events arrive."""

    __slots__ = (
        "chunk_times_s",
        "done",
        "done_s",
        "error",
        "error_message",
        "output_tokens",
        "prompt_tokens",
    )

    def __init__(self) -> None:
        # time.monotonic() when each chunk with content (a non-empty text or delta
        # content) was read.
        self.chunk_times_s: list[float] = []
        # The [DONE] event arrived.
        self.done = False
        # time.monotonic() when the response's last byte was read; 0.0 until then.
        self.done_s = 0.0
        # Error key ("http 503", "timeout", "stream error", ...) or None.
        self.error: str | None = None
        self.error_message = ""
        # From the usage chunk; None when the server sent none.
        self.output_tokens: int | None = None
        self.prompt_tokens: int | None = None

    @property
    def first_content_s(self) -> float | None:
        return self.chunk_times_s[0] if self.chunk_times_s else None

    def event(self, data: bytes, now_s: float) -> None:
        """Take one event's data, read at ``now_s``."""
        if data == DONE:
            self.done = True
            return
        try:
            payload = orjson.loads(data)
        except orjson.JSONDecodeError:
            self.fail("stream bad-json", data.decode("utf-8", "replace"))
            return
        if not isinstance(payload, dict):
            self.fail("stream bad-json", data.decode("utf-8", "replace"))
            return
        if "error" in payload:
            error = payload["error"]
            message = error.get("message", "") if isinstance(error, dict) else str(error)
            self.fail("stream error", str(message))
            return
        choices = payload.get("choices")
        if choices and _content(choices[0]):
            self.chunk_times_s.append(now_s)
        usage = payload.get("usage")
        if isinstance(usage, dict):
            self.output_tokens = usage.get("completion_tokens")
            self.prompt_tokens = usage.get("prompt_tokens")

    def fail(self, key: str, message: str) -> None:
        if self.error is None:
            self.error = key
            self.error_message = message


def _content(choice: object) -> bool:
    """Whether a chunk's first choice carries generated text (completions or chat)."""
    if not isinstance(choice, dict):
        return False
    text = choice.get("text")
    if text is None:
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else None
    return bool(text)


class StreamConnection(HttpConnection):
    """A keep-alive connection whose 2xx bodies are parsed as server-sent events."""

    def __init__(self) -> None:
        super().__init__()
        self.stream = StreamState()
        self._sse = SseParser()

    def begin(self) -> None:
        """A fresh state for the next request on this connection."""
        super().begin()
        self.stream = StreamState()
        self._sse = SseParser()

    def on_body(self, body: bytes) -> None:
        if self._error_body is not None:  # a non-2xx answer: keep its message
            super().on_body(body)
            return
        now_s = time.monotonic()
        for data in self._sse.feed(body):
            self.stream.event(data, now_s)

    def on_message_complete(self) -> None:
        self.stream.done_s = time.monotonic()
        super().on_message_complete()


class OpenAIClient:
    """Streams requests to one OpenAI route; see the module docstring.

    ``send`` never raises for a failed request: the state it returns carries an error
    key, counted by the caller, with the first message of each key kept in
    ``error_examples``.
    """

    def __init__(self, endpoint: Endpoint, path: str, timeout_s: float) -> None:
        self._endpoint = endpoint
        self._path = endpoint.path_prefix + path
        self._timeout_s = timeout_s
        self._connections = HttpConnections(endpoint, timeout_s, StreamConnection)
        # Error key -> the first message seen with it.
        self.error_examples = ErrorExamples()

    @property
    def reconnects(self) -> int:
        """Requests sent again on a fresh connection after the server closed a pooled one
        before answering (a keep-alive timeout): a client's ordinary work, not errors."""
        return self._connections.reconnects

    def encode(self, body: bytes) -> bytes:
        """The whole HTTP request for a JSON body, to pass to :meth:`send`."""
        return post_request(self._endpoint, self._path, body)

    async def send(self, payload: bytes) -> StreamState:
        """Write ``payload`` (see :meth:`encode`) and read its stream to the end."""
        try:
            conn = await self._connections.request(payload)
        except RequestFailed as exc:
            stream = StreamState()
            timed_out = f"the stream did not end within {self._timeout_s:g} s"
            stream.fail(exc.key, timed_out if exc.key == "timeout" else exc.message)
        else:
            stream = conn.stream
            if not 200 <= conn.status < 300:
                stream.fail(f"http {conn.status}", conn.error_message())
            elif stream.error is None and not stream.done:
                stream.fail("stream incomplete", "the response ended without data: [DONE]")
        if stream.error is not None:
            self.error_examples.note(stream.error, stream.error_message)
        return stream

    async def close(self) -> None:
        await self._connections.close()
