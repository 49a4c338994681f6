"""The errors a request can end in, each mapped to one HTTP status and one gRPC code.

A bad request is a :class:`ClientError` subclass: it is answered and the server goes on.
Anything else raised while serving is an internal fault: logged once and answered 500
without its details.
"""

from __future__ import annotations


class SlipstreamError(Exception):
    """Base of every error Slipstream answers a client with."""

    http_status = 500
    # Name of the grpc.StatusCode member, kept as a string so protocol code stays pure.
    grpc_code = "INTERNAL"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ClientError(SlipstreamError):
    """The request itself is wrong: fixing it is up to the client."""


class InvalidRequest(ClientError):
    """Malformed request: bad JSON, unknown tensor, wrong dtype or shape."""

    http_status = 400
    grpc_code = "INVALID_ARGUMENT"


class Decoupled(InvalidRequest):
    """A decoupled model (any number of answers per request) asked for one answer: it is
    served on gRPC ModelStreamInfer only, as in Triton."""


class NotFound(ClientError):
    """Nothing is served at what the request names (a route, a job)."""

    http_status = 404
    grpc_code = "NOT_FOUND"


class ModelNotFound(NotFound):
    """Unknown model or version."""


class GenerativeModel(ModelNotFound):
    """A generative model asked for where tensor models are served (the V2 routes,
    /v1/embeddings): it is served on the OpenAI generation routes only."""


class MethodNotAllowed(ClientError):
    """The path names a route, but not for this HTTP method."""

    http_status = 405
    grpc_code = "UNIMPLEMENTED"

    def __init__(self, message: str, allow: list[str]) -> None:
        super().__init__(message)
        # The methods the route answers; sent as Allow.
        self.allow = allow


class Unavailable(SlipstreamError):
    """The model cannot take the request now: not ready, or its queue is full."""

    http_status = 503
    grpc_code = "UNAVAILABLE"

    def __init__(self, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        # Seconds a client should wait before retrying; sent as Retry-After.
        self.retry_after_s = retry_after_s


class RequestTimeout(Unavailable):
    """The request waited in the queue past its timeout and was never run: UNAVAILABLE
    over gRPC too, as Triton answers it (DEADLINE_EXCEEDED reads as the client's own
    deadline, and clients retry on UNAVAILABLE)."""


class InternalError(SlipstreamError):
    """A fault inside the server; the message shown to clients is generic."""


class Unauthenticated(ClientError):
    """No API key, or one the server does not know (the front door's 401)."""

    http_status = 401
    grpc_code = "UNAUTHENTICATED"


class PermissionDenied(ClientError):
    """A known API key whose role or model list does not cover the request (403)."""

    http_status = 403
    grpc_code = "PERMISSION_DENIED"


class TooManyRequests(ClientError):
    """An API key over one of its rate limits (429, gRPC RESOURCE_EXHAUSTED)."""

    http_status = 429
    grpc_code = "RESOURCE_EXHAUSTED"

    def __init__(
        self, message: str, retry_after_s: int, headers: list[tuple[str, str]] | None = None
    ) -> None:
        super().__init__(message)
        # Seconds until the request would be admitted; sent as Retry-After.
        self.retry_after_s = retry_after_s
        # RateLimit-Policy and RateLimit (IETF httpapi draft), sent with the 429 as HTTP
        # headers or gRPC trailing metadata.
        self.headers = headers or []
