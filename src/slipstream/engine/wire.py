"""Messages between front-end processes and the engine process, as frames on a socket.

A message is one Python value (a request, a response, metadata, an error) pickled with
protocol 5 and its large buffers taken *out of band*: every numpy array's data travels
as a frame of its own, and the receiver rebuilds the array over the received frame's
memory, so the pickler sees only the small header. In a message over 64 KB no tensor is
copied on either side but by the kernel through the socket; a smaller message's tensors
are copied once more out of the link's receive buffer (:mod:`slipstream.engine.channel`).

    frames = encode(("call", 7, "infer", (request,)))   # [header, PickleBuffer, ...]
    value = decode([header, *(buffer.raw() for buffer in frames[1:])])

Pickle runs code from what it loads, so only processes of one server talk this way:
the sockets live in a directory only the server's user can open
(:func:`slipstream.engine.supervisor.socket_dir`).

Errors cross as (class name, message, attributes) and are rebuilt as the same
:mod:`slipstream.errors` class, so a front end answers a remote 400/404/503 exactly as
the in-process server would.
"""

from __future__ import annotations

import copyreg
import dataclasses
import io
import pickle
from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from slipstream import errors
from slipstream.datatypes import BF16
from slipstream.errors import InternalError, SlipstreamError
from slipstream.types import (
    InferRequest,
    InferResponse,
    RequestedOutput,
    SharedMemoryInput,
    SharedMemoryRef,
)

# Out-of-band buffers smaller than this are pickled inline: a frame of its own costs
# more than copying a few hundred bytes into the header.
_INLINE_BYTES = 512


def encode(value: Any) -> list[Any]:
    """``value`` as frames: the pickled header, then one frame per large buffer."""
    buffers: list[pickle.PickleBuffer] = []

    def out_of_band(buffer: pickle.PickleBuffer) -> bool:
        if buffer.raw().nbytes < _INLINE_BYTES:
            return True  # true: pickle this one in band
        buffers.append(buffer)
        return False

    header = io.BytesIO()
    pickler = pickle.Pickler(header, protocol=5, buffer_callback=out_of_band)
    pickler.dispatch_table = _REDUCERS
    pickler.dump(value)
    return [header.getbuffer(), *buffers]


def decode(frames: Sequence[Any]) -> Any:
    """The value :func:`encode` made; arrays lie over the frames' memory (read-only)."""
    return pickle.loads(frames[0], buffers=frames[1:])


# What crosses with every request, reduced more cheaply than by default: a plain numpy
# array as its buffer, dtype string and shape (numpy's own reduction pickles a dtype
# object with its state, ~1 us more each way), and the request's small dataclasses as
# their class and fields (a slotted dataclass's default reduction runs its Python-level
# __getstate__). The request's and response's own fields cross as tuples (below).
# Together: an mlp request and its answer encode and decode in ~17 us instead of ~23.


def _array(buffer: Any, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    return np.frombuffer(buffer, dtype).reshape(shape)


def _reduce_array(array: np.ndarray) -> Any:
    dtype = array.dtype
    bf16 = dtype == BF16
    if (dtype.kind in "OV" and not bf16) or dtype.metadata is not None:
        return array.__reduce_ex__(5)  # objects and records: numpy's own way
    if not array.flags.c_contiguous:
        # Strided: numpy's own reduction copies too (and loses a non-native byte order
        # doing it). Fortran-ordered arrays are copied here, not by numpy: rare here.
        array = array.copy(order="C")
    name = dtype.str
    if bf16:
        # Its dtype.str ("<V2") names a void type, and numpy's own reduction pickles
        # the data in band: its 16-bit patterns travel instead, under its name.
        data, name = array.reshape(-1).view(np.uint16), "bfloat16"
    else:
        # Datetimes export no buffer: their bytes do.
        data = array.reshape(-1).view(np.uint8) if dtype.kind in "mM" else array
    return _array, (pickle.PickleBuffer(cast(Any, data)), name, array.shape)


def _reduce_fields(obj: Any) -> tuple[type, tuple[Any, ...]]:
    cls = type(obj)
    return cls, tuple([getattr(obj, name) for name in _FIELDS[cls]])


_FIELDS = {
    cls: tuple(field.name for field in dataclasses.fields(cls))
    for cls in (RequestedOutput, SharedMemoryRef, SharedMemoryInput)
}
_REDUCERS: dict[type, Any] = {
    **copyreg.dispatch_table,
    np.ndarray: _reduce_array,
    **dict.fromkeys(_FIELDS, _reduce_fields),
}


def error_state(error: BaseException) -> tuple[str, str, dict[str, Any]]:
    """What crosses the boundary for an error: a SlipstreamError's class (the nearest
    one :mod:`slipstream.errors` defines, for subclasses declared elsewhere), message
    and attributes; anything else as an internal error (its details stay in the log
    where it was raised)."""
    if isinstance(error, SlipstreamError):
        for cls in type(error).__mro__:
            if getattr(errors, cls.__name__, None) is cls:
                return cls.__name__, error.message, dict(vars(error))
    return "InternalError", "internal error in the engine process; see the server log", {}


def rebuild_error(state: tuple[str, str, dict[str, Any]]) -> SlipstreamError:
    """The error :func:`error_state` described, as the same class."""
    name, message, attributes = state
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, SlipstreamError)):
        cls = InternalError
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    vars(error).update(attributes)
    error.message = message
    return error


# Requests and responses cross as tuples of their fields: pickling a slotted dataclass
# runs its Python-level __getstate__, which cost about 3 us of the 9 a request took.
_REQUEST_FIELDS = tuple(field.name for field in dataclasses.fields(InferRequest))
# Where a request's inputs sit among its fields (engine/groups.py swaps in stacked ones).
INPUTS_FIELD = _REQUEST_FIELDS.index("inputs")
_RESPONSE_FIELDS = tuple(field.name for field in dataclasses.fields(InferResponse))


def request_fields(request: InferRequest) -> tuple[Any, ...]:
    return tuple([getattr(request, name) for name in _REQUEST_FIELDS])


def request_from(fields: tuple[Any, ...]) -> InferRequest:
    return InferRequest(*fields)


def response_fields(response: InferResponse) -> tuple[Any, ...]:
    return tuple([getattr(response, name) for name in _RESPONSE_FIELDS])


def response_from(fields: tuple[Any, ...]) -> InferResponse:
    return InferResponse(*fields)
