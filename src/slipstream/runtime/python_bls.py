"""A Python model calling other models (Triton's "business logic scripting", BLS).

Inside ``execute`` a model builds ``pb_utils.InferenceRequest(model_name=...,
inputs=[...], requested_output_names=[...])`` and calls ``exec()`` (or awaits
``async_exec()`` from an ``async def execute``). The request goes through the server's
own inference call, as a client's would: the target's version routing, batcher,
response cache and statistics. The answer is an ``InferenceResponse``; a refusal or a
failure is one with ``error()`` set (its code from the status: ``python_utils`` makes
both), as Triton answers, never an exception out of ``exec``.

``exec(decoupled=True)`` reads a decoupled model's answers as they come (:class:`Stream`,
through the serving core's ``infer_stream``); the model-loading calls
(``pb_utils.is_model_ready``, ``load_model``, ``unload_model``) go to the same core
(:func:`manage`).

The model's instance thread waits for the answer while the server's event loop goes on,
so the called model runs as usual. A model calling itself would wait for its own
instance: refused. :func:`bound` ties the calling thread to its server for the length
of one ``initialize`` or ``execute``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import queue
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from slipstream.errors import Decoupled, InvalidRequest
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
    def correlation_id(self) -> int | str: ...
    def flags(self) -> int: ...


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


# TRITONSERVER_REQUEST_FLAG_SEQUENCE_START / _END (python_utils, which imports this).
_SEQUENCE_START, _SEQUENCE_END = 1, 2

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
    if _on_loop(server):
        return Refused("exec() cannot wait on the server's event loop; call it from execute")
    answer: InferResponse | Exception = _wait_on(server.loop, _answer(server, request))
    return answer


def _wait_on(loop: asyncio.AbstractEventLoop, work: Coroutine[Any, Any, Any]) -> Any:
    """``work`` run on the server's ``loop``, waited for on this thread: its result, or
    the exception it raised, or :class:`Refused` where the loop stops first (the server
    shutting down never answers: the instance thread must not wait forever, or the
    process could not exit)."""
    try:
        future = asyncio.run_coroutine_threadsafe(work, loop)
    except RuntimeError:  # the loop is closed
        work.close()
        return Refused(_STOPPED)
    while True:
        try:
            return future.result(timeout=_POLL_S)
        except concurrent.futures.TimeoutError:
            if loop.is_closed() or not loop.is_running():
                future.cancel()
                return Refused(_STOPPED)
        except Exception as exc:
            return exc


async def call_async(request: InferenceRequest) -> InferResponse | Exception:
    """``await request.async_exec()`` from a model's ``async def execute``."""
    server = _server(request)
    if isinstance(server, Refused):
        return server
    future = asyncio.run_coroutine_threadsafe(_answer(server, request), server.loop)
    return await asyncio.wrap_future(future)


def _on_loop(server: _Server) -> bool:
    """Whether this thread runs the server's loop (where waiting would stop it)."""
    try:
        return asyncio.get_running_loop() is server.loop
    except RuntimeError:
        return False


def _server(request: InferenceRequest) -> _Server | Refused:
    server: _Server | None = getattr(_current, "server", None)
    if server is None:
        return Refused(
            "exec() runs another model of the server, so it works inside initialize and "
            "execute only (not in finalize or another thread)"
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
    except Decoupled:
        return InvalidRequest(
            f"exec(): model {request.model_name()!r} is decoupled (it may answer any number "
            "of times); call exec(decoupled=True) and iterate its responses"
        )
    except Exception as exc:  # a refusal or the server's own fault: an error response
        return exc


def _to_v2(request: InferenceRequest) -> InferRequest:
    parameters = json.loads(request.parameters() or "{}")
    # A stateful model's request (Triton's correlation_id and flags): its sequence, as
    # a client's request names it.
    if request.correlation_id():
        parameters["sequence_id"] = request.correlation_id()
        parameters["sequence_start"] = bool(request.flags() & _SEQUENCE_START)
        parameters["sequence_end"] = bool(request.flags() & _SEQUENCE_END)
    version = request.model_version()
    return InferRequest(
        model_name=request.model_name(),
        model_version=str(version) if version >= 0 else "",
        inputs={tensor.name(): tensor.as_numpy() for tensor in request.inputs()},
        id=request.request_id(),
        outputs=[RequestedOutput(name) for name in request.requested_output_names()] or None,
        timeout_us=request.timeout(),
        parameters=parameters,
    )


class Cancelled(Refused):
    """A decoupled call the calling model cancelled (``ResponseIterator.cancel``)."""


class StreamFailed(Exception):
    """An error answer of a decoupled model read through :class:`Stream`."""


# One answer of a Stream: the response (None: a final flag alone), the error sent
# instead, and whether it is the last.
StreamItem = tuple[InferResponse | None, Exception | None, bool]


class Stream:
    """``request.exec(decoupled=True)``: a model's answers as they come, read on the
    model's thread (:meth:`next`) while the server's loop makes them. A model that is
    not decoupled answers once, final."""

    def __init__(self, server: _Server, request: InferenceRequest) -> None:
        self._loop = server.loop
        self._items: queue.Queue[StreamItem] = queue.Queue()
        self._done = False
        self._future = asyncio.run_coroutine_threadsafe(
            self._read(server, _to_v2(request)), server.loop
        )

    async def _read(self, server: _Server, request: InferRequest) -> None:
        answers: Callable[[InferRequest], AsyncIterator[Any]] | None = getattr(
            getattr(server.infer, "__self__", None), "infer_stream", None
        )
        try:
            if answers is None:  # a bare inference call: its one answer
                self._items.put((await server.infer(request), None, True))
                return
            async for response, message, final in answers(request):
                # The model's own error where the stream kept it (serving/decoupled.py's
                # ErrorMessage): its TritonError code survives.
                error = getattr(message, "error", None) or (
                    StreamFailed(message) if message else None
                )
                self._items.put((response, error, final))
                if final:
                    return
            self._items.put((None, None, True))
        except Exception as exc:  # a refusal or the server's own fault: an error answer
            self._items.put((None, exc, True))

    def next(self) -> StreamItem:
        """The next answer (waiting for it); the last one says final."""
        if self._done:
            raise StopIteration
        while True:
            try:
                item = self._items.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if self._loop.is_closed() or not self._loop.is_running():
                    self._future.cancel()
                    item = (None, Refused(_STOPPED), True)
                    break
        self._done = item[2]
        return item

    def cancel(self) -> None:
        """Stop reading: the request is cancelled (a queued one never runs); the answer
        after the ones already made is a final CANCELLED error."""
        self._future.cancel()
        self._items.put((None, Cancelled("exec(decoupled=True): cancelled"), True))


def call_stream(request: InferenceRequest) -> Stream | Refused:
    """``request.exec(decoupled=True)``: its answers, read as they come."""
    server = _server(request)
    if isinstance(server, Refused):
        return server
    if _on_loop(server):
        return Refused("exec() cannot wait on the server's event loop; call it from execute")
    try:
        return Stream(server, request)
    except RuntimeError:  # the loop is closed
        return Refused(_STOPPED)


def manage(call: str, action: Callable[[Any], Coroutine[Any, Any, Any]]) -> Any:
    """``pb_utils.is_model_ready`` / ``load_model`` / ``unload_model``: ``action`` on the
    serving core, waited for on this thread; what it returned, or what refused it."""
    server: _Server | None = getattr(_current, "server", None)
    core = getattr(server.infer, "__self__", None) if server is not None else None
    if server is None or core is None:
        return Refused(
            f"{call}() reaches the server, so it works inside initialize and execute only "
            "(not in finalize or another thread)"
        )
    return _wait_on(server.loop, action(core))
