"""Why a benchmark could not run; the CLI prints the message and exits non-zero."""

from __future__ import annotations


class BenchError(Exception):
    """A run cannot go on (or produced nothing); the message says why and what to do."""


class ServerUnreachable(BenchError):
    """Nothing answers at the address, or it does not speak the protocol asked for."""
