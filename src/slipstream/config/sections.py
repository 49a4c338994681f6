"""The sections of a model's config.yaml that belong to one feature each: generation
(the LLM lane's KV cache), monitoring, the response cache, Ray Serve, rollouts."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from slipstream.config.base import Strict as _Strict
from slipstream.names import checked_model_name

# Backends served by the OpenAI lane (slipstream.llm) rather than the V2 tensor lane.
GENERATIVE_BACKENDS = ("transformers", "llama_cpp")


class GenerationSettings(_Strict):
    """``generation:`` in the config.yaml of a generative model: the KV-cache budget.

    The cache is allocated once, at load: ``num_blocks`` blocks of ``block_size`` tokens
    (per layer, keys and values). Sequences get blocks as they grow and give them back
    when they finish; a request that could never fit is refused with a 400, and one that
    does not fit now waits (up to ``max_queue_size`` waiting, then 503).
    """

    block_size: int = Field(16, ge=4, le=1024, description="tokens per KV-cache block")
    num_blocks: int = Field(512, ge=1, description="blocks in the KV cache")
    max_batch_tokens: int = Field(
        256, ge=16, description="tokens one forward step may process (prefill chunks + decodes)"
    )
    max_num_seqs: int = Field(32, ge=1, description="sequences decoded together at most")
    max_queue_size: int = Field(
        256, ge=1, description="sequences waiting for the cache before new ones get 503"
    )
    max_model_len: int = Field(
        0, ge=0, description="prompt + completion tokens at most; 0 = the model's own limit"
    )
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request omits it")
    prefix_caching: bool = Field(
        True,
        description="llama_cpp: reuse the cached keys and values of a prompt prefix another "
        "sequence computed (a shared system prompt, the earlier turns of a chat)",
    )
    kv_streams: Literal["auto", "shared", "per_sequence"] = Field(
        "auto",
        description="llama_cpp: one KV cache every sequence shares (a long request may use "
        "all of it), or one stream per sequence (each holds the cache's tokens divided by "
        "max_num_seqs, and attention reads only its own stream: faster with many sequences "
        "at once); auto = per_sequence when one stream holds max_model_len tokens",
    )
    threads: int = Field(
        0,
        ge=0,
        description="CPU threads of this model's forward passes; 0 = automatic (llama_cpp: "
        "the process's cores split evenly among its llama_cpp models, fewer while other "
        "work crowds the cores; transformers: torch's default)",
    )
    device: str = Field(
        "cpu",
        pattern=r"^(cpu|cuda(:[0-9]+)?)$",
        description="transformers: where the weights, the KV cache and the batching run: "
        "cpu, cuda (the first GPU) or cuda:N; a host without that device fails the load",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="transformers: the weights' and the KV cache's precision (bfloat16 on a "
        "GPU: half the memory of float32 and its tensor cores)",
    )
    load_format: Literal["auto", "dummy"] = Field(
        "auto",
        description="transformers: auto = the directory's weights (or the GGUF file's); "
        "dummy = random weights in the shape of the directory's config.json, built on the "
        "device (benchmark a model shape without its weights; the tokenizer still loads "
        "from the directory)",
    )
    lora_modules: dict[str, str] = Field(
        default_factory=dict,
        description="llama_cpp: LoRA adapters (GGUF files, paths inside the model's "
        "directory), each served as a model of its own name, e.g. {sql: adapters/sql.gguf} "
        "(vLLM's --lora-modules); requests naming the model itself run without adapters",
    )

    @field_validator("lora_modules")
    @classmethod
    def _check_lora_modules(cls, modules: dict[str, str]) -> dict[str, str]:
        for name, path in modules.items():
            checked_model_name(name)
            if not path.strip():
                raise ValueError(f"{name}: expected the adapter's GGUF file, got {path!r}")
        return modules


class DriftSettings(_Strict):
    """``monitoring.drift:`` in config.yaml: test requests against a reference, off the
    hot path (requests are sampled into a bounded queue and a worker thread tests each
    window of ``window`` samples)."""

    enable: bool = False
    window: int = Field(500, ge=20, description="samples (batch rows) per tested window")
    sample_rate: float = Field(
        1.0, gt=0, le=1, description="share of requests sampled (1.0: every request)"
    )
    reference_samples: int = Field(
        1000,
        ge=20,
        description="rows captured from the first requests of a version as its reference, "
        "when the version has no drift_reference.npz (slipstream monitor reference)",
    )
    alpha: float = Field(
        0.05, gt=0, lt=1, description="false-alarm rate per window (Bonferroni over features)"
    )
    min_interval_s: float = Field(
        10.0,
        ge=0,
        description="seconds from one window's test to the next window's first sample; "
        "requests in between are not sampled, so a busy model pays for one window per "
        "interval",
    )
    queue_size: int = Field(
        10_000, ge=1, description="sampled requests waiting for the worker; more are dropped"
    )
    tensors: list[str] = Field(
        default_factory=list,
        description="inputs and outputs to test, by name; empty: every input and output",
    )


class MonitoringSettings(_Strict):
    """``monitoring:`` in config.yaml."""

    drift: DriftSettings = Field(default_factory=DriftSettings)


class ResponseCacheConfig(_Strict):
    """``response_cache:`` in a model's config.yaml (Triton's name and meaning)."""

    enable: bool = Field(
        False,
        description="Answer a request identical to an earlier one (same version, inputs, "
        "requested outputs and parameters) from the server's --cache, without running it",
    )


class RayServeConfig(_Strict):
    """``ray_serve:`` in config.yaml: the model's deployment under ``slipstream serve --ray``
    (Ray Serve's autoscaling_config names; min = max: a fixed number of replicas)."""

    min_replicas: int = Field(1, ge=0, description="fewest replicas (0: none while idle)")
    max_replicas: int = Field(1, ge=1, description="most replicas")
    target_ongoing_requests: float = Field(2.0, gt=0, description="requests per replica")
    upscale_delay_s: float = Field(30.0, ge=0, description="load held this long adds one")
    downscale_delay_s: float = Field(600.0, ge=0, description="idle this long removes one")
    look_back_period_s: float = Field(30.0, gt=0, description="load averaged over this long")
    num_cpus: float = Field(1.0, ge=0, description="CPUs Ray reserves per replica")
    max_ongoing_requests: int | None = Field(
        None, ge=1, description="requests a replica takes at once (Ray's default is 5, "
        "which caps a batch at 5 requests); unset: what the model can run together "
        "(twice its max_batch_size per instance; a generative model's max_num_seqs)",
    )  # fmt: skip


class ShadowConfig(_Strict):
    """``rollout.shadow``: mirror a share of the default route's traffic to a version."""

    version: str = Field(pattern=r"^[1-9][0-9]*$", description="version that gets the copies")
    share: float = Field(1.0, ge=0.0, le=1.0, description="share of requests mirrored")
    queue: int = Field(256, ge=1, description="copies waiting at most; more are dropped")


class RolloutConfig(_Strict):
    """``rollout:`` in config.yaml: how requests that name no version pick one."""

    weights: dict[str, float] = Field(
        default_factory=dict, description='traffic share per version, e.g. {"1": 90, "2": 10}'
    )
    sticky_key: str = Field(
        "route_key",
        min_length=1,
        description="request parameter whose value routes a request (X-Slipstream-Route-Key)",
    )
    shadow: ShadowConfig | None = None

    @field_validator("weights")
    @classmethod
    def _check_weights(cls, weights: dict[str, float]) -> dict[str, float]:
        for version, weight in weights.items():
            if not version.isdigit() or int(version) < 1 or weight < 0:
                raise ValueError(f"{version!r}: {weight}: expected a version >= 1 and weight >= 0")
        if weights and not sum(weights.values()) > 0:
            raise ValueError("at least one weight must be > 0")
        return weights


class TransactionPolicy(_Strict):
    """``model_transaction_policy:`` (Triton's name): how many answers a request gets."""

    decoupled: bool = Field(
        False,
        description="a Python model that answers each request with any number of responses "
        "through its response sender, streamed to gRPC ModelStreamInfer clients",
    )
