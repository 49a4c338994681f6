"""Completing a model's config from its file, as Triton's auto-complete does.

What the user wrote wins; what they left out comes from the backend's signature. The
config and the file must agree (names, datatypes, ranks): a mismatch fails the load with
a message naming the tensor, so requests never reach a model that cannot run them.
"""

from __future__ import annotations

from slipstream.config import ConfigError, ModelConfig, TensorConfig
from slipstream.runtime.base import ModelSignature, TensorSpec

# max_batch_size given to models whose file has a dynamic first dim and whose config
# sets none: large enough that the batcher can amortise per-batch costs under load.
DEFAULT_MAX_BATCH_SIZE = 64

_PLATFORMS = {"onnxruntime": "onnxruntime_onnx", "torch": "pytorch_libtorch"}


def complete_config(config: ModelConfig, signature: ModelSignature, backend: str) -> ModelConfig:
    """A copy of ``config`` with every field filled in and checked against the file."""
    done = config.model_copy(deep=True)
    done.backend = backend
    done.platform = done.platform or _PLATFORMS.get(backend, backend)
    has_signature = bool(signature.inputs and signature.outputs)
    if done.max_batch_size is None:
        if has_signature:
            dynamic = signature.batch_dim_is_dynamic
            # The file's own bound (a torch.export Dim's max, a Python model's
            # auto_complete_config) where it has one.
            most = signature.max_batch_size or DEFAULT_MAX_BATCH_SIZE
            done.max_batch_size = most if dynamic else 0
        else:
            done.max_batch_size = 0
    if signature.dynamic_batching:  # a Python model's auto_complete_config asks for it
        done.default_scheduler = False
    batching = done.max_batch_size > 0
    too_large = [n for n in done.dynamic_batching.preferred_batch_size if n > done.max_batch_size]
    if batching and too_large:
        raise ConfigError(
            f"dynamic_batching.preferred_batch_size: {too_large[0]} is above max_batch_size "
            f"{done.max_batch_size}; no batch can be that large"
        )
    if not has_signature:
        if not done.input or not done.output:
            raise ConfigError(
                f"{config.name}: the {backend} model file does not declare its tensors; "
                "list input and output (name, data_type, dims) in its config"
            )
        return done
    inputs, outputs = signature.inputs, signature.outputs
    if done.sequence_batching is not None:
        # A stateful model's controls and states are the server's to give, not a client's.
        given = set(done.sequence_batching.model_inputs())
        kept = set(done.sequence_batching.model_outputs())
        inputs = tuple(spec for spec in inputs if spec.name not in given)
        outputs = tuple(spec for spec in outputs if spec.name not in kept)
    # A Python model's auto_complete_config adds to the tensors its config lists (Triton
    # hands it the config); another file's signature completes an empty list only.
    extend = backend == "python"
    done.input = _complete(done.input, inputs, batching, "input", extend)
    done.output = _complete(done.output, outputs, batching, "output", extend)
    return done


def _complete(
    given: list[TensorConfig],
    specs: tuple[TensorSpec, ...],
    batching: bool,
    kind: str,
    extend: bool = False,
) -> list[TensorConfig]:
    by_name = {spec.name: spec for spec in specs}
    if not given:
        return [_from_spec(spec, batching, kind) for spec in specs]
    for tensor in given:
        spec = by_name.get(tensor.name)
        if spec is None:
            known = ", ".join(by_name)
            raise ConfigError(f"{kind} {tensor.name!r}: not in the model file (it has {known})")
        _check_agrees(tensor, spec, batching, kind)
    if extend:
        listed = {tensor.name for tensor in given}
        given = given + [_from_spec(s, batching, kind) for s in specs if s.name not in listed]
    return given


def _from_spec(spec: TensorSpec, batching: bool, kind: str) -> TensorConfig:
    if batching and (not spec.shape or spec.shape[0] != -1):
        raise ConfigError(
            f"{kind} {spec.name!r}: max_batch_size > 0 needs a variable first dim, "
            f"the file declares shape {list(spec.shape)}; set max_batch_size: 0"
        )
    dims = list(spec.shape[1:] if batching else spec.shape)
    return TensorConfig(name=spec.name, data_type=spec.datatype, dims=dims)


def _check_agrees(tensor: TensorConfig, spec: TensorSpec, batching: bool, kind: str) -> None:
    if tensor.data_type != spec.datatype and tensor.data_type not in spec.also:
        raise ConfigError(
            f"{kind} {tensor.name!r}: data_type {tensor.data_type} in the config but "
            f"{spec.datatype} in the model file"
        )
    if batching and spec.shape and spec.shape[0] != -1:
        raise ConfigError(
            f"{kind} {tensor.name!r}: max_batch_size > 0 needs a variable first dim (the "
            f"batch), the model file declares shape {list(spec.shape)}; set max_batch_size: 0"
        )
    file_dims = spec.shape[1:] if batching else spec.shape
    # The model file sees the reshape, where there is one; clients see the dims.
    dims, key = (tensor.dims, "dims") if tensor.reshape is None else (tensor.reshape, "reshape")
    if spec.shape and len(file_dims) != len(dims):
        raise ConfigError(
            f"{kind} {tensor.name!r}: {key} {dims} in the config do not match the model "
            f"file's shape {list(spec.shape)}"
            + (" (the batch dim is implied by max_batch_size > 0)" if batching else "")
        )
    for config_dim, file_dim in zip(dims, file_dims, strict=False):
        if file_dim != -1 and config_dim not in (-1, file_dim):
            raise ConfigError(
                f"{kind} {tensor.name!r}: {key} {dims} in the config do not match the "
                f"model file's shape {list(spec.shape)}"
            )
