"""The split layout's claim on its ports, taken by the supervisor before any front end.

Front-end processes share their ports through SO_REUSEPORT, and the kernel lets any
process of the same user join such a port: a second ``--frontends`` server on the ports of
a running one would bind, say "listening", and take half of the new connections. A
one-process server fails instead ("address already in use"); :func:`claim_ports` makes the
split layout fail the same way, and keeps it failing for servers started later:

- the check: each port is bound as a one-process server binds it, SO_REUSEADDR and no
  SO_REUSEPORT, which fails while any other socket listens on it (with or without
  SO_REUSEPORT) and ignores connections left in TIME_WAIT;
- the claim: once free, the port stays bound (not listening) by the supervisor with
  SO_REUSEPORT and without SO_REUSEADDR. This server's front ends (SO_REUSEPORT) can still
  bind beside it; another server's check, and a one-process server, cannot, even in the
  moments when none of this server's front ends listens (at start, or all restarting).
  Not listening, it is never handed a connection.

Example::

    claim = claim_ports(settings.host, [("HTTP", 8000, "--http-port")])  # OSError if taken
    ...  # start the front ends
    claim.close()
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Port:
    """One port the front ends listen on."""

    # What listens on it, as the one-process server's messages name it: "HTTP", "gRPC".
    kind: str
    number: int
    # The option that chooses another, named in the error.
    option: str


@dataclass(slots=True)
class PortClaim:
    """The sockets held for the server's lifetime (see the module docstring)."""

    sockets: list[socket.socket] = field(default_factory=list)

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()
        self.sockets.clear()


def claim_ports(host: str, ports: Sequence[Port]) -> PortClaim:
    """Check that no other process listens on ``ports`` at ``host`` and hold them.
    OSError naming the port and the option to change, as the one-process server says
    it, when one is taken."""
    claim = PortClaim()
    try:
        for port in ports:
            for family, address in _addresses(host, port.number):
                try:
                    _bind(family, address, reuse_address=True).close()
                except OSError as exc:
                    raise OSError(
                        f"{port.kind} server could not bind {host}:{port.number}: {exc}; "
                        f"choose another with {port.option}"
                    ) from None
                try:
                    claim.sockets.append(_bind(family, address, reuse_address=False))
                except OSError as exc:
                    # Connections of a one-process server that ran here, still in
                    # TIME_WAIT, refuse a socket without SO_REUSEADDR: serve unclaimed,
                    # the front ends' listening sockets still fail a later server's check.
                    if exc.errno != errno.EADDRINUSE:
                        raise
                    logger.info("%s port %d is not held by the supervisor (%s)",
                                port.kind, port.number, exc)  # fmt: skip
    except BaseException:
        claim.close()
        raise
    return claim


def _addresses(host: str, port: int) -> list[tuple[int, tuple[object, ...]]]:
    """Every address the servers bind for ``host`` (asyncio binds them all)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    unique = dict.fromkeys((family, address) for family, _, _, _, address in infos)
    return list(unique)


def _bind(family: int, address: tuple[object, ...], reuse_address: bool) -> socket.socket:
    """A socket bound to ``address``: as a server binds it (``reuse_address``), or as
    the claim (SO_REUSEPORT only)."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if reuse_address:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        else:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:  # as asyncio's servers: v4 has sockets of its own
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock
