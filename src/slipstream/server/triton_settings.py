"""Triton's logging and trace extensions, as both front ends answer them.

Logging (HTTP ``GET/POST /v2/logging``, gRPC ``LogSettings``) changes the server's log for
real: :mod:`slipstream.observability.log_settings`. Trace (HTTP ``GET/POST
/v2[/models/<model>]/trace/setting``, gRPC ``TraceSetting``): globally or per model, as
Triton keeps them, ``trace_level``, ``trace_rate``, ``trace_count`` and ``log_frequency``.
With ``--trace-config mode=opentelemetry`` they decide which requests are traced
(:mod:`slipstream.observability.tracing`; ``trace_mode`` reads ``opentelemetry``, and
``trace_level`` is ``["OFF"]`` or ``["TIMESTAMPS"]``); without it the level stays
``["OFF"]`` and another is refused, naming the option. Both are the answering process's
settings.

    reply = log_settings_json(request.body if request.method == "POST" else None)
    answer = trace_setting_grpc(request)  # after checking request.model_name is served
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from slipstream.errors import InvalidRequest
from slipstream.observability.log_settings import current_log_settings, update_log_settings
from slipstream.protocol import v2
from slipstream.protocol.proto import inference_pb2 as pb

# A trace setting: its values, Triton's strings (trace_level may hold several); an empty
# list in a change clears the setting.
TraceValue = list[str]

# What the settings say where nothing was set: Triton's defaults with tracing off.
TRACE_DEFAULTS: dict[str, TraceValue] = {
    "trace_level": ["OFF"],
    "trace_rate": ["1000"],
    "trace_count": ["-1"],
    "log_frequency": ["0"],
    "trace_file": [""],
    "trace_mode": ["triton"],
}
# The settings a client may give a number, with the range each takes (Triton's).
_NUMBERS = {
    "trace_rate": (0, 2**32 - 1),
    "trace_count": (-1, 2**31 - 1),
    "log_frequency": (0, 2**32 - 1),
}
_NOT_SUPPORTED = (
    "this server traces requests only when started with --trace-config mode=opentelemetry"
)


class TraceSettings:
    """The global trace settings and each model's own, as Triton keeps them: a model's
    setting, until cleared, wins over the global one; a cleared global one is the default."""

    def __init__(self) -> None:
        self._global: dict[str, TraceValue] = {}
        self._models: dict[str, dict[str, TraceValue]] = {}
        self._defaults = dict(TRACE_DEFAULTS)

    def enable(self, level: str, rate: int, count: int) -> None:
        """Requests are traced (--trace-config): the defaults are the config's, and
        ``trace_level`` may be set to OFF or TIMESTAMPS."""
        self._defaults = {**TRACE_DEFAULTS, "trace_level": [level], "trace_rate": [str(rate)],
                          "trace_count": [str(count)], "trace_mode": ["opentelemetry"]}  # fmt: skip

    def view(self, model: str = "") -> dict[str, TraceValue]:
        """Every setting that applies to ``model`` ("" for the global ones)."""
        return {**self._defaults, **self._global, **self._models.get(model, {})}

    def update(self, changes: Mapping[str, TraceValue], model: str = "") -> dict[str, TraceValue]:
        """Apply ``changes`` to ``model``'s settings ("" the global ones) and return the
        settings after them; InvalidRequest naming the setting (then nothing changes)."""
        checked = {name: _checked(name, values, self._defaults)
                   for name, values in changes.items()}  # fmt: skip
        settings = self._models.setdefault(model, {}) if model else self._global
        for name, values in checked.items():
            if values:
                settings[name] = values
            else:
                settings.pop(name, None)
        if model and not settings:
            del self._models[model]
        return self.view(model)


def _checked(name: str, values: TraceValue, defaults: Mapping[str, TraceValue]) -> TraceValue:
    """A change of ``name`` as kept (numbers normalised); [] clears the setting."""
    if name not in TRACE_DEFAULTS:
        raise InvalidRequest(
            f"{name!r} is not a trace setting; expected one of {', '.join(TRACE_DEFAULTS)}"
        )
    if not values:
        return []
    tracing = defaults["trace_mode"] == ["opentelemetry"]
    if name == "trace_level":
        values = [value.upper() for value in values]
        allowed = [["OFF"], ["TIMESTAMPS"]] if tracing else [["OFF"]]
        if values not in allowed:
            levels = " or ".join(str(level) for level in allowed)
            reason = "TENSORS and combined levels are not traced" if tracing else _NOT_SUPPORTED
            raise InvalidRequest(f"trace_level {values}: {reason}; set {levels}")
        return values
    if len(values) != 1:
        raise InvalidRequest(f"{name}: expected one value, got {values}")
    (value,) = values
    if name in ("trace_file", "trace_mode"):
        if value != defaults[name][0]:
            raise InvalidRequest(
                f"{name} {value!r}: spans are exported over OTLP (--trace-config), not "
                f"chosen per request; leave {name} as {defaults[name][0]!r}"
            )
        return []  # nothing to keep: the default
    low, high = _NUMBERS[name]
    try:
        number = int(value)
    except ValueError:
        number = low - 1
    if not low <= number <= high:
        raise InvalidRequest(f"{name}: expected an integer from {low} to {high}, got {value!r}")
    return [str(number)]


# The process's trace settings (both front ends answer from them).
TRACE_SETTINGS = TraceSettings()


# -- HTTP ---------------------------------------------------------------------------------


def log_settings_json(body: bytes | None) -> bytes:
    """The answer of ``GET /v2/logging`` (``body`` None) or ``POST`` (its body, which may
    be empty): every setting after the change, as Triton's JSON object."""
    if not body:
        return orjson.dumps(current_log_settings())
    return orjson.dumps(update_log_settings(v2.load_json_object(body)))


def trace_settings_json(body: bytes | None, model: str = "") -> bytes:
    """The answer of ``GET /v2[/models/<model>]/trace/setting`` (``body`` None) or POST:
    the settings as Triton's JSON (trace_level an array, the others strings)."""
    if body:
        changes = {name: _json_values(name, value)
                   for name, value in v2.load_json_object(body).items()}  # fmt: skip
        settings = TRACE_SETTINGS.update(changes, model)
    else:
        settings = TRACE_SETTINGS.view(model)
    return orjson.dumps(
        {name: values if name == "trace_level" else values[0] for name, values in settings.items()}
    )


def _json_values(name: str, value: Any) -> TraceValue:
    """A JSON setting's values: null clears it; a string (or number) is one value."""
    if value is None:
        return []
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return value
    if isinstance(value, float) and value.is_integer():  # JSON's 7.0 is an integer too
        value = int(value)
    if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
        return [str(value)]
    raise InvalidRequest(
        f"{name}: expected a string, an array of strings or null, got {orjson.dumps(value)!r}"
    )


# -- gRPC ---------------------------------------------------------------------------------


def log_settings_grpc(request: pb.LogSettingsRequest) -> pb.LogSettingsResponse:
    """LogSettings: the request's changes (none: a read), then every setting."""
    if request.settings:
        changes = {
            name: getattr(value, kind) if (kind := value.WhichOneof("parameter_choice")) else None
            for name, value in request.settings.items()
        }
        settings = update_log_settings(changes)
    else:
        settings = current_log_settings()
    response = pb.LogSettingsResponse()
    for name, value in settings.items():
        entry = response.settings[name]
        if isinstance(value, bool):
            entry.bool_param = value
        elif isinstance(value, int):
            entry.uint32_param = value
        else:
            entry.string_param = value
    return response


def trace_setting_grpc(request: pb.TraceSettingRequest) -> pb.TraceSettingResponse:
    """TraceSetting of ``request.model_name`` ("" the global settings); the caller has
    checked the model is served."""
    model = request.model_name
    if request.settings:
        changes = {name: list(value.value) for name, value in request.settings.items()}
        settings = TRACE_SETTINGS.update(changes, model)
    else:
        settings = TRACE_SETTINGS.view(model)
    response = pb.TraceSettingResponse()
    for name, values in settings.items():
        response.settings[name].value.extend(values)
    return response
