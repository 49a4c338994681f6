"""Running the HTTP and gRPC front ends in one event loop, and stopping them gracefully.

On SIGTERM or SIGINT: stop accepting connections, let in-flight requests finish (bounded
by ``shutdown_timeout_s``), unload the models, and return so the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import ssl
import sys
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from prometheus_client import CollectorRegistry, disable_created_metrics

from slipstream.config import ServerSettings
from slipstream.config.tracing import TraceConfig
from slipstream.llm.service import LlmModels
from slipstream.monitor.registry import DriftMonitors
from slipstream.observability.cost import CostTracker
from slipstream.observability.gpu import GpuCollector, Gpus
from slipstream.observability.lifecycle import LifecycleMetrics
from slipstream.observability.metrics import ServerMetrics
from slipstream.observability.startup import TRACE
from slipstream.observability.tracing import Tracing
from slipstream.protocol.v2 import encode_error
from slipstream.repository.layout import Share
from slipstream.runtime import heap
from slipstream.security.gate import Gate, watch_keys
from slipstream.security.keys import KeyRing, KeysFileError
from slipstream.security.limits import Limiter, LimitStore, MemoryStore
from slipstream.security.metrics import FrontDoorMetrics
from slipstream.server.front_door import HttpFrontDoor
from slipstream.server.httpd import HttpLimits, HttpServer
from slipstream.server.kserve_v1_rest import KServeV1App
from slipstream.server.openai_batch_rest import batch_routes
from slipstream.server.openai_rest import OpenAIApp
from slipstream.server.router import Handler, Router
from slipstream.server.state_metrics import ModelStateCollector
from slipstream.server.triton_settings import TRACE_SETTINGS
from slipstream.server.v2_llm import GenerativeV2
from slipstream.server.v2_rest import V2RestApp
from slipstream.serving.core import ModelServer
from slipstream.serving.service import InferenceService

if TYPE_CHECKING:
    from slipstream.jobs.queue import JobQueue

logger = logging.getLogger(__name__)

# An instance thread finishing a batch needs the GIL back to hand over its results; with
# CPython's default 5 ms switch interval it can wait that long behind the event loop
# decoding new requests, stalling a whole batch of clients.
GIL_SWITCH_INTERVAL_S = 0.0005
# Open files kept beside the HTTP connections: model files, gRPC, logs, the repository.
_SPARE_FILES = 1024


def stop_on_signals(
    stop: asyncio.Event | None, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)
) -> asyncio.Event:
    """``stop`` (a new event when None), set by SIGTERM or SIGINT (or ``signals``); the
    GIL switch interval a serving process wants set too."""
    stop = stop or asyncio.Event()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    loop = asyncio.get_running_loop()
    for sig in signals:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    return stop


# A task that runs beside the front ends once the models have started, given the serving
# core, and is cancelled at shutdown (``slipstream edge``'s fleet agent).
Companion = Callable[[ModelServer], Coroutine[Any, Any, None]]


async def serve(
    settings: ServerSettings,
    stop: asyncio.Event | None = None,
    companions: Sequence[Companion] = (),
) -> int:
    """Serve in this process until ``stop`` is set or a termination signal arrives;
    return the exit code. (``--frontends N``: ``server/split.py`` instead.)
    ``companions`` start once the models have started."""
    TRACE.mark("imported")
    stop = stop_on_signals(stop)
    heap.configure()

    raise_open_files_limit(settings.max_connections)
    core = build_core(settings)
    service, metrics, monitors = core.service, core.metrics, core.monitors
    try:
        door = front_door_parts(settings, metrics.registry)
        tls = TlsSetup.of(settings)
    except (KeysFileError, OSError, ssl.SSLError) as exc:
        logger.error("%s", exc)
        return 1
    jobs = job_queue(settings)
    openai_app = OpenAIApp(
        core.generation,
        service,
        settings.model_repository,
        cache=service.response_cache,
        metrics=core.metrics,
    )
    batches = batch_routes(openai_app.handle, settings.files_dir, settings.batch_concurrency,
                           settings.auth_file, door[1] if door else None)  # fmt: skip

    async def drift(model: str, version: str) -> dict[str, Any]:
        return monitors.report(model, version)

    try:
        # The V2 routes serve the generative models too, as Triton's vLLM backend does.
        v2_service = GenerativeV2(service, core.generation)
        fronts = await start_front_ends(
            settings, v2_service, metrics, batches.handle, door, tls, jobs, drift=drift
        )
    except OSError as exc:
        logger.error("%s", exc)
        return 1

    background = background_tasks(settings, core, door, service)
    # Models load while the servers already answer health/live (ready comes after).
    start_task = asyncio.create_task(service.start())
    stop_task = asyncio.create_task(stop.wait())

    def start_companions() -> None:
        background.extend(asyncio.create_task(run(service)) for run in companions)
        batches.start()  # unfinished batches resume once the models are ready

    exit_code = await run_until_stopped(start_task, stop_task, settings, start_companions, service)
    logger.info("shutting down: finishing in-flight requests (up to %.0f s)",
                settings.shutdown_timeout_s)  # fmt: skip
    for task in (start_task, stop_task, *background):
        task.cancel()
    await fronts.shutdown(settings.shutdown_timeout_s)
    await batches.stop()
    await service.stop()
    await close_parts(jobs, door)
    logger.info("shutdown complete")
    return exit_code


@dataclass(frozen=True, slots=True)
class Core:
    """The serving core and what is built with it: the process that runs the models."""

    service: ModelServer
    metrics: ServerMetrics
    # The generative models (the LLM lane), served by the OpenAI routes.
    generation: LlmModels
    # Drift monitors of the versions whose config enables them, fed after each response.
    monitors: DriftMonitors


def build_core(
    settings: ServerSettings,
    with_transport: bool = True,
    share: Share | None = None,
    gpu_metrics: bool = True,
) -> Core:
    """The serving core, the LLM lane and their metrics in one registry.
    ``with_transport``: also the HTTP transport's series (not in an engine process);
    ``share``: the repository's models to serve (one engine of several), all if None;
    ``gpu_metrics``: Triton's nv_gpu_* series where a GPU is visible (one engine of
    several reports them, not each)."""
    # No *_created series beside prometheus_client's counters and histograms (the LLM
    # lane's): in the text format each is a family of its own that nothing plots.
    disable_created_metrics()  # type: ignore[no-untyped-call]
    metrics = ServerMetrics(with_transport=with_transport)
    # Loads and unloads of both lanes' models, counted in one place.
    lifecycle = LifecycleMetrics()
    metrics.registry.register(lifecycle)
    generation = LlmModels(
        settings.model_repository, metrics.registry, settings.idle_unload_seconds,
        settings.load_wait_s, lifecycle, share,
    )  # fmt: skip
    monitors = DriftMonitors()
    metrics.registry.register(monitors)
    service = ModelServer(settings, metrics, lanes=[generation], tap_factory=monitors.tap_for,
                          lifecycle=lifecycle, share=share)  # fmt: skip
    metrics.registry.register(ModelStateCollector(service))
    # Triton's nv_gpu_* series where a GPU is visible; in the split layout only the engine
    # builds a core, so they come once, not once per front end.
    gpus = Gpus.open() if gpu_metrics else None
    if gpus is not None:
        metrics.registry.register(GpuCollector(gpus))
        logger.info("GPU metrics from NVML: %s", ", ".join(gpus.uuids))
    return Core(service, metrics, generation, monitors)


@dataclass(slots=True)
class FrontEnds:
    """The HTTP and gRPC servers of one process (either may be off)."""

    http: HttpServer | None = None
    grpc: Any = None  # grpc.aio.Server
    # Request tracing (--trace-config), whose buffered spans go out at shutdown.
    tracing: Tracing | None = None

    async def shutdown(self, timeout_s: float) -> None:
        """Stop accepting; let in-flight requests finish, up to ``timeout_s``."""
        await asyncio.gather(
            *([self.http.shutdown(timeout_s)] if self.http else []),
            *([self.grpc.stop(grace=timeout_s)] if self.grpc else []),
        )
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)


async def start_front_ends(
    settings: ServerSettings,
    service: InferenceService,
    metrics: ServerMetrics,
    openai: Handler,
    door: tuple[Gate | None, Limiter | None, bool] | None,
    tls: TlsSetup,
    jobs: JobQueue | None,
    drift: Callable[[str, str], Awaitable[dict[str, Any]]] | None = None,
    metrics_text: Callable[[], Awaitable[bytes]] | None = None,
    reuse_port: bool = False,
) -> FrontEnds:
    """Start the HTTP (V2 and, under /v1/, ``openai``) and gRPC servers on ``service``.
    ``reuse_port``: share the ports with the other front-end processes (SO_REUSEPORT).
    OSError naming the port when one cannot be bound."""
    fronts = FrontEnds(tracing=request_tracing(settings))
    if fronts.tracing is not None:
        from slipstream.server.traced import TracedService

        service = TracedService(service, fronts.tracing)
    if settings.http_port:
        v2_app = V2RestApp(service, metrics, drift=drift, jobs=jobs, metrics_text=metrics_text)
        middleware: list[Any] = [HttpFrontDoor(*door)] if door else []
        if fronts.tracing is not None:
            from slipstream.server.traced import TraceMiddleware

            middleware.insert(0, TraceMiddleware(fronts.tracing))
        # vLLM answers rerank outside /v1/ too (/rerank, /v2/rerank), and classify only
        # there (/classify): the OpenAI app's.
        routes = [("/v1/", openai), ("/rerank", openai), ("/v2/rerank", openai),
                  ("/classify", openai)]  # fmt: skip
        # KServe V1 shares /v1/models with the OpenAI routes, and hands them what is theirs.
        routes.insert(0, ("/v1/models", KServeV1App(service, openai).handle))
        router = Router(fallback=v2_app.handle, routes=routes, middleware=middleware)
        fronts.http = HttpServer(
            router.handle, error_body=encode_error, limits=http_limits(settings),
            metrics=metrics.transport,
        )  # fmt: skip
        try:
            await fronts.http.start(
                settings.host, settings.http_port, ssl=tls.http_context, reuse_port=reuse_port
            )
        except OSError as exc:
            raise OSError(
                f"HTTP server could not bind {settings.host}:{settings.http_port}: {exc}; "
                "choose another with --http-port"
            ) from None
        logger.info("HTTP server listening on %s:%d", settings.host, settings.http_port)
        TRACE.mark("http_listening")
    if settings.grpc_port:
        from slipstream.server.grpc_front_door import GrpcFrontDoor, MessageGuard
        from slipstream.server.traced import TraceInterceptor
        from slipstream.server.v2_grpc import build_grpc_server

        try:
            fronts.grpc, grpc_port = build_grpc_server(
                service,
                settings.host,
                settings.grpc_port,
                settings.grpc_max_message_bytes or settings.max_request_bytes,
                max_concurrent_streams=settings.grpc_max_concurrent_streams,
                interceptors=[
                    *([TraceInterceptor()] if fronts.tracing is not None else []),
                    MessageGuard(),
                    *([GrpcFrontDoor(*door)] if door else []),
                ],
                credentials=tls.grpc_credentials,
                reuse_port=reuse_port,
            )
        except OSError:
            await fronts.shutdown(0)
            raise
        await fronts.grpc.start()
        logger.info("gRPC server listening on %s:%d", settings.host, grpc_port)
        TRACE.mark("grpc_listening")
    return fronts


def request_tracing(settings: ServerSettings) -> Tracing | None:
    """This process's request tracing (--trace-config), None where it is off; the trace
    settings' defaults become the config's."""
    config = TraceConfig.parse(settings.trace_config)
    if not config.enabled:
        return None
    TRACE_SETTINGS.enable(config.level, config.rate, config.count)
    tracing = Tracing(config, TRACE_SETTINGS.view)
    logger.info("request tracing: spans to %s (level %s, one request in %d)",
                config.url, config.level, config.rate)  # fmt: skip
    return tracing


def job_queue(settings: ServerSettings) -> JobQueue | None:
    if not settings.jobs_redis:
        return None
    from slipstream.jobs.queue import JobQueue

    return JobQueue(settings.jobs_redis, settings.jobs_max_pending)


def background_tasks(
    settings: ServerSettings,
    core: Core | None,
    door: tuple[Gate | None, Limiter | None, bool] | None,
    service: InferenceService | None = None,
) -> list[asyncio.Task[None]]:
    """The cost gauges' sampler (where the models run) and the keys file's watcher (where
    requests arrive), which unregisters a revoked key's shared-memory regions through
    ``service``."""
    background: list[asyncio.Task[None]] = []
    if core is not None and settings.price_per_hour is not None:
        tracker = CostTracker(core.metrics, settings.price_per_hour, settings.cost_window_s)
        core.metrics.registry.register(tracker)
        background.append(asyncio.create_task(_sample_costs(tracker)))
    if door and door[0] is not None:
        revoked = None if service is None else functools.partial(_release_regions, service)
        background.append(asyncio.create_task(watch_keys(door[0], revoked)))
    return background


async def _release_regions(service: InferenceService, owners: list[str]) -> None:
    for owner in owners:
        await service.unregister_region("", owner)
        await service.unregister_cuda_region("", owner)


async def close_parts(
    jobs: JobQueue | None, door: tuple[Gate | None, Limiter | None, bool] | None
) -> None:
    if jobs is not None:
        await jobs.close()
    if door and door[1] is not None:
        await door[1].store.close()


def _write_trace(path: Path) -> None:
    try:
        path.write_bytes(orjson.dumps(TRACE.as_json(), option=orjson.OPT_INDENT_2))
    except OSError as exc:
        logger.error("--trace-startup: cannot write %s: %s", path, exc)


async def _sample_costs(tracker: CostTracker) -> None:
    """Snapshot the counts the cost gauges need: 12 times a window, at most every 5 s."""
    interval_s = min(5.0, tracker.window_s / 12)
    loop = asyncio.get_running_loop()
    while True:
        tracker.sample(loop.time())
        await asyncio.sleep(interval_s)


def front_door_parts(
    settings: ServerSettings, registry: CollectorRegistry, shared: LimitStore | None = None
) -> tuple[Gate | None, Limiter | None, bool] | None:
    """The key gate, the limiter and whether to log each request; None when the server
    has none of them (then no middleware or interceptor is installed at all).
    ``shared``: where a front end of ``--frontends N`` counts when the limits are kept in
    memory (its engine's store: one budget for every front end)."""
    if settings.access_log:
        _raw_access_log()
    if settings.auth_file is None:
        return (None, None, True) if settings.access_log else None
    keys = KeyRing.load(settings.auth_file)
    counts = FrontDoorMetrics(registry)
    gate = Gate(keys, counts, settings.metrics_need_key)
    # Always a limiter, though no key has limits yet: a key created with limits while the
    # server runs (the keys file is read again) is limited at once.
    store: LimitStore = shared if shared is not None else MemoryStore()
    if settings.rate_limit_store.startswith("redis://"):
        from slipstream.security.redis_store import RedisStore

        store = RedisStore(settings.rate_limit_store)
    limiter = Limiter(store, counts, settings.rate_limit_fail_closed)
    where = settings.rate_limit_store.split(":", 1)[0]  # no Redis password in the log
    logger.info("API keys from %s: %d keys, rate limits in %s", settings.auth_file,
                len(keys.keys), where)  # fmt: skip
    return gate, limiter, settings.access_log


def _raw_access_log() -> None:
    """Access-log lines go to stderr as bare JSON, one a line, whatever the log format."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    access = logging.getLogger("slipstream.access")
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    access.propagate = False


@dataclass(frozen=True, slots=True)
class TlsSetup:
    """TLS of both front ends, or none."""

    http_context: ssl.SSLContext | None = None
    grpc_credentials: Any = None

    @classmethod
    def of(cls, settings: ServerSettings) -> TlsSetup:
        if settings.tls_cert is None or settings.tls_key is None:
            return cls()
        from slipstream.security.tls import grpc_credentials, http_context

        ca = settings.tls_client_ca
        return cls(http_context(settings.tls_cert, settings.tls_key, ca),
                   grpc_credentials(settings.tls_cert, settings.tls_key, ca))  # fmt: skip


def raise_open_files_limit(max_connections: int) -> None:
    """Let the process hold --max-connections sockets (plus model files, gRPC, ...).

    Many systems start processes with a soft limit of 1024 open files; past it, accepting
    fails (EMFILE) before --max-connections can close the idlest connection instead.
    """
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + _SPARE_FILES
    if hard != resource.RLIM_INFINITY:
        wanted = min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    if hard != resource.RLIM_INFINITY and hard < max_connections + _SPARE_FILES:
        logger.warning("the open-files limit (%d) is below --max-connections (%d) plus "
                       "%d spare: raise it (ulimit -n) or lower --max-connections",
                       hard, max_connections, _SPARE_FILES)  # fmt: skip


def http_limits(settings: ServerSettings) -> HttpLimits:
    """The HTTP transport's limits from the serve options."""
    return HttpLimits(
        max_body_bytes=settings.max_request_bytes,
        max_header_bytes=settings.max_header_bytes,
        max_header_count=settings.max_header_count,
        header_timeout_s=settings.header_timeout_s,
        body_timeout_s=settings.body_timeout_s,
        min_body_rate_bytes_s=settings.min_body_rate_bytes_s,
        send_timeout_s=settings.send_timeout_s,
        keep_alive_timeout_s=settings.keep_alive_timeout_s,
        max_connections=settings.max_connections,
        max_buffered_body_bytes=settings.max_buffered_body_bytes,
    )


async def run_until_stopped(
    start_task: asyncio.Task[None],
    stop_task: asyncio.Task[bool],
    settings: ServerSettings,
    on_ready: Callable[[], object] | None = None,
    service: InferenceService | None = None,
) -> int:
    """Wait for a stop signal; 0 on a requested stop, 1 when model loading crashed.
    ``on_ready`` is called once the models have started; ``service`` says whether the
    server is ready then (a model that failed to load keeps it not ready)."""
    watched: set[asyncio.Task[Any]] = {start_task, stop_task}
    while True:
        done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
        if stop_task in done:
            return 0
        if start_task in done:
            watched.discard(start_task)
            if start_task.exception() is not None:
                logger.error("model loading failed: %s", start_task.exception())
                return 1
            TRACE.mark("ready")
            heap.settle()
            if on_ready is not None:
                on_ready()
            ports = (settings.http_port or "off", settings.grpc_port or "off")
            if service is None or await service.is_ready():
                logger.info("Slipstream is ready: HTTP port %s, gRPC port %s", *ports)
            else:
                logger.warning(
                    "Slipstream is serving on HTTP port %s, gRPC port %s, but not ready: a "
                    "model failed to load (see above, or the repository index); with "
                    "--no-strict-readiness the others make it ready", *ports,
                )  # fmt: skip
            logger.info("%s", TRACE.summary())
            if settings.trace_startup is not None:
                _write_trace(settings.trace_startup)
