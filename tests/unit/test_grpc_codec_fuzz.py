"""Property-based fuzzing of the gRPC request decoder (raw_input_contents and typed contents).

Whatever a client puts in a ModelInferRequest (wrong lengths, truncated data, unknown
datatypes, negative or huge dimensions, BYTES elements whose 4-byte length prefixes lie,
typed contents of the wrong count or kind), decoding either yields arrays of exactly the
declared shapes or raises :class:`InvalidRequest` naming the input or field: never another
exception, which the front end would turn into an INTERNAL error.
"""

from __future__ import annotations

import contextlib
import math
import struct

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slipstream.errors import InvalidRequest
from slipstream.protocol import grpc_codec
from slipstream.protocol.proto import inference_pb2 as pb

FUZZ = settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
DATATYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32",
             "INT64", "FP16", "FP32", "FP64", "BYTES", "BF16", "fp32", "", "STRING"]  # fmt: skip
ITEM_SIZES = {"BOOL": 1, "UINT8": 1, "INT8": 1, "UINT16": 2, "INT16": 2, "FP16": 2,
              "UINT32": 4, "INT32": 4, "FP32": 4, "UINT64": 8, "INT64": 8, "FP64": 8}  # fmt: skip
DIMS = st.one_of(st.integers(-2, 4), st.sampled_from([2**31, 2**40, 2**63 - 1, -(2**63)]))
NAMES = st.text(alphabet="abcxyz_0", min_size=1, max_size=3)
# Each typed-contents field of InferTensorContents, with values it can carry.
TYPED_CONTENTS = {
    "bool_contents": st.booleans(),
    "int_contents": st.integers(-(2**31), 2**31 - 1),
    "int64_contents": st.integers(-(2**63), 2**63 - 1),
    "uint_contents": st.integers(0, 2**32 - 1),
    "uint64_contents": st.integers(0, 2**64 - 1),
    "fp32_contents": st.floats(width=32),
    "fp64_contents": st.floats(),
    "bytes_contents": st.binary(max_size=4),
}


@st.composite
def raw_contents(draw: st.DrawFn, datatype: str, shape: list[int]) -> bytes:
    """Bytes near what the shape needs (exact, short, long) or noise."""
    count = math.prod(shape) if all(d >= 0 for d in shape) else 0
    if datatype == "BYTES" and count <= 16:
        parts = []
        for _ in range(draw(st.integers(0, count + 2))):
            payload = draw(st.binary(max_size=6))
            declared = draw(st.one_of(st.just(len(payload)), st.integers(0, 2**32 - 1)))
            parts.append(struct.pack("<I", declared) + payload)
        return b"".join(parts) + draw(st.binary(max_size=3))
    size = ITEM_SIZES.get(datatype, 4) * count if count <= 64 else 0
    exact = bytes(size)
    return draw(
        st.one_of(
            st.just(exact),
            st.just(exact[: max(0, size - 1)]),
            st.just(exact + b"\x00"),
            st.binary(max_size=70),
        )
    )


@st.composite
def infer_requests(draw: st.DrawFn) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name="m")
    raw = draw(st.booleans())
    for _ in range(draw(st.integers(0, 3))):
        datatype = draw(st.sampled_from(DATATYPES))
        shape = draw(st.lists(DIMS, max_size=3))
        tensor = message.inputs.add(name=draw(NAMES), datatype=datatype, shape=shape)
        if raw:
            message.raw_input_contents.append(draw(raw_contents(datatype, shape)))
            continue
        field, values = draw(st.sampled_from(sorted(TYPED_CONTENTS.items())))
        getattr(tensor.contents, field).extend(draw(st.lists(values, max_size=10)))
    if raw and draw(st.booleans()):
        # A raw entry too many or too few.
        if message.raw_input_contents and draw(st.booleans()):
            del message.raw_input_contents[-1]
        else:
            message.raw_input_contents.append(b"\x00" * 4)
    return message


@FUZZ
@given(infer_requests())
def test_any_request_decodes_to_its_shapes_or_is_refused_naming_the_field(
    message: pb.ModelInferRequest,
) -> None:
    try:
        request = grpc_codec.decode_infer_request(message)
    except InvalidRequest as exc:
        names = [t.name for t in message.inputs]
        assert any(f"'{name}'" in exc.message for name in names) or (
            "raw_input_contents" in exc.message or "input" in exc.message
        ), exc.message
        return
    for tensor in message.inputs:
        array = request.inputs[tensor.name]
        assert isinstance(array, np.ndarray)
        assert list(array.shape) == list(tensor.shape)


@FUZZ
@given(st.binary(max_size=300))
def test_garbage_protobuf_bytes_never_escape_as_another_error(data: bytes) -> None:
    """What the wire may carry: bytes that parse as a ModelInferRequest (protobuf accepts
    much) decode or are refused; bytes that do not parse raise protobuf's DecodeError,
    which the front end answers as INVALID_ARGUMENT (tested over a live server)."""
    from google.protobuf.message import DecodeError

    try:
        message = pb.ModelInferRequest.FromString(data)
    except DecodeError:
        return
    with contextlib.suppress(InvalidRequest):
        grpc_codec.decode_infer_request(message)
