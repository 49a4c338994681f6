"""Why a benchmark could not run (the CLI prints the message and exits non-zero), and
how failed requests are summed up."""

from __future__ import annotations

from typing import Protocol


class BenchError(Exception):
    """A run cannot go on (or produced nothing); the message says why and what to do."""


class ServerUnreachable(BenchError):
    """Nothing answers at the address, or it does not speak the protocol asked for."""


# Keep at most this much of an error message as the example shown beside the counts.
ERROR_EXAMPLE_CHARS = 2048


class ErrorExamples(dict[str, str]):
    """Error key -> the first message seen with it, kept by a mode's client."""

    def note(self, key: str, message: str) -> str:
        """Keep ``message`` unless ``key`` has an example already; returns ``key``."""
        if key not in self:
            self[key] = message.strip()[:ERROR_EXAMPLE_CHARS]
        return key


class _HasErrors(Protocol):
    errors_by_code: dict[str, int]
    error_examples: dict[str, str]


def error_summary(result: _HasErrors) -> str:
    """Errors by kind, each with an example message (V2 and OpenAI levels alike).

    >>> class Level:
    ...     errors_by_code = {"http 503": 2}
    ...     error_examples = {"http 503": "queue full"}
    >>> error_summary(Level())
    'http 503 x2 (queue full)'
    """
    if not result.errors_by_code:
        return "no request completed"
    parts = []
    for key, count in result.errors_by_code.items():
        example = result.error_examples.get(key, "")
        parts.append(f"{key} x{count}" + (f" ({example[:200]})" if example else ""))
    return "; ".join(parts)


def reconnects_warning(reconnects: int) -> list[str]:
    """The warning for requests sent again on a fresh connection (none for 0): the
    server closed an idle keep-alive connection under them, which is not an error."""
    if not reconnects:
        return []
    return [
        f"{reconnects} requests went again on a fresh connection: the server closed an idle "
        "keep-alive connection first (counted, not errors)"
    ]
