"""Triton's Python backend: a ``model.py`` whose ``TritonPythonModel`` runs requests.

A Triton repository's Python models (pre- and post-processing, tokenizers, business
rules, most often steps of an ensemble) are served as they are::

    preprocess/config.pbtxt      backend: "python", its inputs and outputs
    preprocess/1/model.py        class TritonPythonModel: initialize / execute / finalize

The model imports ``triton_python_backend_utils`` (:mod:`.python_utils`, registered under
that name) for its tensors and responses. ``initialize(args)`` gets Triton's arguments
(``args["model_config"]``: the completed config as Triton's JSON); ``execute(requests)``
gets the requests of a batch the batcher formed, each with its own tensors, id,
parameters, requested outputs and sequence flags, and returns one response per request
(an ``async def execute`` too, on a loop of the instance's own); ``finalize()`` runs at
unload. A response with an error fails its request only (a 400 for ``INVALID_ARG`` and
``NOT_FOUND``, else a 500); an exception out of ``execute`` fails the batch, whose
requests are then run again one by one, so one request's data cannot fail another
(except a stateful model's: its requests fail together, as in Triton, rather than be
applied twice to their sequences' state).
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
import contextlib
import functools
import importlib.util
import inspect
import itertools
import json
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from slipstream.datatypes import from_config_datatype
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
    LocalInfer,
    ModelSignature,
    RequestContext,
    Respond,
    TensorSpec,
)

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
                    "model_instance_kind": "CPU",
                    "model_instance_name": f"{config.get('name', '')}_0",
                    "model_instance_device_id": "0",
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
        return ModelSignature(inputs, outputs, max_batch_size=batch or None)

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
        finally:
            for answer in sent:
                answer.open = False
        outcomes: list[dict[str, np.ndarray] | BaseException] = []
        for response, (_, context) in zip(responses, requests, strict=True):
            try:
                outcomes.append(self._outputs(response, self._required(context, output_names)))
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
        for request, (_, context) in zip(made, requests, strict=True):
            respond = context.respond
            if respond is None:
                raise Decoupled(
                    f"model {self._config.get('name', '')!r} is decoupled (it may answer a "
                    "request any number of times): send its requests on gRPC ModelStreamInfer"
                )
            required = self._required(context, output_names)
            request._sender = python_utils.InferenceResponseSender(  # type: ignore[attr-defined]
                functools.partial(self._deliver, respond, required), context.cancelled
            )
        returned = self._call_execute(made)
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
            respond(None, None, final)
            return
        try:
            outputs = self._outputs(response, required)
        except (SlipstreamError, PythonModelError) as exc:
            respond(None, exc, final)
            return
        respond(outputs, None, final)

    def _call_execute(self, requests: list[python_utils.InferenceRequest]) -> Any:
        """The model's ``execute`` (a coroutine function's too), with this thread bound to
        the server for ``exec``; what it returned."""
        infer, loop = self._server
        name = str(self._config.get("name", self._path.parent.parent.name))
        try:
            with python_bls.bound(infer, loop, name):
                returned = self._model.execute(requests)
                if inspect.isawaitable(returned):
                    returned = self._own_loop().run_until_complete(returned)
        except python_utils.TritonError as exc:
            raise _error(exc) from None
        except python_utils.TritonModelException as exc:
            # Raised on purpose (Triton's examples pass a BLS call's error on so): its
            # message is the model's, for the client, as Triton passes it on.
            raise InternalError(f"the model failed the request: {exc}") from None
        return returned

    def _execute(
        self, requests: list[python_utils.InferenceRequest], sent: list[_OneAnswer]
    ) -> list[Any]:
        """The model's ``execute``; its list of responses, one per request (those it
        sent through their response senders where it returned None, as Triton allows)."""
        responses = self._call_execute(requests)
        if responses is None and all(answer.response is not None for answer in sent):
            return [answer.response for answer in sent]
        if responses is None and any(answer.response is not None for answer in sent):
            raise PythonModelError(
                f"{self._path.name}: execute returned None but sent no response for some "
                "of its requests; send each request one response (flags="
                "TRITONSERVER_RESPONSE_COMPLETE_FINAL) or return a list of them"
            )
        if not isinstance(responses, list | tuple) or len(responses) != len(requests):
            what = (
                f"{len(responses)} responses"
                if isinstance(responses, list | tuple)
                else f"a {type(responses).__name__}"
            )
            raise PythonModelError(
                f"{self._path.name}: execute returned {what} for {len(requests)} requests; it "
                "returns a list of one InferenceResponse per request, in their order"
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
        if array.dtype.kind not in "biuf":
            raise PythonModelError(
                f"{self._path.name}: output {name!r} is {array.dtype}, its config says "
                f"{declared['data_type']}"
            )
        return array.astype(dtype)

    def close(self) -> None:
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


def _error(error: python_utils.TritonError) -> Exception:
    """A TritonError the model returned or raised: its message is meant for the client, as
    Triton passes it on, with the status its code says."""
    if error.code() in _CLIENT_CODES:
        return InvalidRequest(f"the model refused the request: {error.message()}")
    if error.code() == python_utils.TritonError.UNAVAILABLE:
        return Unavailable(f"the model cannot take the request now: {error.message()}", 1)
    return InternalError(f"the model failed the request: {error.message()}")
