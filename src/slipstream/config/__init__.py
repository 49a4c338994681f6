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
from slipstream.names import MODEL_NAME_RULE, model_name_problem

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
        return _checked_model_name(name) if name else name

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


def _checked_model_name(name: str) -> str:
    problem = model_name_problem(name)
    if problem is not None:
        raise ValueError(f"{name[:64]!r} {problem}; {MODEL_NAME_RULE}")
    return name


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


class ServerSettings(_Strict):
    """Options of ``slipstream serve``; each field's description is its --help text."""

    model_repository: Path = Field(
        description="Directory laid out as <model>/<version>/model.*, or an S3 repository "
        "as Triton names one: s3://bucket/path, s3://host:port/bucket/path (a store of "
        "one's own, over HTTP), s3://https://host:port/bucket/path. An S3 repository is "
        "copied to --repository-cache before serving and followed every "
        "--repository-poll-secs (but with --model-control-mode none)."
    )
    repository_cache: Path | None = Field(
        None,
        description="Where an s3:// repository is copied (kept across restarts: only "
        "what changed is fetched again); a temporary directory removed at exit if not set.",
    )
    host: str = Field("0.0.0.0", description="Address the HTTP and gRPC servers bind to.")
    http_port: int = Field(8000, ge=0, le=65535, description="HTTP port (0 disables HTTP).")
    grpc_port: int = Field(8001, ge=0, le=65535, description="gRPC port (0 disables gRPC).")
    model_control_mode: Literal["none", "explicit", "poll"] = Field(
        "none",
        description="none: load every model at start; explicit: load/unload via the "
        "repository API (and --load-model); poll: load every model at start and follow "
        "the repository's files (added, changed, removed; the load/unload API is refused).",
    )
    load_models: list[str] = Field(
        default_factory=list,
        description="Models to load at start in explicit mode ('*': every model, as Triton's).",
    )
    trust_pickle: bool = Field(
        False,
        description="Load pickle-based model files (scikit-learn .joblib / .pkl, torch "
        ".pt2) of every model, as if each config.yaml said trust_pickle: true. Unpickling "
        "runs code from the file: use it only for a repository you trust like code.",
    )
    allow_client_shm: bool = Field(
        False,
        description="Let clients register system shared-memory regions (Triton's "
        "systemsharedmemory extension) and send tensors through them. A registered region "
        "is read and written by the server: enable it only for trusted clients on this host.",
    )
    repository_poll_secs: float = Field(
        15.0, gt=0, description="How often poll mode rescans the repository."
    )
    idle_unload_seconds: float = Field(
        0.0,
        ge=0,
        description="Unload a model (V2 or generative) after this long without a request "
        "(0: never); a model's config.yaml may set its own idle_unload_seconds, or pin: "
        "true. The next request loads it again and waits for it, up to --load-wait-s.",
    )
    load_wait_s: float = Field(
        60.0,
        gt=0,
        description="Longest a request waits for its idle-unloaded model to load again (or "
        "its own timeout, when shorter); past it: 503 with Retry-After, and the load goes on.",
    )
    max_request_bytes: int = Field(
        64 * 1024 * 1024, ge=1024, description="Larger request bodies are refused with 413."
    )
    shutdown_timeout_s: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM, how long in-flight requests may take to finish; "
        "then they are answered 503 with Retry-After.",
    )
    max_header_bytes: int = Field(
        64 * 1024,
        ge=1024,
        description="Largest HTTP request line plus headers; a larger one is answered 431 "
        "(414 when the URL alone is past it) and its connection closed.",
    )
    max_header_count: int = Field(
        100, ge=1, description="Most header lines in one HTTP request; more gets 431."
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="How long a client may take to send a request's line and headers, from "
        "its first byte (or from connecting); a slower one gets 408 and is closed.",
    )
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        description="How long a request body may stop arriving before its connection is "
        "closed with 408.",
    )
    min_body_rate_bytes_s: float = Field(
        500.0,
        ge=0,
        description="Slowest average rate a request body may arrive at once it has taken "
        "--body-timeout-s; a slower one is answered 408 and closed (a client trickling a "
        "byte at a time). 0 turns it off.",
    )
    send_timeout_s: float = Field(
        60.0,
        gt=0,
        description="How long a client may accept none of a response the server has to "
        "send (it stopped reading) before its connection is dropped, with its pending "
        "responses and pipelined requests.",
    )
    keep_alive_timeout_s: float = Field(
        75.0, gt=0, description="An idle keep-alive HTTP connection is closed after this long."
    )
    price_per_hour: float | None = Field(
        None,
        gt=0,
        description="The machine's price per hour: /metrics then shows each model's cost "
        "per million inferences (the price shared out by compute time).",
    )
    cost_window_s: float = Field(
        60.0, gt=0, description="Window of the cost-per-inference gauges, in seconds."
    )
    max_connections: int = Field(
        10_000,
        ge=1,
        description="Most open HTTP connections. At the limit, a new connection closes the "
        "longest-idle one, or is refused with 503 when none is idle "
        "(slipstream_http_connections_closed_by_limit_total counts both).",
    )
    grpc_max_message_bytes: int | None = Field(
        None,
        ge=1024,
        description="Largest gRPC message received or sent; a larger one is refused with "
        "RESOURCE_EXHAUSTED. Default: --max-request-bytes.",
    )
    grpc_max_concurrent_streams: int = Field(
        1000,
        ge=1,
        description="RPCs one gRPC connection may have open at once; more wait in the "
        "client until one ends.",
    )
    strict_readiness: bool = Field(
        True,
        description="Report not ready while any model failed to load (Triton's default); "
        "with --no-strict-readiness, ready once loading is done.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Logging level; debug logs every request with its id."
    )
    frontends: int = Field(
        0,
        ge=0,
        le=64,
        description="0: one process serves everything (fastest for small CPU models on few "
        "cores). N: N front-end processes (HTTP, gRPC, OpenAI; sharing the ports) in front "
        "of one engine process that runs the models, so decoding and gRPC scale past one "
        "core and the models never wait for the front ends' GIL.",
    )
    engines: Literal["single", "per-device"] = Field(
        "single",
        description="Engine processes of the split layout. single: one runs every model. "
        "per-device: one per device the models run on (the CPU, cuda:0, ...: a torch "
        "model's parameters.device, a generative model's generation.device), front ends "
        "routing each model's requests to its engine: each GPU is fed by a process of its "
        "own, CPU models never wait behind a GPU model's GIL, a cascade runs with its "
        "stages. Implies --frontends 1 when --frontends is 0.",
    )
    frontend_hold_us: int = Field(
        1000,
        ge=0,
        le=100_000,
        description="With --frontends N: the longest (microseconds) a front end holds a "
        "request that would reach the engine alone while more are due (fewer are in "
        "flight than it held at once lately), so that they travel together: gRPC's front "
        "end takes one call at a time. A client alone (C=1) never waits. 0: never hold.",
    )
    cpu_scheduling: Literal["batch", "default"] = Field(
        "batch",
        description="Linux scheduling policy of the --frontends N processes. batch "
        "(SCHED_BATCH): a process woken by another's message waits for the running one's "
        "time slice instead of preempting it, so each hands the other whole batches "
        "(measured: about 1.5x the requests/s of default with one front end and the "
        "engine sharing one core, 1.1-1.2x with two front ends on two cores). default: "
        "the scheduler's usual policy. One process (--frontends 0) is left as it is "
        "started.",
    )

    auth_file: Path | None = Field(
        None,
        description="API keys file (made by `slipstream keys create`): every route but the "
        "health probes then needs a key (Authorization: Bearer, gRPC metadata authorization).",
    )
    metrics_need_key: bool = Field(
        False, description="With --auth-file, /metrics needs a key too (any role)."
    )
    rate_limit_store: str = Field(
        "memory",
        description="Where the keys' rate limits are counted: memory (this server; with "
        "--frontends N, its engine process, shared by every front end) or "
        "redis://host:port[/db] (shared by every server using that Redis).",
    )
    rollout_store: str = Field(
        "",
        pattern=r"^(|rediss?://.+)$",
        description="Where rollouts keep their state: empty for REPO/<model>/rollout.json, or "
        "redis://host:port[/db] (a read-only repository; state that outlives the pod).",
    )
    rate_limit_fail_closed: bool = Field(
        False,
        description="Refuse requests (503) while the Redis rate-limit store is unreachable; "
        "by default they are admitted (fail open) and the outage is logged and counted.",
    )
    trace_startup: Path | None = Field(
        None,
        description="Write where start-up time went (process start, front ends listening, "
        "each model's load and warm-up, ready) to this JSON file once ready; the log has "
        "the same on one line.",
    )
    access_log: bool = Field(
        False,
        description="Log one JSON line per request (logger slipstream.access) and echo or "
        "generate X-Request-Id.",
    )
    cache: str = Field(
        "",
        description="Response cache of the models whose config.yaml says response_cache: "
        "{enable: true}: local:size=256MB (LRU by bytes, this process) or "
        "redis://host:port[/db][?ttl=600] (shared); empty: none.",
    )
    jobs_redis: str = Field(
        "",
        description="Asynchronous jobs (POST /v2/jobs, Prefer: respond-async) in the Redis "
        "stream at redis://host:port[/db], run by `slipstream worker`s; empty: off.",
    )
    jobs_max_pending: int = Field(
        100_000, ge=1, description="Unfinished jobs the stream holds before submissions get 503."
    )
    tls_cert: Path | None = Field(None, description="PEM certificate: serve HTTPS and gRPC TLS.")
    tls_key: Path | None = Field(None, description="PEM private key of --tls-cert.")
    tls_client_ca: Path | None = Field(
        None, description="PEM CA bundle: require client certificates signed by it (mutual TLS)."
    )

    @field_validator("rate_limit_store")
    @classmethod
    def _check_store(cls, value: str) -> str:
        if value != "memory" and not value.startswith(("redis://", "rediss://")):
            raise ValueError(f"expected memory or redis[s]://host:port, got {value!r}")
        return value

    @field_validator("jobs_redis")
    @classmethod
    def _check_jobs_redis(cls, value: str) -> str:
        if value and not value.startswith(("redis://", "rediss://")):
            raise ValueError(f"expected redis://host:port[/db], got {value!r}")
        return value

    @field_validator("cache")
    @classmethod
    def _check_cache(cls, value: str) -> str:
        if value:
            parse_cache_spec(value)
        return value

    @model_validator(mode="after")
    def _check_tls(self) -> ServerSettings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together; give both or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return self

    @field_validator("load_models")
    @classmethod
    def _check_load_models(cls, names: list[str]) -> list[str]:
        return [name if name == "*" else _checked_model_name(name) for name in names]
