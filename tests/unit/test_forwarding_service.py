"""ForwardingService, the base of the services wrapping the serving core for the front
ends (the generative models on the V2 routes, request tracing): every method of the
InferenceService contract must reach the inner service. A method added to the contract
and not forwarded (which would answer with the contract's default, not the core's)
fails here; so does one that drops an argument on the way."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

from slipstream.serving.forwarding import ForwardingService
from slipstream.serving.service import InferenceService


def _contract() -> list[str]:
    return [name for name, _ in inspect.getmembers(InferenceService, inspect.isfunction)
            if not name.startswith("_")]  # fmt: skip


def test_every_method_of_the_contract_is_forwarded() -> None:
    missing = [name for name in _contract() if name not in vars(ForwardingService)]
    assert not missing, f"ForwardingService does not forward {missing}"


def test_each_call_reaches_the_inner_service_with_its_arguments() -> None:
    calls: list[tuple[str, tuple[Any, ...]]] = []

    class Recorder:
        def __getattr__(self, name: str) -> Any:
            if inspect.isasyncgenfunction(getattr(InferenceService, name)):

                async def stream(*args: Any) -> Any:
                    calls.append((name, args))
                    yield "item"

                return stream
            if inspect.iscoroutinefunction(getattr(InferenceService, name)):

                async def call(*args: Any) -> Any:
                    calls.append((name, args))
                    return name

                return call
            return lambda *args: calls.append((name, args)) or name

    service = ForwardingService(Recorder())  # type: ignore[arg-type]
    for name in _contract():
        method = getattr(service, name)
        arity = len(inspect.signature(getattr(InferenceService, name)).parameters) - 1
        args = tuple(f"arg{index}" for index in range(arity))
        if inspect.isasyncgenfunction(getattr(InferenceService, name)):

            async def drain(method: Any = method, args: tuple[Any, ...] = args) -> list[Any]:
                return [item async for item in method(*args)]

            assert asyncio.run(drain()) == ["item"]
        elif inspect.iscoroutinefunction(getattr(InferenceService, name)):
            result = asyncio.run(method(*args))
            # What the inner service answered, but where the contract answers nothing.
            returns = inspect.signature(getattr(InferenceService, name)).return_annotation
            assert result == (None if returns == "None" else name), name
        else:
            assert method(*args) == name
        assert calls[-1] == (name, args), name
