"""The process boundary of the split layout (``engine/``), on real Unix sockets.

The wire format round-trips what crosses it (requests with tensors of every kind, configs,
errors as their own class); a stateful hypothesis machine drives an engine host and two front
ends' clients through calls, held calls, calls the engine gathers (several in one turn of
its loop, answered each as soon as it is done), cancels, streams and engine restarts in
any order, checking that every call ends exactly once (its answer, its error, or 503 when
the engine went away), that no call hangs, and that a cancelled call leaves nothing
running in the engine (a gathered one: once every call gathered with it is cancelled).
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from slipstream import errors
from slipstream.config import parse_model_config
from slipstream.engine.client import EngineClient, EngineGone
from slipstream.engine.host import EngineHost
from slipstream.engine.wire import decode, encode, error_state, rebuild_error
from slipstream.serving.shared_memory import RegionNotFound
from slipstream.types import (
    InferRequest,
    InferResponse,
    RequestedOutput,
    SharedMemoryInput,
    SharedMemoryRef,
)


def roundtrip(value: Any) -> Any:
    return decode([bytes(frame) for frame in encode(value)])


def test_requests_cross_with_every_kind_of_tensor() -> None:
    big = np.arange(4 * 256, dtype=np.float32).reshape(4, 256)
    request = InferRequest(
        "m", "2",
        {"big": big, "small": np.array([[1, 2]], dtype=np.int64),
         "text": np.array([b"a", b"\x00bc"], dtype=object),
         "empty": np.zeros((0, 3), dtype=np.float16),
         "strided": big[:, ::2], "scalar": np.float64(2.5) * np.ones(())},
        id="r1", outputs=[RequestedOutput("y", True, SharedMemoryRef("out", 8, 64))],
        priority=1, timeout_us=5, parameters={"k": [1, "v"]},
        shared_memory_inputs={"z": SharedMemoryInput("FP32", [1, 4], SharedMemoryRef("in", 0, 16))},
        route_key="user-7",
    )  # fmt: skip
    frames = encode(request)
    # The large array travels out of band, as its own frame of its raw bytes.
    assert any(memoryview(frame).nbytes == big.nbytes for frame in frames[1:])
    back = roundtrip(request)
    assert (back.model_name, back.model_version) == ("m", "2")
    assert (back.id, back.route_key) == ("r1", "user-7")
    assert back.outputs == request.outputs and back.parameters == request.parameters
    assert back.shared_memory_inputs == request.shared_memory_inputs
    for name, array in request.inputs.items():
        assert back.inputs[name].dtype == array.dtype and back.inputs[name].shape == array.shape
        np.testing.assert_array_equal(back.inputs[name], array)


def test_responses_and_configs_cross() -> None:
    response = InferResponse("m", "1", {"y": np.ones((2, 300), np.float32)}, id="7",
                             in_shared_memory=frozenset({"z"}))  # fmt: skip
    back = roundtrip(response)
    np.testing.assert_array_equal(back.outputs["y"], response.outputs["y"])
    assert back.in_shared_memory == {"z"}
    config = parse_model_config(
        {"max_batch_size": 8, "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}],
         "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [4]}]}, "m",
    )  # fmt: skip
    assert roundtrip(config) == config


@pytest.mark.parametrize(
    ("error", "cls", "status"),
    [
        (errors.Unavailable("queue full", retry_after_s=3), errors.Unavailable, 503),
        (errors.MethodNotAllowed("GET only", ["GET"]), errors.MethodNotAllowed, 405),
        # A subclass declared outside errors.py crosses as its nearest errors.py class.
        (RegionNotFound("region 'r' is not registered"), errors.ModelNotFound, 404),
        (errors.RequestTimeout("waited too long"), errors.RequestTimeout, 503),
    ],
)
def test_errors_cross_as_their_class_with_their_attributes(
    error: errors.SlipstreamError, cls: type[errors.SlipstreamError], status: int
) -> None:
    back = rebuild_error(roundtrip(error_state(error)))
    assert type(back) is cls and back.http_status == status and back.message == error.message
    for name, value in vars(error).items():
        assert getattr(back, name) == value


def test_an_internal_fault_crosses_without_its_details() -> None:
    back = rebuild_error(error_state(KeyError("secret path /etc/x")))
    assert isinstance(back, errors.InternalError) and "secret" not in back.message


# -- the boundary under any sequence of calls, cancels and restarts -------------------------


class _Engine:
    """What the test engine serves: echo (optionally held until released), fail, count."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.running = 0

    async def echo(self, value: int, hold: bool) -> int:
        self.running += 1
        try:
            if hold:
                await self.release.wait()
            return value
        finally:
            self.running -= 1

    async def fail(self, name: str) -> None:
        raise getattr(errors, name)(f"failed as {name}")

    async def gecho(self, calls: list[tuple[Any, ...]], reply: Any) -> None:
        """Gathered echo calls: each answered as soon as its own echo is done."""

        async def one(index: int, value: int, hold: bool) -> None:
            reply(index, True, await self.echo(value, hold))

        await asyncio.gather(*(one(index, *args) for index, args in enumerate(calls)))

    async def count(self, n: int) -> AsyncIterator[int]:
        for i in range(n):
            await asyncio.sleep(0)
            yield i


class BoundaryMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.directory = Path(tempfile.mkdtemp(prefix="slipstream-test-"))
        self.address = str(self.directory / "engine")
        self.engine = _Engine()
        self.host = self._host()
        self.client = EngineClient(self.address)
        self.other = EngineClient(self.address)  # a second front end
        self.run(self._connect())
        # Calls in flight: task -> the value it echoes.
        self.calls: dict[asyncio.Task[int], int] = {}
        # Held calls the engine gathered, per gathering: those still waited for, and how
        # many held echoes it runs (they run while any call of it is waited for).
        self.gatherings: list[tuple[dict[asyncio.Task[int], int], int]] = []

    def run(self, coroutine: Any, timeout_s: float = 10.0) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coroutine, timeout_s))

    def _host(self) -> EngineHost:
        engine = self.engine
        host = EngineHost(
            self.address,
            {"echo": engine.echo, "fail": engine.fail, "gecho": engine.echo},
            streams={"count": engine.count},
            gathered={"gecho": engine.gecho},
        )
        self.loop.run_until_complete(host.start())
        return host

    async def _connect(self) -> None:
        for client in (self.client, self.other):
            client.start()
            assert await client.wait_connected(10)

    def _held(self) -> dict[asyncio.Task[int], int]:
        """Every call waited for that the engine holds: plain and gathered."""
        held = dict(self.calls)
        for live, _ in self.gatherings:
            held.update(live)
        return held

    async def _settle(self) -> None:
        for _ in range(20):
            await asyncio.sleep(0.001)

    @rule(value=st.integers(0, 10**6), hold=st.booleans())
    def call(self, value: int, hold: bool) -> None:
        async def start() -> asyncio.Task[int]:
            task = asyncio.create_task(self.client.call("echo", value, hold))
            await self._settle()
            return task

        task = self.run(start())
        if hold:
            self.calls[task] = value
        else:
            assert task.done() or self.run(asyncio.shield(task)) == value
            if task.done():
                assert task.result() == value

    @rule(
        sent=st.lists(st.tuples(st.integers(0, 10**6), st.booleans()), min_size=1, max_size=4),
        two_front_ends=st.booleans(),
    )
    def gathered_calls(self, sent: list[tuple[int, bool]], two_front_ends: bool) -> None:
        """Calls sent in one turn, gathered by the engine when several: those not held
        are answered at once, whatever their gathered neighbours wait for."""
        clients = [self.client, self.other] if two_front_ends else [self.client]

        async def start() -> list[asyncio.Task[int]]:
            tasks = [
                asyncio.create_task(clients[i % len(clients)].call("gecho", value, hold))
                for i, (value, hold) in enumerate(sent)
            ]
            await self._settle()
            return tasks

        tasks = self.run(start())
        live = {}
        for task, (value, hold) in zip(tasks, sent, strict=True):
            if hold:
                live[task] = value
            else:
                assert task.done() and task.result() == value
        if len(sent) == 1:
            self.calls.update(live)  # a lone call runs as any call
        elif live:
            self.gatherings.append((live, len(live)))

    @precondition(lambda self: bool(self._held()))
    @rule()
    def release_held_calls(self) -> None:
        self.engine.release.set()
        held = self._held()
        results = self.run(self._gather(list(held)))
        assert results == list(held.values())
        self.calls.clear()
        self.gatherings.clear()
        self.engine.release = asyncio.Event()

    @precondition(lambda self: bool(self._held()))
    @rule(data=st.data())
    def cancel_one(self, data: st.DataObject) -> None:
        task = data.draw(st.sampled_from(sorted(self._held(), key=id)))
        task.cancel()
        self.run(self._settle())
        assert task.cancelled()
        self.calls.pop(task, None)
        for live, _ in self.gatherings:
            live.pop(task, None)
        self.gatherings = [(live, held) for live, held in self.gatherings if live]

    @rule(name=st.sampled_from(["InvalidRequest", "ModelNotFound", "Unavailable"]))
    def failing_call(self, name: str) -> None:
        with pytest.raises(getattr(errors, name)) as info:
            self.run(self.client.call("fail", name))
        assert info.value.message == f"failed as {name}"

    @rule(n=st.integers(0, 5), stop_after=st.integers(0, 6))
    def stream(self, n: int, stop_after: int) -> None:
        async def read() -> list[int]:
            seen = []
            items = self.client.stream("count", n)
            async for item in items:
                seen.append(item)
                if len(seen) == stop_after:
                    await items.aclose()  # type: ignore[attr-defined]
                    break
            return seen

        assert self.run(read()) == list(range(min(n, stop_after) if stop_after else n))

    @rule()
    def restart_engine(self) -> None:
        """The engine goes away: every call in flight fails with 503 at once; new calls
        are refused until the new engine is connected, then served."""
        self.run(self.host.close())
        for task in self._held():
            with pytest.raises(EngineGone) as info:
                self.run(task)
            assert info.value.http_status == 503 and info.value.retry_after_s == 1
        self.calls.clear()
        self.gatherings.clear()
        self.engine.release = asyncio.Event()
        self.run(self._wait_disconnected())
        with pytest.raises(EngineGone):
            self.run(self.client.call("echo", 1, False))
        self.host = self._host()
        for client in (self.client, self.other):
            assert self.run(client.wait_connected(10))
        assert self.run(self.client.call("echo", 5, False)) == 5

    async def _gather(self, tasks: list[asyncio.Task[int]]) -> list[int]:
        return list(await asyncio.gather(*tasks))

    async def _finish_calls(self) -> None:
        await asyncio.gather(*self._held(), return_exceptions=True)

    async def _wait_disconnected(self) -> None:
        while self.client.connected:
            await asyncio.sleep(0.005)

    @invariant()
    def nothing_runs_in_the_engine_but_held_calls(self) -> None:
        self.run(self._settle())
        gathered = sum(held for _, held in self.gatherings)
        assert self.engine.running == len(self.calls) + gathered
        assert len(self.host._tasks) == len(self.calls)
        assert len(self.host._gathering) == sum(len(live) for live, _ in self.gatherings)

    def teardown(self) -> None:
        self.engine.release.set()
        self.run(self._finish_calls())
        self.run(self.client.close())
        self.run(self.other.close())
        self.run(self.host.close())
        self.loop.close()
        shutil.rmtree(self.directory, ignore_errors=True)


TestBoundary = BoundaryMachine.TestCase
TestBoundary.settings = settings(max_examples=10, stateful_step_count=10, deadline=None)
