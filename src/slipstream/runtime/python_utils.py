"""What a Triton Python model imports as ``triton_python_backend_utils`` (``pb_utils``).

Triton's Python backend hands a model's ``execute`` a list of requests and takes back one
response each; these classes carry the tensors both ways, with the names and methods
Triton's give (:mod:`slipstream.runtime.python_model` registers this module under
Triton's name before it imports a ``model.py``). What needs Triton's own server is
refused with an error that says so: running other models from inside one (BLS,
``InferenceRequest.exec``) and decoupled responses.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from slipstream.datatypes import V2_TO_NUMPY, from_config_datatype, v2_datatype

_log = logging.getLogger("slipstream.python_model")


class TritonError(Exception):
    """An error a model returns in a response (or raises): its code sets the status."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        super().__init__(message)
        self._message = message
        self._code = code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class TritonModelException(Exception):
    """Raised by the utilities below on misuse, as Triton's are."""


class Tensor:
    """A named tensor: an input of a request, or an output of a response."""

    def __init__(self, name: str, array: Any) -> None:
        if not isinstance(array, np.ndarray):
            raise TritonModelException(
                f"Tensor {name!r}: expected a numpy array, got {type(array).__name__}"
            )
        self._name = name
        self._array = array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array

    def triton_dtype(self) -> str:
        return _datatype(self._array)

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def is_cpu(self) -> bool:
        return True

    def to_dlpack(self) -> Any:
        return self._array.__dlpack__()

    @classmethod
    def from_dlpack(cls, name: str, capsule: Any) -> Tensor:
        return cls(name, np.from_dlpack(capsule))


class InferenceRequest:
    """One request as a model's ``execute`` sees it."""

    def __init__(
        self,
        inputs: Sequence[Tensor] = (),
        requested_output_names: Sequence[str] = (),
        request_id: str = "",
        correlation_id: int | str = 0,
        parameters: dict[str, Any] | None = None,
        **_: Any,
    ) -> None:
        self._inputs = list(inputs)
        self._outputs = list(requested_output_names)
        self._id = request_id
        self._correlation_id = correlation_id
        self._parameters = parameters or {}

    def inputs(self) -> list[Tensor]:
        return list(self._inputs)

    def requested_output_names(self) -> list[str]:
        return list(self._outputs)

    def request_id(self) -> str:
        return self._id

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def parameters(self) -> str:
        return json.dumps(self._parameters)

    def flags(self) -> int:
        return 0

    def is_cancelled(self) -> bool:
        return False

    def get_response_sender(self) -> Any:
        raise TritonModelException(
            "decoupled models (get_response_sender) are not supported; return one "
            "InferenceResponse per request from execute"
        )

    def exec(self, *_: Any, **__: Any) -> Any:
        raise TritonModelException(
            "running another model from a Python model (BLS: InferenceRequest.exec) is not "
            "supported; chain the models in an ensemble (ensemble_scheduling) instead"
        )

    async_exec = exec


class InferenceResponse:
    """What a model's ``execute`` returns for one request: outputs, or an error."""

    def __init__(
        self, output_tensors: Sequence[Tensor] = (), error: TritonError | None = None, **_: Any
    ) -> None:
        self._outputs = list(output_tensors)
        self._error = error

    def output_tensors(self) -> list[Tensor]:
        return list(self._outputs)

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    return next((tensor for tensor in request.inputs() if tensor.name() == name), None)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((tensor for tensor in response.output_tensors() if tensor.name() == name), None)


def get_input_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((t for t in model_config.get("input", []) if t["name"] == name), None)


def get_output_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((t for t in model_config.get("output", []) if t["name"] == name), None)


def triton_string_to_numpy(triton_type: str) -> type:
    """``TYPE_FP32`` (or ``FP32``) -> numpy's type; BYTES / TYPE_STRING -> object."""
    try:
        dtype = V2_TO_NUMPY[from_config_datatype(triton_type)]
    except (KeyError, ValueError):
        raise TritonModelException(f"unknown Triton datatype {triton_type!r}") from None
    return np.dtype(dtype).type


def using_decoupled_model_transaction_policy(model_config: dict[str, Any]) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled"))


def _datatype(array: np.ndarray) -> str:
    try:
        return v2_datatype(array.dtype)
    except ValueError:
        return str(array.dtype)


class Logger:
    """Triton's model logger: to the server's log."""

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
    def log(message: str, level: int = 0) -> None:
        _log.info("%s", message)
