"""The engine link's framing (``engine/channel.py``): whatever sizes the messages and
however the socket cuts the byte stream, every message arrives once, whole and in order;
a large one's tensors lie over its own receive buffer, read-only, without a copy. And
the wire's cheaper reduction of arrays (``engine/wire.py``) keeps every dtype, shape,
memory order and value."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from slipstream.datatypes import BF16
from slipstream.engine.channel import LARGE_BYTES, Link
from slipstream.engine.wire import decode, encode


class _Wire:
    """What a transport's writelines would put on the socket, kept as bytes."""

    def __init__(self) -> None:
        self.data = bytearray()

    def writelines(self, parts: list[Any]) -> None:
        for part in parts:
            self.data += memoryview(part).cast("B")

    def close(self) -> None:
        pass


def _sent(batches: list[list[Any]]) -> bytes:
    """The bytes a link sends for ``batches`` (each one turn of the loop's posts)."""

    async def send() -> bytes:
        wire = _Wire()
        link = Link(lambda _, message: None, arena=False)
        link.connection_made(wire)
        for batch in batches:
            for message in batch:
                link.post(message)
            await asyncio.sleep(0)  # the turn ends: the batch is written
        return bytes(wire.data)

    return asyncio.run(send())


def _received(data: bytes, cuts: list[int]) -> list[Any]:
    """What a link delivers when ``data`` arrives in pieces ending at ``cuts``."""
    got: list[Any] = []
    link = Link(lambda _, message: got.append(message), arena=False)
    position = 0
    for end in [*sorted(set(cuts)), len(data)]:
        while position < end:  # a receive fills at most the buffer the link offers
            room = link.get_buffer(-1)
            n = min(len(room), end - position)
            room[:n] = data[position : position + n]
            link.buffer_updated(n)
            position += n
    return got


_sizes = st.sampled_from([0, 3, 511, 512, 4_000, LARGE_BYTES // 4 - 40, LARGE_BYTES // 4, 70_000])


@settings(max_examples=60, deadline=None)
@given(
    batches=st.lists(st.lists(_sizes, min_size=1, max_size=4), min_size=1, max_size=5),
    data=st.data(),
)
def test_messages_arrive_whole_and_in_order_however_the_stream_is_cut(
    batches: list[list[int]], data: st.DataObject
) -> None:
    messages = [
        [("call", index, "m", (np.full(size, index % 250, np.float32),)) for size in batch]
        for index, batch in enumerate(batches)
    ]
    wire = _sent(messages)
    cuts = data.draw(st.lists(st.integers(0, len(wire)), max_size=12))
    got = _received(wire, cuts)
    sent = [message for batch in messages for message in batch]
    assert len(got) == len(sent)
    for back, message in zip(got, sent, strict=True):
        assert back[:3] == message[:3]
        np.testing.assert_array_equal(back[3][0], message[3][0])


def test_a_large_tensor_lies_over_the_message_buffer_read_only() -> None:
    big = np.arange(LARGE_BYTES, dtype=np.float32)
    (back,) = _received(_sent([[("ok", 1, big)]]), cuts=[100, 70_000])
    array = back[2]
    np.testing.assert_array_equal(array, big)
    assert not array.flags.writeable
    # No copy: under the array's views lies the message's own receive buffer.
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base, memoryview) and isinstance(base.obj, np.ndarray)
    assert base.obj.nbytes > big.nbytes  # the whole message: prefix, header, tensor


def test_a_real_socket_carries_batches_both_ways() -> None:
    """Through a real Unix socket pair: a batch of small and large messages each way."""

    async def exchange() -> tuple[list[Any], list[Any]]:
        loop = asyncio.get_running_loop()
        left_sock, right_sock = socket.socketpair(socket.AF_UNIX)
        got_left: list[Any] = []
        got_right: list[Any] = []
        done = asyncio.Event()

        def on_right(link: Link, message: Any) -> None:
            got_right.append(message)
            link.post(("ok", message[1], message[3][0] * 2))

        def on_left(_: Link, message: Any) -> None:
            got_left.append(message)
            if len(got_left) == 20:
                done.set()

        _, left = await loop.connect_accepted_socket(lambda: Link(on_left), left_sock)
        right_transport, _ = await loop.connect_accepted_socket(lambda: Link(on_right), right_sock)
        for index in range(20):
            left.post(("call", index, "double", (np.full(index * 1_000, index, np.int64),)))
        await asyncio.wait_for(done.wait(), 10)
        left.close()
        right_transport.close()
        return got_left, got_right

    answers, calls = asyncio.run(exchange())
    assert [call[1] for call in calls] == list(range(20))
    for index, answer in enumerate(answers):
        assert answer[1] == index
        np.testing.assert_array_equal(answer[2], np.full(index * 1_000, 2 * index, np.int64))


@settings(max_examples=150, deadline=None)
@given(
    array=hnp.arrays(
        dtype=st.one_of(
            hnp.scalar_dtypes(),
            hnp.byte_string_dtypes(),
            hnp.unicode_string_dtypes(),
            hnp.array_dtypes(),  # records: numpy's own reduction
        ),
        shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=40),
    ),
    order=st.sampled_from(["C", "F", "strided"]),
)
def test_every_array_crosses_with_its_dtype_shape_and_values(array: np.ndarray, order: str) -> None:
    if order == "F":
        array = np.asfortranarray(array)
    elif order == "strided" and array.ndim:
        array = array[::2]
    back = decode([bytes(memoryview(frame).cast("B")) for frame in encode([array])])[0]
    assert back.dtype == array.dtype and back.shape == array.shape
    assert back.tobytes() == array.tobytes()  # bit for bit: NaN and NaT too


@settings(max_examples=60, deadline=None)
@given(
    bits=hnp.arrays(np.uint16, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=300)),
    order=st.sampled_from(["C", "F", "strided"]),
)
def test_bfloat16_arrays_cross_out_of_band_bit_for_bit(bits: np.ndarray, order: str) -> None:
    """ml_dtypes' bfloat16 (whose dtype.str names a void type): same dtype, shape and
    bits, NaNs included; a large one as a frame of its own, not inside the header."""
    array = bits.view(BF16)
    if order == "F":
        array = np.asfortranarray(array)
    elif order == "strided" and array.ndim:
        array = array[::2]
    frames = encode([array])
    back = decode([bytes(memoryview(frame).cast("B")) for frame in frames])[0]
    assert back.dtype == BF16 and back.shape == array.shape
    assert back.tobytes() == array.tobytes()
    assert (len(frames) == 2) == (array.nbytes >= 512)
