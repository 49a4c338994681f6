"""``slipstream serve``'s options: one definition each, whose description is its --help."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from slipstream.config.base import Strict as _Strict
from slipstream.config.cache_spec import parse_cache_spec
from slipstream.names import checked_model_name


class ServerSettings(_Strict):
    """Options of ``slipstream serve``; each field's description is its --help text."""

    model_repository: Path = Field(
        description="Directory laid out as <model>/<version>/model.*, or a repository in "
        "an object store as Triton names one: s3://bucket/path, s3://host:port/bucket/path "
        "(a store of one's own, over HTTP), s3://https://host:port/bucket/path, "
        "gs://bucket/path (Google Cloud Storage), as://account/container/path (Azure Blob "
        "Storage). It is copied to --repository-cache before serving and followed every "
        "--repository-poll-secs (but with --model-control-mode none)."
    )
    repository_cache: Path | None = Field(
        None,
        description="Where an object store's repository is copied (kept across restarts: only "
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
    max_buffered_body_bytes: int | None = Field(
        None,
        ge=1024,
        description="Most HTTP request-body bytes one server process holds at once, over "
        "all connections (bodies being received, queued, or with their model). Past it, "
        "connections still sending a body are read no further until bodies are released "
        "(TCP back-pressure: no request is refused for it); a body larger than this alone "
        "is still taken, up to --max-request-bytes. With --frontends N each front end has "
        "its own. Default: 8 x --max-request-bytes.",
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
    trace_config: list[str] = Field(
        default_factory=list,
        description="Request tracing, as Triton's --trace-config (repeat it): "
        "mode=opentelemetry turns it on, opentelemetry,url=HOST:PORT/v1/traces is the "
        "OTLP/HTTP collector (default localhost:4318/v1/traces), level=TIMESTAMPS|OFF, "
        "rate=N (one request in N; default 1000), count=N (traces before stopping; -1 "
        "no limit), opentelemetry,resource=KEY=VALUE. Clients change level, rate and "
        "count at /v2[/models/<m>]/trace/setting.",
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
    files_dir: Path | None = Field(
        None,
        description="Where OpenAI's files and batches (POST /v1/files, /v1/batches) are "
        "kept, and from where a restarted server resumes its batches; one server per "
        "directory. Default: $XDG_STATE_HOME/slipstream/files (~/.local/state/...).",
    )
    batch_concurrency: int = Field(
        4,
        ge=1,
        description="Requests of all OpenAI batches in flight at once; live "
        "requests keep the rest of the batchers.",
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

    @field_validator("trace_config")
    @classmethod
    def _check_trace_config(cls, entries: list[str]) -> list[str]:
        from slipstream.config.tracing import TraceConfig

        if TraceConfig.parse(entries).enabled:
            try:
                import opentelemetry.exporter.otlp.proto.http
                import opentelemetry.sdk  # noqa: F401
            except ImportError:
                raise ValueError(
                    "request tracing needs OpenTelemetry's SDK and OTLP exporter: "
                    "pip install 'slipstream[tracing]'"
                ) from None
        return entries

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
        return [name if name == "*" else checked_model_name(name) for name in names]
