"""Loading a model for ``slipstream profile`` as the server loads it, and what one timed
run of a batch size is.

The server (:meth:`slipstream.serving.model.ModelVersion.load`) loads an instance with
the config's ``parameters``, completes the config from the file's signature and hands it
to ``Backend.configure`` (a Python model's ``initialize`` runs there), and closes the
instance at unload (its ``finalize``). Profile does the same, so a model that sets its
state in ``initialize`` runs here as it runs in the server; its ``--threads`` override
the config's thread parameters, as the figures are per core.

A run of batch size B is what the server's batcher hands the backend for B one-row
requests: one ``run`` of B rows, or for a backend that takes requests (a Python model)
one ``run_requests`` of B requests. A stateful model's runs are sequences
(:mod:`slipstream.profile.sequences`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from slipstream.config import ConfigError, ModelConfig
from slipstream.config.sequence import SequenceBatching
from slipstream.datatypes import from_config_datatype
from slipstream.protocol.v2_meta import model_config_json
from slipstream.repository.autocomplete import complete_config
from slipstream.runtime.base import (
    Backend,
    BackendUnavailable,
    ModelSignature,
    RequestContext,
    TensorSpec,
)

# Backend parameters that set the intra-op threads ({} is the count); one inter-op
# thread, as the server runs each instance.
THREAD_PARAMETERS = {
    "onnxruntime": {"intra_op_thread_count": "{}", "inter_op_thread_count": "1"},
    "torch": {"intra_op_thread_count": "{}"},
}


class ProfileError(ValueError):
    """The model cannot be profiled as asked; the message names the option that fixes it."""


class _NoConfig(ConfigError):
    """A bare model file (no config) whose signature completes no config."""


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A configured model instance and what its runs take and give."""

    backend: Backend
    # The client's inputs (a stateful model's controls and states left out: the runs
    # give those) and every output a run returns.
    signature: ModelSignature
    output_names: list[str]
    # A stateful model's sequence_batching; None for the others.
    sequences: SequenceBatching | None
    notes: list[str]


def thread_parameters(backend_name: str, threads: int) -> dict[str, str]:
    return {
        key: value.format(threads) for key, value in THREAD_PARAMETERS.get(backend_name, {}).items()
    }


def load_model(
    backend_class: type[Backend], path: Path, threads: int, config: ModelConfig | None
) -> LoadedModel:
    """Load, complete the config and configure, as the server does (see the module)."""
    notes: list[str] = []
    if backend_class.name not in THREAD_PARAMETERS:
        notes.append(
            f"threads not applied: the {backend_class.name} backend has no thread setting "
            "(numpy / BLAS use their own defaults)"
        )
    parameters = {
        **(config.parameters if config else {}),
        **thread_parameters(backend_class.name, threads),
    }
    try:
        model = backend_class.load(path, parameters, 1)
    except (BackendUnavailable, ProfileError):
        raise
    except Exception as exc:  # a file the backend cannot read: the CLI says so, no trace
        raise ProfileError(f"{path.name}: {backend_class.name} cannot load it: {exc}") from exc
    try:
        signature, outputs, sequences = _configured(model, backend_class.name, path, config)
    except _NoConfig as exc:
        # A bare file the server would not serve without a config: run it unconfigured,
        # as given, and say so.
        notes.append(f"not configured as the server would: {exc}")
        signature = model.signature()
        outputs, sequences = _outputs(signature), None
    except BaseException:
        model.close()
        raise
    return LoadedModel(model, signature, outputs, sequences, notes)


def _configured(
    model: Backend, backend_name: str, path: Path, config: ModelConfig | None
) -> tuple[ModelSignature, list[str], SequenceBatching | None]:
    """The model configured with its completed config: the signature its runs take,
    their outputs and its sequence_batching."""
    file_signature = model.signature()
    declared = bool(file_signature.inputs and file_signature.outputs)
    if config is None and not declared:
        if backend_name == "python":
            raise ProfileError(
                f"{path}: a Python model's tensors are listed in its config, and its "
                "initialize reads it; profile the model's directory in its repository "
                "(REPO/<model>, with its config.pbtxt or config.yaml)"
            )
        # A signature-less file (TorchScript) without a config: the runs take --shape.
        return file_signature, _outputs(file_signature), None
    try:
        completed = complete_config(
            config or ModelConfig(name=path.stem), file_signature, backend_name
        )
    except ConfigError as exc:
        raise (ProfileError(str(exc)) if config else _NoConfig(str(exc))) from None
    try:
        model.configure(model_config_json(completed))
    except (BackendUnavailable, ProfileError):
        raise
    except Exception as exc:  # the model's own initialize failed: say so, no trace
        raise ProfileError(
            f"{path.name}: configuring the model failed: {type(exc).__name__}: {exc}"
        ) from exc
    sequences = completed.sequence_batching
    signature = _client_signature(completed, file_signature if declared else None)
    outputs = _outputs(signature)
    if sequences is not None:
        outputs += [name for name in sequences.model_outputs() if name not in outputs]
    return signature, outputs, sequences


def _client_signature(config: ModelConfig, file: ModelSignature | None) -> ModelSignature:
    """The tensors a client gives and gets: the file's (its controls and states left
    out), or the config's where the file declares none (a Python model)."""
    given = set(config.sequence_batching.model_inputs()) if config.sequence_batching else set()
    if file is not None:
        inputs = tuple(spec for spec in file.inputs if spec.name not in given)
        return ModelSignature(inputs, file.outputs, file.max_batch_size)
    lead = (-1,) if config.max_batch_size else ()

    def spec(name: str, data_type: str, dims: list[int]) -> TensorSpec:
        return TensorSpec(name, from_config_datatype(data_type), (*lead, *dims))

    return ModelSignature(
        tuple(spec(t.name, t.data_type, t.dims) for t in config.input),
        tuple(spec(t.name, t.data_type, t.dims) for t in config.output),
    )


def _outputs(signature: ModelSignature) -> list[str]:
    return [spec.name for spec in signature.outputs] or ["output"]


# A timed run: executes one batch, raising what failed it.
Run = Callable[[], object]


def batch_run(
    model: Backend, inputs: dict[str, np.ndarray], output_names: list[str], batching: bool
) -> Run:
    """One run of ``inputs``: ``run``, or for a backend that takes requests a batch of
    one-row requests (the batch the server's batcher forms), each failure raised."""
    if not model.takes_requests:
        return lambda: model.run(inputs, output_names)
    requests = [(inputs, RequestContext())]
    if batching:
        rows = len(next(iter(inputs.values()))) if inputs else 1
        requests = [
            ({name: array[row : row + 1] for name, array in inputs.items()}, RequestContext())
            for row in range(rows)
        ]
    return lambda: raise_failure(model.run_requests(requests, output_names))


def raise_failure(
    outcomes: list[dict[str, np.ndarray] | BaseException],
) -> list[dict[str, np.ndarray]]:
    """``run_requests``'s outcomes, or the first request's failure raised."""
    answered = []
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
        answered.append(outcome)
    return answered
