"""Runtime errors caused by a request's data, told apart from faults of the server.

A model refuses some inputs only when it runs them: a token id past the end of an
embedding table, a tensor whose size a Reshape inside the graph cannot take. The
request was well-formed as far as the model's config could tell, so only the runtime
knows; its message is what the client needs to fix the request. Those errors are
answered 400 with the runtime's message, as Triton answers them; anything else a
runtime raises stays an internal fault (500, details in the server log only).

The batcher reruns the requests of a failed batch one at a time, so a request with bad
data fails alone and its batch mates are answered (``scheduling/batcher.py``).
"""

from __future__ import annotations

import re

from slipstream.errors import InvalidRequest

try:  # onnxruntime is a core dependency, but keep this module importable without it
    from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument
except ImportError:  # pragma: no cover
    ORT_DATA_ERRORS: tuple[type[Exception], ...] = ()
else:
    # ORT's INVALID_ARGUMENT status: inputs a kernel refused (indices out of bounds,
    # shapes a node cannot take). FAIL and RUNTIME_EXCEPTION stay internal: they are
    # also how ORT reports its own faults (allocation failures, broken kernels).
    ORT_DATA_ERRORS = (InvalidArgument,)

# ORT prefixes every message with its status: "[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : ".
_ORT_PREFIX = re.compile(r"^\[ONNXRuntimeError\] : \d+ : [A-Z_]+ : ")

# What torch says when an op is handed data it cannot take. Matched against the last
# line of the message (TorchScript puts its interpreter's traceback before it).
_TORCH_DATA_MESSAGES = re.compile(
    r"index out of range"  # embedding / index_select / gather past the table
    r"|out of bounds"  # index_select, take, scatter
    r"|is invalid for input of size"  # reshape / view of a tensor of another size
    r"|cannot be multiplied"  # matmul of mismatched inner dims
    r"|must match the size of tensor"  # broadcasting two mismatched dims
)


def refused(message: str) -> InvalidRequest:
    """The 400 a client gets for data the model refused while running."""
    return InvalidRequest(f"the model refused the request's data: {message}")


def ort_message(exc: BaseException) -> str:
    """ONNX Runtime's message without its status prefix."""
    return _ORT_PREFIX.sub("", str(exc).strip())


def torch_data_error(exc: BaseException) -> InvalidRequest | None:
    """The 400 for a torch error caused by the request's data, else None (a fault).

    Eager and exported programs raise IndexError for an index past a table; TorchScript
    raises RuntimeError whose last line is the original error. Only the last line goes
    to the client: the lines before it are the interpreter's traceback, with paths.
    """
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    last = lines[-1].strip() if lines else type(exc).__name__
    if isinstance(exc, IndexError) or (
        isinstance(exc, RuntimeError) and _TORCH_DATA_MESSAGES.search(last)
    ):
        return refused(last)
    return None
