"""A Python model calling other models (Triton's "business logic scripting", BLS).

Inside ``execute`` a model builds ``pb_utils.InferenceRequest(model_name=...,
inputs=[...], requested_output_names=[...])`` and calls ``exec()`` (or awaits
``async_exec()`` from an ``async def execute``). The request goes through the server's
own inference call, as a client's would: the target's version routing, batcher,
response cache and statistics. The answer is an ``InferenceResponse``; a refusal or a
failure is one with ``error()`` set (its code from the status: ``python_utils`` makes
both), as Triton answers, never an exception out of ``exec``.

The model's instance thread waits for the answer while the server's event loop goes on,
so the called model runs as usual. A model calling itself would wait for its own
instance: refused. :func:`bound` ties the calling thread to its server for the length
of one ``execute``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from slipstream.types import InferRequest, InferResponse, RequestedOutput

if TYPE_CHECKING:
    from slipstream.runtime.base import LocalInfer


class InferenceRequest(Protocol):
    """What is read of ``python_utils.InferenceRequest`` (which imports this module)."""

    def model_name(self) -> str: ...
    def model_version(self) -> int: ...
    def inputs(self) -> list[Any]: ...
    def request_id(self) -> str: ...
    def requested_output_names(self) -> list[str]: ...
    def timeout(self) -> int: ...
    def parameters(self) -> str: ...


@dataclass(frozen=True, slots=True)
class _Server:
    infer: LocalInfer
    loop: asyncio.AbstractEventLoop
    # The calling model, which may not call itself.
    model: str


_current = threading.local()


@contextmanager
def bound(
    infer: LocalInfer | None, loop: asyncio.AbstractEventLoop | None, model: str
) -> Iterator[None]:
    """Within: this thread's ``exec`` calls go to ``infer`` on ``loop``."""
    previous = getattr(_current, "server", None)
    _current.server = (
        _Server(infer, loop, model) if infer is not None and loop is not None else None
    )
    try:
        yield
    finally:
        _current.server = previous


# How often a waiting exec() checks that the server's loop still runs.
_POLL_S = 0.5
_STOPPED = "exec(): the server is shutting down"


class Refused(Exception):
    """A call this module will not make (outside execute, a model calling itself)."""


def call(request: InferenceRequest) -> InferResponse | Exception:
    """``request.exec()``: wait on this thread for the server's answer, or what refused
    or failed the call."""
    server = _server(request)
    if isinstance(server, Refused):
        return server
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is server.loop:
        return Refused("exec() cannot wait on the server's event loop; call it from execute")
    try:
        future = asyncio.run_coroutine_threadsafe(_answer(server, request), server.loop)
    except RuntimeError:  # the loop is closed
        return Refused(_STOPPED)
    while True:
        try:
            return future.result(timeout=_POLL_S)
        except concurrent.futures.TimeoutError:
            # A loop that stopped (the server shutting down) will never answer: the
            # instance thread must not wait forever, or the process could not exit.
            if server.loop.is_closed() or not server.loop.is_running():
                future.cancel()
                return Refused(_STOPPED)


async def call_async(request: InferenceRequest) -> InferResponse | Exception:
    """``await request.async_exec()`` from a model's ``async def execute``."""
    server = _server(request)
    if isinstance(server, Refused):
        return server
    future = asyncio.run_coroutine_threadsafe(_answer(server, request), server.loop)
    return await asyncio.wrap_future(future)


def _server(request: InferenceRequest) -> _Server | Refused:
    server: _Server | None = getattr(_current, "server", None)
    if server is None:
        return Refused(
            "exec() runs another model of the server, so it works inside execute only "
            "(not in initialize, finalize or another thread)"
        )
    if not request.model_name():
        return Refused("exec(): the InferenceRequest names no model_name")
    if request.model_name() == server.model:
        return Refused(
            f"model {server.model!r} cannot exec() itself: the call would wait for the "
            "instance that makes it"
        )
    return server


async def _answer(server: _Server, request: InferenceRequest) -> InferResponse | Exception:
    try:
        return await server.infer(_to_v2(request))
    except Exception as exc:  # a refusal or the server's own fault: an error response
        return exc


def _to_v2(request: InferenceRequest) -> InferRequest:
    parameters = request.parameters()
    version = request.model_version()
    return InferRequest(
        model_name=request.model_name(),
        model_version=str(version) if version >= 0 else "",
        inputs={tensor.name(): tensor.as_numpy() for tensor in request.inputs()},
        id=request.request_id(),
        outputs=[RequestedOutput(name) for name in request.requested_output_names()] or None,
        timeout_us=request.timeout(),
        parameters=json.loads(parameters) if parameters else {},
    )
