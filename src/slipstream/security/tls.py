"""TLS for the HTTP and gRPC front ends from PEM files (``--tls-cert/--tls-key``), with
optional client certificates (``--tls-client-ca``: mutual TLS)."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any


def http_context(cert: Path, key: Path, client_ca: Path | None = None) -> ssl.SSLContext:
    """A server context (TLS 1.2+); with ``client_ca``, clients must show a certificate."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    for option, path in (("--tls-cert", cert), ("--tls-key", key), ("--tls-client-ca", client_ca)):
        if path is not None and not path.is_file():  # ssl's "[Errno 2]" names neither
            raise FileNotFoundError(f"{option} {path}: no such file")
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as exc:  # OpenSSL's words alone name neither file
        raise ssl.SSLError(
            f"--tls-cert {cert} and --tls-key {key}: {exc.reason or exc}; the key must be "
            "the certificate's, both PEM"
        ) from exc
    if client_ca is not None:
        try:
            context.load_verify_locations(client_ca)
        except ssl.SSLError as exc:
            raise ssl.SSLError(
                f"--tls-client-ca {client_ca}: {exc.reason or exc}; expected PEM CA certificates"
            ) from exc
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def grpc_credentials(cert: Path, key: Path, client_ca: Path | None = None) -> Any:
    """grpc.ServerCredentials of the same files."""
    import grpc

    return grpc.ssl_server_credentials(
        [(key.read_bytes(), cert.read_bytes())],
        root_certificates=client_ca.read_bytes() if client_ca is not None else None,
        require_client_auth=client_ca is not None,
    )
