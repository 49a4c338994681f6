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
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument
except ImportError:  # pragma: no cover
    ORT_ERRORS: tuple[type[Exception], ...] = ()
else:
    # ORT's INVALID_ARGUMENT status: inputs a kernel refused (indices out of bounds, an
    # Expand to a shape that cannot be). Its FAIL status is also how ORT reports its own
    # faults (allocation failures, broken kernels): only the shape checks below count.
    ORT_ERRORS = (InvalidArgument, Fail)

# ORT prefixes every message with its status: "[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : ".
_ORT_PREFIX = re.compile(r"^\[ONNXRuntimeError\] : \d+ : ([A-Z_]+) : ")
# A kernel's refusal: "Non-zero status code returned while running Add node.
# Name:'/encoder/Add_1' Status Message: <source file>:<line> <function> [<check> was
# false.] <what>".
_ORT_NODE = re.compile(
    r"^Non-zero status code returned while running (\w+) node\. Name:'([^']*)' "
    r"Status Message: (?:\S+\.(?:h|cc|cpp):\d+ (?:.*? was false\. |\w+ ))?(.*)$",
    re.DOTALL,
)
# FAIL messages of kernels whose input shapes do not fit together: a request whose
# tensors share a dimension in the model's eyes but not in its data, a sequence longer
# than a position table, an empty sequence a Reshape cannot take.
_ORT_SHAPE_FAILS = re.compile(
    r"Attempting to broadcast an axis"  # Add, Mul, Where...: mismatched dims
    r"|Can broadcast 0 by 0 or 1"  # the same, one of them empty
    r"|cannot be reshaped to the requested shape"  # Reshape
    r"|dimension mismatch"  # MatMul
    r"|mismatched dimensions"  # Concat
)
# FAIL messages of ORT's own checks when a kernel computes an output shape from the
# request's data (ConstantOfShape, Expand, Tile, Range...): in plain words, for the client.
_ORT_DATA_SHAPES = {
    "shape.Size() must be >= 0": "a shape computed from the request's data has a negative dim",
    "Integer overflow": "a shape computed from the request's data is too large",
}

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


def ort_data_error(exc: BaseException) -> InvalidRequest | None:
    """The 400 for an ONNX Runtime error caused by the request's data, else None (a fault).

    The client gets the kernel's own words and the node that said them, without ORT's
    status prefix or the source file and C++ function it came from.
    """
    message = str(exc).strip()
    status = _ORT_PREFIX.match(message)
    text = message[status.end() :] if status else message
    kernel = _ORT_NODE.match(text)
    if kernel is not None:
        op, node, what = kernel.groups()
        text = f"{op} node {node!r}: {what.strip()}" if node else f"{op} node: {what.strip()}"
    if status is not None and status[1] == "INVALID_ARGUMENT":
        return refused(text)
    if status is not None and status[1] == "FAIL" and kernel and _ORT_SHAPE_FAILS.search(text):
        return refused(text)
    if status is not None and status[1] == "FAIL" and kernel is not None:
        op, node = kernel.group(1), kernel.group(2)
        for phrase, words in _ORT_DATA_SHAPES.items():
            if phrase in kernel.group(3):
                return refused(f"{op} node {node!r}: {words}" if node else f"{op} node: {words}")
    return None


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
