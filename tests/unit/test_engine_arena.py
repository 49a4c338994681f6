"""Large tensors between a front end and the engine through shared memory
(``engine/arena.py`` and the link's use of it in ``engine/channel.py``): the allocator
never hands out a byte twice, a place comes back only once no array uses it (whichever
thread drops the last one), a full or missing arena falls back to the socket, and a
place outside the arena is refused."""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from slipstream.engine import arena as arenas
from slipstream.engine.arena import Blocks, IncomingArena, OutgoingArena
from slipstream.engine.channel import Link
from slipstream.engine.wire import decode, encode


class BlocksMachine(RuleBasedStateMachine):
    """Takes and gives back in any order: taken places never overlap nor leave the
    arena, and all of it is free (as one block) once everything is given back."""

    SIZE = 64 * 1024

    def __init__(self) -> None:
        super().__init__()
        self.blocks = Blocks(self.SIZE)
        self.taken: dict[int, int] = {}

    @rule(nbytes=st.integers(1, 20_000))
    def take(self, nbytes: int) -> None:
        offset = self.blocks.take(nbytes)
        if offset is None:
            # Refused only when no free block is large enough.
            need = -(-nbytes // 64) * 64
            assert self.blocks.free_bytes < need or len(self.taken) > 0
            return
        assert offset % 64 == 0 and offset + nbytes <= self.SIZE
        for other, size in self.taken.items():
            assert offset + nbytes <= other or other + size <= offset
        self.taken[offset] = nbytes

    @precondition(lambda self: self.taken)
    @rule(data=st.data())
    def give(self, data: st.DataObject) -> None:
        offset = data.draw(st.sampled_from(sorted(self.taken)))
        self.blocks.give(offset, self.taken.pop(offset))

    @invariant()
    def accounted(self) -> None:
        used = sum(-(-n // 64) * 64 for n in self.taken.values())
        assert self.blocks.free_bytes + used == self.SIZE

    def teardown(self) -> None:
        for offset, nbytes in self.taken.items():
            self.blocks.give(offset, nbytes)
        assert self.blocks.take(self.SIZE) == 0  # merged back into one block


TestBlocks = BlocksMachine.TestCase
TestBlocks.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_giving_a_place_twice_is_refused() -> None:
    blocks = Blocks(4096)
    offset = blocks.take(100)
    assert offset is not None
    blocks.give(offset, 100)
    with pytest.raises(ValueError, match="overlaps"):
        blocks.give(offset, 100)


def test_a_place_comes_back_only_when_no_array_uses_it() -> None:
    outgoing = OutgoingArena.create(1024 * 1024)
    freed: list[tuple[int, int]] = []
    incoming = IncomingArena.open(outgoing.path, outgoing.size, lambda *p: freed.append(p))
    outgoing.opened()
    tensor = np.arange(50_000, dtype=np.float32)
    place = outgoing.place(memoryview(tensor).cast("B"))
    assert place is not None
    # As the wire rebuilds it: pickle's out-of-band buffer, then frombuffer and reshape.
    header, *_ = encode(tensor)
    array = decode([header, incoming.view(*place)])
    np.testing.assert_array_equal(array, tensor)
    assert not array.flags.writeable  # the sender's memory: read-only here
    derived = [array[::2], array.reshape(100, 500).T, memoryview(array)]
    del array
    gc.collect()
    assert freed == []  # views of it still read the place
    derived.clear()
    assert freed == [place]
    outgoing.release(*place)
    assert outgoing.free_bytes == outgoing.size
    with pytest.raises(ValueError, match="outside"):
        incoming.view(outgoing.size - 8, 16)
    outgoing.close()


def test_only_a_link_arena_is_opened() -> None:
    with pytest.raises(ValueError, match="not a link arena"):
        IncomingArena.open("/etc/passwd", 100, lambda *p: None)


async def _pair(
    on_left: Callable[[Link, Any], None], on_right: Callable[[Link, Any], None]
) -> tuple[Link, Link, list[Any]]:
    """Two links over a real Unix socket pair, once both arenas are set up (or not)."""
    loop = asyncio.get_running_loop()
    left_sock, right_sock = socket.socketpair(socket.AF_UNIX)
    t1, left = await loop.connect_accepted_socket(lambda: Link(on_left), left_sock)
    t2, right = await loop.connect_accepted_socket(lambda: Link(on_right), right_sock)
    for _ in range(100):  # the handshake: a few turns of the loop
        await asyncio.sleep(0.001)
    return left, right, [t1, t2]


async def _until(ready: Callable[[], bool]) -> None:
    """Up to 100 ms of the loop's turns, until ``ready()``."""
    for _ in range(100):
        if ready():
            return
        await asyncio.sleep(0.001)


def test_large_tensors_cross_in_shared_memory_and_their_places_come_back() -> None:
    """An echo: each large tensor goes into the sender's arena, the receiver's answer
    into its own; a place is in use while the receiver holds the array, and given back
    (by a free message) once the receiver drops it, even from another thread."""

    async def run() -> None:
        held: list[Any] = []
        got: list[Any] = []
        done = asyncio.Event()

        def on_right(link: Link, message: Any) -> None:
            held.append(message[1])  # the engine still holds the input
            link.post(("ok", message[1] * 2))

        def on_left(_: Link, message: Any) -> None:
            got.append(message[1])
            if len(got) == 3:
                done.set()

        left, right, transports = await _pair(on_left, on_right)
        assert left._outgoing_ready and right._outgoing_ready
        tensors = [np.full(100_000, index, np.float32) for index in range(3)]
        for tensor in tensors:
            left.post(("call", tensor))
        await asyncio.wait_for(done.wait(), 10)
        for index in range(3):
            np.testing.assert_array_equal(got[index], tensors[index] * 2)
        assert left._outgoing is not None and right._outgoing is not None
        full = left._outgoing.size
        # The right side holds three inputs: three places of the left's arena in use.
        assert left._outgoing.free_bytes == full - 3 * 400_000
        # The answers are held by the test: the right's places are in use too.
        assert right._outgoing.free_bytes == full - 3 * 400_000
        # Dropped in another thread (an engine's instance thread, say).
        dropper = threading.Thread(target=held.clear)
        dropper.start()
        dropper.join()
        got.clear()
        await _until(lambda: left._outgoing.free_bytes == right._outgoing.free_bytes == full)
        assert left._outgoing.free_bytes == full and right._outgoing.free_bytes == full
        for transport in transports:
            transport.close()

    asyncio.run(run())


def test_a_full_arena_sends_through_the_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    """Frames larger than what the arena has free go through the socket, and arrive."""
    monkeypatch.setattr(arenas, "ARENA_BYTES", 512 * 1024)

    async def run() -> None:
        got: list[Any] = []
        done = asyncio.Event()

        def on_right(_: Link, message: Any) -> None:
            got.append(message)
            if len(got) == 3:
                done.set()

        left, _, transports = await _pair(lambda *_: None, on_right)
        tensors = [np.full(50_000, 1, np.float32), np.full(100_000, 2, np.float32),
                   np.full(30_000, 3, np.float32)]  # fmt: skip
        for tensor in tensors:  # 200 KB into the arena; 400 KB cannot: the socket; 120 KB can
            left.post(("call", tensor))
        await asyncio.wait_for(done.wait(), 10)
        for tensor, message in zip(tensors, got, strict=True):
            np.testing.assert_array_equal(message[1], tensor)
        assert left._outgoing is not None
        # The first and the last are in the arena (held in ``got``); the second is not.
        assert left._outgoing.free_bytes == 512 * 1024 - 200_000 - 120_000
        for transport in transports:
            transport.close()

    asyncio.run(run())


def test_a_place_outside_the_arena_drops_that_message_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def run() -> list[Any]:
        got: list[Any] = []
        left, right, transports = await _pair(lambda *_: None, lambda _, m: got.append(m))
        assert right._incoming is not None
        size = right._incoming.size
        outgoing = left._outgoing
        assert outgoing is not None

        real_place = outgoing.place

        def wrong_place(data: memoryview) -> tuple[int, int] | None:
            real_place(data)
            return size - 16, data.nbytes  # past the end of the arena

        outgoing.place = wrong_place  # type: ignore[method-assign]
        left.post(("call", np.zeros(100_000, np.float32)))
        await asyncio.sleep(0.05)
        outgoing.place = real_place  # type: ignore[method-assign]
        left.post(("call", np.ones(100_000, np.float32)))
        await _until(lambda: bool(got))
        for transport in transports:
            transport.close()
        return got

    with caplog.at_level(logging.ERROR, logger="slipstream.engine.channel"):
        got = asyncio.run(run())
    assert len(got) == 1 and float(got[0][1][0]) == 1.0
    assert "an undecodable message; dropped" in caplog.text


def test_without_shared_memory_the_link_uses_its_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    def cannot(size: int) -> OutgoingArena:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(OutgoingArena, "create", staticmethod(cannot))

    async def run() -> list[Any]:
        got: list[Any] = []
        left, right, transports = await _pair(lambda *_: None, lambda _, m: got.append(m))
        assert not left._outgoing_ready and right._incoming is None
        left.post(("call", np.full(100_000, 7, np.float32)))
        await _until(lambda: bool(got))
        for transport in transports:
            transport.close()
        return got

    got = asyncio.run(run())
    np.testing.assert_array_equal(got[0][1], np.full(100_000, 7, np.float32))
