"""``slipstream serve --frontends N``: N front-end processes in front of one engine process
(or, with ``--engines per-device``, one engine per device the models run on).

    supervisor                 engine/supervisor.py: starts, restarts and stops the rest
    engine process             the serving core (batchers, runtimes), the LLM lane and the
                               OpenAI app; answers the front ends (engine/host.py); with
                               several, each serves its device's share of the repository
                               (repository/placement.py)
    front end x N              HTTP and gRPC on shared ports: V2 decoding and encoding,
                               the front door (keys, limits, TLS), jobs; V2 calls go to the
                               engine through engine/remote.py, /v1/ requests are
                               forwarded whole (the tokenizers and the LLM loop live
                               beside the engines)

What runs where is composed here; how the processes talk is ``engine/``'s business.
``/metrics`` on any front end answers every process's series: the engine's as they are,
each front end's with a ``frontend`` label (front ends send theirs to the engine every
second); with several engines, each engine's with an ``engine`` label naming its device.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from multiprocessing.synchronize import Event as ProcessEvent
from pathlib import Path
from typing import Any

import orjson
from prometheus_client import disable_created_metrics

from slipstream import runtime
from slipstream.config import ServerSettings
from slipstream.engine.client import EngineClient, EngineLinkCollector
from slipstream.engine.company import Company
from slipstream.engine.host import Call, EngineHost
from slipstream.engine.limit_store import engine_limit_store, limit_calls
from slipstream.engine.remote import (
    RemoteInferenceService,
    engine_calls,
    engine_gathered,
    engine_streams,
)
from slipstream.engine.supervisor import (
    Supervisor,
    engine_address,
    remove_socket_dir,
    set_cpu_scheduling,
    socket_dir,
    watch_parent,
)
from slipstream.errors import SlipstreamError
from slipstream.observability.merge import Family, merged_text, snapshot
from slipstream.observability.metrics import ServerMetrics
from slipstream.observability.startup import TRACE
from slipstream.protocol import openai_replies as replies
from slipstream.repository.layout import list_models, tensor_models
from slipstream.repository.placement import CPU, Routing, Share, engine_devices
from slipstream.runtime import heap
from slipstream.security.gate import body_model
from slipstream.security.keys import KeysFileError
from slipstream.security.shared_store import LocalBackend
from slipstream.server.httpd import HttpRequest, HttpResponse, StreamingResponse, error_reply
from slipstream.server.journal import EngineJournal
from slipstream.server.openai_batch_rest import batch_routes, engine_limiter
from slipstream.server.openai_rest import OpenAIApp
from slipstream.server.ports import Port, claim_ports
from slipstream.server.runner import (
    TlsSetup,
    background_tasks,
    build_core,
    close_parts,
    front_door_parts,
    job_queue,
    raise_open_files_limit,
    run_until_stopped,
    start_front_ends,
    stop_on_signals,
)
from slipstream.server.v2_llm import GenerativeV2
from slipstream.serving.core import ModelServer

logger = logging.getLogger(__name__)

# How often each front end sends its own series to the engine, and how long the engine
# keeps a front end's last ones (a front end that stopped drops out).
METRICS_PUSH_S = 1.0
_METRICS_STALE_S = 5.0
# How often a front end reads which engine serves which model (--engines per-device).
_ROUTING_REFRESH_S = 2.0
# How long a starting front end waits to reach the engine before it listens anyway
# (answering 503 until the engine is there).
_CONNECT_WAIT_S = 10.0


async def serve_split(settings: ServerSettings, stop: asyncio.Event | None = None) -> int:
    """Run the supervisor until ``stop`` or a termination signal; the exit code."""
    stop = stop_on_signals(stop)
    try:  # before anything starts: a port taken fails the server as one process does
        claim = claim_ports(settings.host, _ports(settings))
    except OSError as exc:
        logger.error("%s", exc)
        return 1
    directory = socket_dir()
    backends = runtime.registered_backends()
    if settings.engines == "per-device":
        try:
            devices = engine_devices(list_models(settings.model_repository))
        except FileNotFoundError:
            devices = [CPU]
        shares: list[Share | None] = [Share(device, tuple(devices)) for device in devices]
    else:
        shares = [None]
    names = ["engine" if share is None else f"engine {share.device}" for share in shares]
    supervisor = Supervisor(
        engines={name: (run_engine, (settings, directory, backends, share, index))
                 for index, (name, share) in enumerate(zip(names, shares, strict=True))},
        frontends=[(run_frontend, (settings, directory, shares, i))
                   for i in range(settings.frontends)],
        shutdown_timeout_s=settings.shutdown_timeout_s,
    )  # fmt: skip
    logger.info("split layout: %d front-end processes, %s", settings.frontends,
                ", ".join(names))  # fmt: skip
    try:
        exit_code = await supervisor.run(stop)
    finally:
        remove_socket_dir(directory)
        claim.close()
    logger.info("shutdown complete")
    return exit_code


def _ports(settings: ServerSettings) -> list[Port]:
    """The ports every front end listens on (0: that server is off)."""
    ports = [Port("HTTP", settings.http_port, "--http-port"),
             Port("gRPC", settings.grpc_port, "--grpc-port")]  # fmt: skip
    return [port for port in ports if port.number]


# -- the engine process ------------------------------------------------------------------


def run_engine(
    settings: ServerSettings,
    directory: Path,
    backends: dict[str, tuple[str, str]],
    share: Share | None,
    index: int,
    ready: ProcessEvent,
) -> None:
    """An engine process's entry point (spawned by the supervisor). ``backends``: those
    the launcher registered (runtime.register_backend), registered here again; ``share``:
    the models this engine serves (None: all); ``index``: its place among the engines."""
    _child_setup(settings, "engine" if share is None else f"engine {share.device}")
    for name, (module, class_name) in backends.items():
        runtime.register_backend(name, module, class_name)
    sys.exit(_run(_serve_engine(settings, directory, share, index, ready)))


async def _serve_engine(
    settings: ServerSettings,
    directory: Path,
    share: Share | None,
    index: int,
    ready: ProcessEvent,
) -> int:
    TRACE.mark("imported")
    stop = stop_on_signals(None, (signal.SIGTERM,))
    parent = watch_parent(stop)
    journal = EngineJournal(Path(f"{engine_address(directory, index)}-state.json"))
    explicit = settings.model_control_mode == "explicit"
    loaded: list[str] = []  # explicit mode's models, from --load-model or the journal
    early: list[str] = []
    if explicit:
        journaled = journal.models if journal.models is not None else settings.load_models
        if "*" in journaled:  # Triton's --load-model=*: every model of the repository
            journaled = _every_model(settings)
        loaded = _mine(journaled, settings, share)
        early = _tensor_models(loaded, settings, share)
        settings = settings.model_copy(
            update={"load_models": [name for name in loaded if name not in early]}
        )
    core = build_core(settings, with_transport=False, share=share, gpu_metrics=index == 0)
    service = core.service
    openai_app = OpenAIApp(
        core.generation,
        service,
        settings.model_repository,
        cache=service.response_cache,
        metrics=core.metrics,
    )
    limits = LocalBackend()  # the front ends' rate limits, which batches spend too
    # The first engine owns OpenAI's files and batches (front ends send them all there).
    batches = None if index else batch_routes(
        openai_app.handle, settings.files_dir, settings.batch_concurrency, settings.auth_file,
        engine_limiter(settings.auth_file, settings.rate_limit_store, limits),
    )  # fmt: skip
    handle = openai_app.handle if batches is None else batches.handle
    board = _FrontEndBoard()

    async def drift(model: str, version: str) -> dict[str, Any]:
        return core.monitors.report(model, version)

    async def metrics(asking: str) -> tuple[list[Family], dict[str, list[Family]]]:
        return snapshot(core.metrics.registry), board.others(asking)

    async def forward(request: HttpRequest) -> AsyncIterator[Any]:
        """An OpenAI request run here: its whole response, or a stream's head and then
        its chunks."""
        reply = await handle(request)
        if isinstance(reply, HttpResponse):
            yield reply
            return
        yield (reply.status, reply.content_type, reply.headers)
        async for chunk in reply.chunks:
            yield chunk

    journal.restore_regions(service.shared_memory)
    asleep = journal.restore_models(service.models)  # before any load: they stay asleep
    v2_service = GenerativeV2(service, core.generation)  # the V2 routes' generative models
    calls = engine_calls(v2_service)
    calls.update(drift=drift, metrics=metrics, **limit_calls(limits))
    _journaled_calls(calls, service, journal, loaded)
    host = EngineHost(
        engine_address(directory, index), calls,
        streams={"http": forward, **engine_streams(v2_service)},
        tells={"board": board.put},
        gathered=engine_gathered(v2_service),
    )  # fmt: skip
    loads = [asyncio.create_task(service.models.load(n)) for n in early if n not in asleep]
    await asyncio.sleep(0)  # their first steps: every model of ``early`` is LOADING
    start_task = asyncio.create_task(_start(service, loads))
    watch = asyncio.create_task(journal.watch(service.models, start_task))
    await host.start()
    background = background_tasks(settings, core, None)
    stop_task = asyncio.create_task(stop.wait())

    def on_ready() -> None:
        ready.set()
        if batches is not None:
            batches.start()  # unfinished batches resume once the models are ready

    exit_code = await run_until_stopped(
        start_task, stop_task, settings, on_ready=on_ready, service=service
    )
    logger.info("engine stopping")
    for task in (start_task, stop_task, parent, watch, *background):
        task.cancel()
    await host.close()
    if batches is not None:
        await batches.stop()
    await service.stop()
    logger.info("engine stopped")
    return exit_code


async def _start(service: ModelServer, loads: list[asyncio.Task[None]]) -> None:
    """Start the engine's core once explicit mode's V2 models are loaded (``loads``,
    begun side by side before the engine listens). ModelServer.start loads them one after
    another, and until its turn came each answered "not loaded; load it with POST ..."
    (no Retry-After) to the front ends, which reach an engine as soon as it listens;
    begun before, each is LOADING from the first call: 503 with Retry-After, as in the
    other modes. Their cascades, then the LLM lane, load in start() after them."""
    await asyncio.gather(*loads)
    await service.start()


def _tensor_models(names: list[str], settings: ServerSettings, share: Share | None) -> list[str]:
    """Those of ``names`` that the V2 model manager loads (not cascades nor generative)."""
    try:
        models = tensor_models(settings.model_repository, share)
    except FileNotFoundError:
        return []
    return [name for name in names if name in models]


def _every_model(settings: ServerSettings) -> list[str]:
    try:
        return sorted(list_models(settings.model_repository))
    except FileNotFoundError:
        return []


def _mine(names: list[str], settings: ServerSettings, share: Share | None) -> list[str]:
    """Those of the models ``names`` (explicit mode's --load-model) that this engine
    loads: all without a share; else those placed on it, and the first engine also those
    the repository lacks (it reports them missing, as one engine would)."""
    if share is None or not names:
        return names
    try:
        models = list_models(settings.model_repository)
    except FileNotFoundError:
        models = {}
    mine = share.select(models)
    first = share.device == share.devices[0]
    return [name for name in names if name in mine or (first and name not in models)]


def _journaled_calls(
    calls: dict[str, Call], service: ModelServer, journal: EngineJournal, explicit: list[str]
) -> None:
    """Wrap the calls that change the engine's state so each change is journaled.
    ``explicit``: the models loaded now in explicit mode (empty in other modes)."""
    loaded = set(explicit)

    def saving_regions(method: str) -> Call:
        call = getattr(service, method)

        async def journaled(*args: Any) -> None:
            await call(*args)
            journal.save(service.shared_memory)

        return journaled

    async def load_model(name: str, config: str | None = None) -> None:
        await service.load_model(name, config)
        loaded.add(name)
        journal.models = sorted(loaded)
        journal.set_override(name, config)
        journal.save()

    async def unload_model(name: str, unload_dependents: bool = False) -> None:
        await service.unload_model(name, unload_dependents)
        loaded.discard(name)
        journal.models = sorted(loaded)
        journal.set_override(name, None)
        journal.save()

    for method in ("register_region", "unregister_region", "register_cuda_region",
                   "unregister_cuda_region"):  # fmt: skip
        calls[method] = saving_regions(method)
    calls.update(load_model=load_model, unload_model=unload_model)


class _FrontEndBoard:
    """The last series each front end sent, for /metrics on any of them."""

    def __init__(self) -> None:
        self._reports: dict[str, tuple[float, list[Family]]] = {}

    def put(self, frontend: str, report: list[Family]) -> None:
        self._reports[frontend] = (time.monotonic(), report)

    def others(self, asking: str) -> dict[str, list[Family]]:
        now = time.monotonic()
        return {
            name: report
            for name, (at, report) in self._reports.items()
            if name != asking and now - at <= _METRICS_STALE_S
        }


# -- a front-end process -----------------------------------------------------------------


def run_frontend(
    settings: ServerSettings,
    directory: Path,
    shares: list[Share | None],
    index: int,
    ready: ProcessEvent,
) -> None:
    """A front-end process's entry point (spawned by the supervisor): ``shares`` are the
    engines' (their sockets in ``directory``); ``ready`` is set once it listens."""
    _child_setup(settings, f"frontend {index}")
    sys.exit(_run(_serve_frontend(settings, directory, shares, index, ready)))


async def _serve_frontend(
    settings: ServerSettings,
    directory: Path,
    shares: list[Share | None],
    index: int,
    ready: ProcessEvent,
) -> int:
    stop = stop_on_signals(None, (signal.SIGTERM,))
    parent = watch_parent(stop)
    raise_open_files_limit(settings.max_connections)
    disable_created_metrics()  # type: ignore[no-untyped-call]
    metrics = ServerMetrics()
    clients = [EngineClient(engine_address(directory, i)) for i in range(len(shares))]
    metrics.registry.register(EngineLinkCollector(clients))
    try:
        door = front_door_parts(settings, metrics.registry, engine_limit_store(clients[0]))
        tls = TlsSetup.of(settings)
    except (KeysFileError, OSError) as exc:
        logger.error("%s", exc)
        return 1
    for client in clients:
        client.start()
    connecting: asyncio.Future[Any] = asyncio.gather(
        *(client.wait_connected(_CONNECT_WAIT_S) for client in clients)
    )
    stopping: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
    await asyncio.wait({connecting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():  # stopped before it served (an engine that could not start)
        connecting.cancel()
        await asyncio.gather(*(client.close() for client in clients))
        await close_parts(None, door)
        return 0
    stopping.cancel()
    routing = None
    if len(shares) > 1:
        devices = [share.device for share in shares if share is not None]
        routing = await asyncio.to_thread(Routing, settings.model_repository, devices)
    service = RemoteInferenceService(clients, routing, Company(settings.frontend_hold_us / 1e6))
    jobs = job_queue(settings)
    name = str(index)
    # The board of front ends' series lives in the first engine.
    client = clients[0]

    async def drift(model: str, version: str) -> dict[str, Any]:
        report: dict[str, Any] = await service.engine_for(model).call("drift", model, version)
        return report

    async def metrics_text() -> bytes:
        return await _metrics_text(clients, shares, name, metrics)

    try:
        forwarder = OpenAIForwarder(clients, service.engine_for)
        fronts = await start_front_ends(
            settings, service, metrics, forwarder.handle, door, tls, jobs,
            drift=drift, metrics_text=metrics_text, reuse_port=True,
        )  # fmt: skip
    except OSError as exc:
        logger.error("%s", exc)
        await asyncio.gather(*(client.close() for client in clients))
        return 1
    ready.set()
    heap.settle()
    background = [*background_tasks(settings, None, door, service),
                  asyncio.create_task(_push_metrics(client, name, metrics))]  # fmt: skip
    if routing is not None:
        background.append(asyncio.create_task(_refresh(routing)))
    await stop.wait()
    service.stop()
    logger.info("shutting down: front end %d finishing in-flight requests (up to %.0f s)",
                index, settings.shutdown_timeout_s)  # fmt: skip
    await fronts.shutdown(settings.shutdown_timeout_s)
    for task in (parent, *background):
        task.cancel()
    await asyncio.gather(*(client.close() for client in clients))
    await close_parts(jobs, door)
    return 0


async def _metrics_text(
    clients: list[EngineClient], shares: list[Share | None], name: str, metrics: ServerMetrics
) -> bytes:
    """/metrics: this front end's series, the other front ends' (from the first engine's
    board) labelled ``frontend``, each engine's (labelled ``engine`` where there are
    several); an engine away leaves its series out."""
    reports: list[tuple[dict[str, str], list[Family]]] = [
        ({"frontend": name}, snapshot(metrics.registry))
    ]
    answers = await asyncio.gather(
        *(client.call("metrics", name) for client in clients), return_exceptions=True
    )
    for share, answer in zip(shares, answers, strict=True):
        if isinstance(answer, SlipstreamError):
            continue
        if isinstance(answer, BaseException):
            raise answer
        engine, others = answer
        reports.append(({} if share is None else {"engine": share.device}, engine))
        reports.extend(({"frontend": other}, report) for other, report in others.items())
    return merged_text(reports)


async def _refresh(routing: Routing) -> None:
    """Keep the front end's view of which engine serves which model as the repository
    changes (the engines' own polls move a model whose device changed)."""
    while True:
        await asyncio.sleep(_ROUTING_REFRESH_S)
        await asyncio.to_thread(routing.refresh)


async def _push_metrics(client: EngineClient, name: str, metrics: ServerMetrics) -> None:
    while True:
        client.tell("board", name, snapshot(metrics.registry))
        await asyncio.sleep(METRICS_PUSH_S)


class OpenAIForwarder:
    """The /v1/ routes of a front end: each request runs whole in the engine process
    (beside the tokenizers and the generation loop); streamed answers are relayed chunk
    by chunk, and a client that goes away cancels the engine's side. With several
    engines, a request goes to the engine of the model it names (its body's ``model``,
    or the path's in /v1/models/<name>); /v1/models lists every engine's."""

    def __init__(
        self, clients: list[EngineClient], engine_for: Callable[[str], EngineClient]
    ) -> None:
        self._clients = clients
        self._engine_for = engine_for

    async def handle(self, request: HttpRequest) -> HttpResponse | StreamingResponse:
        if len(self._clients) == 1:
            return await self._forward(self._clients[0], request)
        route = request.path.rstrip("/")
        if route.startswith(("/v1/files", "/v1/batches")):  # the first engine owns these
            return await self._forward(self._clients[0], request)
        if request.method in ("GET", "HEAD") and route == "/v1/models":
            return await self._models(request)
        if route.startswith("/v1/models/"):
            return await self._forward(self._engine_for(route.removeprefix("/v1/models/")),
                                       request)  # fmt: skip
        return await self._forward(self._engine_for(body_model(request.body)), request)

    async def _models(self, request: HttpRequest) -> HttpResponse | StreamingResponse:
        """Every engine's /v1/models, as one list (the first failure as it is)."""
        answers = await asyncio.gather(
            *(self._forward(client, request) for client in self._clients)
        )
        data: list[Any] = []
        for reply in answers:
            if not isinstance(reply, HttpResponse) or reply.status != 200:
                return reply
            data.extend(orjson.loads(reply.body)["data"])
        data.sort(key=lambda card: str(card.get("id", "")))
        return HttpResponse(200, orjson.dumps({"object": "list", "data": data}))

    async def _forward(
        self, client: EngineClient, request: HttpRequest
    ) -> HttpResponse | StreamingResponse:
        items = client.stream("http", request)
        try:
            first = await anext(items)
        except SlipstreamError as exc:
            return error_reply(exc, replies.error(exc))
        if isinstance(first, HttpResponse):
            async for _ in items:  # the end of the stream
                pass
            return first
        status, content_type, headers = first
        return StreamingResponse(status, _relay(items), content_type, headers)


async def _relay(items: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A stream's chunks; an engine lost part-way ends it with OpenAI's error event."""
    try:
        async for chunk in items:
            yield chunk
    except SlipstreamError as exc:
        yield replies.error_event(exc)
    finally:
        await items.aclose()  # type: ignore[attr-defined]


# -- both kinds of child -----------------------------------------------------------------


def _child_setup(settings: ServerSettings, role: str) -> None:
    """Logging as ``slipstream serve`` sets it, each line saying which process; Ctrl-C
    left to the supervisor (it reaches the whole process group), which stops the children
    in order; the CPU scheduling policy of ``--cpu-scheduling``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format=f"%(asctime)s %(levelname)s [{role}] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    set_cpu_scheduling(settings.cpu_scheduling)  # after logging: a refusal is logged as such
    heap.configure()


def _run(main: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is absent on Windows
        return asyncio.run(main)
    return uvloop.run(main)
