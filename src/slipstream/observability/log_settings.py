"""Triton's logging extension on Python's logging: the ``slipstream`` loggers' settings,
read and changed while the server runs (HTTP ``/v2/logging``, gRPC ``LogSettings``).

    update_log_settings({"log_verbose_level": 1})  # the slipstream loggers log DEBUG
    current_log_settings()
    # {"log_file": "", "log_info": True, "log_warning": True, "log_error": True,
    #  "log_verbose_level": 1, "log_format": "default"}

Triton's switches on Python's levels: ``log_verbose_level`` above 0 lets DEBUG through
(Triton's verbose levels are all DEBUG here; the number set is kept and answered);
``log_info``, ``log_warning`` and ``log_error`` each let their level through or not
(CRITICAL goes with ERROR). They apply to the ``slipstream`` loggers of this process,
whatever ``--log-level`` set; libraries' loggers keep their levels, and the access log
(``--access-log``, its own switch and handler) is not affected. A level switched off
between two left on (info on, warning off) is dropped by a filter on the handlers the
server's log is written by. ``log_format`` "ISO8601" writes each line's time as
``2024-05-20T20:03:26Z`` (UTC); "default" as the server started. ``log_file`` is always
"": the log goes to stderr (redirect it to keep a file), and a client may not name a
file for the server to write.

The settings are the process's: in the split layout (``--frontends N``) a change applies
in the process that answered it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from slipstream.errors import InvalidRequest

logger = logging.getLogger(__name__)

# The logger hierarchy the settings govern.
ROOT_LOGGER = "slipstream"
# Triton's setting names, in the order Triton answers them.
LOG_SETTINGS = (
    "log_file", "log_info", "log_warning", "log_error", "log_verbose_level", "log_format",
)  # fmt: skip
LOG_FORMATS = ("default", "ISO8601")
# The largest verbose level: gRPC answers it as a uint32.
_MAX_VERBOSE_LEVEL = 2**32 - 1
_ISO8601_DATEFMT = "%Y-%m-%dT%H:%M:%SZ"


@dataclass(slots=True)
class _Switches:
    info: bool
    warning: bool
    error: bool
    verbose_level: int
    iso8601: bool = False

    def allows(self, level: int) -> bool:
        """Whether a record of ``level`` from a slipstream logger is written."""
        if level >= logging.ERROR:
            return self.error
        if level >= logging.WARNING:
            return self.warning
        if level >= logging.INFO:
            return self.info
        return self.verbose_level > 0

    def threshold(self) -> int:
        """The slipstream logger's level: the lowest level let through (nothing is
        created below it, so a switched-off level costs no formatting)."""
        for level in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR):
            if self.allows(level):
                return level
        return logging.CRITICAL + 1


class _SwitchFilter(logging.Filter):
    """Drops a slipstream record whose level is switched off (handlers' filters see the
    records of every logger below them, unlike a logger's own)."""

    def __init__(self, switches: _Switches) -> None:
        super().__init__()
        self.switches = switches

    def filter(self, record: logging.LogRecord) -> bool:
        name = record.name
        if name != ROOT_LOGGER and not name.startswith(ROOT_LOGGER + "."):
            return True
        return self.switches.allows(record.levelno)


class _LogControl:
    """The process's settings, made on the first read from the logging configuration."""

    def __init__(self) -> None:
        self._switches: _Switches | None = None
        self._filter: _SwitchFilter | None = None
        # Formatters switched to ISO 8601 -> their datefmt and converter before it.
        self._formats: dict[logging.Formatter, tuple[str | None, Callable[..., Any]]] = {}

    def switches(self) -> _Switches:
        if self._switches is None:
            level = logging.getLogger(ROOT_LOGGER).getEffectiveLevel()
            self._switches = _Switches(
                info=level <= logging.INFO,
                warning=level <= logging.WARNING,
                error=level <= logging.ERROR,
                verbose_level=int(level <= logging.DEBUG),
            )
        return self._switches

    def apply(self, switches: _Switches) -> None:
        self._switches = switches
        logging.getLogger(ROOT_LOGGER).setLevel(switches.threshold())
        for handler in _handlers():
            if self._filter is None:
                self._filter = _SwitchFilter(switches)
            self._filter.switches = switches
            if self._filter not in handler.filters:
                handler.addFilter(self._filter)
            if handler.formatter is not None:
                self._format(handler.formatter, switches.iso8601)

    def _format(self, formatter: logging.Formatter, iso8601: bool) -> None:
        if iso8601 and formatter not in self._formats:
            self._formats[formatter] = (formatter.datefmt, formatter.converter)
            formatter.datefmt = _ISO8601_DATEFMT
            formatter.converter = time.gmtime
        elif not iso8601 and formatter in self._formats:
            formatter.datefmt, formatter.converter = self._formats.pop(formatter)


_CONTROL = _LogControl()


def _handlers() -> list[logging.Handler]:
    """The handlers a slipstream record reaches: the slipstream logger's, then the root's
    (where ``logging.basicConfig`` put the server's)."""
    found: list[logging.Handler] = []
    current: logging.Logger | None = logging.getLogger(ROOT_LOGGER)
    while current is not None:
        found.extend(h for h in current.handlers if h not in found)
        current = current.parent if current.propagate else None
    return found


def current_log_settings() -> dict[str, Any]:
    """Every setting now, in Triton's names and JSON types."""
    switches = _CONTROL.switches()
    return {
        "log_file": "",
        "log_info": switches.info,
        "log_warning": switches.warning,
        "log_error": switches.error,
        "log_verbose_level": switches.verbose_level,
        "log_format": "ISO8601" if switches.iso8601 else "default",
    }


def update_log_settings(changes: Mapping[str, Any]) -> dict[str, Any]:
    """Apply ``changes`` (Triton's names; a None value leaves that setting as it is) and
    return every setting after them. InvalidRequest naming the setting when one is
    unknown or of the wrong type, and then nothing changes."""
    current = _CONTROL.switches()
    new = dataclasses.replace(current)
    for name, value in changes.items():
        if name not in LOG_SETTINGS:
            raise InvalidRequest(
                f"{name!r} is not a log setting; expected one of {', '.join(LOG_SETTINGS)}"
            )
        if value is not None:
            _set(new, name, value)
    if new != current:
        logger.info("log settings changed: %s", ", ".join(
            f"{name}={value!r}" for name, value in changes.items() if value is not None
        ))  # fmt: skip
        _CONTROL.apply(new)
    return current_log_settings()


def _set(switches: _Switches, name: str, value: Any) -> None:
    if name in ("log_info", "log_warning", "log_error"):
        if type(value) is not bool:
            raise InvalidRequest(f"{name}: expected true or false, got {value!r}")
        setattr(switches, name.removeprefix("log_"), value)
    elif name == "log_verbose_level":
        if type(value) is float and value.is_integer():  # JSON's 1.0 is an integer too
            value = int(value)
        if type(value) is not int or not 0 <= value <= _MAX_VERBOSE_LEVEL:
            raise InvalidRequest(
                f"log_verbose_level: expected an integer from 0 (off) to "
                f"{_MAX_VERBOSE_LEVEL}, got {value!r}"
            )
        switches.verbose_level = value
    elif name == "log_format":
        if value not in LOG_FORMATS:
            raise InvalidRequest(f"log_format: expected 'default' or 'ISO8601', got {value!r}")
        switches.iso8601 = value == "ISO8601"
    elif not isinstance(value, str):  # log_file
        raise InvalidRequest(f"log_file: expected a string, got {value!r}")
    elif value:
        raise InvalidRequest(
            f"log_file: {value!r} refused; the server logs to stderr and a client cannot "
            "make it write a file: redirect the server's stderr to a file when starting "
            "it, and leave log_file empty"
        )
