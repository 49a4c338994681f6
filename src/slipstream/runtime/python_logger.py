"""``pb_utils.Logger``: a Python model's log lines, to the server's log (Triton's
``triton_python_backend_utils.Logger``; :mod:`.python_utils` re-exports it)."""

from __future__ import annotations

import logging

# One logger for every Python model's lines, as Triton's model log is the server's.
_log = logging.getLogger("slipstream.python_model")


class _LogLevel:
    """``pb_utils.Logger.LogLevel``: a message's level, as Python's logging levels."""

    INFO = logging.INFO
    WARNING = logging.WARNING
    ERROR = logging.ERROR
    VERBOSE = logging.DEBUG


class Logger:
    """Triton's model logger: to the server's log."""

    LogLevel = _LogLevel
    INFO = _LogLevel.INFO
    WARNING = _LogLevel.WARNING
    ERROR = _LogLevel.ERROR
    VERBOSE = _LogLevel.VERBOSE

    @staticmethod
    def log_info(message: str) -> None:
        _log.info("%s", message)

    @staticmethod
    def log_warn(message: str) -> None:
        _log.warning("%s", message)

    @staticmethod
    def log_error(message: str) -> None:
        _log.error("%s", message)

    @staticmethod
    def log_verbose(message: str) -> None:
        _log.debug("%s", message)

    @staticmethod
    def log(message: str, level: int = _LogLevel.INFO) -> None:
        _log.log(level, "%s", message)
