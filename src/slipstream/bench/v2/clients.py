"""The clients a worker process sends requests with: HTTP/1.1 (JSON or binary tensors)
over :mod:`slipstream.bench.core.http`'s keep-alive connections, and gRPC, each sending
pre-encoded bytes and reading back no more than the status.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any
from urllib.parse import quote

from slipstream.bench.core.endpoint import Endpoint
from slipstream.bench.core.errors import ErrorExamples
from slipstream.bench.core.http import (
    HttpConnection,
    HttpConnections,
    RequestFailed,
    post_request,
)
from slipstream.bench.v2.blocking import BlockingHttpUser
from slipstream.bench.v2.messages import EncodedRequest
from slipstream.bench.v2.sequences import in_sequence

INFER_METHOD = "/inference.GRPCInferenceService/ModelInfer"
# gRPC servers commonly allow 100 concurrent streams per connection: one channel (its
# own connection) per this many outstanding requests.
_STREAMS_PER_CHANNEL = 100


def model_path(endpoint: Endpoint, model: str, version: str) -> str:
    """/v2/models/{m}[/versions/{v}] below the endpoint's path prefix."""
    path = f"{endpoint.path_prefix}/v2/models/{quote(model, safe='')}"
    if version:
        path += f"/versions/{quote(version, safe='')}"
    return path


class InferClient(ABC):
    """Sends one worker's requests. ``infer`` never raises for a failed request: it
    returns an error key (``"http 400"``, ``"grpc UNAVAILABLE"``, ``"timeout"``,
    ``"connect ConnectionRefusedError"``) so failures are counted, not fatal."""

    def __init__(self) -> None:
        # Error key -> the first message seen with it, shown beside the counts.
        self.error_examples = ErrorExamples()

    @abstractmethod
    async def infer(self, index: int) -> str | None:
        """Send pre-encoded request ``index``; None on success, else the error key."""

    async def infer_in_sequence(
        self, index: int, sequence_id: int | str, start: bool, end: bool
    ) -> str | None:
        """Send request ``index`` as a request of sequence ``sequence_id`` (a stateful
        model's, :mod:`.sequences`); what ``infer`` returns."""
        raise NotImplementedError(f"{type(self).__name__} sends no sequences")

    @abstractmethod
    async def close(self) -> None:
        """Close every connection; requests still outstanding fail."""

    @property
    def reconnects(self) -> int:
        """Requests sent again on a fresh connection after the server closed a reused one
        before answering (keep-alive timeouts): not errors. Only HTTP reconnects."""
        return 0

    def blocking_user(self) -> BlockingHttpUser | None:
        """A closed-loop user on one blocking socket instead of ``infer``, where the
        protocol has one (plain HTTP); its errors and reconnects are counted here."""
        return None


def make_client(
    endpoint: Endpoint,
    model: str,
    version: str,
    requests: list[EncodedRequest],
    timeout_s: float,
    max_outstanding: int,
) -> InferClient:
    """The client for the endpoint's protocol; call it inside the worker's event loop."""
    if endpoint.protocol == "grpc":
        return GrpcClient(endpoint, requests, timeout_s, max_outstanding)
    return HttpClient(
        endpoint, model_path(endpoint, model, version) + "/infer", requests, timeout_s
    )


# ---------------------------------------------------------------------------- HTTP


def http_request_bytes(endpoint: Endpoint, path: str, request: EncodedRequest) -> bytes:
    """A complete V2 infer request (JSON, or binary tensors), for one write."""
    if request.header_length is None:
        return post_request(endpoint, path, request.body)
    header = f"Inference-Header-Content-Length: {request.header_length}\r\n"
    return post_request(endpoint, path, request.body, "application/octet-stream", header)


class HttpClient(InferClient):
    """HTTP/1.1 keep-alive connections, one per outstanding request, opened on demand."""

    def __init__(
        self, endpoint: Endpoint, path: str, requests: list[EncodedRequest], timeout_s: float
    ) -> None:
        super().__init__()
        self._endpoint = endpoint
        self._path = path
        self._requests = requests
        self._payloads = [http_request_bytes(endpoint, path, r) for r in requests]
        self._timeout_s = timeout_s
        self._connections = HttpConnections(endpoint, timeout_s, HttpConnection)
        self._blocking: BlockingHttpUser | None = None

    @property
    def reconnects(self) -> int:
        blocking = self._blocking.reconnects if self._blocking is not None else 0
        return self._connections.reconnects + blocking

    def blocking_user(self) -> BlockingHttpUser | None:
        if self._connections.tls:
            return None
        self._blocking = BlockingHttpUser(
            self._endpoint, self._payloads, self._timeout_s, self.error_examples.note
        )
        return self._blocking

    async def infer(self, index: int) -> str | None:
        try:
            conn = await self._connections.request(self._payloads[index])
        except RequestFailed as exc:
            return self.error_examples.note(exc.key, exc.message)
        return self._outcome(conn)

    async def infer_in_sequence(
        self, index: int, sequence_id: int | str, start: bool, end: bool
    ) -> str | None:
        # Encoded per request, as the id and flags change: one copy of the tensors' bytes.
        request = in_sequence("http", self._requests[index], sequence_id, start, end)
        try:
            conn = await self._connections.request(
                http_request_bytes(self._endpoint, self._path, request)
            )
        except RequestFailed as exc:
            return self.error_examples.note(exc.key, exc.message)
        return self._outcome(conn)

    def _outcome(self, conn: HttpConnection) -> str | None:
        if 200 <= conn.status < 300:
            return None
        return self.error_examples.note(f"http {conn.status}", conn.error_message())

    async def close(self) -> None:
        await self._connections.close()


# ---------------------------------------------------------------------------- gRPC


class GrpcClient(InferClient):
    """grpc.aio unary calls with the serialised request as is and the reply left
    undecoded: no protobuf work per request on the client."""

    def __init__(
        self,
        endpoint: Endpoint,
        requests: list[EncodedRequest],
        timeout_s: float,
        max_outstanding: int,
    ) -> None:
        super().__init__()
        import grpc

        self._grpc: Any = grpc
        self._requests = requests
        self._bodies = [r.body for r in requests]
        self._timeout_s = timeout_s
        options = [
            ("grpc.max_send_message_length", -1),
            ("grpc.max_receive_message_length", -1),
            # Each channel its own connection, so streams spread over several.
            ("grpc.use_local_subchannel_pool", 1),
        ]
        count = max(1, math.ceil(max_outstanding / _STREAMS_PER_CHANNEL))
        if endpoint.tls:
            credentials = grpc.ssl_channel_credentials()
            self._channels = [
                grpc.aio.secure_channel(endpoint.address, credentials, options=options)
                for _ in range(count)
            ]
        else:
            self._channels = [
                grpc.aio.insecure_channel(endpoint.address, options=options) for _ in range(count)
            ]
        self._calls = [channel.unary_unary(INFER_METHOD) for channel in self._channels]
        self._next = 0

    async def infer(self, index: int) -> str | None:
        return await self._send(self._bodies[index])

    async def infer_in_sequence(
        self, index: int, sequence_id: int | str, start: bool, end: bool
    ) -> str | None:
        request = in_sequence("grpc", self._requests[index], sequence_id, start, end)
        return await self._send(request.body)

    async def _send(self, body: bytes) -> str | None:
        self._next = (self._next + 1) % len(self._calls)
        try:
            await self._calls[self._next](body, timeout=self._timeout_s)
        except self._grpc.aio.AioRpcError as exc:
            return self.error_examples.note(f"grpc {exc.code().name}", exc.details() or "")
        return None

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
