"""Validated settings: the per-model ``config.yaml`` and the server's own options.

Model config keys follow Triton's names (``max_batch_size``,
``dynamic_batching.max_queue_delay_microseconds``, ``instance_group``, ...) so Triton users
can bring what they know. Every model is validated on load; a bad key fails that model's
load with a message naming the key, and other models are unaffected.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from slipstream.config.base import Strict as _Strict
from slipstream.config.batching import DynamicBatching, QueuePolicy
from slipstream.config.cache_spec import parse_cache_spec
from slipstream.config.cascade import CascadeConfig, CascadeStage, ConfidenceRule
from slipstream.config.ensemble import EnsembleConfig, EnsembleStep
from slipstream.config.reshape import dims_problem, reshape_problem
from slipstream.config.sections import (
    GENERATIVE_BACKENDS,
    DriftSettings,
    GenerationSettings,
    MonitoringSettings,
    RayServeConfig,
    ResponseCacheConfig,
    RolloutConfig,
    ShadowConfig,
    TransactionPolicy,
)
from slipstream.config.sequence import SequenceBatching, check_sequence_tensors
from slipstream.config.versions import VersionPolicy, WarmupInput, WarmupSample
from slipstream.datatypes import from_config_datatype
from slipstream.names import checked_model_name

__all__ = [
    "GENERATIVE_BACKENDS",
    "CascadeConfig",
    "CascadeStage",
    "ConfidenceRule",
    "ConfigError",
    "DriftSettings",
    "DynamicBatching",
    "EnsembleConfig",
    "EnsembleStep",
    "GenerationSettings",
    "InstanceGroup",
    "ModelConfig",
    "MonitoringSettings",
    "QueuePolicy",
    "RayServeConfig",
    "ResponseCacheConfig",
    "RolloutConfig",
    "ServerSettings",
    "ShadowConfig",
    "TensorConfig",
    "VersionPolicy",
    "WarmupInput",
    "WarmupSample",
    "format_validation_error",
    "parse_cache_spec",
    "parse_model_config",
]


class TensorConfig(_Strict):
    """One input or output: name, V2 datatype, dims without the batch dim when batching."""

    name: str = Field(min_length=1)
    data_type: str = Field(description="TYPE_FP32 (Triton) or FP32 (V2) spelling")
    dims: list[int] = Field(description="shape without the batch dim; -1 for variable")
    # Triton: an optional input may be left out of a request.
    optional: bool = False
    reshape: list[int] | None = Field(
        None, description="the shape the model file takes or produces, when not dims (Triton)"
    )
    label_filename: str = Field(
        "", description="outputs: class labels, one a line, in the model directory"
    )

    @field_validator("data_type")
    @classmethod
    def _normalise_datatype(cls, value: str) -> str:
        return from_config_datatype(value)

    @field_validator("dims")
    @classmethod
    def _check_dims(cls, dims: list[int]) -> list[int]:
        if (problem := dims_problem(dims)) is not None:
            raise ValueError(problem)
        return dims

    @model_validator(mode="after")
    def _check_reshape(self) -> TensorConfig:
        label = Path(self.label_filename)
        if label.is_absolute() or ".." in label.parts:
            raise ValueError("label_filename: a file in the model directory, not a path out of it")
        if self.reshape is not None:
            if self.reshape == self.dims:
                self.reshape = None
            elif (problem := reshape_problem(self.dims, self.reshape)) is not None:
                raise ValueError(f"reshape: {problem}")
        return self


class InstanceGroup(_Strict):
    """How many copies of the model run batches in parallel."""

    count: int = Field(1, ge=1, le=64)
    kind: Literal["KIND_CPU", "KIND_GPU", "KIND_AUTO"] = "KIND_CPU"
    name: str = ""


class ModelConfig(_Strict):
    """The ``config.yaml`` of one model (shared by all its versions)."""

    name: str = ""
    backend: str = Field(
        "",
        description="onnxruntime, torch, sklearn, openvino, transformers or llama_cpp; default by "
        "file type",
    )
    platform: str = ""
    default_model_filename: str = ""
    max_batch_size: int | None = Field(
        None, ge=0, description="0 = no batching; omitted = taken from the model file"
    )
    input: list[TensorConfig] = Field(default_factory=list)
    output: list[TensorConfig] = Field(default_factory=list)
    dynamic_batching: DynamicBatching = Field(default_factory=DynamicBatching)
    default_scheduler: bool = Field(
        False,
        description="Triton's default scheduler: the config has neither dynamic_batching "
        "nor sequence_batching (set so when it has none). A Python model's execute then "
        "gets one request at a time, as in Triton; other backends still run requests "
        "queued together as one batch (never waiting for more), which changes no output",
    )
    instance_group: list[InstanceGroup] = Field(default_factory=lambda: [InstanceGroup()])
    version_policy: VersionPolicy = Field(default_factory=VersionPolicy)
    model_warmup: list[WarmupSample] = Field(default_factory=list)
    parameters: dict[str, str] = Field(
        default_factory=dict, description="backend options, e.g. intra_op_thread_count"
    )
    generation: GenerationSettings = Field(default_factory=GenerationSettings)
    monitoring: MonitoringSettings = Field(default_factory=MonitoringSettings)
    response_cache: ResponseCacheConfig = Field(default_factory=ResponseCacheConfig)
    ray_serve: RayServeConfig = Field(default_factory=RayServeConfig)
    rollout: RolloutConfig | None = None
    sequence_batching: SequenceBatching | None = Field(
        None, description="a stateful model (see config/sequence.py), as Triton's"
    )
    ensemble: EnsembleConfig | None = Field(
        None,
        description="this model is an ensemble of other models (see config/ensemble.py): "
        "no model file; steps run models, tensors passed between them by name",
    )
    cascade: CascadeConfig | None = Field(
        None,
        description="this model is a cascade of other models (see config/cascade.py): no "
        "model file; its inputs and outputs are its first stage's",
    )
    # Embedding models: the tokenizer file (in the model directory) that
    # /v1/embeddings uses to turn text into the model's input_ids and attention_mask.
    tokenizer: str = ""
    max_request_tokens: int = Field(
        300_000,
        ge=1,
        description="/v1/embeddings: most tokens one request may carry, summed over its "
        "inputs (OpenAI's own limit is 300,000); more is refused with a 400",
    )
    idle_unload_seconds: float | None = Field(
        None,
        ge=0,
        description="Unload the model after this long without a request (0: never; unset: "
        "the server's --idle-unload-seconds); the next request loads it again and waits "
        "for it (scale to zero inside one server)",
    )
    pin: bool = Field(False, description="Keep the model loaded however idle it is")
    model_transaction_policy: TransactionPolicy = Field(default_factory=TransactionPolicy)
    trust_pickle: bool = Field(
        False,
        description="Allow loading a model file that unpickles when loaded (scikit-learn "
        ".joblib / .pkl, torch.export .pt2): unpickling runs any code the file holds, so "
        "set it only for files you trust as you trust code. Prefer a pickle-free format "
        "(ONNX: skl2onnx, torch.onnx.export).",
    )

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        return checked_model_name(name) if name else name

    @field_validator("instance_group", mode="before")
    @classmethod
    def _group_as_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, dict) else value

    @field_validator("parameters", mode="before")
    @classmethod
    def _flatten_parameters(cls, value: Any) -> Any:
        # Triton writes parameters as {key: {string_value: "..."}}; accept both forms.
        if not isinstance(value, dict):
            return value
        flat: dict[str, Any] = {}
        for key, item in value.items():
            if isinstance(item, dict) and set(item) == {"string_value"}:
                item = item["string_value"]
            flat[key] = item if isinstance(item, str) else str(item)
        return flat

    @model_validator(mode="after")
    def _default_scheduler(self) -> ModelConfig:
        given = self.model_fields_set
        if "dynamic_batching" not in given and "default_scheduler" not in given:
            self.default_scheduler = self.sequence_batching is None
        return self

    @model_validator(mode="after")
    def _check_input_labels(self) -> ModelConfig:
        for tensor in self.input:
            if tensor.label_filename:
                raise ValueError(f"input {tensor.name!r}: label_filename is for outputs")
        return self

    @model_validator(mode="after")
    def _check_sequences(self) -> ModelConfig:
        if self.sequence_batching is not None:
            check_sequence_tensors(self.sequence_batching, self.input, self.output)
            if self.ray_serve.max_replicas > 1:
                raise ValueError(
                    "ray_serve.max_replicas: a stateful model's sequences live in one "
                    "replica (Ray routes each request anywhere); keep it at 1"
                )
        return self

    @model_validator(mode="after")
    def _check_ensemble(self) -> ModelConfig:
        if self.ensemble is None:
            return self
        own = sorted(self.model_fields_set & (_MODEL_FILE_KEYS - _ENSEMBLE_KEYS))
        if own or self.cascade is not None:
            raise ValueError(
                "an ensemble has no model file of its own; remove "
                f"{', '.join(own or ['cascade'])} (set them on its steps' models)"
            )
        if not self.input or not self.output:
            raise ValueError("an ensemble lists its input and output (name, data_type, dims)")
        inputs, outputs = [t.name for t in self.input], [t.name for t in self.output]
        self.ensemble.check_graph(inputs, outputs)
        return self

    @model_validator(mode="after")
    def _check_cascade(self) -> ModelConfig:
        if self.cascade is not None:
            # A cascade runs no file of its own: these would be silently ignored.
            own = sorted(self.model_fields_set & _MODEL_FILE_KEYS)
            if own:
                raise ValueError(
                    f"a cascade has no model file of its own and takes its signature from "
                    f"its first stage; remove {', '.join(own)} (set them on the stages' models)"
                )
        return self

    @property
    def generative(self) -> bool:
        return self.backend in GENERATIVE_BACKENDS

    @property
    def instance_count(self) -> int:
        return sum(group.count for group in self.instance_group)


# Keys about a model file and how it runs, which a cascade does not have.
_MODEL_FILE_KEYS = frozenset({
    "backend", "platform", "default_model_filename", "max_batch_size", "input", "output",
    "dynamic_batching", "instance_group", "version_policy", "model_warmup", "parameters",
    "generation", "tokenizer", "rollout", "ray_serve", "trust_pickle",
})  # fmt: skip


# What an ensemble declares of its own: its signature and batching, as Triton's does.
_ENSEMBLE_KEYS = frozenset({"platform", "max_batch_size", "input", "output"})


class ConfigError(ValueError):
    """A model's config.yaml is invalid; the message names the key and the problem."""


def format_validation_error(source: str, error: ValidationError) -> str:
    """One line per problem: ``source: key.path: message``."""
    lines = []
    for problem in error.errors():
        key = ".".join(str(part) for part in problem["loc"]) or "(top level)"
        lines.append(f"{source}: {key}: {problem['msg']}")
    return "; ".join(lines)


def parse_model_config(data: Any, source: str) -> ModelConfig:
    """Validate a parsed config.yaml; raise ConfigError naming the offending key."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of keys, got {type(data).__name__}")
    try:
        return ModelConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(source, exc)) from None


# Last: it reads the model-name rule above (a package module importing this one).
from slipstream.config.server import ServerSettings  # noqa: E402
