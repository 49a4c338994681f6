"""Where a benchmarked server listens, parsed once from the URL.

Light on purpose (no asyncio, no httptools): the V2 mode's worker processes import it
first, through their messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass(frozen=True)
class Endpoint:
    """Where the server listens (see :func:`parse_endpoint`)."""

    # The mode's protocol: "http", "http-binary" or "grpc" (the OpenAI mode uses "http").
    protocol: str
    host: str
    port: int
    # https:// (HTTP) or grpcs:// (gRPC).
    tls: bool
    # HTTP only: a path before the API's routes, e.g. behind a reverse proxy.
    path_prefix: str = ""

    @property
    def origin(self) -> str:
        """http(s)://host:port, for the HTTP API."""
        scheme = "https" if self.tls else "http"
        return f"{scheme}://{self.host}:{self.port}"

    @property
    def address(self) -> str:
        """host:port, for gRPC and messages."""
        return f"{self.host}:{self.port}"


def parse_endpoint(url: str, protocol: str) -> Endpoint:
    """``http://host:port`` for HTTP, ``host:port`` for gRPC (a scheme is tolerated).

    >>> parse_endpoint("localhost:8001", "grpc")
    Endpoint(protocol='grpc', host='localhost', port=8001, tls=False, path_prefix='')
    """
    if "://" not in url:
        url = ("grpc://" if protocol == "grpc" else "http://") + url
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    known = ("grpc", "grpcs", "http", "https")
    if scheme not in known or not parts.hostname:
        raise ValueError(f"URL {url!r}: expected http://host:port or host:port")
    tls = scheme in ("https", "grpcs")
    default_port = 8001 if protocol == "grpc" else (443 if tls else 80)
    try:
        port = parts.port or default_port
    except ValueError:
        raise ValueError(f"URL {url!r}: the port is not a number") from None
    prefix = "" if protocol == "grpc" else parts.path.rstrip("/")
    return Endpoint(protocol=protocol, host=parts.hostname, port=port, tls=tls, path_prefix=prefix)
