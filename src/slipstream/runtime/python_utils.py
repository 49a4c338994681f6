"""What a Triton Python model imports as ``triton_python_backend_utils`` (``pb_utils``).

Triton's Python backend hands a model's ``execute`` a list of requests and takes back one
response each; these classes carry the tensors both ways, with the names and methods
Triton's give (:mod:`slipstream.runtime.python_model` registers this module under
Triton's name before it imports a ``model.py``). ``InferenceRequest.exec`` runs another
model of the server (:mod:`.python_bls`); a decoupled model answers through
``InferenceRequest.get_response_sender()``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from slipstream.datatypes import BF16, V2_TO_NUMPY, from_config_datatype, v2_datatype
from slipstream.errors import ClientError, NotFound, SlipstreamError, Unavailable
from slipstream.runtime.python_logger import Logger
from slipstream.runtime.python_metrics import MetricFamily
from slipstream.runtime.python_tensors import (
    TRITON_STRING_TO_NUMPY,
    deserialize_bytes_tensor,
    numpy_to_triton_type,
    serialize_byte_tensor,
    triton_to_numpy_type,
)

if TYPE_CHECKING:
    from slipstream.types import InferResponse

# Re-exported: a model's logger (python_logger), custom metrics (python_metrics),
# Triton's datatype tables and BYTES codecs (python_tensors).
__all__ = [
    "TRITON_STRING_TO_NUMPY",
    "Logger",
    "MetricFamily",
    "deserialize_bytes_tensor",
    "numpy_to_triton_type",
    "serialize_byte_tensor",
    "triton_to_numpy_type",
]


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


# The attribute a model's error answer keeps its TritonError code in (python_model sets
# it): a BLS call's error response gets that code back, not one guessed from the status.
TRITON_CODE_ATTRIBUTE = "triton_error_code"


class TritonModelException(Exception):
    """Raised by the utilities below on misuse, as Triton's are."""


# Where a BLS call would like its outputs (InferenceRequest's preferred_memory): taken
# and ignored, as every tensor is in host memory here.
TRITONSERVER_MEMORY_CPU = 0
TRITONSERVER_MEMORY_CPU_PINNED = 1
TRITONSERVER_MEMORY_GPU = 2


class PreferredMemory:
    """Triton's ``pb_utils.PreferredMemory(memory_type, device_id)``."""

    def __init__(
        self, preferred_memory_type: int = TRITONSERVER_MEMORY_CPU, preferred_device_id: int = 0
    ) -> None:
        self.preferred_memory_type = preferred_memory_type
        self.preferred_device_id = preferred_device_id


# InferenceRequest.flags() of a stateful model's request: its sequence's first, last.
TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
# InferenceRequest.set_release_flags: Triton's request rescheduling, refused here.
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2


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
        return self.__dlpack__()

    def __dlpack__(self, stream: Any = None) -> Any:
        if self._array.dtype == BF16:  # numpy exports no bfloat16: torch's tensor over it
            from slipstream.runtime.torch_arrays import as_tensor

            return as_tensor(np.ascontiguousarray(self._array)).__dlpack__()
        return self._array.__dlpack__()

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU

    @classmethod
    def from_dlpack(cls, name: str, capsule: Any) -> Tensor:
        """A tensor from a DLPack capsule (``torch.utils.dlpack.to_dlpack(t)``, as
        Triton's examples pass) or an object with ``__dlpack__``; a GPU tensor's data
        is copied to the host (instances run on the CPU here)."""
        if hasattr(capsule, "__dlpack__"):
            try:
                return cls(name, np.from_dlpack(capsule))
            except (BufferError, RuntimeError, TypeError):
                pass  # on another device: torch below copies it to the host
        try:
            import torch
        except ImportError:
            if hasattr(capsule, "__dlpack__"):
                raise
            return cls(name, np.from_dlpack(_Capsule(capsule)))
        from slipstream.runtime.torch_arrays import as_array

        return cls(name, as_array(torch.utils.dlpack.from_dlpack(capsule).cpu()))


class _Capsule:
    """A bare DLPack capsule as numpy's ``from_dlpack`` takes it (a host tensor's)."""

    def __init__(self, capsule: Any) -> None:
        self._capsule = capsule

    def __dlpack__(self, **_: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU


class InferenceRequest:
    """One request as a model's ``execute`` sees it, or one a model makes to run another
    model of the server (``exec``/``async_exec``: :mod:`.python_bls`)."""

    def __init__(
        self,
        inputs: Sequence[Tensor] = (),
        requested_output_names: Sequence[str] = (),
        request_id: str = "",
        correlation_id: int | str = 0,
        parameters: dict[str, Any] | str | None = None,
        model_name: str = "",
        model_version: int = -1,
        flags: int = 0,
        timeout: int = 0,
        **_: Any,
    ) -> None:
        self._inputs = list(inputs)
        self._outputs = [_text(name) for name in requested_output_names]
        self._id = _text(request_id)
        self._correlation_id = correlation_id
        if isinstance(parameters, str):  # Triton takes a JSON object's text too
            try:
                parameters = json.loads(parameters) if parameters else {}
            except json.JSONDecodeError as exc:
                raise TritonModelException(f"parameters: not JSON ({exc})") from None
        if parameters is not None and not isinstance(parameters, dict):
            raise TritonModelException(
                f"parameters: expected a dict or its JSON text, got {type(parameters).__name__}"
            )
        self._parameters = parameters or {}
        # A name read from a BYTES input (Triton's BLS example does so) is bytes.
        self._model_name = _text(model_name)
        self._model_version = model_version
        self._flags = flags
        self._timeout = timeout

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
        """TRITONSERVER_REQUEST_FLAG_SEQUENCE_START / _END of a stateful model's request."""
        return self._flags

    def set_flags(self, flags: int) -> None:
        self._flags = flags

    def set_release_flags(self, flags: int) -> None:
        """Triton's request rescheduling (``TRITONSERVER_REQUEST_RELEASE_RESCHEDULE``,
        for iterative sequences): not supported here."""
        if flags == TRITONSERVER_REQUEST_RELEASE_ALL:
            return
        raise TritonModelException(
            "set_release_flags: Slipstream does not reschedule requests (Triton's "
            "iterative_sequence); answer each request in the execute call that gets it"
        )

    def model_name(self) -> str:
        return self._model_name

    def model_version(self) -> int:
        return self._model_version

    def timeout(self) -> int:
        """The request's queue timeout in microseconds (0: the model's default)."""
        return self._timeout

    def is_cancelled(self) -> bool:
        """Whether the client has gone (a decoupled request's stream closed)."""
        sender: InferenceResponseSender | None = getattr(self, "_sender", None)
        return sender is not None and sender.is_cancelled()

    def get_response_sender(self) -> InferenceResponseSender:
        sender: InferenceResponseSender | None = getattr(self, "_sender", None)
        if sender is None:
            raise TritonModelException(
                "get_response_sender: the model is not decoupled; set "
                "model_transaction_policy { decoupled: true } in its config, or return one "
                "InferenceResponse per request from execute"
            )
        return sender

    def exec(self, decoupled: bool = False, **_: Any) -> Any:
        """Run this request on the model it names and wait for its answer (an error
        response where the server refused or failed it); ``decoupled=True``: a
        :class:`ResponseIterator` over a decoupled model's answers."""
        from slipstream.runtime import python_bls

        if decoupled:
            return ResponseIterator(python_bls.call_stream(self))
        return _response(python_bls.call(self))

    async def async_exec(self, decoupled: bool = False, **_: Any) -> Any:
        """:meth:`exec` for an ``async def execute``."""
        from slipstream.runtime import python_bls

        if decoupled:
            return ResponseIterator(python_bls.call_stream(self))
        return _response(await python_bls.call_async(self))


class ResponseIterator:
    """What ``exec(decoupled=True)`` returns: the called model's responses as they come,
    the last one empty where the model sent its final flag alone (as Triton's)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream  # a python_bls.Stream, or what refused the call
        self._done = False

    def __iter__(self) -> ResponseIterator:
        return self

    def __next__(self) -> InferenceResponse:
        if self._done:
            raise StopIteration
        if isinstance(self._stream, Exception):
            self._done = True
            return _response(self._stream)
        answer, error, self._done = self._stream.next()
        if error is not None:
            return _response(error)
        return InferenceResponse() if answer is None else _response(answer)

    def cancel(self) -> None:
        if not isinstance(self._stream, Exception):
            self._stream.cancel()


# InferenceResponseSender.send's flags: this is the request's last response.
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1


class InferenceResponseSender:
    """A decoupled model's way to answer one request any number of times, from any
    thread, during or after ``execute``; the last ``send`` carries
    ``TRITONSERVER_RESPONSE_COMPLETE_FINAL``."""

    def __init__(
        self,
        deliver: Callable[[InferenceResponse | None, bool], None],
        cancelled: Callable[[], bool] | None = None,
    ) -> None:
        self._deliver = deliver
        self._cancelled = cancelled
        self._lock = threading.Lock()
        self._closed = False

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        final = bool(flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        if response is None and not final:
            raise TritonModelException("send: give a response, or flags=COMPLETE_FINAL, or both")
        if response is not None and not isinstance(response, InferenceResponse):
            raise TritonModelException(
                f"send: expected an InferenceResponse, got {type(response).__name__}"
            )
        with self._lock:
            if self._closed:
                raise TritonModelException("send: the request's final response is already sent")
            self._closed = final
            self._deliver(response, final)

    def close_with(self, fail: Callable[[], None]) -> None:
        """The server's: end a request whose final response is not sent yet with
        ``fail`` (its model's execute failed); later sends are refused."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            fail()

    def is_cancelled(self) -> bool:
        """Whether the client has gone before the last answer: stop making answers
        (and still send the final flag, as Triton asks)."""
        return self._cancelled is not None and self._cancelled()


class InferenceResponse:
    """What a model's ``execute`` returns for one request: outputs, or an error."""

    def __init__(
        self,
        output_tensors: Sequence[Tensor] = (),
        error: TritonError | None = None,
        parameters: dict[str, Any] | None = None,
        **_: Any,
    ) -> None:
        self._outputs = list(output_tensors)
        self._error = error
        # Sent to the client with the response (V2's response parameters), as Triton's.
        self._parameters = _response_parameters(parameters)

    def parameters(self) -> str:
        return json.dumps(self._parameters)

    def output_tensors(self) -> list[Tensor]:
        return list(self._outputs)

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


def _response_parameters(parameters: dict[str, Any] | str | None) -> dict[str, Any]:
    """A response's parameters, checked: a JSON object's text or a dict, whose keys are
    text and values bool, int, float or text (what V2's parameters carry)."""
    if isinstance(parameters, str):
        try:
            parameters = json.loads(parameters) if parameters else {}
        except json.JSONDecodeError as exc:
            raise TritonModelException(f"parameters: not JSON ({exc})") from None
    if not isinstance(parameters, dict | None):
        raise TritonModelException(
            f"parameters: expected a dict or its JSON text, got {type(parameters).__name__}"
        )
    for key, value in (parameters or {}).items():
        if not isinstance(key, str) or not isinstance(value, bool | int | float | str):
            raise TritonModelException(
                f"parameters: {key!r} is {type(value).__name__}; a response parameter's key "
                "is a str and its value a bool, int, float or str"
            )
    return dict(parameters or {})


def _response(answer: InferResponse | Exception) -> InferenceResponse:
    """What ``exec`` returns: the answer's outputs, or an error response with the code
    the failure's status says (Triton answers so, and never raises out of ``exec``)."""
    from slipstream.runtime.python_bls import Refused, StreamFailed

    if not isinstance(answer, Exception):
        made = InferenceResponse([Tensor(name, array) for name, array in answer.outputs.items()])
        # As the called model (or the server) gave them: not checked as a model's own.
        made._parameters = dict(answer.parameters)
        return made
    plain = isinstance(answer, SlipstreamError | Refused | StreamFailed)
    message = str(answer) if plain else repr(answer)
    return InferenceResponse(error=TritonError(message, _code(answer)))


def _code(error: Exception) -> int:
    """The TritonError code of an error answer: the one its model gave it, else the one
    its status says."""
    from slipstream.runtime.python_bls import Cancelled, Refused

    given = getattr(error, TRITON_CODE_ATTRIBUTE, None)
    if isinstance(given, int):
        return given
    if isinstance(error, Cancelled):
        return TritonError.CANCELLED
    if isinstance(error, Refused):
        return TritonError.UNSUPPORTED
    if isinstance(error, NotFound):
        return TritonError.NOT_FOUND
    if isinstance(error, ClientError):
        return TritonError.INVALID_ARG
    if isinstance(error, Unavailable):
        return TritonError.UNAVAILABLE
    return TritonError.INTERNAL


class ModelConfig:
    """What a model's ``auto_complete_config(auto_complete_model_config)`` fills in: the
    tensors and batch size its config leaves out (Triton's ``pb_utils.ModelConfig``,
    which takes the config's JSON text)."""

    def __init__(self, config: dict[str, Any] | str | None = None) -> None:
        self._config: dict[str, Any] = {"input": [], "output": [], "max_batch_size": 0}
        self._config.update(json.loads(config) if isinstance(config, str) else config or {})

    def as_dict(self) -> dict[str, Any]:
        return self._config

    def set_max_batch_size(self, max_batch_size: int) -> None:
        if not isinstance(max_batch_size, int) or max_batch_size < 0:
            raise TritonModelException(
                f"set_max_batch_size: expected a whole number >= 0, got {max_batch_size!r}"
            )
        self._config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        self._config.setdefault("dynamic_batching", {})

    def add_input(self, tensor: dict[str, Any]) -> None:
        self._add("input", tensor)

    def add_output(self, tensor: dict[str, Any]) -> None:
        self._add("output", tensor)

    def set_model_transaction_policy(self, policy: dict[str, Any]) -> None:
        self._config["model_transaction_policy"] = dict(policy)

    def _add(self, kind: str, tensor: dict[str, Any]) -> None:
        missing = [key for key in ("name", "data_type", "dims") if key not in tensor]
        if missing:
            raise TritonModelException(
                f"add_{kind}: the {kind} {tensor.get('name', '')!r} has no {', '.join(missing)}"
            )
        for known in self._config[kind]:
            if known["name"] != tensor["name"]:
                continue
            # Added again (Triton merges an equal one): only a different one is an error.
            if (known["data_type"], list(known["dims"])) != (
                tensor["data_type"],
                list(tensor["dims"]),
            ):
                raise TritonModelException(
                    f"add_{kind}: {tensor['name']!r} is already there as "
                    f"{known['data_type']} {list(known['dims'])}"
                )
            known.update(tensor)
            return
        self._config[kind].append(dict(tensor))


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


def _text(value: str | bytes) -> str:
    """A name or id given as bytes (read from a BYTES tensor) as text."""
    return value.decode() if isinstance(value, bytes) else value


def is_model_ready(model_name: str | bytes, model_version: str = "") -> bool:
    """Whether a model of the server is ready (``False`` where it is unknown)."""
    from slipstream.runtime import python_bls

    name = _text(model_name)
    ready = python_bls.manage("is_model_ready", lambda core: core.model_ready(name, model_version))
    if isinstance(ready, Exception):
        if isinstance(ready, python_bls.Refused):
            raise TritonModelException(str(ready))
        return False
    return bool(ready)


def load_model(model_name: str, config: str = "", files: dict[str, bytes] | None = None) -> None:
    """Load (or reload) a model of the repository, with ``config`` (JSON) in place of
    its own; the server must run with ``--model-control-mode explicit``."""
    from slipstream.runtime import python_bls

    if files:
        raise TritonModelException(
            "load_model: files are not supported; put the model's files in the repository"
        )
    done = python_bls.manage("load_model", lambda core: core.load_model(model_name, config or None))
    if isinstance(done, Exception):
        raise TritonModelException(f"load_model {model_name!r}: {done}")


def unload_model(model_name: str, unload_dependents: bool = False) -> None:
    """Unload a model; the server must run with ``--model-control-mode explicit``."""
    from slipstream.runtime import python_bls

    done = python_bls.manage(
        "unload_model", lambda core: core.unload_model(model_name, unload_dependents)
    )
    if isinstance(done, Exception):
        raise TritonModelException(f"unload_model {model_name!r}: {done}")
