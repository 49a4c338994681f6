"""``slipstream monitor reference``: a version's drift reference, checked against its model.

The server tests each reference array against the input or output of the same name, row
by row; an array named like none of them, or whose rows have another shape, would be
written, then silently never tested (and would replace a good reference). So the
arrays are checked against the model's tensors first, read from its config completed by
its file, as the server completes it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from slipstream.config import ConfigError, ModelConfig, TensorConfig
from slipstream.monitor.sampler import REFERENCE_FILE
from slipstream.repository.autocomplete import complete_config
from slipstream.repository.layout import (
    ModelDirectory,
    is_cascade,
    is_generative,
    model_file,
    read_config,
)
from slipstream.runtime import backend_for_file, get_backend
from slipstream.runtime.pickles import check_pickle_trust


class ReferenceError(ValueError):
    """A reference that cannot be the model's: the message says why."""


def pick_version(directory: ModelDirectory, version: int | None) -> int:
    """``version`` (the newest when None), checked to be one of the model's."""
    if not directory.versions:
        raise ReferenceError(f"{directory.path}: no version directory (1/, 2/, ...)")
    chosen = version if version is not None else max(directory.versions)
    if chosen not in directory.versions:
        found = ", ".join(map(str, directory.versions))
        raise ReferenceError(f"--version {chosen}: {directory.name} has versions {found}")
    return chosen


def write_reference(
    directory: ModelDirectory,
    version: int,
    requests: Sequence[Mapping[str, np.ndarray]],
    source: Path,
) -> tuple[Path, dict[str, np.ndarray]]:
    """Write the version's reference from ``requests`` (samples along axis 0 of each
    array), once checked against the model; its path and arrays."""
    arrays = {}
    for name in sorted({name for request in requests for name in request}):
        parts = [np.asarray(r[name]) for r in requests if name in r]
        if any(part.ndim == 0 for part in parts):
            raise ReferenceError(f"{source}: {name!r} is a scalar; samples go along axis 0")
        try:
            arrays[name] = np.concatenate(parts)
        except ValueError as exc:
            raise ReferenceError(f"{source}: {name!r}: rows of different shapes: {exc}") from exc
    check_reference(model_config(directory, version), arrays, source)
    target = directory.path / str(version) / REFERENCE_FILE
    np.savez(target, **arrays)  # type: ignore[arg-type]
    return target, arrays


def model_config(directory: ModelDirectory, version: int) -> ModelConfig:
    """The version's config, completed from its model file (the file is loaded once)."""
    if is_generative(directory) or is_cascade(directory):
        raise ReferenceError(
            f"{directory.name} is a generative model or a cascade; drift references are for "
            "the tensor models of the V2 routes"
        )
    try:
        config = read_config(directory)
        path = model_file(directory.path / str(version), config)
        backend = get_backend(config.backend or backend_for_file(path))
        check_pickle_trust(directory.name, path, backend, config.trust_pickle)
    except (ConfigError, RuntimeError) as exc:  # RuntimeError: BackendUnavailable
        raise ReferenceError(f"{directory.name}: {exc}") from exc
    try:
        instance = backend.load(path, config.parameters, 1)
    except Exception as exc:  # a file its backend cannot read
        raise ReferenceError(f"{path}: {backend.name} cannot load it: {exc}") from exc
    try:
        return complete_config(config, instance.signature(), backend.name)
    except ConfigError as exc:
        raise ReferenceError(f"{directory.name}: {exc}") from exc
    finally:
        instance.close()


def check_reference(config: ModelConfig, arrays: Mapping[str, np.ndarray], source: Path) -> None:
    """ReferenceError unless each array is an input or output of the model, its samples
    along axis 0 shaped as that tensor's rows, with at least a drift window of them."""
    tensors = {tensor.name: tensor for tensor in [*config.input, *config.output]}
    listed = ", ".join(f"{name} {_shape(tensor, config)}" for name, tensor in tensors.items())
    if not arrays:
        raise ReferenceError(
            f"{source}: no arrays; save one per tensor to monitor, named after it "
            f"(its tensors: {listed})"
        )
    unknown = sorted(set(arrays) - set(tensors))
    if unknown:
        raise ReferenceError(
            f"{source}: {', '.join(map(repr, unknown))}: not an input or output of "
            f"{config.name} (its tensors: {listed}); name each array after the tensor it "
            "samples"
        )
    if config.max_batch_size:  # else a request's whole tensor is a sample, as sent
        for name, array in arrays.items():
            dims = tensors[name].dims
            shape = array.shape[1:]
            if len(shape) != len(dims) or any(
                d not in (-1, r) for d, r in zip(dims, shape, strict=True)
            ):
                raise ReferenceError(
                    f"{source}: {name!r} has rows of shape {list(shape)}; {config.name}'s "
                    f"{name} takes {_shape(tensors[name], config)} (samples along axis 0)"
                )
    # A window is tested against the whole reference: one smaller than a window would
    # make the reference's own noise the drift found (the server refuses under 2 rows).
    window = config.monitoring.drift.window
    for name, array in arrays.items():
        if len(array) < window:
            raise ReferenceError(
                f"{source}: {name!r} has {len(array)} rows (samples along axis 0); a drift "
                f"reference needs at least {window}, {config.name}'s "
                "monitoring.drift.window: save more known-good samples"
            )


def _shape(tensor: TensorConfig, config: ModelConfig) -> list[int]:
    return [-1, *tensor.dims] if config.max_batch_size else list(tensor.dims)
