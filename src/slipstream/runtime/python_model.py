"""Triton's Python backend: a ``model.py`` whose ``TritonPythonModel`` runs requests.

A Triton repository's Python models (pre- and post-processing, tokenizers, business
rules, most often steps of an ensemble) are served as they are::

    preprocess/config.pbtxt      backend: "python", its inputs and outputs
    preprocess/1/model.py        class TritonPythonModel: initialize / execute / finalize

The model imports ``triton_python_backend_utils`` (:mod:`.python_utils`, registered under
that name) for its tensors and responses. ``initialize(args)`` gets Triton's arguments
(``args["model_config"]``: the completed config as Triton's JSON, and the instance's
Triton name, kind and device); ``execute(requests)`` gets the requests of a batch the
batcher formed (one request where the config has no dynamic_batching: Triton's default
scheduler), each with its own tensors, id, parameters, requested outputs and sequence
flags, and returns one response per request, whose parameters reach the client (an
``async def execute`` too, on a loop of the instance's own; a decoupled model's
coroutines run side by side on :mod:`.python_loop`'s); ``is_ready()``, where the model
has one, is its readiness; ``finalize()`` runs at unload. A response with an error
fails its request only (a 400 for ``INVALID_ARG`` and ``NOT_FOUND``, else a 500); a
list of responses of another length fails each request of the call, naming the counts;
an exception out of ``execute`` fails the batch, whose requests are then run again one
by one, so one request's data cannot fail another (except a stateful model's: its
requests fail together, as in Triton, rather than be applied twice to their sequences'
state).
``InferenceRequest(model_name=...).exec()`` runs another model of the server
(:mod:`.python_bls`).

A ``model.py`` is code the server runs: it loads only when its model says
``trust_pickle: true`` (or with ``slipstream serve --trust-pickle``), as pickles do.
Each instance runs in its own thread of the server process (Triton runs a stub process
per instance), so a model holding the GIL for long slows the server: do the heavy work
in numpy or in a model of another backend.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import importlib.util
import inspect
import itertools
import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from slipstream.datatypes import from_config_datatype, is_float
from slipstream.errors import (
    Decoupled,
    InternalError,
    InvalidRequest,
    SlipstreamError,
    Unavailable,
)
from slipstream.runtime import python_bls, python_utils
from slipstream.runtime.base import (
    Backend,
    InstancePlace,
    LocalInfer,
    ModelSignature,
    RequestContext,
    Respond,
    TensorSpec,
)
from slipstream.runtime.python_loop import ModelLoop

logger = logging.getLogger(__name__)

# Triton's error codes a request's own data causes: answered 400, not 500.
_CLIENT_CODES = {python_utils.TritonError.INVALID_ARG, python_utils.TritonError.NOT_FOUND}
_loaded = itertools.count()


class PythonModelError(RuntimeError):
    """What a Python model's ``execute`` returned or raised that is not an answer."""


class PythonBackend(Backend):
    name = "python"
    file_extensions = (".py",)
    # execute runs Python: each instance gets a thread of its own, off the event loop.
    releases_gil: ClassVar[bool] = True
    # execute() is the user's code: zeros may be no input it takes (Triton runs no
    # default warm-up at all).
    warm_up_faults_are_fatal: ClassVar[bool] = False
    # execute() takes the batch's requests, each with its id and parameters.
    takes_requests: ClassVar[bool] = True
    pickle_free_format = "review model.py as you review code: it runs in the server"

    def __init__(self, model: Any, path: Path) -> None:
        self._model = model
        self._path = path
        self._config: dict[str, Any] = {}
        # The server's inference call and its loop, for exec() (attach sets them).
        self._server: tuple[LocalInfer | None, asyncio.AbstractEventLoop | None] = (None, None)
        # Answers each request through a response sender (configure reads it).
        self._decoupled = False
        # The loop an async def execute runs on, made at its first call.
        self._loop: asyncio.AbstractEventLoop | None = None
        # A decoupled model's: its coroutines run side by side there (started at the first).
        self._model_loop: ModelLoop | None = None
        # Which instance this is (place sets it before configure).
        self._place = InstancePlace("", "CPU", 0)
        # Whether the model's is_ready raised last time it was asked (logged once).
        self._ready_failing = False
        # Whether execute has miscounted its responses yet (logged the first time).
        self._miscounted = False

    @classmethod
    def loads_pickle(cls, path: Path) -> bool:
        return True  # loading it runs the file's code: opt-in, as for pickles

    @classmethod
    def load(cls, path: Path, parameters: dict[str, str], instance_count: int) -> Backend:
        sys.modules.setdefault("triton_python_backend_utils", python_utils)
        # A module name of its own per instance: two models' model.py never share one.
        spec = importlib.util.spec_from_file_location(f"_slipstream_model_{next(_loaded)}", path)
        if spec is None or spec.loader is None:
            raise PythonModelError(f"{path}: not a Python file")
        module = importlib.util.module_from_spec(spec)
        with _beside(path):
            spec.loader.exec_module(module)
        model_class = getattr(module, "TritonPythonModel", None)
        if model_class is None:
            raise PythonModelError(f"{path.name}: defines no class TritonPythonModel")
        return cls(model_class(), path)

    def place(self, place: InstancePlace) -> None:
        self._place = place

    def configure(self, config: dict[str, Any]) -> None:
        """Run the model's ``initialize`` with Triton's arguments (``config`` is the
        completed model config in Triton's JSON form)."""
        self._config = config
        policy = config.get("model_transaction_policy") or {}
        self._decoupled = bool(policy.get("decoupled"))
        initialize = getattr(self._model, "initialize", None)
        if initialize is not None:
            version_dir = self._path.parent
            infer, loop = self._server
            # Bound to the server: initialize may ask whether a model is ready, or load it.
            with python_bls.bound(infer, loop, str(config.get("name", ""))):
                initialize({
                    "model_config": json.dumps(config),
                    "model_instance_kind": self._place.kind,
                    "model_instance_name": (
                        self._place.name or f"{config.get('name', '')}_0_0"
                    ),
                    "model_instance_device_id": str(self._place.device_id),
                    "model_repository": str(version_dir.parent),
                    "model_version": version_dir.name,
                    "model_name": config.get("name", version_dir.parent.name),
                })  # fmt: skip

    def signature(self) -> ModelSignature:
        """What the model's ``auto_complete_config`` declares (its tensors, and its
        batch size as the bound of a batch); nothing where it has none: the config lists
        a Python model's tensors then."""
        complete = getattr(type(self._model), "auto_complete_config", None)
        if complete is None:
            return ModelSignature((), ())
        # Its name as Triton's has it (models name it in their errors).
        filled = python_utils.ModelConfig({"name": self._path.parent.parent.name})
        returned = complete(filled)
        config = (returned if isinstance(returned, python_utils.ModelConfig) else filled).as_dict()
        batch = int(config.get("max_batch_size") or 0)
        lead = (-1,) if batch else ()

        def specs(kind: str) -> tuple[TensorSpec, ...]:
            return tuple(
                TensorSpec(
                    str(t["name"]),
                    from_config_datatype(str(t["data_type"])),
                    lead + tuple(int(d) for d in t["dims"]),
                )
                for t in config.get(kind, [])
            )

        try:
            inputs, outputs = specs("input"), specs("output")
        except (KeyError, TypeError, ValueError) as exc:
            raise PythonModelError(
                f"{self._path.name}: auto_complete_config declared a tensor Slipstream cannot "
                f"read ({exc})"
            ) from None
        return ModelSignature(
            inputs, outputs, max_batch_size=batch or None,
            dynamic_batching="dynamic_batching" in config,
        )  # fmt: skip

    def is_ready(self) -> bool:
        """The model's own ``is_ready()`` where it has one (Triton asks it for the
        model's readiness); one that raises says not ready, logged once until it
        answers again."""
        ready = getattr(self._model, "is_ready", None)
        if ready is None:
            return True
        try:
            answer = ready()
            if inspect.isawaitable(answer):
                answer = asyncio.run(_awaited(answer))  # this thread's own, for the call
        except Exception:
            if not self._ready_failing:
                logger.exception(
                    "model %s: is_ready raised; the model is not ready until it answers",
                    self._config.get("name", ""),
                )
            self._ready_failing = True
            return False
        self._ready_failing = False
        return bool(answer)

    def attach(self, infer: LocalInfer, loop: asyncio.AbstractEventLoop) -> None:
        self._server = (infer, loop)

    def run(
        self, inputs: dict[str, np.ndarray], output_names: Sequence[str]
    ) -> dict[str, np.ndarray]:
        (outcome,) = self.run_requests([(inputs, RequestContext())], output_names)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def run_requests(
        self,
        requests: Sequence[tuple[dict[str, np.ndarray], RequestContext]],
        output_names: Sequence[str],
    ) -> list[dict[str, np.ndarray] | BaseException]:
        """One ``execute`` call for the batch's requests, each with its own tensors, id,
        parameters, requested outputs and sequence flags, as Triton calls it."""
        made = [
            python_utils.InferenceRequest(
                [python_utils.Tensor(name, array) for name, array in inputs.items()],
                context.outputs or output_names,
                request_id=context.id,
                correlation_id=context.correlation_id,
                parameters=dict(context.parameters),
                flags=(
                    python_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START * context.sequence_start
                )
                | (python_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END * context.sequence_end),
            )
            for inputs, context in requests
        ]
        if self._decoupled:
            return self._run_decoupled(made, requests, output_names)
        sent = [_OneAnswer() for _ in made]
        for request, answer in zip(made, sent, strict=True):
            request._sender = python_utils.InferenceResponseSender(answer)  # type: ignore[attr-defined]
        try:
            responses = self._execute(made, sent)
        except _Miscounted as exc:
            # The model's fault, not a request's data: each request of the call fails
            # with it (as in Triton), never run again alone; the log says it once.
            if not self._miscounted:
                self._miscounted = True
                logger.error("model %s: %s", self._name, exc)
            return [InternalError(str(exc)) for _ in made]
        finally:
            for answer in sent:
                answer.open = False
        outcomes: list[dict[str, np.ndarray] | BaseException] = []
        for response, (_, context) in zip(responses, requests, strict=True):
            if isinstance(response, InternalError):  # one the model left unanswered
                outcomes.append(response)
                continue
            try:
                outcomes.append(self._outputs(response, self._required(context, output_names)))
                context.response_parameters.update(_parameters(response))
            except (SlipstreamError, PythonModelError) as exc:
                outcomes.append(exc)
        return outcomes

    def _run_decoupled(
        self,
        made: list[python_utils.InferenceRequest],
        requests: Sequence[tuple[dict[str, np.ndarray], RequestContext]],
        output_names: Sequence[str],
    ) -> list[dict[str, np.ndarray] | BaseException]:
        """A decoupled model's batch: each request answered through its sender, during or
        after ``execute``, which returns None; a request's outcome here is only that
        ``execute`` took it (empty outputs)."""
        responders = []
        for request, (_, context) in zip(made, requests, strict=True):
            respond = context.respond
            if respond is None:
                raise Decoupled(
                    f"model {self._config.get('name', '')!r} is decoupled (it may answer a "
                    "request any number of times): send its requests on gRPC ModelStreamInfer"
                )
            if context.started is not None:
                context.started()
            required = self._required(context, output_names)
            request._sender = python_utils.InferenceResponseSender(  # type: ignore[attr-defined]
                functools.partial(self._deliver, respond, required), context.cancelled
            )
            responders.append((request._sender, respond))  # type: ignore[attr-defined]
        returned = self._call_execute(made, started=functools.partial(self._fail_open, responders))
        if returned is not None:
            raise PythonModelError(
                f"{self._path.name}: execute of a decoupled model returns None (it answers "
                f"through each request's response sender), not a {type(returned).__name__}"
            )
        return [{} for _ in made]

    def _deliver(
        self,
        respond: Respond,
        required: list[str],
        response: python_utils.InferenceResponse | None,
        final: bool,
    ) -> None:
        """One response of a decoupled model, checked and cast as ``execute``'s are."""
        if response is None:
            respond(None, None, final, {})
            return
        try:
            outputs = self._outputs(response, required)
        except (SlipstreamError, PythonModelError) as exc:
            respond(None, exc, final, {})
            return
        respond(outputs, None, final, _parameters(response))

    def _call_execute(
        self,
        requests: list[python_utils.InferenceRequest],
        started: Callable[[concurrent.futures.Future[Any]], None] | None = None,
    ) -> Any:
        """The model's ``execute`` (a coroutine function's too), with this thread bound to
        the server for ``exec``; what it returned. ``started``: a decoupled model's
        coroutine is not waited for but started on the instance's loop, beside the
        ones before it, and handed over with its future (None is returned then)."""
        infer, loop = self._server
        try:
            with python_bls.bound(infer, loop, self._name):
                returned = self._model.execute(requests)
                if inspect.isawaitable(returned) and started is not None:
                    started(self._coroutines().start(returned))
                    return None
                if inspect.isawaitable(returned):
                    returned = self._own_loop().run_until_complete(returned)
        except Exception as exc:
            raise _execute_error(exc) from None
        return returned

    @property
    def _name(self) -> str:
        return str(self._config.get("name", self._path.parent.parent.name))

    def _coroutines(self) -> ModelLoop:
        """The loop a decoupled model's coroutines run on, bound to the server as the
        instance's thread is during ``execute``."""
        if self._model_loop is None:
            infer, loop = self._server
            self._model_loop = ModelLoop(
                self._name, functools.partial(python_bls.bound, infer, loop, self._name)
            )
        return self._model_loop

    def _fail_open(
        self,
        responders: list[tuple[python_utils.InferenceResponseSender, Respond]],
        run: concurrent.futures.Future[Any],
    ) -> None:
        """Once a decoupled model's coroutine ends: where it failed (or was cancelled
        by an unload), each of its requests not yet answered in full ends with the
        error; where it returned anything but None, likewise."""
        run.add_done_callback(functools.partial(self._coroutine_done, responders))

    def _coroutine_done(
        self,
        responders: list[tuple[python_utils.InferenceResponseSender, Respond]],
        run: concurrent.futures.Future[Any],
    ) -> None:
        if run.cancelled():
            error: Exception = Unavailable("the model was unloaded", 1)
        elif isinstance(raised := run.exception(), Exception):
            error = _execute_error(raised)
        elif run.result() is not None:
            error = InternalError(
                f"{self._path.name}: execute of a decoupled model returns None (it answers "
                f"through each request's response sender), not a {type(run.result()).__name__}"
            )
        else:
            return
        if not isinstance(error, SlipstreamError):  # the model's own bug: logged here
            logger.error("model %s: execute failed", self._name, exc_info=error)
            error = InternalError("model execution failed; see the server log")
        for sender, respond in responders:
            sender.close_with(functools.partial(respond, None, error, True, {}))

    def _execute(
        self, requests: list[python_utils.InferenceRequest], sent: list[_OneAnswer]
    ) -> list[Any]:
        """The model's ``execute``; its list of responses, one per request (those it
        sent through their response senders where it returned None, as Triton allows;
        an error for one it left unanswered)."""
        responses = self._call_execute(requests)
        if responses is None and any(answer.response is not None for answer in sent):
            unanswered = InternalError(
                f"{self._path.name}: execute returned None but sent no response for this "
                "request; send each request one response (flags="
                "TRITONSERVER_RESPONSE_COMPLETE_FINAL) or return a list of them"
            )
            return [answer.response or unanswered for answer in sent]
        if not isinstance(responses, list | tuple) or len(responses) != len(requests):
            what = (
                f"{len(responses)} responses"
                if isinstance(responses, list | tuple)
                else f"a {type(responses).__name__}"
            )
            raise _Miscounted(
                f"{self._path.name}: execute returned {what} for {len(requests)} "
                "requests; it returns a list of one InferenceResponse per request, in their "
                "order (a config without dynamic_batching hands it one request at a time)"
            )
        return list(responses)

    def _own_loop(self) -> asyncio.AbstractEventLoop:
        """The event loop this instance's ``async def execute`` runs on (one per
        instance, on its thread; never the server's)."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop

    def _required(self, context: RequestContext, output_names: Sequence[str]) -> list[str]:
        """The outputs a response must carry: the ones the client asked for (every
        output where it named none), and any a stateful model's states need."""
        if context.outputs is None:
            return list(output_names)
        declared = {str(t.get("name")) for t in self._config.get("output", [])}
        states = [name for name in output_names if declared and name not in declared]
        return [*context.outputs, *states]

    def _outputs(self, response: Any, output_names: Sequence[str]) -> dict[str, np.ndarray]:
        if not isinstance(response, python_utils.InferenceResponse):
            raise PythonModelError(
                f"{self._path.name}: execute returned a {type(response).__name__} where an "
                "InferenceResponse belongs"
            )
        error = response.error()
        if error is not None:
            raise _error(error)
        made = {tensor.name(): tensor.as_numpy() for tensor in response.output_tensors()}
        missing = [name for name in output_names if name not in made]
        if missing:
            raise PythonModelError(
                f"{self._path.name}: execute's response has no output {', '.join(missing)} "
                f"(it has {', '.join(made) or 'none'})"
            )
        return {name: self._declared(name, made[name]) for name in output_names}

    def _declared(self, name: str, array: np.ndarray) -> np.ndarray:
        """``array`` in the output's declared datatype: numpy's defaults (float64,
        int64, str) are what a Python model makes without thinking about it."""
        declared = python_utils.get_output_config_by_name(self._config, name)
        if declared is None:
            return array
        dtype = python_utils.triton_string_to_numpy(declared["data_type"])
        if array.dtype == dtype:
            return array
        if dtype is np.object_:
            if array.dtype.kind == "U":
                return np.vectorize(str.encode, otypes=[object])(array)  # type: ignore[no-any-return]
            return array.astype(object)
        if not (is_float(array.dtype) or array.dtype.kind in "biu"):
            raise PythonModelError(
                f"{self._path.name}: output {name!r} is {array.dtype}, its config says "
                f"{declared['data_type']}"
            )
        return array.astype(dtype)

    def close(self) -> None:
        if self._model_loop is not None:
            self._model_loop.close()
        try:
            finalize = getattr(self._model, "finalize", None)
            if finalize is not None:
                result = finalize()
                if inspect.isawaitable(result):
                    self._own_loop().run_until_complete(result)
        finally:
            if self._loop is not None:
                self._loop.close()
                self._loop = None


class _Miscounted(PythonModelError):
    """``execute`` returned no response, or several, for some of its requests."""


def _parameters(response: python_utils.InferenceResponse) -> dict[str, Any]:
    """The parameters a response carries for its client (Triton 24.x's)."""
    parameters: dict[str, Any] = json.loads(response.parameters())
    return parameters


async def _awaited(work: Any) -> Any:
    return await work


class _OneAnswer:
    """A response sender's sink for a model that is not decoupled (Triton 24.06 lets one
    answer through it): the request's one response, sent during ``execute``."""

    def __init__(self) -> None:
        self.response: python_utils.InferenceResponse | None = None
        # Closed when execute returns: the batch's answers are read then.
        self.open = True

    def __call__(self, response: python_utils.InferenceResponse | None, final: bool) -> None:
        if not self.open:
            raise python_utils.TritonModelException(
                "send: a model that is not decoupled answers before execute returns; set "
                "model_transaction_policy { decoupled: true } to answer later"
            )
        if response is not None and self.response is not None:
            raise python_utils.TritonModelException(
                "send: a model that is not decoupled sends one response per request; set "
                "model_transaction_policy { decoupled: true } to send more"
            )
        if response is not None:
            self.response = response


# Names of modules imported from beside a model.py: another model's of the same name
# must not be handed to the next model that imports its own.
_beside_modules: set[str] = set()
# Models load on threads side by side; sys.path and sys.modules are the process's, so
# one model.py imports at a time.
_import_lock = threading.Lock()


@contextlib.contextmanager
def _beside(path: Path) -> Iterator[None]:
    """Importing a ``model.py``: the modules beside it (in its version directory and
    model directory, which Triton appends to ``sys.path``) import by their names, never
    as another model's module of the same name, which is put back after."""
    places = [str(path.parent), str(path.parent.parent)]
    with _import_lock:
        shadowed = {name: sys.modules.pop(name) for name in _beside_modules if name in sys.modules}
        before = set(sys.modules)
        sys.path.extend(places)
        try:
            yield
        finally:
            for place in places:
                sys.path.remove(place)
            for name in set(sys.modules) - before:
                where = getattr(sys.modules[name], "__file__", None) or ""
                if any(where.startswith(place + os.sep) for place in places):
                    _beside_modules.add(name)
            sys.modules.update(shadowed)


def _execute_error(exc: Exception) -> Exception:
    """What ``execute`` raised, as the request's error: a TritonError or a
    TritonModelException carries the model's message for the client; anything else is
    the model's bug, passed on as it is (logged where it is answered)."""
    if isinstance(exc, python_utils.TritonError):
        return _error(exc)
    if isinstance(exc, python_utils.TritonModelException):
        # Raised on purpose (Triton's examples pass a BLS call's error on so): its
        # message is the model's, for the client, as Triton passes it on.
        return InternalError(f"the model failed the request: {exc}")
    return exc


def _error(error: python_utils.TritonError) -> Exception:
    """A TritonError the model returned or raised: its message is meant for the client, as
    Triton passes it on, with the status its code says."""
    made: Exception
    if error.code() in _CLIENT_CODES:
        made = InvalidRequest(f"the model refused the request: {error.message()}")
    elif error.code() == python_utils.TritonError.UNAVAILABLE:
        made = Unavailable(f"the model cannot take the request now: {error.message()}", 1)
    else:
        made = InternalError(f"the model failed the request: {error.message()}")
    setattr(made, python_utils.TRITON_CODE_ATTRIBUTE, error.code())
    return made
