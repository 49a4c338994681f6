"""Model files that unpickle when loaded run code: loading one is opt-in.

scikit-learn models (``joblib.load``) and torch.export programs (``.pt2``, whose weights
``torch.export.load`` unpickles) are pickles: whoever wrote the file chooses code that
runs in the server as it loads. So such a file loads only when its model's config.yaml
says ``trust_pickle: true``, or the server was started with ``--trust-pickle``; every
pickle loaded is logged as a warning.
"""

from __future__ import annotations

import logging
from pathlib import Path

from slipstream.config import ConfigError
from slipstream.runtime.base import Backend

logger = logging.getLogger(__name__)

# Set once at start-up from ``slipstream serve --trust-pickle`` (one server per process).
_trusted_server_wide = False


def trust_pickles_server_wide(trusted: bool) -> None:
    """Whether every model may load pickle-based files (``--trust-pickle``)."""
    global _trusted_server_wide
    _trusted_server_wide = trusted


def check_pickle_trust(
    model: str, path: Path, backend: type[Backend], model_trusts_pickle: bool
) -> None:
    """Refuse (ConfigError) to load a pickle-based file that nobody opted in to.

    The message says how to opt in and how to avoid pickles altogether.
    """
    if not backend.loads_pickle(path):
        return
    if not (model_trusts_pickle or _trusted_server_wide):
        raise ConfigError(
            f"model {model!r}: {path.name} is {_what(backend)} ({backend.name} backend), "
            "and loading it runs any code the file holds, so it is refused by default. "
            f"If you trust the file like code, add `trust_pickle: true` to {model}/config.yaml "
            f"(or start the server with --trust-pickle); better, {backend.pickle_free_format}"
        )
    logger.warning(
        "model %s: loading the pickle %s (trust_pickle): it can run any code it holds",
        model,
        path,
    )


def _what(backend: type[Backend]) -> str:
    return "Python code" if backend.name == "python" else "a pickle"
